"""overlap_decode: a chunk's decode beside the next chunk's DiT (fastwan.pipelines.stream_decode). The frames are the
serial stream's bit for bit; a chunk leaves only after the next one is started and the last one is flushed; a stream
closed early, or failing, drops its started chunk; a prompt switch applies from the chunk not yet started. On the
CPU the overlapped path runs the same order of calls (nothing runs beside); the CUDA test runs where a GPU is."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fastwan import VideoGenerator
from fastwan.errors import InvalidArgumentType
from fastwan.models.wan.causal import CausalRun
from fastwan.pipelines.stream_decode import DecodeQueue

PROMPT = "a lighthouse at dusk, waves"


@pytest.fixture(scope="module")
def gen(tiny_causal):
    return VideoGenerator.from_pretrained(str(tiny_causal.fastvideo), device="cpu", dtype=torch.float32)


def test_overlapped_frames_are_the_serial_frames_bit_for_bit(gen):
    serial = list(gen.stream_video(PROMPT, num_frames=33, seed=5, overlap_decode=False))
    overlapped = list(gen.stream_video(PROMPT, num_frames=33, seed=5, overlap_decode=True))
    assert [(c.index, c.first_frame, c.prompt) for c in overlapped] == [(c.index, c.first_frame, c.prompt)
                                                                        for c in serial] == [
        (0, 0, PROMPT), (1, 9, PROMPT), (2, 21, PROMPT)]
    assert all(np.array_equal(a.frames, b.frames) for a, b in zip(serial, overlapped))
    for c in overlapped:
        assert all(c.timings[k] >= 0 for k in ("dit", "kv_write", "decode"))
    assert [c.timings["elapsed"] for c in overlapped] == sorted(c.timings["elapsed"] for c in overlapped)


def progress(gen, monkeypatch, overlap: bool, num_frames=33) -> list[tuple[int, int]]:
    """(DiT forwards, decoder pushes) done when each chunk is handed out."""
    forwards, pushes = [0], [0]
    forward = CausalRun.forward

    def counted(self, *args, **kwargs):
        forwards[0] += 1
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(CausalRun, "forward", counted)
    stream = gen.stream_video(PROMPT, num_frames=num_frames, seed=2, overlap_decode=overlap)
    push = stream._decoder.push

    def pushed(latents):
        pushes[0] += 1
        return push(latents)

    stream._decoder.push = pushed
    return [(forwards[0], pushes[0]) for _ in stream]


def test_a_chunk_leaves_after_the_next_one_is_started_and_the_last_is_flushed(gen, monkeypatch):
    """Overlapped, the first chunk leaves at once (the first frames' latency), a middle chunk once the next one is
    started, the last at once; no chunk waits for its own cache write, and the last has none."""
    steps = len(gen.causal.timesteps)  # a chunk's cache write runs after its hand-out, the last chunk has none
    assert progress(gen, monkeypatch, False) == [(steps, 1), (2 * steps + 1, 2), (3 * steps + 2, 3)]
    assert progress(gen, monkeypatch, True) == [(steps, 1), (3 * steps + 2, 3), (3 * steps + 2, 3)]
    assert progress(gen, monkeypatch, True, num_frames=9) == [(steps, 1)]  # one chunk: flushed at once
    # a middle chunk that stays queued has its write queued before the host waits for the chunk ahead of it
    assert progress(gen, monkeypatch, True, num_frames=45) == [(steps, 1), (3 * steps + 3, 3), (4 * steps + 3, 4),
                                                               (4 * steps + 3, 4)]


def watch_drops(monkeypatch) -> list[tuple[int, int]]:
    """(chunks waiting before, after) of each DecodeQueue.drop."""
    drops = []
    drop = DecodeQueue.drop

    def watched(self):
        before = self.waiting
        drop(self)
        drops.append((before, self.waiting))

    monkeypatch.setattr(DecodeQueue, "drop", watched)
    return drops


def test_a_stream_closed_early_drops_its_started_chunk_quietly(gen, monkeypatch):
    drops = watch_drops(monkeypatch)
    with gen.stream_video(PROMPT, seed=1, window_frames=6, overlap_decode=True) as stream:
        got = [chunk for _, chunk in zip(range(2), stream)]
    assert [c.index for c in got] == [0, 1]
    assert drops == [(1, 0)]  # chunk 2 was started, never handed out, dropped
    with pytest.raises(ValueError, match="closed stream"):
        stream._decoder.push(torch.zeros(1, 16, 1, 16, 16))
    assert gen.generate_video(PROMPT, num_frames=9, seed=1, save_video=False).frames.shape[0] == 9  # lock freed
    gen.stream_video(PROMPT, seed=1, overlap_decode=True).close()  # never started: no queue
    assert drops == [(1, 0), (0, 0)]  # generate's stream ran to its end: every chunk handed out


def test_an_error_in_the_next_chunk_propagates_and_drops_the_queue(gen, monkeypatch):
    drops = watch_drops(monkeypatch)
    forward, calls = CausalRun.forward, [0]

    def failing(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] > 2 * (len(gen.causal.timesteps) + 1) + 1:  # inside chunk 2
            raise RuntimeError("boom")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(CausalRun, "forward", failing)
    with pytest.raises(RuntimeError, match="boom"):
        list(gen.stream_video(PROMPT, num_frames=33, seed=1, overlap_decode=True))
    assert drops == [(1, 0)]  # chunk 1 decoded, not handed out: the error came first (chunk 0 left at once)


def test_a_prompt_switch_applies_from_the_chunk_not_yet_started(gen):
    other = "a red car in the snow"

    def switched(overlap: bool, after: int):
        stream = gen.stream_video(PROMPT, num_frames=45, seed=11, overlap_decode=overlap)
        out = []
        for chunk in stream:
            out.append(chunk)
            if chunk.index == after:
                stream.switch_prompt(other)
        return out

    overlapped = switched(True, 1)
    assert [c.prompt for c in overlapped] == [PROMPT, PROMPT, PROMPT, other]  # chunk 2 was under way at the switch
    serial = switched(False, 2)
    assert all(np.array_equal(a.frames, b.frames) for a, b in zip(overlapped, serial))


def test_the_setting_is_checked_before_any_compute_and_defaults_to_the_device(gen):
    with pytest.raises(InvalidArgumentType, match="overlap_decode='yes' must be True, False or None"):
        gen.stream_video(PROMPT, overlap_decode="yes")
    stream = gen.stream_video(PROMPT, num_frames=9)
    assert stream.settings.overlap_decode is False  # off CUDA nothing would overlap
    stream.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the side stream needs CUDA")
def test_on_cuda_the_side_stream_decode_gives_the_serial_frames(tiny_causal):
    cuda = VideoGenerator.from_pretrained(str(tiny_causal.fastvideo), device="cuda", dtype=torch.float32)
    assert cuda.stream_video(PROMPT, num_frames=9).settings.overlap_decode is True
    serial = list(cuda.stream_video(PROMPT, num_frames=45, seed=3, overlap_decode=False))
    overlapped = list(cuda.stream_video(PROMPT, num_frames=45, seed=3, overlap_decode=True))
    assert all(np.array_equal(a.frames, b.frames) for a, b in zip(serial, overlapped))
    assert all(c.timings["decode"] > 0 and c.timings["dit"] > 0 for c in overlapped)
    with cuda.stream_video(PROMPT, seed=3, window_frames=6) as stream:
        early = [c.frames for _, c in zip(range(2), stream)]
    assert all(np.array_equal(a, b.frames) for a, b in zip(early, serial))
