"""A GPU memory budget (``max_gpu_memory``): what a checkpoint and job need, and the plan carried out on a generator.

:func:`weight_bytes` sizes every component from its config on the meta device (no weights read) in the dtypes it
will run in (FP8 block linears at one byte), once per generator; :func:`estimate_footprint` adds the activation
peaks of a job:

* DiT forward: ``batch * S * (7 C + 2 F) * 2`` bytes (the stream, the norm output, q / k / v, the attention output,
  a pending projection, the FFN's hidden state and its GELU; with FP8 weights another hidden state in the
  activation dtype and one in e4m3: an FP8 14B 720p run at 24 GiB ran out without them) plus the per-prompt
  cross-attention keys and values (``layers * 2 * prompts * 512 * C * 2``) and a fixed 512 MiB (RoPE tables,
  modulation, allocator slack);
* VAE decode: 2.8 KB per output pixel per frame of a decoder call (measured on an H100: 9.42 GiB at 720x1280 with
  4 frames per call; 6.08 GiB at 480x832 with 8; a call decodes at most the latent frames after the first),
  tiled: the same for a 256x256 tile at 1.5x, at least 1 GiB;
* text encoding: 512 MiB.

:class:`Placement` carries a :class:`fastwan.offload.OffloadPlan` out: an offloaded component keeps its tensors in
pinned host memory and gets device copies only inside its phase (:meth:`Placement.encoding`,
:meth:`Placement.denoising`, :meth:`Placement.expert`); the last ``streamed_blocks`` blocks of each DiT stream
through a :class:`fastwan.offload.BlockStreamer` (the cross-attention key/value weights, which the prompt cache reads
outside the block loop, stay with the rest of the DiT); the text encoder streams layer by layer through hooks.
Between calls every offloaded tensor is at home on the host, so LoRA merges and the like change the host copies,
and the plan of a video that needs other levers than the current one takes the modules over from there (each
video gets the plan the planner picks for it, whatever came before).
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import torch
import torch.nn as nn

from fastwan.errors import InvalidArgument
from fastwan.offload import BlockStreamer, Footprint, OffloadPlan
from fastwan.offload.stream import held_tensors, stop_streaming, stream_blocks
from fastwan.offload.plan import Usable
from fastwan.checkpoint.presets import runs_cfg
from fastwan.vae.decode import tiling_state

logger = logging.getLogger("fastwan")

MiB = 2**20
TEXT_TOKENS = 512
CROSS_KV = ("attn2.to_k.", "attn2.to_v.", "attn2.norm_k.", "attn2.to_out.", "attn2.add_k_proj.", "attn2.add_v_proj.",
            "attn2.norm_added_k.")  # what the prompt cache reads: resident whenever the DiT is
VAE_BYTES_PER_PIXEL_FRAME = 2800
VAE_FACTORS = (4, 8)  # Wan's VAE: (temporal, spatial) compression


def keep_cross(name: str) -> bool:
    """The tensors of a streamed DiT block that stay with the resident DiT (names within the block)."""
    return name.startswith(CROSS_KV)


def _tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``model``'s parameters and buffers by name, a tied tensor once."""
    return [*model.named_parameters(), *model.named_buffers()]


def _bytes(named, dtype: torch.dtype, fp32=lambda name: False) -> int:
    """Bytes of the (name, tensor) pairs ``named`` (meta tensors) in the dtypes they run in: float8 as stored,
    ``fp32(name)`` tensors and FP8 scales fp32, other floating tensors ``dtype``."""
    size = torch.empty((), dtype=dtype).element_size()
    total = 0
    for name, t in named:
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            total += t.numel()
        elif fp32(name) or name.endswith(".weight_scale"):
            total += 4 * t.numel()
        else:
            total += (size if t.is_floating_point() else t.element_size()) * t.numel()
    return total


def dit_quantization(ckpt, quantization: str | None) -> str | None:
    """The DiT weights' format as they will load: ``quantization``, or "fp8" when ``ckpt``'s DiT files already
    hold FP8 weights (a folder ``fastwan quantize`` wrote loads in FP8 whatever the argument); read from the
    safetensors headers."""
    from fastwan.checkpoint.safetensors import header_tensors, weight_files
    from fastwan.models.wan.quantize import prequantized_layers

    if quantization is not None:
        return quantization
    for e in ckpt.experts:
        if not any(ckpt.folder(e).glob("*.safetensors")):  # pickle files (never FP8) or configs only
            continue
        if prequantized_layers(header_tensors(weight_files(ckpt.folder(e)))):
            return "fp8"
    return None


def _dit_sizes(ckpt, dtype, quantization) -> tuple[tuple[int, ...], int, int]:
    """(each expert's weight bytes, the largest block's streamable bytes, streamable blocks per expert: all but
    block 0, whose two halves the CFG path calls outside the block loop)."""
    from fastwan.models import WanConfig, WanTransformer, keep_in_fp32
    from fastwan.models.wan.quantize import fp8_layer_names, use_fp8

    sizes, block = [], 0
    for e in ckpt.experts:
        with torch.device("meta"):
            model = WanTransformer(WanConfig.from_file(ckpt.folder(e) / "config.json"))
            if ckpt.vsa_gates:
                model.add_gate_compress()
        if quantization == "fp8":
            use_fp8(model, fp8_layer_names(model), device="meta", dtype=dtype, route="dequant")
        sizes.append(_bytes(_tensors(model), dtype, keep_in_fp32))
        streamable = [(f"blocks.0.{n}", t) for n, t in _tensors(model.blocks[0]) if not keep_cross(n)]
        block = max(block, _bytes(streamable, dtype, keep_in_fp32))
    return tuple(sizes), block, len(model.blocks) - 1


def weight_bytes(ckpt, *, dtype: torch.dtype, vae_dtype: torch.dtype, quantization: str | None) -> dict[str, int]:
    """The weight fields of a :class:`~fastwan.offload.Footprint` of ``ckpt`` (they do not depend on the video:
    compute them once per generator)."""
    from diffusers import AutoencoderKLWan
    from transformers import AutoConfig, UMT5EncoderModel

    dit, block, blocks = _dit_sizes(ckpt, dtype, dit_quantization(ckpt, quantization))
    with torch.device("meta"):
        te = UMT5EncoderModel(AutoConfig.from_pretrained(ckpt.folder("text_encoder")))
        vae = AutoencoderKLWan.from_config(AutoencoderKLWan.load_config(ckpt.folder("vae")))
        clip = 0
        if ckpt.image_encoder:
            from transformers import CLIPVisionModel

            clip = _bytes(_tensors(CLIPVisionModel(AutoConfig.from_pretrained(ckpt.folder("image_encoder")))), dtype)
    layers = te.encoder.block
    return dict(text_encoder=_bytes(_tensors(te), dtype),
                text_encoder_layer=max(_bytes(_tensors(b), dtype) for b in layers),
                text_encoder_layers=len(layers), image_encoder=clip, vae=_bytes(_tensors(vae), vae_dtype), dit=dit,
                dit_block=block, dit_blocks=blocks)


def estimate_footprint(ckpt, weights: dict[str, int], *, dtype: torch.dtype, quantization: str | None,
                       height: int, width: int, num_frames: int, cfg_batch: int, prompts: int, vae_chunk: int,
                       vae_tiled_px: int = 256) -> Footprint:
    """The :class:`~fastwan.offload.Footprint` of ``ckpt`` (its :func:`weight_bytes` ``weights``) for one video of
    ``height`` x ``width`` x ``num_frames`` with ``cfg_batch`` samples per DiT forward, ``prompts`` encoded prompts
    and ``vae_chunk`` latent frames per decoder call."""
    cfg = ckpt.transformer_config
    tokens = video_tokens(cfg, height, width, num_frames)
    size = torch.empty((), dtype=dtype).element_size()
    acts = cfg_batch * tokens * (7 * cfg.inner_dim + 2 * cfg.ffn_dim) * size
    if quantization == "fp8":  # the FFN's GELU leaves the GEMM (its own output) and its input is quantized too
        acts += cfg_batch * tokens * (size + 1) * cfg.ffn_dim
    acts += cfg.num_layers * 2 * prompts * TEXT_TOKENS * cfg.inner_dim * size + 512 * MiB
    latent_frames = (num_frames - 1) // VAE_FACTORS[0] + 1  # the first decodes alone, the rest in chunks
    frames_per_call = VAE_FACTORS[0] * min(vae_chunk, max(1, latent_frames - 1))
    decode = VAE_BYTES_PER_PIXEL_FRAME * height * width * frames_per_call
    tiled = max(int(1.5 * VAE_BYTES_PER_PIXEL_FRAME * vae_tiled_px**2 * frames_per_call), 1024 * MiB)
    return Footprint(**weights, text_activations=512 * MiB, dit_activations=acts, vae_decode=decode,
                     vae_decode_tiled=min(tiled, decode))


def video_tokens(cfg, height: int, width: int, num_frames: int) -> int:
    """DiT tokens per sample of a video (Wan's VAE factors, the DiT's ``cfg.patch_size``)."""
    (ft, fs), (pt, ph, pw) = VAE_FACTORS, cfg.patch_size
    return ((num_frames - 1) // ft + 1) // pt * (height // fs // ph) * (width // fs // pw)


def job_footprint(ckpt, weights: dict[str, int], s, dtype, quantization, cfg_batched: Callable[[int], bool],
                  vae_chunk) -> Footprint:
    """The footprint of one video with settings ``s`` (a preset: height, width, frames, guidance) for ``ckpt``'s
    :func:`weight_bytes` ``weights``, where ``cfg_batched(tokens)`` says whether CFG runs as one batch of 2, with
    ``vae_chunk`` ("auto" or latent frames per decoder call)."""
    from fastwan.vae.decode import auto_chunk_frames

    cfg = runs_cfg(s)
    batch = 2 if cfg and cfg_batched(video_tokens(ckpt.transformer_config, s.height, s.width, s.num_frames)) else 1
    chunk = auto_chunk_frames(s.height, s.width, VAE_FACTORS[0]) if vae_chunk == "auto" else vae_chunk
    return estimate_footprint(ckpt, weights, dtype=dtype, quantization=dit_quantization(ckpt, quantization),
                              height=s.height,
                              width=s.width, num_frames=s.num_frames, cfg_batch=batch, prompts=2 if cfg else 1,
                              vae_chunk=chunk)


def usable(budget: int) -> Usable:
    """The bytes of a budget the planner may fill: the caching allocator also holds reserved-but-unallocated blocks
    (1.66 GiB in an FP8 14B 720p run on an H100 at 24 GiB, which ran out with 22.12 GiB allocated), so a plan
    leaves max(1 GiB, 1/16 of the budget) free (:func:`fastwan.offload.plan.reserve`). A :class:`Usable`, so
    the planner names the budget as given, and the one a job needs; a budget of 1 GiB or less raises."""
    return Usable(budget)


class Offloaded:
    """A module whose tensors (all but those whose storage pointer is in ``skip``) live in (pinned) host memory,
    with device copies made by :meth:`to_device` and dropped by :meth:`to_host`; a tensor held by several places
    (a tied embedding) is copied once."""

    def __init__(self, module: nn.Module, device: torch.device, skip: set[int] = frozenset()):
        self.device = device
        pin = device.type == "cuda"
        self._held = []
        for tensor, _, hold in held_tensors(module):
            if tensor.data_ptr() not in skip:
                host = tensor.detach().to("cpu")
                self._held.append(hold(host.pin_memory() if pin else host))
        self.to_host()

    def to_device(self) -> None:
        for h in self._held:
            h.point(h.host.to(self.device, non_blocking=True))

    def to_host(self) -> None:
        for h in self._held:
            h.point(h.host)


class Placement:
    """An :class:`~fastwan.offload.OffloadPlan` carried out on a generator's modules (see the module docstring)."""

    def __init__(self, plan: OffloadPlan, device: torch.device, *, transformers, text_encoder, image_encoder, vae):
        self.plan, self.device = plan, device
        self.transformers = transformers
        self.streamers = []
        k = plan.streamed_blocks
        for t in transformers:
            n = len(t.blocks)
            if k >= n:
                raise InvalidArgument(f"streamed_blocks={k}: a DiT of {n} blocks streams at most {n - 1} (block 0's "
                                      "halves run outside the block loop); plan with the footprint's dit_blocks.")
            streamer = None if k == 0 else BlockStreamer(t.blocks, device, range(n - k, n), keep=keep_cross)
            if streamer is not None:
                stream_blocks(t, streamer)
            self.streamers.append(streamer)
        offload_dit = plan.dit_offload or plan.experts == "swap"
        skip = set()
        for s, t in zip(self.streamers, transformers):
            if s is not None:
                for i in s.streamed:
                    skip |= {p.data_ptr() for n, p in t.blocks[i].state_dict().items() if not keep_cross(n)}
        self.dits = [Offloaded(t, device, skip) if offload_dit else None for t in transformers]
        for t in transformers:
            if not offload_dit:
                _move_except(t, device, skip)
        self.text = self.image = None
        self.te_streamer = None
        if plan.text_encoder == "stream":
            blocks = text_encoder.encoder.block
            self.te_streamer = BlockStreamer(blocks, device, range(len(blocks)))
            self.te_streamer.attach_hooks()
            kept = {p.data_ptr() for b in blocks for p in b.state_dict().values()}
            self.text = Offloaded(text_encoder, device, kept)
        elif plan.text_encoder == "offload":
            self.text = Offloaded(text_encoder, device)
        else:
            text_encoder.to(device)
        if image_encoder is not None:
            if plan.text_encoder == "resident":
                image_encoder.to(device)
            else:
                self.image = Offloaded(image_encoder, device)
        vae.to(device)
        self.vae = vae
        self.tiled = plan.vae_tiling and tiling_state(vae) is None  # turned on here, off in detach
        if self.tiled:
            vae.enable_tiling()
        self._active: int | None = None

    def detach(self) -> None:
        """Stop carrying the plan out (before another Placement takes the modules over; every offloaded tensor is
        at home on the host between calls, where the next plan finds it)."""
        if self.te_streamer is not None:
            self.te_streamer.detach_hooks()
        for t in self.transformers:
            stop_streaming(t)
        if self.tiled:  # tiles change the decoded values: only a plan that needs them keeps them
            self.vae.disable_tiling()

    @contextlib.contextmanager
    def encoding(self) -> Iterator[None]:
        """The text (and image) encoders on the device for the block's duration."""
        parts = [p for p in (self.text, self.image) if p is not None]
        for p in parts:
            p.to_device()
        try:
            yield
        finally:
            for p in parts:
                p.to_host()
            self._return_cache()

    @contextlib.contextmanager
    def denoising(self) -> Iterator[None]:
        """The DiT on the device (with "swap": the expert :meth:`expert` selects) for the block's duration."""
        if self.plan.experts != "swap":
            for d in self.dits:
                if d is not None:
                    d.to_device()
        try:
            yield
        finally:
            for d in self.dits:
                if d is not None:
                    d.to_host()
            for s in self.streamers:
                if s is not None:
                    s.release()
            self._active = None
            self._return_cache()

    def _return_cache(self) -> None:
        """After a phase: the freed blocks go back to the driver, so the next phase's differently sized tensors
        are not refused by a budget the cached blocks fill."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def expert(self, i: int) -> None:
        """Before a step of expert ``i``: with "swap", the other expert leaves the device and ``i`` comes."""
        if self.plan.experts != "swap" or self._active == i:
            return
        if self._active is not None:
            self.dits[self._active].to_host()
            if self.streamers[self._active] is not None:  # its prefetched block would stay on the device
                self.streamers[self._active].release()
        self.dits[i].to_device()
        self._active = i


def _move_except(module: nn.Module, device: torch.device, skip: set[int]) -> None:
    """Every tensor of ``module`` to ``device``, except those whose storage is in ``skip`` (streamed blocks')."""
    for mod in module.modules():
        for t in mod._parameters.values():
            if t is not None and t.data_ptr() not in skip:
                t.data = t.data.to(device)
        for name, t in list(mod._buffers.items()):
            if t is not None and t.data_ptr() not in skip:
                mod._buffers[name] = t.to(device)
