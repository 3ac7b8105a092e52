"""The Wan DiT: patch and time/text embeddings, the blocks, the output head.

``WanTransformer(cfg, attention, options)`` builds the block chosen by ``options`` (:class:`fastwan.options.
DiTOptions`, resolved): :class:`~fastwan.models.wan.block.WanBlock` (the reference) or
:class:`~fastwan.models.wan.block.FastWanBlock`, whose cross-attention reads per-prompt keys and values
(:mod:`fastwan.models.wan.cross`). Every attention call goes through :class:`fastwan.attention.AttentionDispatch`
in the [B, S, H, D] layout.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from fastwan.attention import AttentionDispatch, AttentionMetadata
from fastwan.errors import InvalidArgument
from fastwan.models.wan.block import FastWanBlock, Residual, WanBlock, settle
from fastwan.models.wan.config import WanConfig
from fastwan.models.wan.cross import CrossInputs, PromptCache
from fastwan.models.wan.layers import TimeTextEmbedding, fp32_layer_norm, keep_in_fp32, rope_tables
from fastwan.options import DiTOptions
from fastwan.parallel import UlyssesDispatch, shard_sizes

if TYPE_CHECKING:
    from fastwan.cache import PassCache

__all__ = ["WanTransformer", "keep_in_fp32"]


def _shape(value) -> str:
    """A tensor's shape as a list, or what else ``value`` is."""
    return str(list(value.shape)) if isinstance(value, torch.Tensor) else f"{value!r} ({type(value).__name__})"


class WanTransformer(nn.Module):
    """Wan DiT. ``forward(latents [B, C, F, H, W], timestep [B] or [B, S], text [B, L, text_dim])``."""

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
        self.norm_out = nn.LayerNorm(dim, cfg.eps, elementwise_affine=False)
        self.proj_out = nn.Linear(dim, cfg.out_channels * math.prod(cfg.patch_size))
        self.scale_shift_table = nn.Parameter(torch.randn(1, 2, dim) / dim**0.5)
        self.attention = attention
        self._rope_cache: dict = {}
        self._sp = None  # fastwan.parallel.SequenceParallel once enable_sequence_parallel() ran
        self._first_halves = None  # compiled (video_half, text_half) of block 0, set by compile_blocks()
        self.prompts = PromptCache() if options.fast else None
        # a fastwan.offload.BlockStreamer when blocks' weights stream from host memory (never block 0, whose halves
        # forward_cfg calls outside the block loop)
        self.streamer = None

    def set_attention(self, dispatch: AttentionDispatch) -> None:
        self.attention = dispatch if self._sp is None else UlyssesDispatch(dispatch, self._sp)

    def enable_sequence_parallel(self, sp) -> None:
        """Split every forward's token sequence over the ranks of ``sp`` (:class:`fastwan.parallel.SequenceParallel`):
        each rank runs its shard through the blocks, self-attention exchanges shards for heads (Ulysses), the
        prediction is gathered on every rank. Raises if the heads do not divide over the ranks."""
        sp.check_heads(self.config.num_attention_heads)
        self._sp = sp
        if self.attention is not None:
            self.set_attention(getattr(self.attention, "inner", self.attention))

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
        :meth:`forward_cfg` calls separately (``kwargs`` go to ``torch.compile``)."""
        for block in self.blocks:
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
        for blk in self.blocks:
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
        """What each block's cross-attention reads for the texts (concatenated along the batch) and the image
        tokens: the fast block's per-prompt :class:`~fastwan.models.wan.cross.CrossKV`, or the reference block's
        :class:`~fastwan.models.wan.cross.CrossInputs` (the text embedding ``context`` if given)."""
        if self.prompts is not None:
            return self.prompts.contexts(self, texts, image)
        context = self.text_context(texts) if context is None else context
        image_context = None if image is None else self.image_context(image, context.shape[0])
        return [CrossInputs(context, image_context)] * len(self.blocks)

    # -- forward ------------------------------------------------------------------------------------------
    def _embed(self, latents: torch.Tensor, timestep: torch.Tensor):
        """Patch embedding (in a sparse backend's compact tile-major order: no dummy slots), RoPE table and time
        embeddings -> (x [B, S, C], rope, temb, mod, grid, layout)."""
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
        if self._sp is not None:  # this rank's contiguous shard of the (layout-ordered) sequence
            sizes = self.attention.sizes = shard_sizes(x.shape[1], self._sp.world)
            x = self._sp.shard(x, sizes).contiguous()
            rope = self._sp.shard(rope, sizes)
            if mod.dim() == 4:
                mod = self._sp.shard(mod, sizes)
        return x, rope, temb, mod, grid, layout

    def _meta(self, grid, layout, i: int, step_index, num_steps) -> AttentionMetadata | None:
        if not self.attention.sparse:
            return None
        return AttentionMetadata(grid=grid, step_index=step_index, num_steps=num_steps, layer_index=i, layout=layout,
                                 compact=True)

    def _head(self, r: Residual, temb: torch.Tensor, grid, layout) -> torch.Tensor:
        """The last block's stream (compact layout order under a sparse backend) -> prediction [B, C_out, F, H, W]."""
        x = settle(r)
        if self._sp is not None:
            x = self._sp.gather(x, self.attention.sizes)
        if layout is not None:
            x = layout.unpermute_compact(x, dim=1)
        if temb.dim() == 3:  # per-token: [B, S, C]
            shift, scale = (self.scale_shift_table.unsqueeze(0) + temb.unsqueeze(2)).unbind(2)
        else:
            shift, scale = (self.scale_shift_table + temb.unsqueeze(1)).unsqueeze(2).unbind(1)
        x = (fp32_layer_norm(x, self.norm_out) * (1 + scale) + shift).type_as(x)
        x = self.proj_out(x)  # [B, S, C_out * pt * ph * pw]
        B = x.shape[0]
        T, H, W = grid
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
        cache: PassCache | None = None,
    ) -> torch.Tensor:
        """latents [B, C_in, F, H, W]; timestep [B] (or per-token [B, S]); text [B, L, text_dim]; image: CLIP image
        tokens [B or 1, N, image_dim] for image-conditioned checkpoints (see :meth:`image_context`), else None;
        cache: the step cache of this pass (:class:`fastwan.cache.PassCache`, with ``step_index``), which may skip
        the blocks -> prediction [B, C_out, F, H, W] in the dtype of the model."""
        self._check_inputs(latents, timestep, (text,), image)
        x, rope, temb, mod, grid, layout = self._embed(latents, timestep)
        contexts = self._contexts((text,), image=image)
        args = (contexts, mod, rope, grid, layout, step_index, num_steps)
        if cache is not None and self._sp is not None:
            raise InvalidArgument("step caches do not run with sequence parallelism yet (each rank would decide on "
                                  "its own shard); pass cache=None.")
        if cache is None:
            r = self._blocks(0, Residual(x), *args)
        else:
            if step_index is None:
                raise InvalidArgument("forward(cache=...) needs step_index (the denoising step of this call).")
            r = Residual(self._cached_blocks(cache, x, temb, args))
        return self._head(r, temb, grid, layout)

    def _blocks(self, start: int, r: Residual, contexts, mod, rope, grid, layout, step_index, num_steps,
                stop: int | None = None) -> Residual:
        """Blocks ``start`` .. ``stop`` - 1 (default: the last) on the stream; ``contexts``: one cross-attention
        input per block."""
        streamer = self.streamer
        for i in range(start, len(self.blocks) if stop is None else stop):
            meta = self._meta(grid, layout, i, step_index, num_steps)
            if streamer is not None:
                streamer.before(i)
            r = self.blocks[i](r, contexts[i], mod, rope, self.attention, meta)
            if streamer is not None:
                streamer.after(i)
        return r

    def _cached_blocks(self, cache: PassCache, x: torch.Tensor, temb: torch.Tensor, args: tuple) -> torch.Tensor:
        """The blocks under a step cache: x [B, S, C] (the stream entering block 0) -> the stream after the last
        block, computed or reused as ``cache`` decides. The fast block adds into its input in place, so every
        tensor kept for a residual is a copy."""
        step, mod = args[5], args[1]
        start = x.clone()
        if cache.skip_stack(step, temb, mod):
            return cache.reuse(start)
        return self._cached_rest(cache, self._blocks(0, Residual(x), *args, stop=1), start, args)

    def _cached_rest(self, cache: PassCache, head: Residual, start: torch.Tensor, args: tuple) -> torch.Tensor:
        """Blocks 1.. under a step cache that did not skip the whole stack: ``head`` is the stream after block 0,
        ``start`` a copy of the stream entering it -> the stream after the last block; the cache stores the
        residual of what ran (a First-Block cache may skip blocks 1.. here)."""
        step = args[5]
        if not cache.head_decides:
            out = settle(self._blocks(1, head, *args))
            cache.stored(step, out - start)
            return out
        head_x = settle(head)
        head_residual = head_x - start
        if cache.skip_rest(step, head_residual):
            return cache.reuse(head_x)
        head_out = head_x.clone()
        out = settle(self._blocks(1, Residual(head_x), *args))
        cache.stored(step, out - head_out, head_residual)
        return out

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
        caches: tuple[PassCache, PassCache] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The conditional and unconditional predictions of one CFG step, as ``forward(latents, timestep, text)``
        and ``forward(latents, timestep, text_uncond)`` would give them.

        The two passes see the same latents and timestep, and the text enters a Wan block only at its
        cross-attention, so everything up to the first block's cross-attention is computed once, at batch 1.
        The passes then run as one batch of 2 (``batched``) or one after the other (less memory).

        latents [1, C_in, F, H, W]; timestep [1] (or per-token [1, S]); text, text_uncond [1, L, text_dim]; image:
        the image tokens both passes read, as in :meth:`forward`; caches: the two passes' step caches (as
        :meth:`forward` takes one; the passes then run one after the other, the shared start only when one of them
        computes) -> (cond, uncond), each [1, C_out, F, H, W].
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
        x, rope, temb, mod, grid, layout = self._embed(latents, timestep)
        video_half, text_half = self._first_halves or (self.blocks[0].video_half, self.blocks[0].text_half)
        attn = self.attention
        if caches is not None:
            if self._sp is not None:
                raise InvalidArgument("step caches do not run with sequence parallelism yet (each rank would decide "
                                      "on its own shard); pass caches=None.")
            if batched or step_index is None:
                raise InvalidArgument("forward_cfg(caches=...) runs the passes one after the other: pass "
                                      "batched=False and the step_index.")
            context = None if self.prompts is not None else self.text_context((text, text_uncond))
            ctx = [self._contexts((t,), None if context is None else context[i:i + 1], image)
                   for i, t in enumerate((text, text_uncond))]
            return self._cached_cfg(caches, x, temb, mod, rope, grid, layout, step_index, num_steps,
                                    (video_half, text_half), ctx)
        r, h = video_half(Residual(x), mod, rope, attn, self._meta(grid, layout, 0, step_index, num_steps))

        def rest(r: Residual, h: torch.Tensor, ctx: list) -> torch.Tensor:
            r = text_half(r, h, ctx[0], mod, attn)
            r = self._blocks(1, r, ctx, mod, rope, grid, layout, step_index, num_steps)
            return self._head(r, temb, grid, layout)

        if batched:
            both = r._replace(x=torch.cat([r.x, r.x]), y=None if r.y is None else torch.cat([r.y, r.y]))
            return rest(both, torch.cat([h, h]), self._contexts((text, text_uncond), image=image)).chunk(2)
        context = None if self.prompts is not None else self.text_context((text, text_uncond))  # one embedder call
        ctx = [self._contexts((t,), None if context is None else context[i:i + 1], image)
               for i, t in enumerate((text, text_uncond))]
        # the fast block adds into x in place: the first pass gets its own copy
        first = r._replace(x=r.x.clone()) if self.prompts is not None else r
        return rest(first, h, ctx[0]), rest(r, h, ctx[1])

    def _cached_cfg(self, caches, x, temb, mod, rope, grid, layout, step_index, num_steps, halves, ctx):
        """forward_cfg's two passes under step caches: each pass decides with its own state; block 0's video half,
        which the passes share, runs once if either computes. -> (cond, uncond) predictions."""
        video_half, text_half = halves
        args = [(c, mod, rope, grid, layout, step_index, num_steps) for c in ctx]
        start = x.clone()  # the stream entering block 0 (the fast block adds into x in place)
        skips = [c.skip_stack(step_index, temb, mod) for c in caches]
        computing = [i for i in (0, 1) if not skips[i]]
        if computing:
            r, h = video_half(Residual(x), mod, rope, self.attention, self._meta(grid, layout, 0, step_index,
                                                                                 num_steps))
        outs = []
        for i, cache in enumerate(caches):
            if skips[i]:
                outs.append(cache.reuse(start))
                continue
            shared = self.prompts is not None and i == computing[0] and len(computing) == 2
            ri = text_half(r._replace(x=r.x.clone()) if shared else r, h, ctx[i][0], mod, self.attention)
            outs.append(self._cached_rest(cache, ri, start, args[i]))
        return tuple(self._head(Residual(o), temb, grid, layout) for o in outs)
