"""The causal DiT forward (fastwan.models.wan.causal.CausalRun): chunk by chunk through the key/value cache it must
equal the whole sequence under the block-causal mask (a masked dense attention, float64), with and without a
window of frames and attention sinks; the denoising steps read the cache without changing it; with a window the
cache stays the same size however long the stream runs."""
from __future__ import annotations

import pytest
import torch

from fastwan.attention import AttentionDispatch
from fastwan.errors import InvalidArgument
from fastwan.hooks import HookRegistry
from fastwan.models import WanConfig, WanTransformer
from fastwan.models.wan.causal import CausalRun

F_CHUNK, H, W = 2, 4, 6  # latent frames per chunk, latent height and width (patch 1x2x2: 6 tokens per frame)
TOKENS = (H // 2) * (W // 2)


def model(seed=0, layers=2, rope_max=1024):
    torch.manual_seed(seed)
    cfg = WanConfig(num_layers=layers, num_attention_heads=2, attention_head_dim=12, ffn_dim=32, text_dim=8,
                    freq_dim=16, in_channels=4, out_channels=4, rope_max_seq_len=rope_max)
    m = WanTransformer(cfg).double().eval()
    for p in m.parameters():  # larger than the init's scale, so every part moves the output
        p.data.normal_(0, 0.3)
    m.set_attention(AttentionDispatch.resolve("TORCH_SDPA", device="cpu", dtype=torch.float64, head_dim=12))
    return m


class Masked:
    """The dispatch with a boolean mask [S, S] (True: the query may attend the key) on its self-attention."""

    def __init__(self, dispatch, allowed):
        self.dispatch, self.allowed = dispatch, allowed

    def __getattr__(self, name):
        return getattr(self.dispatch, name)

    def self_attention(self, q, k, v, meta=None):
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
        scores = scores.masked_fill(~self.allowed, float("-inf"))
        return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


def allowed_mask(chunks, window=None, sink=0):
    """The published rule: a token of chunk c sees the frames before the end of chunk c; with a window, only the
    first ``sink`` frames and the last ``window - sink`` frames up to that end."""
    frame = torch.arange(chunks * F_CHUNK).repeat_interleave(TOKENS)
    end = (frame // F_CHUNK + 1) * F_CHUNK  # the end frame of each query's chunk
    ok = frame[None, :] < end[:, None]
    if window is not None:
        ok &= (frame[None, :] < sink) | (frame[None, :] >= end[:, None] - (window - sink))
    return ok


def inputs(chunks, seed=1):
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(1, 4, chunks * F_CHUNK, H, W, generator=g, dtype=torch.float64)
    text = torch.randn(1, 5, 8, generator=g, dtype=torch.float64)
    t = torch.rand(chunks, generator=g, dtype=torch.float64) * 1000  # one timestep per chunk
    return latents, text, t


def whole(m, latents, text, t, allowed):
    """The whole sequence at once, each chunk's tokens at its own timestep, under ``allowed``."""
    plain = m.attention
    m.set_attention(Masked(plain, allowed))
    try:
        per_token = t.repeat_interleave(F_CHUNK * TOKENS)[None]
        return m(latents, per_token, text)
    finally:
        m.set_attention(plain)


def chunked(m, latents, text, t, **window):
    outs = []
    with CausalRun(m, **window) as run:
        for c in range(len(t)):
            chunk = latents[:, :, c * F_CHUNK:(c + 1) * F_CHUNK]
            outs.append(run.forward(chunk, t[c:c + 1], text, write=True))
    return torch.cat(outs, 2)


@pytest.mark.parametrize("window", [{}, {"window_frames": 4}, {"window_frames": 5, "sink_frames": 1}],
                         ids=["all", "window", "window+sink"])
def test_chunks_through_the_cache_equal_the_whole_sequence_under_the_block_causal_mask(window):
    m = model()
    latents, text, t = inputs(chunks=5)
    expected = whole(m, latents, text, t, allowed_mask(5, window.get("window_frames"), window.get("sink_frames", 0)))
    got = chunked(m, latents, text, t, **window)
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9)
    if window:  # the window matters: everything visible gives another video
        assert not torch.allclose(got, whole(m, latents, text, t, allowed_mask(5)), atol=1e-6)


def test_each_chunk_equals_its_prefix_alone_later_chunks_change_nothing():
    m = model()
    latents, text, t = inputs(chunks=4)
    got = chunked(m, latents, text, t)
    for c in range(4):
        n = (c + 1) * F_CHUNK
        prefix = whole(m, latents[:, :, :n], text, t[:c + 1], allowed_mask(c + 1))
        torch.testing.assert_close(got[:, :, c * F_CHUNK:n], prefix[:, :, c * F_CHUNK:], rtol=1e-9, atol=1e-9)


def test_denoising_steps_read_the_cache_and_only_a_write_adds_to_it():
    m = model()
    latents, text, t = inputs(chunks=3)
    expected = chunked(m, latents, text, t)
    noisy = torch.randn_like(latents)
    outs = []
    with CausalRun(m) as run:
        for c in range(3):
            sl = slice(c * F_CHUNK, (c + 1) * F_CHUNK)
            for step_t in (999.0, 500.0, 250.0):  # steps on other latents at other timesteps: read only
                run.forward(noisy[:, :, sl], torch.tensor([step_t], dtype=torch.float64), text)
                assert run.frame == c * F_CHUNK and run.cached_frames() == c * F_CHUNK
            outs.append(run.forward(latents[:, :, sl], t[c:c + 1], text, write=True))
    torch.testing.assert_close(torch.cat(outs, 2), expected, rtol=1e-9, atol=1e-9)
    assert "causal" not in HookRegistry.of(m)  # detached: a plain DiT again


def test_a_windowed_stream_keeps_its_cache_size_over_200_chunks_past_the_rope_table():
    m = model(layers=1, rope_max=16)  # 200 chunks x 2 frames run far past 16 RoPE positions
    g = torch.Generator().manual_seed(3)
    text = torch.randn(1, 5, 8, generator=g, dtype=torch.float64)
    sizes = {}
    with CausalRun(m, window_frames=6, sink_frames=2) as run:
        for c in range(200):
            chunk = torch.randn(1, 4, F_CHUNK, H, W, generator=g, dtype=torch.float64)
            out = run.forward(chunk, torch.tensor([500.0], dtype=torch.float64), text, write=True)
            assert torch.isfinite(out).all()
            sizes[c] = (run.nbytes(), run.cached_frames())
    assert run.frame == 400
    assert sizes[199] == sizes[10] and sizes[199][1] == 6  # flat from the time the window filled


def test_bad_runs_are_refused():
    m = model(layers=1)
    with pytest.raises(InvalidArgument, match="window_frames=0"):
        CausalRun(m, window_frames=0)
    with pytest.raises(InvalidArgument, match="sink_frames=2 .* 0 without a window"):
        CausalRun(m, sink_frames=2)
    latents, text, t = inputs(chunks=2)
    with CausalRun(m, window_frames=2, sink_frames=1) as run:
        with pytest.raises(InvalidArgument, match="does not fit window_frames=2"):
            run.forward(latents[:, :, :F_CHUNK], t[:1], text)
    with CausalRun(m) as run:
        run.forward(latents[:, :, :F_CHUNK], t[:1], text, write=True)
        with pytest.raises(InvalidArgument, match="one frame size"):
            run.forward(latents[:, :, :F_CHUNK, :2], t[:1], text)
    with pytest.raises(RuntimeError, match="outside its"):
        run.forward(latents[:, :, :F_CHUNK], t[:1], text)


def test_the_fast_block_streams_as_the_reference_block_does():
    from fastwan.options import DiTOptions

    ref = model().float()
    fast = WanTransformer(ref.config, options=DiTOptions(block="fast"))
    fast.load_state_dict(ref.state_dict())
    fast.set_attention(AttentionDispatch.resolve("TORCH_SDPA", device="cpu", dtype=torch.float32, head_dim=12))
    ref.set_attention(fast.attention)
    latents, text, t = inputs(chunks=3)
    latents, text, t = latents.float(), text.float(), t.float()
    window = {"window_frames": 4, "sink_frames": 1}
    torch.testing.assert_close(chunked(fast, latents, text, t, **window), chunked(ref, latents, text, t, **window),
                               rtol=1e-4, atol=1e-4)
