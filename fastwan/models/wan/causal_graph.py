"""CUDA graphs of a causal stream's chunk forward: :class:`ChunkGraphs`.

A causal chunk's forward is small (a few thousand query tokens), so its time goes to the host's kernel launches,
not to the GPU (benchmarks/RESULTS.md, "Streaming causal Wan": the host takes longer to queue a forward than the GPU
to run it). A :class:`~fastwan.models.wan.causal.CausalRun` with a window keeps its buffers for the whole run, so a
captured forward can be replayed for every later forward with the same key: a chunk's steps and its cache write,
and, once the window is full, every chunk's.

Rules:

- A run with a window allocates its caches once, at the window's size, and evicts before each forward (outside
  it), so a forward's kernels depend only on its key: the text tensor (identity and version: the DiT's text keys
  for it), the latents' and timestep's shapes and dtype, and the caches' kept tokens (the rows it writes and reads;
  the same for every chunk once the window is full, the same for the 4 steps and the write of a chunk before).
- The first forward with a new key runs the DiT as usual (its warm-up: compilation for new shapes, the text keys'
  host sync); the next one with that key captures a graph (the previous graph is freed first) and replays it;
  later ones replay it.
- Before a replay the inputs are copied into the graph's own buffers: the latents, the timestep and the run's RoPE
  table (its chunk's frame positions change every chunk). The captured forward runs with ``writing`` off; a replayed
  cache write moves the caches' kept-token counts on the host afterwards, as the forward's own bookkeeping would.
- The output is a copy of the graph's output buffer (the next replay overwrites the buffer).
- The graph keeps the text tensor alive, so the DiT's per-prompt text keys it reads stay alive.

``capture(fn) -> (replay, out)`` is how a graph is made: on CUDA :func:`cuda_capture` (``torch.cuda.graph``);
it is an argument so the bookkeeping can be checked where no GPU is (a capture that runs ``fn`` at each replay).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


def cuda_capture(fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
    """``fn``'s kernels captured in a CUDA graph -> (its replay, the output buffer it writes)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = fn()
    return graph.replay, out


@dataclass
class _Graph:
    key: tuple  # :func:`_key` of the forwards it serves
    text: torch.Tensor  # the text tensor it was captured with (kept alive)
    latents: torch.Tensor  # the input buffers the captured forward reads
    timestep: torch.Tensor
    rope: torch.Tensor
    replay: Callable[[], None]
    out: torch.Tensor  # the output buffer each replay writes


def _key(run, latents: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor) -> tuple:
    """What a captured forward depends on besides its inputs' values: the text tensor (its identity and version:
    the DiT's text keys for it), the shapes, and the caches' kept tokens (the rows it writes and reads)."""
    return (id(text), text._version, latents.shape, latents.dtype, timestep.shape, run.caches[0].tokens)


class ChunkGraphs:
    """One stream's captured chunk forward (the module's rules). ``capture``: how to capture one (default
    :func:`cuda_capture`)."""

    def __init__(self, capture: Callable = cuda_capture):
        self._capture = capture
        self._graph: _Graph | None = None
        self._warm: tuple | None = None  # (key, text) of the last forward run as usual
        self.captures = 0  # graphs captured so far
        self.replays = 0  # forwards replayed so far

    def forward(self, run, latents: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor,
                new: int) -> torch.Tensor:
        """``run``'s forward of a chunk of ``new`` tokens (the run evicted and set its RoPE table): a replay when the
        graph serves its key, else the DiT as usual (the key's first forward) or a capture and its replay."""
        key = _key(run, latents, timestep, text)  # the graph and the warm key hold their text: its id stays its own
        g = self._graph
        if g is None or g.key != key:
            if self._warm is None or self._warm[0] != key:
                self._graph, self._warm = None, (key, text)
                return run.model(latents, timestep, text)
            g = self._graph = self._make(run, key, latents, timestep, text)
        g.latents.copy_(latents)
        g.timestep.copy_(timestep)
        g.rope.copy_(run.rope)
        g.replay()
        self.replays += 1
        if run.writing:
            for cache in run.caches:
                cache.tokens += new
        return g.out.clone()

    def _make(self, run, key: tuple, latents, timestep, text) -> _Graph:
        self._graph = None  # the old graph's memory goes before the new one is captured
        x, t, rope = latents.clone(), timestep.clone(), run.rope.clone()

        def forward() -> torch.Tensor:
            writing = run.writing
            run.rope, run.writing = rope, False
            try:
                return run.model(x, t, text)
            finally:
                run.writing = writing

        try:
            replay, out = self._capture(forward)
        except RuntimeError as exc:
            raise RuntimeError(f"cuda_graphs=True: capturing the chunk forward in a CUDA graph failed ({exc}); a "
                               "kernel of this model's attention backend may not allow capture. Stream with "
                               "cuda_graphs=False.") from exc
        self.captures += 1
        return _Graph(key, text, x, t, rope, replay, out)

    def close(self) -> None:
        """Free the graph and its memory."""
        self._graph = self._warm = None


__all__ = ["ChunkGraphs", "cuda_capture"]
