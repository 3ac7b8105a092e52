"""CUDA graphs of a causal stream's chunk forward (fastwan.models.wan.causal_graph.ChunkGraphs). Where no GPU is, the
graphs' bookkeeping runs with a capture that calls the forward again at each replay (the replayed kernels' effect:
the captured forward's input buffers, cache rows and output buffer, with no host code of the forward changing the
run's state): a long windowed run with graphs equals the same run without them, steps and cache writes alike,
across a prompt switch; the stream's rules for the option are checked before any compute. The CUDA test replays
real graphs."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fastwan import VideoGenerator
from fastwan.errors import InvalidArgument, InvalidArgumentType
from fastwan.models.wan.causal import CausalRun
from fastwan.models.wan.causal_graph import ChunkGraphs

from .test_causal_dit import F_CHUNK, inputs, model

PROMPT = "a lighthouse at dusk, waves"


def replaying(fn):
    """A capture whose replay runs ``fn`` again into one output buffer (what a graph's replay does to memory)."""
    out = fn().clone()
    return (lambda: out.copy_(fn())), out


def steps(m, latents, texts, t, graphs, switch_at=None):
    """Each chunk: 3 denoising forwards that read the cache, then its cache write; the text changes at chunk
    ``switch_at``. -> every forward's output."""
    outs = []
    with CausalRun(m, window_frames=6, sink_frames=2, graphs=graphs) as run:
        for c in range(len(t)):
            chunk = latents[:, :, c * F_CHUNK:(c + 1) * F_CHUNK]
            text = texts[1] if switch_at is not None and c >= switch_at else texts[0]
            for s in range(3):
                outs.append(run.forward(chunk * (1 + s), t[c:c + 1] - 100 * s, text))
            outs.append(run.forward(chunk, t[c:c + 1], text, write=True))
    return outs


def test_replayed_forwards_equal_the_dit_over_a_long_windowed_run():
    m = model()
    latents, text, t = inputs(9)
    other = torch.randn(text.shape, generator=torch.Generator().manual_seed(9), dtype=text.dtype)
    plain = steps(m, latents, (text, other), t, None, switch_at=6)
    graphs = ChunkGraphs(capture=replaying)
    got = steps(m, latents, (text, other), t, graphs, switch_at=6)
    for a, b in zip(got, plain):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # window 6 frames, 2 sinks, chunks of 2 frames: the caches hold 0, 2, then 4 frames before each chunk from chunk 2
    # on; each new key (chunks 0, 1, 2, and the prompt switch at chunk 6) runs one forward as usual, then captures
    assert graphs.captures == 4
    assert graphs.replays == 9 * 4 - 4


def test_a_replay_reads_this_chunks_rope_and_moves_the_cache_on_a_write(monkeypatch):
    """The replays need the run's new RoPE table and the write's token count: without them the run differs."""
    m = model()
    latents, text, t = inputs(6)
    plain = steps(m, latents, (text,), t, None)
    stale = ChunkGraphs(capture=replaying)
    monkeypatch.setattr(stale, "forward", _without_rope_copy(stale))
    got = steps(m, latents, (text,), t, stale)
    assert not all(torch.equal(a, b) for a, b in zip(got, plain))


def _without_rope_copy(graphs):
    forward = ChunkGraphs.forward

    def f(run, latents, timestep, text, new):
        g = graphs._graph
        if g is not None:  # the buffer keeps the table it was captured with
            rope = run.rope
            run.rope = g.rope
            try:
                return forward(graphs, run, latents, timestep, text, new)
            finally:
                run.rope = rope
        return forward(graphs, run, latents, timestep, text, new)
    return f


def test_a_failed_capture_names_the_option():
    def failing(fn):
        raise RuntimeError("operation not permitted when stream is capturing")

    m = model()
    latents, text, t = inputs(2)
    with pytest.raises(RuntimeError, match="cuda_graphs=True: capturing .* not permitted .*cuda_graphs=False"):
        steps(m, latents, (text,), t, ChunkGraphs(capture=failing))


@pytest.fixture(scope="module")
def gen(tiny_causal):
    return VideoGenerator.from_pretrained(str(tiny_causal.fastvideo), device="cpu", dtype=torch.float32)


def test_the_option_is_checked_before_any_compute(gen):
    with pytest.raises(InvalidArgumentType, match="cuda_graphs='yes' must be True or False"):
        gen.stream_video(PROMPT, cuda_graphs="yes")
    with pytest.raises(InvalidArgument, match="cuda_graphs=True replays .* has no window .*pass window_frames=N"):
        gen.stream_video(PROMPT, num_frames=9, cuda_graphs=True)
    with pytest.raises(InvalidArgument, match="cuda_graphs=True needs a CUDA device .*cpu"):
        gen.stream_video(PROMPT, window_frames=6, cuda_graphs=True)
    stream = gen.stream_video(PROMPT, num_frames=9)
    assert stream.settings.cuda_graphs is False
    stream.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_on_cuda_graph_replays_give_the_streams_frames(tiny_causal, monkeypatch):
    cuda = VideoGenerator.from_pretrained(str(tiny_causal.fastvideo), device="cuda", dtype=torch.float32)
    kw = dict(num_frames=93, seed=3, window_frames=6, sink_frames=3)
    plain = list(cuda.stream_video(PROMPT, **kw))
    replays = []
    forward = ChunkGraphs.forward

    def counted(self, *args):
        out = forward(self, *args)
        replays.append(self.replays)
        return out

    monkeypatch.setattr(ChunkGraphs, "forward", counted)
    graphed = list(cuda.stream_video(PROMPT, cuda_graphs=True, **kw))
    assert len(graphed) == len(plain) == 8 and replays[-1] > 20  # 8 chunks of 5 forwards (the last has 4)
    assert all(np.abs(a.frames.astype(int) - b.frames.astype(int)).max() <= 1 for a, b in zip(plain, graphed))
