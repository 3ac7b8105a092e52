"""Durability: ``kill -9`` of ``fastwan serve`` while a job runs, then a restart on the same data folder: the job is
queued again and completes, the videos made before are still listed and downloadable, and a job queued behind the
killed one runs too; SIGTERM stops the running job at its next step and queues it again, and ends the event
streams open then."""
from __future__ import annotations

import io
import re
import signal
import urllib.request

import imageio.v3 as iio
import pytest

from fastwan.serve.store import SqliteStore
from tests.serve.helpers import KEY, Server, wait, wait_started

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_a_job_killed_mid_run_completes_after_a_restart(tmp_path):
    server = Server(tmp_path).start()
    try:
        client = server.client()
        earlier = client.videos.create(prompt="made before the crash", size="32x32", seconds="0.5",
                                       extra_body={"num_inference_steps": 1})
        assert wait(client, earlier.id).status == "completed"
        killed = client.videos.create(prompt="running at the crash", size="64x64", seconds="1",
                                      extra_body={"num_inference_steps": 30, "seed": 3})
        behind = client.videos.create(prompt="queued at the crash", size="32x32", seconds="0.5",
                                      extra_body={"num_inference_steps": 1})
        wait_started(client, killed.id)
        assert client.videos.retrieve(killed.id).status == "in_progress"
    finally:
        server.stop(signal.SIGKILL)
    videos = server.data_dir / "videos"
    visible = sorted(p.name for p in videos.iterdir() if not p.name.startswith("."))
    # nothing of the killed job is visible; a video's files carry its claim's token
    assert [re.sub(r"-[0-9a-f]{16}\.", ".", n) for n in visible] == [f"{earlier.id}.mp4", f"{earlier.id}.png"]

    server = Server(tmp_path, data_dir=server.data_dir).start()
    try:
        client = server.client()
        statuses = {v.id: v.status for v in client.videos.list(limit=100).data}
        assert statuses[earlier.id] == "completed" and set(statuses) == {earlier.id, killed.id, behind.id}
        for video_id in (killed.id, behind.id):
            done = wait(client, video_id)
            assert done.status == "completed" and done.progress == 100, done.error
        frames = iio.imread(io.BytesIO(client.videos.download_content(killed.id).read()), extension=".mp4")
        assert frames.shape == (9, 64, 64, 3)
        again = iio.imread(io.BytesIO(client.videos.download_content(earlier.id).read()), extension=".mp4")
        assert again.shape[1:] == (32, 32, 3)
        assert "queued again after a restart: " + killed.id in server.log.read_text()
        assert not [p for p in videos.iterdir() if p.name.startswith(".")]  # the killed run's temporaries swept
    finally:
        server.stop()


def test_sigterm_queues_the_running_job_again_and_exits(tmp_path):
    server = Server(tmp_path).start()
    try:
        client = server.client()
        running = client.videos.create(prompt="running at the stop", size="64x64", seconds="1",
                                       extra_body={"num_inference_steps": 200})
        wait_started(client, running.id)
        events = urllib.request.Request(f"{server.url}/v1/videos/{running.id}/events",
                                        headers={"Authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(events, timeout=60) as answer:  # an open event stream does not hold the stop
            assert answer.readline().startswith(b"data: ")
            server.process.send_signal(signal.SIGTERM)
            answer.read()  # it ends
            assert server.process.wait(timeout=60) in (0, -signal.SIGTERM)  # uvicorn hands the signal back
    finally:
        server.stop(signal.SIGKILL)  # nothing when it has exited
    store = SqliteStore(server.data_dir / "jobs.sqlite3")
    job = store.get(running.id)
    assert (job.status, job.progress) == ("queued", 0)
    assert f"video {running.id}: queued again (the server is stopping)" in server.log.read_text()
    assert not list((server.data_dir / "videos").iterdir())
