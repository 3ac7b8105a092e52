"""What ``VideoGenerator.from_pretrained`` settles before loading: its plain options (dtypes, CFG mode and gate,
flags, DiT options, device), the scheduler class, torch.compile's arguments, the attention a VSA-trained
checkpoint runs, and the attention config argument."""
from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from fastwan import envs
from fastwan.attention import AttentionDispatch
from fastwan.attention.registry import backend_keys, requested_backend
from fastwan.errors import InvalidArgument, InvalidArgumentType
from fastwan.options import DiTOptions
from fastwan.checkpoint.presets import VSA_TILE, trained_vsa_sparsity
from fastwan.checkpoint.resolver import Checkpoint
from fastwan.checkpoint.components import scheduler_class

logger = logging.getLogger("fastwan")



def check_load_options(options) -> tuple:
    """What ``from_pretrained``'s options (a checked :class:`~fastwan.pipelines.load_options.LoadOptions`) leave to
    this machine, filled in -> (device: a torch.device, CUDA when None and available; dtype: the device's default
    (:func:`~fastwan.pipelines.load_options.default_dtype`) when None; vae_dtype: ``dtype`` when None;
    cfg_gate_step: the environment's (``FASTVIDEO_CFG_GATE_STEP``) when None; dit_options: ``DiTOptions()`` when
    None)."""
    from fastwan.pipelines.load_options import default_dtype

    device = options.device
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgument(f"device={device} was requested but CUDA is not available; use device='cpu'.")
    dtype = default_dtype(device) if options.dtype is None else options.dtype
    vae_dtype = dtype if options.vae_dtype is None else options.vae_dtype  # bf16 halves the VAE's time
    cfg_gate_step = envs.cfg_gate_step() if options.cfg_gate_step is None else options.cfg_gate_step
    dit_options = DiTOptions() if options.dit_options is None else options.dit_options
    return device, dtype, vae_dtype, cfg_gate_step, dit_options


AUTO_SEQUENTIAL_TOKENS = 16384  # cfg_mode="auto": sequential CFG on CUDA from this many video tokens per sample


def cfg_batched(cfg_mode: str, device: torch.device, tokens: int) -> bool:
    """``cfg_mode``'s rule (see ``VideoGenerator._cfg_batched``) for ``tokens`` video tokens per sample."""
    if cfg_mode != "auto":
        return cfg_mode == "batched"
    return not (device.type == "cuda" and tokens >= AUTO_SEQUENTIAL_TOKENS)


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (CUDA; nothing elsewhere): a host timing's end."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def on_device(device: torch.device):
    """A context in which ``device`` is the calling thread's current CUDA device (nothing off CUDA). Rule: a
    generator's work runs inside it: Triton kernels launch on the current device, which CUDA keeps per thread (a
    thread's is cuda:0 until set), so a generator on cuda:1 called from any thread needs it."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def set_fp32_precision(device: torch.device, precision: str) -> None:
    """Rule: on CUDA, fp32 matmuls and convolutions run as ``precision`` says ("tf32" or "ieee") from this load on;
    torch keeps one setting per process. Off CUDA nothing changes."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.fp32_precision = precision
        torch.backends.cudnn.conv.fp32_precision = precision


def load_scheduler(ckpt: Checkpoint):
    """The checkpoint's diffusers scheduler: the class diffusers' pipeline loading builds
    (:func:`fastwan.checkpoint.components.scheduler_class`) from ``scheduler/scheduler_config.json``."""
    cls, cfg = scheduler_class(ckpt.index, ckpt.root)
    return cls.from_config(cfg)


def compile_kwargs(user: Mapping[str, Any] | None, attention: AttentionDispatch, ring: int = 1,
                   causal: bool = False) -> dict:
    """torch.compile kwargs for the DiT blocks: fullgraph unless the self-attention backend is sparse, runs round a
    ring of ``ring`` > 1 processes (:mod:`fastwan.parallel.ring`) or reads a causal stream's cache (``causal``:
    :mod:`fastwan.models.wan.causal`); the user's checked before any weight loads (:func:`check_compile_kwargs`)."""
    if user is not None:
        check_compile_kwargs(user)
    eager = attention.sparse or ring > 1 or causal
    kwargs = dict(user) if user is not None else {"fullgraph": not eager}
    if eager and kwargs.get("fullgraph"):
        what = (f"the sparse backend {attention.self_backend.name}" if attention.sparse else
                f"ring attention (ring degree {ring}: its send/receive calls)" if ring > 1 else
                "a causal checkpoint (its key/value cache's bookkeeping)")
        raise InvalidArgument(
            f"torch_compile_kwargs={dict(user)!r}: fullgraph=True cannot be used with {what}; its attention call "
            "runs outside the graph (one graph break per block). Set fullgraph=False or leave "
            "torch_compile_kwargs unset."
        )
    if attention.sparse and user is None:
        logger.info("torch.compile with sparse attention %s: blocks compiled with fullgraph=False "
                    "(attention runs eagerly between the compiled parts)", attention.self_backend.name)
    return kwargs


def check_compile_kwargs(user: Mapping[str, Any]) -> None:
    """Rule: torch_compile_kwargs are keyword arguments of ``torch.compile`` (its own names; ``fullgraph`` and
    ``disable`` True or False, ``dynamic`` True, False or None), with values torch.compile takes. torch.compile
    refuses an unknown mode, backend or option only when it is called, which is after the weights load: a trial
    call on a trivial function (nothing is compiled until it runs) raises here instead."""
    names = [k for k in inspect.signature(torch.compile).parameters if k != "model"]
    unknown = [k for k in user if not isinstance(k, str) or k not in names]
    if unknown:
        raise InvalidArgument(f"torch_compile_kwargs={dict(user)!r}: {unknown[0]!r} is not an argument of "
                              f"torch.compile; use among {names}.")
    for key, allowed in (("fullgraph", (True, False)), ("disable", (True, False)), ("dynamic", (True, False, None))):
        if key in user and not any(user[key] is a for a in allowed):
            raise InvalidArgumentType(f"torch_compile_kwargs={dict(user)!r}: {key}={user[key]!r} must be "
                                      f"{' or '.join(map(str, allowed))}.")
    try:
        torch.compile(_trial, **user)
    except Exception as exc:  # the trial function is trivial: whatever torch.compile refuses is in the kwargs
        raise InvalidArgument(f"torch_compile_kwargs={dict(user)!r} are refused by torch.compile "
                              f"({type(exc).__name__}: {exc}); fix them (e.g. {{'mode': 'max-autotune'}}) or leave "
                              "torch_compile_kwargs unset.") from None


def _trial(x):
    """The function :func:`check_compile_kwargs` hands torch.compile."""
    return x


def trained_attention(ckpt: Checkpoint, requested, config: dict | None):
    """A VSA-trained checkpoint (FastWan) runs VIDEO_SPARSE_ATTN unless the argument, an ``attention_backend()``
    context or the environment names another backend, with its trained tile and FastVideo's sparsity wherever
    ``attention_config`` leaves them unset -> (backend request, backend config, who requested it for messages:
    None when the user did)."""
    if not ckpt.vsa_gates:
        return requested, config, None
    source = None
    name = requested_backend(requested)[0]
    if name is None:
        requested = name = "VIDEO_SPARSE_ATTN"
        source = "the checkpoint (its DiT carries VSA gates)"
        foreign = sorted(k for k in (config or {}) if k not in backend_keys(name))
        if foreign:
            raise InvalidArgument(
                f"attention_config keys {foreign} are not settings of VIDEO_SPARSE_ATTN, which {ckpt.root} runs by "
                f"default (its DiT carries VSA gates; VSA takes {', '.join(backend_keys(name))}). Name the backend "
                "these settings are for with attention_backend= (CLI --attention-backend, or "
                "FASTVIDEO_ATTENTION_BACKEND), or drop them."
            )
        logger.info("attention: %s was trained with video sparse attention (its DiT carries VSA gates); "
                    "VIDEO_SPARSE_ATTN is the default", ckpt.root)
    if isinstance(name, str) and name.strip().upper() == "VIDEO_SPARSE_ATTN":
        trained = {"sparsity": trained_vsa_sparsity(ckpt.transformer_config.inner_dim), "tile": list(VSA_TILE)}
        config = {**trained, **(config or {})}
    return requested, config, source


def attention_config(value) -> dict | None:
    """attention_config kwarg (dict, JSON path or JSON string) or FASTWAN_ATTENTION_CONFIG -> backend kwargs."""
    from fastwan.attention.sparse import load_attention_config

    given_by = "attention_config= (CLI --attention-config)"
    if value is None:
        value, given_by = envs.attention_config(), envs.attention_config_variable()
    return None if value is None else load_attention_config(value, given_by=given_by)


def load_vae(folder: Path, dtype, device, fast: bool, tiling: dict | None, allow_pickle: bool,
             variant: str | None = None):
    """diffusers' ``AutoencoderKLWan`` from ``folder`` on ``device``, set up for decoding: channels-last 3-D conv
    weights on CUDA (cuDNN: -9% decode time, -10% decode memory), the decoder's RMSNorm + SiLU pairs as one pass
    each when ``fast`` (:mod:`fastwan.vae.norms`), fewer full-tensor copies (:mod:`fastwan.vae.convs`), and
    ``tiling`` (diffusers' ``enable_tiling`` arguments) when given; ``variant``: diffusers' weight-file variant."""
    import diffusers
    import torch

    from fastwan.vae.convs import fast_decoder_convs
    from fastwan.vae.norms import fuse_decoder_norms

    vae = diffusers.AutoencoderKLWan.from_pretrained(folder, dtype=dtype, variant=variant,
                                                     use_safetensors=None if allow_pickle else True).to(device).eval()
    if device.type == "cuda":
        for mod in vae.modules():
            if isinstance(mod, torch.nn.Conv3d):
                mod.weight.data = mod.weight.data.contiguous(memory_format=torch.channels_last_3d)
    if fast:
        fuse_decoder_norms(vae)
    fast_decoder_convs(vae)
    if tiling is not None:
        vae.enable_tiling(**tiling)
    return vae
