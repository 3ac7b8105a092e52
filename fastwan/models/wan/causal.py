"""Causal (chunk-by-chunk) forwards of the Wan DiT with a key/value cache: :class:`CausalRun`.

A causal Wan checkpoint (Self-Forcing, CausVid) has the plain DiT's weights; what makes it causal is how it is run.
The video is made a chunk of latent frames at a time. Under the block-causal rule a token of chunk ``c`` attends to
every token of chunks ``0 .. c`` (its own chunk in full, no later one), so a chunk's forward needs only its own
tokens plus the keys and values the earlier chunks left: each block's self-attention reads
``[cached keys, this chunk's keys]``. The cached keys are stored after RoPE at their own frame positions, and this
chunk's tokens take RoPE positions from the frame they start at. Only a forward run with ``write=True`` (the
published rule: the clean chunk, once more after its last denoising step) adds its keys and values to the cache;
the denoising steps read it without changing it.

With ``window_frames`` the self-attention reads at most that many latent frames, the current chunk's included:
before a chunk's keys are added, the oldest frames past the first ``sink_frames`` (attention sinks, kept for good)
are dropped, so the cache never holds more than ``window_frames`` frames and memory stays flat however long the
stream runs. Without a window every earlier frame is kept.

The run attaches as a hook (:mod:`fastwan.hooks`) on the DiT's ``embed`` point (the chunk's RoPE positions) and
each ``block_calls.i`` (the block's self-attention through its cache); the DiT's own forward is unchanged, and
detaching the hook leaves a plain DiT.
"""
from __future__ import annotations

import torch

from fastwan.errors import InvalidArgument
from fastwan.hooks import Hook, HookRegistry
from fastwan.models.wan.layers import rope_tables


class KVCache:
    """One block's cached keys and values: ``k``, ``v`` [B, capacity, H, D] buffers whose first ``tokens`` rows are
    the kept tokens (sinks first, then the most recent frames in order)."""

    def __init__(self):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.tokens = 0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v) if t is not None)

    def _reserve(self, k: torch.Tensor, need: int, capacity: int | None) -> None:
        """Buffers of at least ``need`` rows like ``k`` (``capacity`` rows when bounded; else grown by doubling),
        the kept rows copied over."""
        if self.k is not None and self.k.shape[1] >= need and self.k.shape[0] == k.shape[0]:
            return
        rows = capacity if capacity is not None else max(need, 2 * (0 if self.k is None else self.k.shape[1]))
        k_new = k.new_empty((k.shape[0], rows, *k.shape[2:]))
        v_new = k.new_empty((k.shape[0], rows, *k.shape[2:]))
        if self.k is not None and self.tokens:
            k_new[:, :self.tokens] = self.k[:, :self.tokens]
            v_new[:, :self.tokens] = self.v[:, :self.tokens]
        self.k, self.v = k_new, v_new

    def evict(self, new: int, capacity: int | None, sink: int) -> None:
        """Drop the oldest rows after the first ``sink`` so that ``new`` more rows fit in ``capacity``."""
        if capacity is None or self.tokens + new <= capacity:
            return
        drop = self.tokens + new - capacity
        keep = self.tokens - drop - sink
        if keep > 0:
            self.k[:, sink:sink + keep] = self.k[:, sink + drop:sink + drop + keep].clone()
            self.v[:, sink:sink + keep] = self.v[:, sink + drop:sink + drop + keep].clone()
        self.tokens -= drop

    @torch.compiler.disable  # bookkeeping on Python ints: a compiled block breaks its graph here, never recompiles
    def attend_with(self, k: torch.Tensor, v: torch.Tensor, capacity: int | None,
                    write: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """This chunk's k, v [B, S, H, D] placed after the kept rows (evicted to fit before the forward:
        :meth:`evict`) -> the keys and values the chunk attends to, [B, kept + S, H, D] (views of the buffers); with
        ``write`` the chunk's rows stay kept. With ``capacity`` the buffers are allocated once, at that size: their
        addresses stay for the run (a captured forward replays on them)."""
        new = k.shape[1]
        self._reserve(k, self.tokens + new, capacity)
        end = self.tokens + new
        self.k[:, self.tokens:end] = k
        self.v[:, self.tokens:end] = v
        if write:
            self.tokens = end
        return self.k[:, :end], self.v[:, :end]


class _CachedAttention:
    """The attention dispatch as one block sees it during a causal forward: self-attention through the block's
    cache, everything else the dispatch's own."""

    def __init__(self, dispatch, cache: KVCache, run: CausalRun):
        self._dispatch, self._cache, self._run = dispatch, cache, run

    def __getattr__(self, name):
        return getattr(self._dispatch, name)

    def self_attention(self, q, k, v, meta=None):
        """q, k, v [B, S, H, D] of this chunk -> [B, S, H, D] over the cached and this chunk's keys."""
        run = self._run
        k_all, v_all = self._cache.attend_with(k, v, run.capacity, run.writing)
        return self._dispatch.self_attention(q, k_all, v_all, meta)


class CausalRun(Hook):
    """The state of one causal stream on a :class:`~fastwan.models.wan.transformer.WanTransformer`: one
    :class:`KVCache` per block and the frame the next chunk starts at.

    ``with CausalRun(model, window_frames=None, sink_frames=0) as run:`` attaches it (hook ``"causal"``);
    ``run.forward(latents [B, C, f, H, W], timestep [B], text [B, L, text_dim], write=False)`` is the DiT's
    prediction [B, C_out, f, H, W] for the chunk at frame ``run.frame`` under the block-causal rule; with
    ``write=True`` its keys and values join the cache and ``run.frame`` moves past it. Every chunk of a run has the
    same latent height and width. ``graphs`` (a :class:`~fastwan.models.wan.causal_graph.ChunkGraphs`, with a
    window): the caches are the graphs' and forwards replay captured ones. Before each forward the caches evict
    what the chunk needs room for, and the run makes the chunk's RoPE table (:attr:`rope`), which the ``embed``
    point hands to the DiT; the blocks read :attr:`contexts` when set (a capture's text buffers), else the DiT's."""

    name = "causal"

    def __init__(self, model, window_frames: int | None = None, sink_frames: int = 0, graphs=None):
        if window_frames is not None and not (isinstance(window_frames, int) and window_frames >= 1):
            raise InvalidArgument(f"window_frames={window_frames!r} must be None (every earlier frame) or an int "
                                  ">= 1 (latent frames the self-attention reads, the current chunk's included).")
        if not (isinstance(sink_frames, int) and 0 <= sink_frames and (sink_frames == 0 or window_frames)):
            raise InvalidArgument(f"sink_frames={sink_frames!r} must be an int >= 0, and 0 without a window.")
        self.model = model
        self.window_frames, self.sink_frames = window_frames, sink_frames
        self.caches = [KVCache() for _ in model.blocks] if graphs is None else graphs.caches(len(model.blocks))
        self.frame = 0  # the first latent frame of the next chunk
        self.frame_tokens: int | None = None  # tokens per latent frame (set by the first chunk)
        self.writing = False
        self.rope: torch.Tensor | None = None  # the current forward's RoPE table (its chunk's frame positions)
        self.contexts: list | None = None  # the blocks' cross-attention inputs in place of the DiT's (a capture's)
        self._graphs = graphs  # a fastwan.models.wan.causal_graph.ChunkGraphs, or None: every forward runs the DiT
        self._views: dict[int, _CachedAttention] = {}

    # -- the hook ---------------------------------------------------------------------------------------------
    def attach(self, module) -> None:
        if getattr(module.attention, "sparse", False):
            raise InvalidArgument("a causal stream runs with a dense attention backend (its chunks attend to a "
                                  "cache, not to a sparse layout); choose a dense backend (e.g. SDPA, FLASH_ATTN).")

    def points(self, module) -> dict:
        def embed(model, inner, latents, timestep):
            return inner(latents, timestep)._replace(rope=self.rope)

        def block(i):
            def call(model, inner, r, ctx, temb, rope, attn, meta=None):
                ctx = ctx if self.contexts is None else self.contexts[i]
                return inner(r, ctx, temb, rope, self._cached(i, attn), meta)
            return call

        return {"embed": embed, **{f"block_calls.{i}": block(i) for i in range(len(module.blocks))}}

    def _cached(self, i: int, attn) -> _CachedAttention:
        """Block ``i``'s view of the dispatch ``attn``, one object per block for the run (a compiled block sees the
        same object at every call)."""
        view = self._views.get(i)
        if view is None or view._dispatch is not attn:
            view = self._views[i] = _CachedAttention(attn, self.caches[i], self)
        return view

    def __enter__(self) -> CausalRun:
        HookRegistry.of(self.model).add(self)
        return self

    def __exit__(self, *exc) -> None:
        HookRegistry.of(self.model).remove(self.name)

    # -- geometry ---------------------------------------------------------------------------------------------
    @property
    def capacity(self) -> int | None:
        """Tokens a block's cache may hold, the current chunk's included (None: no bound)."""
        return None if self.window_frames is None else self.window_frames * self.frame_tokens

    @property
    def sink_tokens(self) -> int:
        return self.sink_frames * (self.frame_tokens or 0)

    def cached_frames(self) -> int:
        """Latent frames the caches hold now."""
        return self.caches[0].tokens // self.frame_tokens if self.frame_tokens else 0

    def nbytes(self) -> int:
        """Bytes of the caches' buffers."""
        return sum(c.nbytes() for c in self.caches)

    # -- forward ----------------------------------------------------------------------------------------------
    def forward(self, latents: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor, *,
                write: bool = False) -> torch.Tensor:
        """The chunk ``latents`` [B, C, f, H, W] at frame :attr:`frame` -> the DiT's prediction [B, C_out, f, H, W];
        ``write``: its keys and values join the caches and :attr:`frame` moves ``f`` on."""
        if HookRegistry.of(self.model).get(self.name) is not self:
            raise RuntimeError("CausalRun.forward outside its `with CausalRun(model) as run:` block.")
        pt, ph, pw = self.model.config.patch_size
        frames, h, w = latents.shape[2] // pt, latents.shape[3] // ph, latents.shape[4] // pw
        if self.frame_tokens is None:
            self.frame_tokens = h * w
        elif h * w != self.frame_tokens:
            raise InvalidArgument(f"chunk latents {tuple(latents.shape)}: a stream keeps one frame size "
                                  f"({self.frame_tokens} tokens per latent frame from its first chunk); start a new "
                                  "run for another size.")
        if self.window_frames is not None and frames + self.sink_frames > self.window_frames:
            raise InvalidArgument(f"a chunk of {frames} latent frames does not fit window_frames="
                                  f"{self.window_frames} with sink_frames={self.sink_frames}; use a larger window.")
        new = frames * h * w
        for cache in self.caches:  # room for the chunk, before the forward (none of it inside a captured one)
            cache.evict(new, self.capacity, self.sink_tokens)
        cfg = self.model.config
        self.rope = rope_tables((frames, h, w), cfg.attention_head_dim, cfg.rope_max_seq_len, latents.device,
                                start=self.frame)
        self.writing = write
        try:
            if self._graphs is not None and self.capacity is not None:
                out = self._graphs.forward(self, latents, timestep, text, new)
            else:
                out = self.model(latents, timestep, text)
        finally:
            self.writing = False
        if write:
            self.frame += frames
        return out
