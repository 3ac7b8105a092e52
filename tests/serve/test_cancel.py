"""A job deleted while it runs stops at its next step, whichever way the deletion reaches the worker: through this
process's ``cancel`` or only through the store (its row gone: a delete racing ``cancel``, or another host's)."""

from __future__ import annotations

import logging
import time

import torch

from fastwan.pipelines.load_options import LoadOptions
from fastwan.serve.store import SqliteStore, new_id
from fastwan.serve.worker import Worker

FIELDS = {"prompt": "a lighthouse", "width": 32, "height": 32, "num_frames": 5}


def until(check, what: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def add(store, steps: int) -> str:
    video_id = new_id()
    store.add(
        id=video_id,
        model="tiny",
        prompt=FIELDS["prompt"],
        size="32x32",
        seconds="0.3",
        fields={**FIELDS, "num_inference_steps": steps},
        image=None,
    )
    return video_id


def test_a_job_deleted_from_the_store_alone_is_logged_cancelled_and_the_worker_goes_on(tiny_ckpts, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="fastwan.serve")
    store = SqliteStore(tmp_path / "jobs.sqlite3")
    running = add(store, 300)
    worker = Worker(LoadOptions(model=str(tiny_ckpts["wan2.1"]), device="cpu", dtype=torch.float32), store, tmp_path)
    worker.start()
    try:
        until(lambda: (job := store.get(running)) is not None and job.progress >= 1, "the job to take steps")
        assert store.delete(running) is not None  # no cancel(): the worker learns it from the store
        after = add(store, 1)
        until(lambda: store.get(after).status == "completed", "the next job to complete")
    finally:
        worker.stop(timeout=120)
        store.close()
    assert f"video {running}: cancelled (deleted while in progress)" in caplog.text
    assert not list((tmp_path / "videos").glob(f"*{running}*"))  # no file, partial or whole
