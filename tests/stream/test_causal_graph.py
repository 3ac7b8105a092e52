"""CUDA graphs of a causal stream's chunk forward (fastwan.models.wan.causal_graph.ChunkGraphs). Where no GPU is, the
graphs' bookkeeping runs with a capture that calls the forward again at each replay (the replayed kernels' effect:
the captured forward's input buffers, cache rows and output buffer, with no host code of the forward changing the
run's state): a long windowed run with graphs equals the same run without them, steps and cache writes alike,
across a prompt switch; the stream's rules for the option are checked before any compute. The CUDA test replays
real graphs."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fastwan import VideoGenerator
from fastwan.errors import InvalidArgument, InvalidArgumentType
from fastwan.hooks import Hook, HookRegistry
from fastwan.models.wan import WanTransformer
from fastwan.models.wan.causal import CausalRun
from fastwan.models.wan.causal_graph import ChunkGraphs
from fastwan.options import DiTOptions
from fastwan.pipelines.stream import check_cuda_graphs

from .test_causal_dit import F_CHUNK, H, W, inputs, model

PROMPT = "a lighthouse at dusk, waves"


def replaying(fn):
    """A capture whose replay runs ``fn`` again into one output buffer (what a graph's replay does to memory)."""
    out = fn().clone()
    return (lambda: out.copy_(fn())), out


def dit(block: str):
    """The tiny causal DiT with the reference block (its graphs read a text buffer) or the fast one (they read the
    cross-attention inputs' buffers); fp64 on the CPU."""
    m = model()
    if block == "reference":
        return m
    fast = WanTransformer(m.config, options=DiTOptions(block="fast")).double().eval()
    fast.load_state_dict(m.state_dict())
    fast.set_attention(m.attention)
    return fast


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


def assert_same(got, plain):
    assert len(got) == len(plain)
    for a, b in zip(got, plain):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def another(text, seed=9, padded=0):
    """A text of ``text``'s shape, its last ``padded`` rows equal (Wan's zero padding: the fast DiT collapses them,
    another form of cross-attention inputs)."""
    other = torch.randn(text.shape, generator=torch.Generator().manual_seed(seed), dtype=text.dtype)
    if padded:
        other[:, -padded:] = 0
    return other


@pytest.mark.parametrize("block", ["reference", "fast"])
def test_replayed_forwards_equal_the_dit_over_a_long_windowed_run(block):
    m = dit(block)
    latents, text, t = inputs(9)
    other = another(text)
    plain = steps(m, latents, (text, other), t, None, switch_at=6)
    graphs = ChunkGraphs(capture=replaying)
    assert_same(steps(m, latents, (text, other), t, graphs, switch_at=6), plain)
    # window 6 frames, 2 sinks, chunks of 2 frames: the caches hold 0, 2, then 4 frames before each chunk from chunk 2
    # on; each key runs one forward as usual, then captures; the prompt switch (a prompt of the same form) replays
    assert graphs.captures == 3
    assert graphs.replays == 9 * 4 - 3


@pytest.mark.parametrize("block", ["reference", "fast"])
def test_a_later_run_replays_from_its_first_forward_with_its_own_prompt(block, monkeypatch):
    m = dit(block)
    latents, text, t = inputs(4)
    other = another(text)
    graphs = ChunkGraphs(capture=replaying)
    steps(m, latents, (text,), t, graphs)
    captures, replays = graphs.captures, graphs.replays
    later = inputs(5, seed=4)[0]
    plain = steps(m, later, (other, text), t[:4], None, switch_at=2)
    assert_same(steps(m, later, (other, text), t[:4], graphs, switch_at=2), plain)
    assert graphs.captures == captures and graphs.replays == replays + 4 * 4
    # the text buffers must take the new prompt: kept stale, the run differs
    monkeypatch.setattr("fastwan.models.wan.causal_graph._TextSlot.load", lambda slot, value: None)
    got = steps(m, later, (other, text), t[:4], graphs, switch_at=2)
    assert not all(torch.equal(a, b) for a, b in zip(got, plain))


@pytest.mark.parametrize("block", ["reference", "fast"])
def test_a_prompt_of_another_form_and_another_frame_size_capture_their_own(block):
    m = dit(block)
    latents, text, t = inputs(4)
    graphs = ChunkGraphs(capture=replaying)
    steps(m, latents, (text,), t, graphs)
    captures = graphs.captures
    # fast: padding rows collapse (keys set); reference: a longer text
    other = another(text, padded=3) if block == "fast" else torch.randn(1, 7, 8, dtype=text.dtype)
    plain = steps(m, latents, (text, other), t, None, switch_at=2)
    assert_same(steps(m, latents, (text, other), t, graphs, switch_at=2), plain)
    assert graphs.captures == captures + 1  # the switch's chunks (4 cached frames each): a new key for this form
    wide = torch.randn(1, 4, 4 * F_CHUNK, H, W + 2, generator=torch.Generator().manual_seed(5), dtype=text.dtype)
    plain = steps(m, wide, (text,), t, None)
    assert_same(steps(m, wide, (text,), t, graphs), plain)
    assert graphs.captures == captures + 1 + 3 and len(graphs) == 3  # a new geometry frees the old graphs


def test_a_replay_reads_this_chunks_rope_and_moves_the_cache_on_a_write(monkeypatch):
    """The replays need the run's new RoPE table and the write's token count: without them the run differs."""
    m = model()
    latents, text, t = inputs(6)
    plain = steps(m, latents, (text,), t, None)
    load = ChunkGraphs._load

    def stale_rope(g, run, latents, timestep):
        rope = g.rope.clone()
        load(g, run, latents, timestep)
        g.rope.copy_(rope)

    monkeypatch.setattr(ChunkGraphs, "_load", staticmethod(stale_rope))
    got = steps(m, latents, (text,), t, ChunkGraphs(capture=replaying))
    assert not all(torch.equal(a, b) for a, b in zip(got, plain))


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
    with pytest.raises(InvalidArgumentType, match="cuda_graphs='yes' must be True, False or None"):
        gen.stream_video(PROMPT, cuda_graphs="yes")
    with pytest.raises(InvalidArgument, match="cuda_graphs=True replays .* has no window .*pass window_frames=N"):
        gen.stream_video(PROMPT, num_frames=9, cuda_graphs=True)
    with pytest.raises(InvalidArgument, match="cuda_graphs=True replays .* on a CUDA device.* is on cpu"):
        gen.stream_video(PROMPT, window_frames=6, cuda_graphs=True)
    stream = gen.stream_video(PROMPT, num_frames=9, window_frames=6)
    assert stream.settings.cuda_graphs is False  # unset: where it can run
    stream.close()


class _Other(Hook):
    name = "block_streaming"


def test_graphs_run_where_they_can_and_refuse_another_hook_on_the_dit(gen):
    recipe = dataclasses.replace(gen.checkpoint.causal, window_frames=6)
    m = model()
    on_cuda = SimpleNamespace(device=torch.device("cuda"), transformers=[m])
    assert check_cuda_graphs(None, on_cuda, recipe) is True
    assert check_cuda_graphs(None, on_cuda, dataclasses.replace(recipe, window_frames=None)) is False
    assert check_cuda_graphs(False, on_cuda, recipe) is False
    HookRegistry.of(m).add(_Other())
    assert check_cuda_graphs(None, on_cuda, recipe) is False
    with pytest.raises(InvalidArgument, match=r"cuda_graphs=True .* the DiT carries hooks \['block_streaming'\]"):
        check_cuda_graphs(True, on_cuda, recipe)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_graph_replays_give_the_streams_frames(tiny_causal, monkeypatch, dtype):
    cuda = VideoGenerator.from_pretrained(str(tiny_causal.fastvideo), device="cuda", dtype=dtype)
    kw = dict(num_frames=93, seed=3, window_frames=9, sink_frames=3)
    plain = [list(cuda.stream_video(p, cuda_graphs=False, **kw)) for p in (PROMPT, "a red kite over dunes")]
    graphs = cuda.stream_graphs
    graphed = list(cuda.stream_video(PROMPT, cuda_graphs=True, **kw))
    captures, replays = graphs.captures, graphs.replays
    assert len(graphed) == len(plain[0]) == 8 and replays > 20  # 8 chunks of 5 forwards (the last has 4)
    later = list(cuda.stream_video("a red kite over dunes", **kw))  # unset: graphs on CUDA with a window
    assert graphs.captures == captures and graphs.replays == replays + 8 * 5 - 1  # every forward replayed
    for got, want in ((graphed, plain[0]), (later, plain[1])):
        assert all(np.abs(a.frames.astype(int) - b.frames.astype(int)).max() <= 1 for a, b in zip(want, got))
