"""The Wan DiT: patch and time/text embeddings, the blocks, the output head.

``WanTransformer(cfg, attention, options)`` builds the block chosen by ``options`` (:class:`fastwan.options.
DiTOptions`, resolved): :class:`~fastwan.models.wan.block.WanBlock` (the reference) or
:class:`~fastwan.models.wan.block.FastWanBlock`, whose cross-attention reads per-prompt keys and values
(:mod:`fastwan.models.wan.cross`). Every attention call goes through :class:`fastwan.attention.AttentionDispatch`
in the [B, S, H, D] layout.

The forward is one path: :meth:`WanTransformer.embed` -> :meth:`WanTransformer.run_blocks` ->
:meth:`WanTransformer.head`. The step cache, block streaming and sequence parallelism are hooks on those call points
(:mod:`fastwan.hooks`), attached when the model is built or a run starts: ``run_blocks`` / ``run_cfg`` (the step
cache, :mod:`fastwan.models.wan.step_cache`), ``block_calls.i`` (block streaming, :mod:`fastwan.offload.stream`),
and the points the sequence plan ``_sp_plan`` names (:mod:`fastwan.parallel.plan`).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn as nn

from fastwan.attention import AttentionDispatch, AttentionMetadata
from fastwan.errors import InvalidArgument
from fastwan.hooks import Gather, HookRegistry, Split
from fastwan.models.compiled import share_across_threads
from fastwan.models.wan.animate import HOOK_NAME as ANIMATE_HOOK, animate_modules
from fastwan.models.wan.block import FastWanBlock, Residual, WanBlock, settle
from fastwan.models.wan.config import WanConfig
from fastwan.models.wan.cross import CrossInputs, PromptCache
from fastwan.models.wan.layers import TimeTextEmbedding, fp32_layer_norm, keep_in_fp32, rope_tables
from fastwan.models.wan.vace import ControlTokens, control_tokens, vace_modules
from fastwan.options import DiTOptions

__all__ = ["Embedded", "WanTransformer", "keep_in_fp32"]


def _shape(value) -> str:
    """A tensor's shape as a list, or what else ``value`` is."""
    return str(list(value.shape)) if isinstance(value, torch.Tensor) else f"{value!r} ({type(value).__name__})"


class Embedded(NamedTuple):
    """One forward's embedded input, what the blocks and the head read: the stream ``x`` [B, S, C] (contiguous, in a
    sparse backend's compact order), the RoPE table ``rope`` [1, S, 1, 2 * head_dim], the time embedding ``temb``
    ([B, C], or per token [B, S, C], raster order) and modulation ``mod`` ([B, 6, C], or per token [B, S, 6, C]), the
    token ``grid`` and the sparse backend's ``layout`` (None for a dense one)."""
    x: torch.Tensor
    rope: torch.Tensor
    temb: torch.Tensor
    mod: torch.Tensor
    grid: tuple[int, int, int]
    layout: object


class WanTransformer(nn.Module):
    """Wan DiT. ``forward(latents [B, C, F, H, W], timestep [B] or [B, S], text [B, L, text_dim])``."""

    # where sequence parallelism splits the token sequence over the ranks and gathers it back
    # (fastwan.parallel.plan): the embedding's stream, RoPE table and per-token modulation, VACE's control tokens
    # (the same token count, so the same shards); the head's input
    _sp_plan = {"embed": Split({"x": 3, "rope": 4, "mod": 4}), "embed_control": Split({"c": 3}), "head": Gather(0)}

    def __init__(self, cfg: WanConfig, attention: AttentionDispatch | None = None,
                 options: DiTOptions | None = None):
        super().__init__()
        options = DiTOptions(block="reference") if options is None else options
        if options.block == "auto":
            raise InvalidArgument("WanTransformer: options.block='auto' is not resolved; pass "
                                  "options.resolve(device, dtype).")
        self.config = cfg
        self.options = options
        dim = cfg.inner_dim
        self.patch_embedding = nn.Conv3d(cfg.in_channels, dim, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        self.condition_embedder = TimeTextEmbedding(cfg)
        block = FastWanBlock if options.fast else WanBlock
        self.blocks = nn.ModuleList([block(cfg) for _ in range(cfg.num_layers)])
        # VACE's control blocks (fastwan.models.wan.vace; none for a plain DiT), run by its hook
        self.vace_patch_embedding, self.vace_blocks = vace_modules(cfg, block)
        # Animate's pose embedding, motion and face encoders, face adapters (fastwan.models.wan.animate; None for
        # the other DiTs), run by its hook
        for name, module in animate_modules(cfg).items():
            setattr(self, name, module)
        self.norm_out = nn.LayerNorm(dim, cfg.eps, elementwise_affine=False)
        self.proj_out = nn.Linear(dim, cfg.out_channels * math.prod(cfg.patch_size))
        self.scale_shift_table = nn.Parameter(torch.randn(1, 2, dim) / dim**0.5)
        self.attention = attention
        self._rope_cache: dict = {}
        self._first_halves = None  # compiled (video_half, text_half) of block 0, set by compile_blocks()
        self.prompts = PromptCache() if options.fast else None
        # what the block loop calls for block i: the block itself, or a hook's wrapper of it (point "block_calls.i")
        self.block_calls: list = list(self.blocks)

    def set_attention(self, dispatch: AttentionDispatch) -> None:
        self.attention = dispatch

    def add_gate_compress(self) -> None:
        """Create the VSA ``to_gate_compress`` projections (checkpoints trained for VSA carry their weights)."""
        for blk in self.blocks:
            blk.attn1.to_gate_compress = nn.Linear(self.config.inner_dim, self.config.inner_dim)

    @property
    def dtype(self) -> torch.dtype:
        return self.proj_out.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.proj_out.weight.device

    def _rope(self, grid, device):
        key = (grid, device)
        if key not in self._rope_cache:
            self._rope_cache = {key: rope_tables(grid, self.config.attention_head_dim, self.config.rope_max_seq_len,
                                                 device)}
        return self._rope_cache[key]

    def compile_blocks(self, **kwargs) -> None:
        """Regional torch.compile: each block's forward, and the two halves of the first block that
        :meth:`forward_cfg` calls separately (``kwargs`` go to ``torch.compile``). Several threads may each run
        their compiled model (:func:`fastwan.models.compiled.share_across_threads`)."""
        share_across_threads()
        for block in (*self.blocks, *self.vace_blocks):
            block.compile(**kwargs)
        first = self.blocks[0]
        self._first_halves = (torch.compile(first.video_half, **kwargs), torch.compile(first.text_half, **kwargs))

    # -- text ---------------------------------------------------------------------------------------------
    def text_parameters(self):
        """The tensors the cross-attention inputs (text and image keys and values, the folded output projection) are
        computed from."""
        yield from self.condition_embedder.text_embedder.parameters()
        if self.condition_embedder.image_embedder is not None:
            yield from self.condition_embedder.image_embedder.parameters()
        for blk in (*self.blocks, *self.vace_blocks):
            a = blk.attn2
            parts = [a.to_k, a.to_v, a.norm_k, a.to_out[0]]
            if a.add_k_proj is not None:
                parts += [a.add_k_proj, a.add_v_proj, a.norm_added_k]
            for part in parts:  # an FP8 layer's tensors are buffers
                yield from part.parameters()
                yield from part.buffers()

    def text_context(self, texts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The text embedder on the texts concatenated along the batch -> [sum B_i, L, C]."""
        text = texts[0].to(self.dtype) if len(texts) == 1 else torch.cat([t.to(self.dtype) for t in texts])
        return self.condition_embedder.text(text)

    def image_context(self, image: torch.Tensor, batch: int) -> torch.Tensor:
        """The image embedder on CLIP image tokens ``image`` [B_img, N, image_dim] ([2 B_img, N, image_dim] for
        first-last-frame checkpoints, both frames' tokens) -> [batch, N or 2N, C]; one image's tokens serve a batch
        of any size (CFG's passes share the image)."""
        if self.condition_embedder.image_embedder is None:
            raise InvalidArgument("this Wan DiT has no image embedder (image_dim is not set in its config); it takes "
                                  "no image tokens. Use an image-to-video checkpoint, or pass image=None.")
        ctx = self.condition_embedder.image_embedder(image.to(self.dtype))
        if ctx.shape[0] == batch:
            return ctx
        if ctx.shape[0] != 1:
            raise InvalidArgument(f"image tokens for {ctx.shape[0]} samples, but the batch has {batch}; give one "
                                  "image per sample, or one for the whole batch.")
        return ctx.expand(batch, -1, -1)

    def _check_inputs(self, latents, timestep, texts: tuple, image: torch.Tensor | None) -> None:
        """Rules for a forward's inputs (their shapes only, nothing runs): latents [B, in_channels, F, H, W] on a grid
        the patch size divides; timestep [B] or [1], or per-token [B or 1, tokens]; each text [B, L, text_dim];
        image tokens exactly where the DiT reads them (:meth:`_check_image`)."""
        cfg = self.config
        if not (isinstance(latents, torch.Tensor) and latents.dim() == 5 and latents.shape[1] == cfg.in_channels):
            raise InvalidArgument(f"latents {_shape(latents)} must be [B, {cfg.in_channels}, F, H, W] (this DiT reads "
                                  f"in_channels={cfg.in_channels}); pass latents with the checkpoint's channels.")
        B, sizes = latents.shape[0], latents.shape[2:]
        if any(n % p for n, p in zip(sizes, cfg.patch_size)):
            raise InvalidArgument(
                f"latent grid {'x'.join(map(str, sizes))} is not divisible by patch_size {cfg.patch_size}; choose a "
                "height/width that is a multiple of the VAE factor times the patch size.")
        tokens = math.prod(n // p for n, p in zip(sizes, cfg.patch_size))
        if not (isinstance(timestep, torch.Tensor) and timestep.dim() in (1, 2) and timestep.shape[0] in (1, B)
                and timestep.shape[1:] in ((), (tokens,))):
            shared = "" if B == 1 else f" (or [1] and [1, {tokens}]: the same for the whole batch)"
            raise InvalidArgument(f"timestep {_shape(timestep)} must be [{B}], or per-token [{B}, {tokens}] (one per "
                                  f"latent token){shared}; pass one of those shapes.")
        for t in texts:
            if not (isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[0] == B and t.shape[2] == cfg.text_dim):
                raise InvalidArgument(f"text {_shape(t)} must be [{B}, L, {cfg.text_dim}] (the latents' batch, this "
                                      f"DiT's text_dim={cfg.text_dim}); pass the text encoder's output per sample.")
        self._check_image(image)
        if cfg.animate and ANIMATE_HOOK not in HookRegistry.of(self):
            raise InvalidArgument("this Wan2.2-Animate DiT reads pose latents and a face video with every forward; "
                                  "run it inside fastwan.models.wan.animate.animate_inputs(model, pose, face).")

    def _check_image(self, image: torch.Tensor | None) -> None:
        embedder = self.condition_embedder.image_embedder
        if (image is None) != (embedder is None):
            raise InvalidArgument(
                "this Wan DiT reads CLIP image tokens (image_dim is set in its config): pass image=[B, N, image_dim]."
                if image is None else
                "this Wan DiT has no image embedder (image_dim is not set in its config); pass image=None.")
        if image is None:
            return
        dim, pos = self.config.image_dim, self.config.pos_embed_seq_len
        if not (isinstance(image, torch.Tensor) and image.dim() == 3 and image.shape[2] == dim):
            raise InvalidArgument(f"image tokens {_shape(image)} must be [B, N, {dim}] (this DiT's image_dim={dim}); "
                                  "pass the CLIP image encoder's hidden states of this checkpoint.")
        if pos is not None and (image.shape[0] % 2 or 2 * image.shape[1] != pos):
            raise InvalidArgument(
                f"image tokens {_shape(image)}: this first-last-frame DiT reads both frames' tokens stacked on the "
                f"batch, [2 B, N, {dim}] with 2 N = pos_embed_seq_len = {pos}; pass both frames' CLIP hidden states.")

    def _contexts(self, texts: tuple[torch.Tensor, ...], context: torch.Tensor | None = None,
                  image: torch.Tensor | None = None) -> list:
        """What each block's cross-attention reads (the main blocks', then VACE's control blocks') for the texts
        (concatenated along the batch) and the image tokens: the fast block's per-prompt
        :class:`~fastwan.models.wan.cross.CrossKV`, or the reference block's
        :class:`~fastwan.models.wan.cross.CrossInputs` (the text embedding ``context`` if given)."""
        if self.prompts is not None:
            return self.prompts.contexts(self, texts, image)
        context = self.text_context(texts) if context is None else context
        image_context = None if image is None else self.image_context(image, context.shape[0])
        return [CrossInputs(context, image_context)] * (len(self.blocks) + len(self.vace_blocks))

    def _cfg_contexts(self, text: torch.Tensor, text_uncond: torch.Tensor, image: torch.Tensor | None,
                      batched: bool) -> list:
        """forward_cfg's cross-attention inputs: for the batch of 2 (``batched``), else a pair, one per pass (the
        reference block's text embedder runs once for both)."""
        if batched:
            return self._contexts((text, text_uncond), image=image)
        context = None if self.prompts is not None else self.text_context((text, text_uncond))
        return [self._contexts((t,), None if context is None else context[i:i + 1], image)
                for i, t in enumerate((text, text_uncond))]

    # -- forward ------------------------------------------------------------------------------------------
    def embed(self, latents: torch.Tensor, timestep: torch.Tensor) -> Embedded:
        """Patch embedding (in a sparse backend's compact tile-major order: no dummy slots), RoPE table and time
        embeddings (call point "embed")."""
        if self.attention is None:
            raise RuntimeError("WanTransformer has no attention dispatch; call set_attention() first.")
        _, _, Fr, Hh, Ww = latents.shape
        pt, ph, pw = self.config.patch_size
        grid = (Fr // pt, Hh // ph, Ww // pw)
        # [B, S, C], contiguous: the fast block adds into it in place
        x = self.patch_embedding(latents.to(self.dtype)).flatten(2).transpose(1, 2).contiguous()
        rope = self._rope(grid, x.device)
        temb, mod = self.condition_embedder.time(timestep, self.dtype)
        layout = self.attention.layout_for(grid, x.device)
        if layout is not None:  # sparse backend: the layout's compact order (no dummy slots), once per forward
            x = layout.permute_compact(x, dim=1)
            rope = layout.permute_compact(rope, dim=1)
            if mod.dim() == 4:  # per-token modulation [B, S, 6, C]; temb stays raster (used after unpermute)
                mod = layout.permute_compact(mod, dim=1)
        return Embedded(x, rope, temb, mod, grid, layout)

    def embed_control(self, control: torch.Tensor, grid: tuple[int, int, int], layout) -> ControlTokens:
        """VACE's control latents patch-embedded, in the stream's order (call point "embed_control";
        :func:`fastwan.models.wan.vace.control_tokens`)."""
        return control_tokens(self, control, grid, layout)

    def attention_meta(self, e: Embedded, i: int, step_index, num_steps) -> AttentionMetadata | None:
        """Block ``i``'s attention metadata (a sparse backend's; for a dense one None, or a hybrid schedule's step)."""
        if not self.attention.sparse:
            return self.attention.step_meta(step_index, num_steps)
        return AttentionMetadata(grid=e.grid, step_index=step_index, num_steps=num_steps, layer_index=i,
                                 layout=e.layout, compact=True)

    def head(self, x: torch.Tensor, e: Embedded) -> torch.Tensor:
        """The last block's stream x [B, S, C] (compact layout order under a sparse backend) -> prediction
        [B, C_out, F, H, W] (call point "head")."""
        if e.layout is not None:
            x = e.layout.unpermute_compact(x, dim=1)
        temb = e.temb
        if temb.dim() == 3:  # per-token: [B, S, C]
            shift, scale = (self.scale_shift_table.unsqueeze(0) + temb.unsqueeze(2)).unbind(2)
        else:
            shift, scale = (self.scale_shift_table + temb.unsqueeze(1)).unsqueeze(2).unbind(1)
        x = (fp32_layer_norm(x, self.norm_out) * (1 + scale) + shift).type_as(x)
        x = self.proj_out(x)  # [B, S, C_out * pt * ph * pw]
        B = x.shape[0]
        T, H, W = e.grid
        pt, ph, pw = self.config.patch_size
        x = x.view(B, T, H, W, pt, ph, pw, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
        return x.reshape(B, -1, T * pt, H * ph, W * pw)

    def forward(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        text: torch.Tensor,
        *,
        image: torch.Tensor | None = None,
        step_index: int | None = None,
        num_steps: int | None = None,
    ) -> torch.Tensor:
        """latents [B, C_in, F, H, W]; timestep [B] (or per-token [B, S]); text [B, L, text_dim]; image: CLIP image
        tokens [B or 1, N, image_dim] for image-conditioned checkpoints (see :meth:`image_context`), else None;
        step_index / num_steps: the denoising step of this call (what sparse backends and a step cache read)
        -> prediction [B, C_out, F, H, W] in the dtype of the model."""
        self._check_inputs(latents, timestep, (text,), image)
        e = self.embed(latents, timestep)
        x = self.run_blocks(e, self._contexts((text,), image=image), step_index, num_steps)
        return self.head(x, e)

    def run_blocks(self, e: Embedded, contexts: list, step_index, num_steps) -> torch.Tensor:
        """Every block on the embedded stream -> the stream after the last one [B, S, C] (call point "run_blocks");
        ``contexts``: one cross-attention input per block."""
        return settle(self.blocks_range(0, Residual(e.x), contexts, e, step_index, num_steps))

    def blocks_range(self, start: int, r: Residual, contexts: list, e: Embedded, step_index, num_steps,
                     stop: int | None = None) -> Residual:
        """Blocks ``start`` .. ``stop`` - 1 (default: the last) on the stream ``r``, each through ``block_calls``."""
        calls, mod, rope, attn = self.block_calls, e.mod, e.rope, self.attention
        for i in range(start, len(calls) if stop is None else stop):
            r = calls[i](r, contexts[i], mod, rope, attn, self.attention_meta(e, i, step_index, num_steps))
        return r

    def first_halves(self) -> tuple:
        """Block 0's (video_half, text_half), compiled once :meth:`compile_blocks` ran."""
        return self._first_halves or (self.blocks[0].video_half, self.blocks[0].text_half)

    def forward_cfg(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        text: torch.Tensor,
        text_uncond: torch.Tensor,
        *,
        image: torch.Tensor | None = None,
        batched: bool = True,
        step_index: int | None = None,
        num_steps: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The conditional and unconditional predictions of one CFG step, as ``forward(latents, timestep, text)``
        and ``forward(latents, timestep, text_uncond)`` would give them.

        The two passes see the same latents and timestep, and the text enters a Wan block only at its
        cross-attention, so everything up to the first block's cross-attention is computed once, at batch 1.
        The passes then run as one batch of 2 (``batched``) or one after the other (less memory).

        latents [1, C_in, F, H, W]; timestep [1] (or per-token [1, S]); text, text_uncond [1, L, text_dim]; image:
        the image tokens both passes read, as in :meth:`forward` -> (cond, uncond), each [1, C_out, F, H, W].
        """
        if any(isinstance(a, torch.Tensor) and a.dim() == d and a.shape[0] != 1
               for a, d in ((latents, 5), (text, 3), (text_uncond, 3))):
            raise InvalidArgument(
                f"forward_cfg takes one sample: latents {_shape(latents)}, text {_shape(text)}, text_uncond "
                f"{_shape(text_uncond)} (each of batch 1); call forward() for batches.")
        self._check_inputs(latents, timestep, (text, text_uncond), image)
        if text.shape[1:] != text_uncond.shape[1:]:
            raise InvalidArgument(
                f"forward_cfg: text {tuple(text.shape)} and text_uncond {tuple(text_uncond.shape)} must have the same "
                "length and width (the pipeline pads both prompts to the same number of tokens); pad them equally."
            )
        e = self.embed(latents, timestep)
        contexts = self._cfg_contexts(text, text_uncond, image, batched)
        return self.run_cfg(e, contexts, batched, step_index, num_steps)

    def run_cfg(self, e: Embedded, contexts: list, batched: bool, step_index,
                num_steps) -> tuple[torch.Tensor, torch.Tensor]:
        """Both CFG passes from the embedded input to their predictions (call point "run_cfg"): block 0's video
        half once, then each pass's rest and head, as one batch of 2 (``batched``; ``contexts`` for the batch) or
        one after the other (``contexts``: a pair, one per pass)."""
        video_half, text_half = self.first_halves()
        attn = self.attention
        r, h = video_half(Residual(e.x), e.mod, e.rope, attn, self.attention_meta(e, 0, step_index, num_steps))

        def rest(r: Residual, h: torch.Tensor, ctx: list) -> torch.Tensor:
            r = text_half(r, h, ctx[0], e.mod, attn)
            return self.head(settle(self.blocks_range(1, r, ctx, e, step_index, num_steps)), e)

        if batched:
            both = r._replace(x=torch.cat([r.x, r.x]), y=None if r.y is None else torch.cat([r.y, r.y]))
            return rest(both, torch.cat([h, h]), contexts).chunk(2)
        # the fast block adds into x in place: the first pass gets its own copy
        first = r._replace(x=r.x.clone()) if self.prompts is not None else r
        return rest(first, h, contexts[0]), rest(r, h, contexts[1])
