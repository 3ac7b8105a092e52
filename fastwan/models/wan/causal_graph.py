"""CUDA graphs of a causal stream's chunk forward: :class:`ChunkGraphs`.

A causal chunk's forward is small (a few thousand query tokens), so its time goes to the host's kernel launches,
not to the GPU (benchmarks/RESULTS.md, "Streaming causal Wan": the host takes longer to queue a forward than the GPU
to run it). A :class:`ChunkGraphs` belongs to one DiT and outlives a stream: it owns the KV caches' buffers (at a
window's size), one set of buffers per prompt form for the text keys, and the captured forwards, so a later
stream replays its first chunk too.

Rules:

- A run's caches are the graphs' own (:meth:`ChunkGraphs.caches`, emptied at each run's start) and keep their
  buffers from run to run while the geometry (window capacity, latents shape and dtype) stays; a new geometry frees
  every buffer and graph first. Eviction and the RoPE table are outside the forward
  (:class:`~fastwan.models.wan.causal.CausalRun`), so a forward's kernels depend only on its key: the geometry,
  the caches' kept tokens (the same for the steps and the write of a chunk; the same for every chunk once the
  window is full), the timestep's shape, and the form of the prompt's cross-attention inputs (the fields'
  shapes and dtypes of its :class:`~fastwan.models.wan.cross.CrossKV`: the folded width changes with the prompt's
  length), not the prompt itself.
- The prompt's cross-attention inputs (computed once per prompt by the fast DiT's prompt cache, outside any
  graph) are copied into the buffers of their form when the prompt differs from the one they hold; a captured
  forward reads those buffers (the run hands them to the blocks). The reference DiT computes them in its forward:
  its graphs read a buffer of the text embedding instead.
- The first forward with a new key runs the DiT as usual (its warm-up: compilation for new shapes); the next one
  with that key captures a graph, into one memory pool shared by all the graphs (they never run at once), and
  replays it; later ones, in this stream or a later one, replay it. Past :attr:`ChunkGraphs.max_graphs` the graphs
  are dropped and captured again as they are needed.
- Before a replay the inputs are copied into the graph's buffers: the latents, the timestep and the run's RoPE
  table (its chunk's frame positions change every chunk). The forward is captured with ``writing`` off (a write
  differs from a step only in the host's token count); a replayed write moves the kept-token counts afterwards.
- The output is a copy of the graph's output buffer (the next replay overwrites the buffer).
- :meth:`ChunkGraphs.close` frees the caches, the text buffers and the graphs.

``capture(fn) -> (replay, out)`` is how a graph is made: on CUDA :func:`cuda_capture` (``torch.cuda.graph``);
it is an argument so the bookkeeping can be checked where no GPU is (a capture that runs ``fn`` at each replay).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fastwan.models.wan.causal import KVCache

MAX_GRAPHS = 64  # captured forwards kept (a window's kept-token counts x the prompt forms in use)


def cuda_capture(fn: Callable[[], torch.Tensor], pool=None) -> tuple[Callable[[], None], torch.Tensor]:
    """``fn``'s kernels captured in a CUDA graph (its memory from ``pool``) -> (its replay, the output buffer it
    writes)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = fn()
    return graph.replay, out


@dataclass
class _Graph:
    latents: torch.Tensor  # the input buffers the captured forward reads
    timestep: torch.Tensor
    rope: torch.Tensor
    replay: Callable[[], None]
    out: torch.Tensor  # the output buffer each replay writes


class _TextSlot:
    """The buffers of one prompt form: the fast DiT's cross-attention inputs (a list of ``CrossKV``, one per
    block), or the text embedding [B, L, text_dim] the reference DiT computes them from in the forward; and the
    value they hold now (kept, so its identity cannot be taken by a later one)."""

    def __init__(self, value):
        if isinstance(value, torch.Tensor):
            self.buffers = value.clone()
        else:
            self.buffers = [type(kv)(*(None if f is None else f.clone() for f in kv)) for kv in value]
        self.held, self.version = value, _version(value)

    def load(self, value) -> None:
        if value is self.held and _version(value) == self.version:
            return
        if isinstance(value, torch.Tensor):
            self.buffers.copy_(value)
        else:
            for dst, src in zip(self.buffers, value):
                for d, s in zip(dst, src):
                    if d is not None:
                        d.copy_(s)
        self.held, self.version = value, _version(value)


def _version(value) -> int | None:
    return value._version if isinstance(value, torch.Tensor) else None


def _prompt_inputs(model, text: torch.Tensor) -> tuple[tuple, object]:
    """(form, value) of what a captured forward reads of the prompt: the fast DiT's cross-attention inputs
    (computed here, once per prompt, by its prompt cache: their count and each field's shape and dtype; every
    block's are alike), or the reference DiT's text embedding."""
    if model.prompts is None:
        return ("text", tuple(text.shape), text.dtype), text
    kvs = model.prompts.contexts(model, (text,))
    return (len(kvs), tuple(None if f is None else (tuple(f.shape), f.dtype) for f in kvs[0])), kvs


class ChunkGraphs:
    """The captured chunk forwards of one DiT, with the caches and text buffers they read (the module's rules).
    ``capture``: how to capture one (default :func:`cuda_capture` into the graphs' shared pool)."""

    max_graphs = MAX_GRAPHS

    def __init__(self, capture: Callable | None = None):
        self._capture = capture
        self._pool = None
        self._caches: list[KVCache] = []
        self._geometry: tuple | None = None
        self._slots: dict[tuple, _TextSlot] = {}
        self._graphs: dict[tuple, _Graph] = {}
        self._warm: set[tuple] = set()  # keys whose first forward ran as usual
        self._run = None  # the CausalRun of the forward being served
        self.captures = 0  # graphs captured so far
        self.replays = 0  # forwards replayed so far

    def caches(self, blocks: int) -> list[KVCache]:
        """The caches of a new run of a DiT with ``blocks`` blocks: the graphs' own, emptied (buffers kept)."""
        if len(self._caches) != blocks:
            self.close()
            self._caches = [KVCache() for _ in range(blocks)]
        for cache in self._caches:
            cache.tokens = 0
        return self._caches

    def forward(self, run, latents: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor,
                new: int) -> torch.Tensor:
        """``run``'s forward of a chunk of ``new`` tokens (the run evicted and set its RoPE table): a replay when a
        graph serves its key, else the DiT as usual (the key's first forward) or a capture and its replay."""
        if run.caches is not self._caches:
            raise RuntimeError("ChunkGraphs.forward: the run's caches are not these graphs' (make the run with "
                               "CausalRun(..., graphs=graphs)).")
        self._run = run
        geometry = (run.capacity, tuple(latents.shape), latents.dtype)
        if geometry != self._geometry:
            if run.caches[0].tokens:
                raise RuntimeError(f"ChunkGraphs.forward: a run changed its geometry mid-stream ({geometry}).")
            self._reset(geometry)
        form, value = _prompt_inputs(run.model, text)
        key = (form, tuple(timestep.shape), run.caches[0].tokens)
        g = self._graphs.get(key)
        if g is None and key not in self._warm:
            self._warm.add(key)
            return run.model(latents, timestep, text)
        slot = self._slots.get(form)
        if slot is None:
            slot = self._slots[form] = _TextSlot(value)
        slot.load(value)
        if g is None:
            if len(self._graphs) >= self.max_graphs:
                self._graphs.clear()
            g = self._graphs[key] = self._make(run, latents, timestep, text, slot)
        self._load(g, run, latents, timestep)
        g.replay()
        self.replays += 1
        if run.writing:
            for cache in run.caches:
                cache.tokens += new
        return g.out.clone()

    @staticmethod
    def _load(g: _Graph, run, latents: torch.Tensor, timestep: torch.Tensor) -> None:
        """The forward's inputs into ``g``'s buffers: the latents, the timestep and the run's RoPE table."""
        g.latents.copy_(latents)
        g.timestep.copy_(timestep)
        g.rope.copy_(run.rope)

    def _reset(self, geometry: tuple | None) -> None:
        """Drop the graphs, the warm keys, the text buffers and the caches' buffers; then serve ``geometry``."""
        self._graphs.clear()
        self._warm.clear()
        self._slots.clear()
        for cache in self._caches:  # the run's next forward allocates them at the new capacity
            cache.k = cache.v = None
        self._geometry = geometry

    def _make(self, run, latents, timestep, text, slot: _TextSlot) -> _Graph:
        x, t, rope = latents.clone(), timestep.clone(), run.rope.clone()

        reference = isinstance(slot.buffers, torch.Tensor)  # the forward embeds the text buffer; else the blocks
        # read the buffers, and the DiT's own lookup of ``text``'s inputs (a hit) launches nothing

        def forward() -> torch.Tensor:  # on the run being served (the one captured, or a later one's replay)
            run = self._run
            writing = run.writing
            run.rope, run.writing, run.contexts = rope, False, None if reference else slot.buffers
            try:
                return run.model(x, t, slot.buffers if reference else text)
            finally:
                run.writing, run.contexts = writing, None

        try:
            replay, out = self._capture(forward) if self._capture is not None else self._cuda_capture(forward)
        except RuntimeError as exc:
            raise RuntimeError(f"cuda_graphs=True: capturing the chunk forward in a CUDA graph failed ({exc}); a "
                               "kernel of this model's attention backend may not allow capture. Stream with "
                               "cuda_graphs=False.") from exc
        self.captures += 1
        return _Graph(x, t, rope, replay, out)

    def _cuda_capture(self, fn):
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return cuda_capture(fn, self._pool)

    def close(self) -> None:
        """Free the graphs, their memory pool, the text buffers and the caches' buffers."""
        self._reset(None)
        for cache in self._caches:
            cache.tokens = 0
        self._pool = self._run = None

    def __len__(self) -> int:
        """Graphs held."""
        return len(self._graphs)


__all__ = ["ChunkGraphs", "MAX_GRAPHS", "cuda_capture"]
