"""A worker runs the next job on its device while the last job's mp4 is encoded (the device does not wait for the
encoder), and a job completes only once its files are in place."""
from __future__ import annotations

import threading
import time

import imageio.v3 as iio
import torch

import fastwan.serve.worker as worker_module
from fastwan.pipelines.load_options import LoadOptions
from fastwan.serve.store import SqliteStore, new_id
from fastwan.serve.worker import Worker

FIELDS = {"prompt": "a lighthouse", "width": 32, "height": 32, "num_frames": 5, "num_inference_steps": 2}


def until(check, what: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_next_job_runs_while_the_last_video_is_written(tiny_ckpts, tmp_path, monkeypatch):
    store = SqliteStore(tmp_path / "jobs.sqlite3")
    ids = [new_id() for _ in range(2)]
    for seed, video_id in enumerate(ids):
        store.add(id=video_id, model="tiny", prompt=FIELDS["prompt"], size="32x32", seconds="0.3",
                  fields={**FIELDS, "seed": seed}, image=None)
    release, written = threading.Event(), []
    save_video = worker_module.save_video

    def held(target, name, frames, fps):  # the encoder is slow: it waits until the test lets it go
        assert release.wait(120), "never released"
        written.append(name)
        return save_video(target, name, frames, fps)

    monkeypatch.setattr(worker_module, "save_video", held)
    worker = Worker(LoadOptions(model=str(tiny_ckpts["wan2.1"]), device="cpu", dtype=torch.float32), store, tmp_path)
    worker.start()
    try:
        until(lambda: store.get(ids[1]).status == "in_progress", "the second job to start")
        first = store.get(ids[0])
        assert first.status == "in_progress" and first.video is None and written == []  # still being written
        assert not list((tmp_path / "videos").glob("*.mp4"))  # no file is visible before it is whole
        release.set()
        until(lambda: all(store.get(i).status == "completed" for i in ids), "both jobs to complete")
    finally:
        release.set()
        worker.stop(timeout=120)
        store.close()
    reopened = SqliteStore(tmp_path / "jobs.sqlite3")
    try:
        for video_id in ids:
            job = reopened.get(video_id)
            assert job.progress == 100 and iio.imread(job.video, index=None).shape == (5, 32, 32, 3)
    finally:
        reopened.close()
