"""``fastwan generate --stream``: a causal checkpoint's video written as it is made (a fragmented mp4 that a reader
can decode while it grows), a line per chunk; the frames are generate_video's; --stream on a checkpoint that is not
causal is one error line and exit 2 before anything loads."""
from __future__ import annotations

import imageio.v3 as iio
import numpy as np
import torch

from fastwan import VideoGenerator, cli
from tests.cli.helpers import assert_one_error_line

PROMPT = "a lighthouse at dusk, waves"


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return 10 * np.log10(255.0**2 / max(mse, 1e-12))


def test_stream_writes_the_causal_video_chunk_by_chunk(tiny_causal, tmp_path, capsys):
    out = tmp_path / "stream.mp4"
    argv = ["generate", "--model", str(tiny_causal.fastvideo), "--prompt", PROMPT, "--num-frames", "33", "--seed",
            "5", "--stream", "--output", str(out), "--device", "cpu", "--dtype", "float32"]
    assert cli.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    chunks = [line for line in lines if line.startswith("chunk ")]
    assert [c.split(" ready")[0] for c in chunks] == ["chunk 1: frames 0-8", "chunk 2: frames 9-20",
                                                      "chunk 3: frames 21-32"]
    assert f"video: {out}" in lines and "seed: 5" in lines
    frames = iio.imread(out)
    gen = VideoGenerator.from_pretrained(str(tiny_causal.fastvideo), device="cpu", dtype=torch.float32)
    expected = gen.generate_video(PROMPT, num_frames=33, seed=5, save_video=False).frames
    assert frames.shape == expected.shape == (33, 128, 128, 3)
    assert psnr(frames, expected) > 30  # mp4 is lossy
    assert cli.main(argv) == 2  # the file exists: refused without --overwrite, before any work
    assert_one_error_line(capsys.readouterr().err, [str(out), "--overwrite"], "exists")


def test_stream_on_a_checkpoint_that_is_not_causal_is_one_error_line(tiny_ckpts, tmp_path, capsys):
    argv = ["generate", "--model", str(tiny_ckpts["wan2.1"]), "--prompt", PROMPT, "--stream", "--output",
            str(tmp_path / "x.mp4"), "--device", "cpu"]
    assert cli.main(argv) == 2
    assert_one_error_line(capsys.readouterr().err, ["--stream needs a causal checkpoint", "Drop --stream"],
                          "not causal")
    assert not (tmp_path / "x.mp4").exists()
