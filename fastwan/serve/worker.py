"""The server's one worker thread: it loads the model once, then runs the store's queued jobs one at a time, oldest
first.

Rules: progress (0-99 while running, 100 when complete) is written after every denoising step; a job deleted while
it runs stops at its next step (:meth:`Worker.cancel`: the step callback raises :class:`Cancelled`), and so does
the running job when the server stops (:meth:`Worker.stop`), which goes back to the queue; since the
video and its thumbnail appear only whole (written to a hidden name, then moved), a stopped or deleted job leaves no
file; a job deleted just as it completes has its files removed. A job that fails keeps its error as OpenAI's
``{"code", "message"}``. With a retention (``keep_s``), finished videos past it are deleted with their files while
the queue is empty. One log line per change of a job's state.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from fastwan.errors import UserError, one_line
from fastwan.serve.requests import build
from fastwan.serve.store import Job, JobStore

logger = logging.getLogger("fastwan.serve")


class Cancelled(Exception):
    """Raised from the step callback of a job that was deleted while it ran."""


class Stopping(Exception):
    """Raised from the step callback when the server stops: the job goes back to the queue."""


def write_png(frame, path: Path) -> None:
    """``frame`` (uint8 [H, W, 3]) as a PNG at ``path``, written under a hidden name and moved into place."""
    from PIL import Image

    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        Image.fromarray(frame).save(f, format="PNG")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def remove(*paths: str | Path | None) -> None:
    for path in paths:
        if path:
            Path(path).unlink(missing_ok=True)


class Worker:
    """Loads ``options`` (a LoadOptions) on its thread, then runs ``store``'s jobs; files go under ``data_dir``."""

    def __init__(self, options, store: JobStore, data_dir: Path, on_load_failure: Callable[[], None] | None = None,
                 keep_s: float | None = None):
        self.options, self.store, self.data_dir = options, store, Path(data_dir)
        self.keep_s = keep_s  # finished videos older than this (seconds) are deleted with their files; None: never
        self.on_load_failure = on_load_failure  # called (on the worker thread) when the model fails to load
        self.gen = None
        self.load_failure: BaseException | None = None
        self.load_error: str | None = None
        self.steps_total = 0  # denoising steps run since the start (/metrics)
        self.step_seconds: float | None = None  # the last step's duration, between two steps of one video
        self._wake = threading.Condition()
        self._cancelled: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fastwan-serve-worker", daemon=True)

    @property
    def videos(self) -> Path:
        return self.data_dir / "videos"

    def video_path(self, id: str) -> Path:
        return self.videos / f"{id}.mp4"

    def start(self) -> None:
        """Start the thread; the hidden temporary files a killed process left in the server's folders go first
        (nothing else writes there)."""
        self.videos.mkdir(parents=True, exist_ok=True)
        for folder in (self.videos, self.data_dir / "uploads"):
            if folder.is_dir():
                remove(*folder.glob(".*"))
        self._thread.start()

    def stop(self, timeout: float | None = None) -> bool:
        """Stop taking jobs; a running job stops at its next step and is queued again (one past its last step
        completes). Waits up to ``timeout`` seconds; False when the thread still runs then."""
        self._stop.set()
        self.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def ready(self) -> bool:
        """The model is loaded and the worker thread is alive."""
        return self.gen is not None and self._thread.is_alive()

    def notify(self) -> None:
        """A job was queued: wake the worker."""
        with self._wake:
            self._wake.notify()

    def cancel(self, id: str) -> None:
        """Stop the job ``id`` at its next step if it runs (its row is already deleted)."""
        self._cancelled.add(id)

    def _run(self) -> None:
        from fastwan.pipelines.generator import VideoGenerator

        try:
            self.gen = VideoGenerator.load(self.options)
        except Exception as exc:  # noqa: BLE001 -- reported by /ready, every create and on_load_failure
            self.load_failure = exc
            self.load_error = one_line(exc) if isinstance(exc, UserError) else f"{type(exc).__name__}: {exc}"
            logger.error("the model did not load: %s", self.load_error)
            if self.on_load_failure is not None:
                self.on_load_failure()
            return
        logger.info("model %s loaded; serving", self.options.model)
        while not self._stop.is_set():
            job = self.store.claim()
            if job is None:
                self.expire()
                with self._wake:
                    self._wake.wait(timeout=1.0)
                continue
            self.run(job)

    def expire(self) -> None:
        """Delete the finished videos past the retention, with their files (checked while the queue is empty)."""
        if self.keep_s is None:
            return
        for job in self.store.expire(time.time() - self.keep_s):
            remove(job.video, job.thumbnail, job.image)
            logger.info("video %s: deleted (kept %g s after it finished)", job.id, self.keep_s)

    def run(self, job: Job) -> None:
        """Make ``job``'s video (the job is ``in_progress``)."""
        logger.info("video %s: in_progress", job.id)
        target = self.video_path(job.id)
        thumbnail = target.with_suffix(".png")

        last_step = None

        def on_step(done: int, total: int) -> None:
            nonlocal last_step
            now = time.perf_counter()
            if last_step is not None:
                self.step_seconds = now - last_step
            last_step = now
            self.steps_total += 1
            if job.id in self._cancelled:
                raise Cancelled(job.id)
            if self._stop.is_set():
                raise Stopping(job.id)
            self.store.progress(job.id, min(99, 100 * done // total))

        try:
            image = None
            if job.image is not None:
                from PIL import Image

                with Image.open(job.image) as im:
                    image = im.convert("RGB")
            result = self.gen.generate(build(job.fields, target, image), on_step=on_step)
            write_png(result.frames[0], thumbnail)
        except Cancelled:
            logger.info("video %s: cancelled (deleted while in progress)", job.id)
            remove(target, thumbnail, job.image)
            return
        except Stopping:
            if self.store.release(job.id):
                logger.info("video %s: queued again (the server is stopping)", job.id)
            return
        except Exception as exc:  # noqa: BLE001 -- a job's failure is its status, the worker goes on
            if isinstance(exc, UserError):
                error = {"code": "invalid_request", "message": one_line(exc)}
            else:
                logger.exception("video %s failed", job.id)
                error = {"code": "generation_failed", "message": f"{type(exc).__name__}: {exc}"}
            remove(target, thumbnail)
            if self.store.finish(job.id, error=error):
                logger.info("video %s: failed (%s)", job.id, error["message"])
            remove(job.image)
            return
        finally:
            self._cancelled.discard(job.id)
        if self.store.finish(job.id, video=str(target), thumbnail=str(thumbnail)):
            logger.info("video %s: completed", job.id)
        else:  # deleted as it completed
            remove(target, thumbnail)
        remove(job.image)
