"""``fastwan serve --sp 2``: one worker whose two processes (gloo on the CPU) make each video together. The video
equals the same request through ``from_pretrained(num_gpus=2)``; progress arrives step by step from rank 0; a
video deleted while it runs stops every rank at its next step, and the group makes the next video."""
from __future__ import annotations

import io

import imageio.v3 as iio
import pytest

from tests.serve.helpers import Server, call, nearest_4k_plus_1, wait, wait_started

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
TINY_FPS = 8


def test_a_sequence_parallel_worker_serves_and_stops_at_a_step(tmp_path):
    from fastwan import VideoGenerator

    server = Server(tmp_path, "--sp", "2").start()
    try:
        client = server.client()
        long = client.videos.create(prompt="a long river", size="32x32", seconds="0.5",
                                    extra_body={"num_inference_steps": 300})
        wait_started(client, long.id)
        assert 1 <= client.videos.retrieve(long.id).progress < 99
        client.videos.delete(long.id)  # stops both ranks at their next step
        created = client.videos.create(prompt="a green tree", size="48x32", seconds="0.5",
                                       extra_body={"num_inference_steps": 3, "seed": 11, "guidance_scale": 4.0})
        done = wait(client, created.id)
        assert done.status == "completed", done.error
        served = iio.imread(io.BytesIO(client.videos.download_content(created.id).read()), extension=".mp4")
        assert f"video {long.id}: cancelled" in server.log.read_text()
        assert not [p for p in (server.data_dir / "videos").iterdir() if p.name.startswith(long.id)]
        status, metrics = call("GET", f"{server.url}/metrics")
        assert status == 200 and b'fastwan_model_ready 1' in metrics
    finally:
        server.stop()
    with VideoGenerator.from_pretrained("tiny", device="cpu", num_gpus=2) as gen:
        local = gen.generate_video("a green tree", width=48, height=32, num_frames=nearest_4k_plus_1(0.5 * TINY_FPS),
                                   num_inference_steps=3, seed=11, guidance_scale=4.0,
                                   output_path=str(tmp_path / "v.mp4"))
    assert (served == iio.imread(local.video_path)).all()


def test_sp_flags_are_checked_before_anything_starts(tmp_path):
    import subprocess
    import sys

    for argv, words in ((["--sp", "2", "--gpus", "0"], "give one"), (["--cfg-parallel"], "give --sp N too")):
        run = subprocess.run([sys.executable, "-m", "fastwan", "serve", *argv, "--data-dir", str(tmp_path / "d")],
                             capture_output=True, text=True, cwd=tmp_path, timeout=120)
        assert run.returncode == 2 and words in run.stderr.strip().splitlines()[-1], run.stderr
