"""The streamed mp4 (:class:`fastwan.pipelines.stream_output.VideoStreamWriter`), read back by ffmpeg itself (imageio-
ffmpeg's binary decoding a copy of the file to raw RGB): while it grows, a copy taken after each chunk decodes to
every frame appended but the last (the muxer writes a frame's fragment when the next one reaches it), close to the
input; after close, every frame, also through imageio's reader. The path rules: an existing file refused without
overwrite and left as it was, an automatic name taking its next free variant, overwrite replacing the file only when
the stream completes. A stream that fails (an exception or an interrupt in its ``with`` block, an encoder that fails,
no frames at all) is removed and a file it replaced is put back; bad frames are refused."""
from __future__ import annotations

import shutil
import subprocess
import time

import imageio.v2 as imageio
import imageio_ffmpeg
import numpy as np
import pytest

from fastwan.errors import InvalidArgument, InvalidArgumentType, OutputExistsError, VideoWriteError
from fastwan.pipelines import stream_output
from fastwan.pipelines.output import check_output_path, prepare_output
from fastwan.pipelines.stream_output import VideoStreamWriter

H, W = 64, 96
PSNR_FLOOR = 30.0  # dB: H.264 at the writer's quality on smooth moving content
WAIT_S = 30.0


def chunk(n: int, start: int) -> np.ndarray:
    """Frames ``start`` ... ``start + n - 1`` of a smooth moving pattern, uint8 [n, H, W, 3]."""
    t = np.arange(start, start + n, dtype=np.float64)[:, None, None, None]
    y = np.arange(H)[None, :, None, None]
    x = np.arange(W)[None, None, :, None]
    c = np.arange(3)[None, None, None, :]
    v = 128 + 100 * np.sin(x / 9 + t / 4 + c) * np.cos(y / 11 - t / 6)
    return v.round().astype(np.uint8)


def decoded(path, folder) -> np.ndarray:
    """The frames ffmpeg decodes from a copy of ``path`` (as it is now) -> uint8 [n, H, W, 3]."""
    copy = folder / "copy.mp4"
    shutil.copyfile(path, copy)
    out = subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-v", "quiet", "-i", str(copy), "-f", "rawvideo",
                          "-pix_fmt", "rgb24", "-"], capture_output=True).stdout
    return np.frombuffer(out, np.uint8)[:len(out) // (H * W * 3) * H * W * 3].reshape(-1, H, W, 3)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return 10 * np.log10(255 ** 2 / max(mse, 1e-12))


def writer(path, overwrite=False, auto_name="auto.mp4") -> VideoStreamWriter:
    target = check_output_path(path, overwrite)
    prepare_output(target)
    return VideoStreamWriter(target, auto_name, 16)


def test_the_file_plays_while_it_grows(tmp_path):
    dest, peek = tmp_path / "out" / "clip.mp4", tmp_path / "peek"
    peek.mkdir()
    video = []
    with writer(dest) as stream:
        assert stream.path == dest and dest.is_file()  # claimed before the first frame
        for n in (9, 12, 12, 5):  # the chunk sizes of a 3-latent-frame causal stream, a short last one
            frames = chunk(n, len(video))
            stream.append(frames)
            video.extend(frames)
            deadline = time.monotonic() + WAIT_S
            while len(got := decoded(dest, peek)) < len(video) - 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(video) - 1 <= len(got) <= len(video), (len(got), len(video))
            assert min(psnr(g, v) for g, v in zip(got, video)) > PSNR_FLOOR
        assert stream.frames_written == 38
    got = decoded(dest, peek)
    assert len(got) == 38 and min(psnr(g, v) for g, v in zip(got, video)) > PSNR_FLOOR
    with imageio.get_reader(str(dest)) as reader:
        assert sum(1 for _ in reader) == 38
    assert sorted(p.name for p in dest.parent.iterdir()) == ["clip.mp4"]  # no temporary left


def test_existing_paths(tmp_path):
    dest = tmp_path / "clip.mp4"
    dest.write_bytes(b"the user's video")
    target = check_output_path(dest, False)
    with pytest.raises(OutputExistsError, match="exists; pass overwrite=True"):
        VideoStreamWriter(target, "unused.mp4", 16)  # also after prepare_output: the file may appear between
    assert dest.read_bytes() == b"the user's video"
    (tmp_path / "auto.mp4").write_bytes(b"taken")
    with writer(tmp_path, auto_name="auto.mp4") as stream:
        assert stream.path == tmp_path / "auto-2.mp4"
        stream.append(chunk(1, 0))
    assert (tmp_path / "auto.mp4").read_bytes() == b"taken" and len(decoded(tmp_path / "auto-2.mp4", tmp_path)) == 1
    with writer(dest, overwrite=True) as stream:
        assert dest.read_bytes() == b""  # replaced by the stream while it grows, the old file kept aside
        stream.append(chunk(5, 0))
    assert len(decoded(dest, tmp_path)) == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["auto-2.mp4", "auto.mp4", "clip.mp4", "copy.mp4"]


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("overwrite", [False, True])
def test_a_failed_stream_is_removed(tmp_path, error, overwrite):
    dest = tmp_path / "clip.mp4"
    if overwrite:
        dest.write_bytes(b"the user's video")
    with pytest.raises(error):
        with writer(dest, overwrite) as stream:
            stream.append(chunk(9, 0))
            stream.append(chunk(12, 9))
            raise error("the producer failed")
    if overwrite:
        assert dest.read_bytes() == b"the user's video"
    assert sorted(p.name for p in tmp_path.iterdir()) == (["clip.mp4"] if overwrite else [])
    with pytest.raises(ValueError, match="closed or aborted"):
        stream.append(chunk(1, 0))


def test_encoder_failures_and_empty_streams_are_removed(tmp_path, monkeypatch):
    dest = tmp_path / "clip.mp4"
    with pytest.raises(VideoWriteError, match="got no frames; the stream was removed"):
        with writer(dest):
            pass
    assert not dest.exists()
    dest.write_bytes(b"the user's video")
    monkeypatch.setattr(stream_output, "STREAM_FLAGS", ("-movflags", "no_such_flag"))
    stream = writer(dest, overwrite=True)
    with pytest.raises(VideoWriteError, match=f"(?s)the video {dest} failed.*the stream was removed"):
        for start in range(0, 90, 3):  # the failure shows on a later write or at close
            stream.append(chunk(3, start))
        stream.close()
    assert dest.read_bytes() == b"the user's video" and [p.name for p in tmp_path.iterdir()] == ["clip.mp4"]


def test_bad_frames_are_refused(tmp_path):
    with writer(tmp_path / "clip.mp4") as stream:
        with pytest.raises(InvalidArgumentType, match="numpy array"):
            stream.append([chunk(1, 0)[0]])
        for bad in (chunk(1, 0).astype(np.float32), chunk(1, 0)[0], chunk(1, 0)[..., :2]):
            with pytest.raises(InvalidArgument, match=r"must be uint8 \[t, H, W, 3\]"):
                stream.append(bad)
        with pytest.raises(InvalidArgument, match="63x96 pixels; H.264 in yuv420p needs an even"):
            stream.append(chunk(1, 0)[:, :63])
        stream.append(chunk(2, 0))
        with pytest.raises(InvalidArgument, match="32x96 pixels after frames of 64x96"):
            stream.append(chunk(1, 0)[:, :32])
        stream.append(chunk(2, 2))  # refused frames leave the stream as it was
    assert len(decoded(tmp_path / "clip.mp4", tmp_path)) == 4
    for fps in (0, 2.5, True):
        with pytest.raises(InvalidArgument, match="fps"):
            VideoStreamWriter(check_output_path(tmp_path / "other.mp4", False), "x.mp4", fps)
    assert not (tmp_path / "other.mp4").exists()


def test_an_interrupt_inside_append_removes_the_stream(tmp_path, monkeypatch):
    start = VideoStreamWriter._start

    def interrupted_start(self):
        encoder = start(self)

        def interrupted(frame):
            raise KeyboardInterrupt

        encoder.append_data = interrupted
        return encoder

    monkeypatch.setattr(VideoStreamWriter, "_start", interrupted_start)
    stream = writer(tmp_path / "clip.mp4")  # no with block: append itself cleans up
    with pytest.raises(KeyboardInterrupt):
        stream.append(chunk(2, 0))
    assert list(tmp_path.iterdir()) == []
