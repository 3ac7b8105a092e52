"""CUDA graphs of a causal stream's chunk forward: :class:`ChunkGraphs`.

A causal chunk's forward is small (a few thousand query tokens), so its time goes to the host's kernel launches,
not to the GPU (benchmarks/RESULTS.md, "Streaming causal Wan": the host takes longer to queue a forward than the GPU
to run it). Once a :class:`~fastwan.models.wan.causal.CausalRun`'s window is full, every forward has the same shapes
and reads and writes the same buffers (the caches are allocated once at the window's size and evicted before each
forward, outside it), so one captured forward serves every later one: the denoising steps and the cache writes alike.

Rules:

- A forward is replayed only when the run is full (:meth:`CausalRun.full_after`), with the text tensor, latents
  shape and timestep shape the graph was captured with; the first full forward with a new text (a prompt switch) or
  shape runs the DiT as usual (its warm-up: lazy state such as the text keys' host sync happens there), the next one
  captures a new graph (the old one is freed) and replays it.
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
    text: torch.Tensor  # the text tensor it was captured with (kept alive)
    version: int  # its version then
    latents: torch.Tensor  # the input buffers the captured forward reads
    timestep: torch.Tensor
    rope: torch.Tensor
    replay: Callable[[], None]
    out: torch.Tensor  # the output buffer each replay writes

    def fits(self, latents: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor) -> bool:
        return (text is self.text and text._version == self.version and latents.shape == self.latents.shape
                and latents.dtype == self.latents.dtype and timestep.shape == self.timestep.shape)


class ChunkGraphs:
    """One stream's captured chunk forward (the module's rules). ``capture``: how to capture one (default
    :func:`cuda_capture`)."""

    def __init__(self, capture: Callable = cuda_capture):
        self._capture = capture
        self._graph: _Graph | None = None
        self._warm: tuple | None = None  # (text, version, latents shape) of the last full forward run as usual
        self.captures = 0  # graphs captured so far
        self.replays = 0  # forwards replayed so far

    def forward(self, run, latents: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor,
                new: int) -> torch.Tensor:
        """``run``'s forward of a full window for a chunk of ``new`` tokens (the run evicted and set its RoPE table):
        a replay when a graph fits, else the DiT as usual (a warm-up) or a capture and its replay."""
        g = self._graph
        if g is None or not g.fits(latents, timestep, text):
            warm = self._warm
            if warm is None or not (warm[0] is text and warm[1:] == (text._version, latents.shape, timestep.shape)):
                self._graph, self._warm = None, (text, text._version, latents.shape, timestep.shape)
                return run.model(latents, timestep, text)
            g = self._graph = self._make(run, latents, timestep, text)
        g.latents.copy_(latents)
        g.timestep.copy_(timestep)
        g.rope.copy_(run.rope)
        g.replay()
        self.replays += 1
        if run.writing:
            for cache in run.caches:
                cache.tokens += new
        return g.out.clone()

    def _make(self, run, latents, timestep, text) -> _Graph:
        self._graph = None  # the old graph's memory goes before the new one is captured
        x, t, rope = latents.clone(), timestep.clone(), run.rope.clone()

        def forward() -> torch.Tensor:
            writing = run.writing
            run.rope, run.writing = rope, False
            try:
                return run.model(x, t, text)
            finally:
                run.writing = writing

        replay, out = self._capture(forward)
        self.captures += 1
        return _Graph(text, text._version, x, t, rope, replay, out)

    def close(self) -> None:
        """Free the graph and its memory."""
        self._graph = self._warm = None


__all__ = ["ChunkGraphs", "cuda_capture"]
