"""A worker thread: it loads the model once (on its own device), then runs the store's jobs one at a time, oldest
first; a server has one per GPU (``--gpus``), or none (``--role api``).

Rules: a job is claimed with a lease (:mod:`fastwan.serve.store`) that a heartbeat thread renews every quarter of
``lease_s``; progress (0-99 while running, 100 when complete) is written after every denoising step. The job stops
at its next step when it is deleted (:meth:`Worker.cancel` here, or its row gone from a shared store), when its
claim was lost (the lease lapsed and another worker took it: the job is that worker's now), and when the server
stops (:meth:`Worker.stop`: it goes back to the queue). A finished job's mp4 is encoded on the worker's writer
thread while the next job runs on the device, one video at a time, under the job's lease; the job completes once its
files are in place, and a stopping worker writes the video it holds before it ends. A claim's files carry its token
in their names, and the video and its thumbnail appear only whole (written to a hidden name, then moved), so no
partial file is visible and a worker that lost its claim removes only its own files. A job that fails keeps its
error as OpenAI's ``{"code", "message"}``. With a retention (``keep_s``), finished videos past it are deleted with
their files while the queue is empty. One log line per change of a job's state. A causal model's job is written
as it is made, chunk by chunk, and its progress is per chunk (:mod:`fastwan.serve.streaming`).
"""
from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from fastwan.errors import UserError, one_line
from fastwan.pipelines.output import check_output_path, save_video
from fastwan.serve.loras import ServedLoras
from fastwan.serve.requests import build, job_images, uploads
from fastwan.serve.store import Job, JobStore
from fastwan.serve.streaming import is_causal, stream_job

logger = logging.getLogger("fastwan.serve")


class Cancelled(Exception):
    """Raised from the step callback of a job that was deleted while it ran."""


class Stopping(Exception):
    """Raised from the step callback when the server stops: the job goes back to the queue."""


class Lost(Exception):
    """Raised from the step callback of a job whose claim no longer holds it (deleted, or claimed again)."""


SWEEP_AGE_S = 3600.0  # on a shared store, a hidden temporary file untouched this long was left by a dead process


def write_png(frame, path: Path) -> None:
    """``frame`` (uint8 [H, W, 3]) as a PNG at ``path``, written under a hidden name and moved into place."""
    from PIL import Image

    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        Image.fromarray(frame).save(f, format="PNG")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def spent(timings: dict[str, float]) -> str:
    """A job's seconds for the log: ``text 0.05 s, steps 43.12 s, vae 0.83 s, file 1.21 s``."""
    names = {"text_encoding": "text", "denoising": "steps", "decoding": "vae", "saving": "file"}
    return ", ".join(f"{names[k]} {timings[k]:.2f} s" for k in names if k in timings)


def _rules_of(gen, options):
    """A sequence-parallel group's rules (its ranks resolve each request; this process checks creates by the
    checkpoint's files)."""
    from fastwan.pipelines.rules import CheckpointRules

    return CheckpointRules.of(gen.checkpoint, options.cache)


def sweep(data_dir: Path, age_s: float | None) -> None:
    """Remove the hidden temporary files in the server's folders under ``data_dir``: all (``age_s`` None) or those
    untouched for ``age_s`` seconds."""
    now = time.time()
    for folder in (data_dir / "videos", data_dir / "uploads"):
        for path in folder.glob(".*") if folder.is_dir() else ():
            with contextlib.suppress(OSError):  # another process removed or renamed it meanwhile
                if age_s is None or now - path.stat().st_mtime > age_s:
                    path.unlink()


def remove(*paths: str | Path | None) -> None:
    for path in paths:
        if path:
            Path(path).unlink(missing_ok=True)


class Worker:
    """Loads ``options`` (a LoadOptions) on its thread, then runs ``store``'s jobs of ``model`` (the served name);
    files go under ``data_dir``; ``name`` tells this worker from the process's others (e.g. its device)."""

    def __init__(self, options, store: JobStore, data_dir: Path, on_load_failure: Callable[[], None] | None = None,
                 keep_s: float | None = None, *, model: str | None = None, name: str = "0", lease_s: float = 60.0,
                 loras: ServedLoras | None = None):
        self.options, self.store, self.data_dir = options, store, Path(data_dir)
        self.model, self.lease_s = model, lease_s
        self.name = f"{socket.gethostname()}:{os.getpid()}:{name}"  # the claims' owner, in the store's rows
        self.keep_s = keep_s  # finished videos older than this (seconds) are deleted with their files; None: never
        self.loras = loras or ServedLoras(None)  # --lora-dir: merged into the model for the jobs that name them
        self.on_load_failure = on_load_failure  # called (on the worker thread) when the model fails to load
        self.gen = None
        self.rules = None  # what checks a create for this worker's model: its generator, or the checkpoint's rules
        self.load_failure: BaseException | None = None
        self.load_error: str | None = None
        self.steps_total = 0  # denoising steps run since the start (/metrics)
        self.step_seconds: float | None = None  # the last step's duration, between two steps of one video
        self._wake = threading.Condition()
        self._cancelled: set[str] = set()
        self._held: dict[str, str] = {}  # claim -> job id: the jobs this worker runs or writes (their leases)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"fastwan-serve-writer-{name}")
        self._writing: Future | None = None  # the video being written
        self._lost: set[str] = set()  # claims the heartbeat found lost
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"fastwan-serve-worker-{name}", daemon=True)
        self._beat = threading.Thread(target=self._heartbeat, name=f"fastwan-serve-heartbeat-{name}", daemon=True)

    @property
    def videos(self) -> Path:
        return self.data_dir / "videos"

    def video_path(self, id: str, claim: str | None = None) -> Path:
        """The video file of the job ``id`` as the claim ``claim`` writes it (its token in the name)."""
        return self.videos / (f"{id}.mp4" if claim is None else f"{id}-{claim.rsplit('/', 1)[-1]}.mp4")

    def start(self) -> None:
        """Start the threads; the hidden temporary files a killed process left in the server's folders go first:
        all of them when this process alone uses the store, else those untouched for ``SWEEP_AGE_S``."""
        self.videos.mkdir(parents=True, exist_ok=True)
        sweep(self.data_dir, None if not self.store.shared else SWEEP_AGE_S)
        self._thread.start()
        self._beat.start()

    def stop(self, timeout: float | None = None) -> bool:
        """Stop taking jobs; a running job stops at its next step and is queued again (one past its last step
        completes). Waits up to ``timeout`` seconds; False when the thread still runs then."""
        self._stop.set()
        self.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if not self._thread.is_alive():
            with contextlib.suppress(Exception):  # the store may be gone; its heartbeat then lapses on its own
                self.store.gone(self.name)
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
        self.gen.set_progress_bar_config(disable=True)  # progress goes to the store; the log keeps its lines
        self.rules = self.gen if hasattr(self.gen, "resolve") else _rules_of(self.gen, self.options)
        logger.info("model %s loaded on %s; serving", self.options.model, self.gen.device)
        with contextlib.suppress(Exception):  # the heartbeat says it again
            self.store.beat(self.name, self.model or self.options.model)
        while not self._stop.is_set():
            try:
                job = self.store.claim(self.name, self.model, self.lease_s)
            except Exception:  # noqa: BLE001 -- the store is unreachable for now: retry, the jobs wait there
                logger.exception("claiming a job failed; retrying")
                job = None
            if job is None:
                self.expire()
                with self._wake:
                    self._wake.wait(timeout=1.0)
                continue
            self.run(job)
        self._written()
        self._writer.shutdown(wait=False)

    def _written(self) -> None:
        """Wait until the video being written is in place (or its failure recorded)."""
        if self._writing is not None:
            try:
                self._writing.result()
            except Exception:  # noqa: BLE001 -- the store was unreachable: the job's lease lapses, it runs again
                logger.exception("completing a video failed")
            self._writing = None

    def expire(self) -> None:
        """Delete the finished videos past the retention, with their files (checked while the queue is empty)."""
        if self.keep_s is None:
            return
        for job in self.store.expire(time.time() - self.keep_s):
            remove(job.video, job.thumbnail, *uploads(job))
            logger.info("video %s: deleted (kept %g s after it finished)", job.id, self.keep_s)

    def _heartbeat(self) -> None:
        """Every quarter lease until the worker thread ended: this worker is alive (the store's ``workers``), and
        the running job's lease renewed; a claim the store no longer holds is marked lost."""
        while self._thread.is_alive() or not self._stop.is_set():
            if self._stop.is_set():  # stopping: the running job keeps its lease until it reaches its next step
                self._thread.join(self.lease_s / 4)
            else:
                self._stop.wait(self.lease_s / 4)
            try:
                if self.gen is not None and not self._stop.is_set():
                    self.store.beat(self.name, self.model or self.options.model)
                for claim, id in list(self._held.items()):
                    if not self.store.heartbeat(id, claim):
                        self._lost.add(claim)
            except Exception:  # noqa: BLE001 -- the store is unreachable for now; the lease may lapse
                logger.warning("renewing the lease failed; retrying", exc_info=True)

    def run(self, job: Job) -> None:
        """Make ``job``'s video (the job is ``in_progress`` under ``job.claim``)."""
        logger.info("video %s: in_progress on %s", job.id, self.gen.device)
        claim = job.claim
        target = self.video_path(job.id, claim)
        thumbnail = target.with_suffix(".png")
        self._held[claim] = job.id
        handed = False

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
            if claim in self._lost or not self.store.progress(job.id, claim, min(99, 100 * done // total)):
                raise Lost(job.id)

        try:
            request = build(job.fields, target, *job_images(job)).replace(save_video=False, return_frames=True)
            self.loras.use(self.gen, job.fields)  # the job's LoRAs merged, or the base weights
            if is_causal(self.gen):  # written chunk by chunk as it is made, then completed
                timings, first = stream_job(self.gen, request, self.videos, job, target, on_step)
                write_png(first, thumbnail)
                self._written()
                self._writing = self._writer.submit(self._complete, job, target, thumbnail, timings)
                handed = True
                return
            result = self.gen.generate(request, on_step=on_step)
            self._written()  # one video written at a time
            self._writing = self._writer.submit(self._finish, job, result, target, thumbnail)
            handed = True
        except Cancelled:
            logger.info("video %s: cancelled (deleted while in progress)", job.id)
            remove(target, thumbnail, *uploads(job))
            return
        except Stopping:
            if self.store.release(job.id, claim):
                logger.info("video %s: queued again (the server is stopping)", job.id)
            return
        except Lost:
            remove(target, thumbnail)
            if self.store.get(job.id) is None:  # deleted here before cancel() or by another host
                logger.info("video %s: cancelled (deleted while in progress)", job.id)
                remove(*uploads(job))
            else:
                logger.warning("video %s: stopped (its lease lapsed and another worker runs it)", job.id)
            return
        except Exception as exc:  # noqa: BLE001 -- a job's failure is its status, the worker goes on
            self._failed(job, exc, target, thumbnail)
        finally:
            if not handed:
                self._release(job)

    def _release(self, job: Job) -> None:
        """The job is no longer this worker's to run or write."""
        self._held.pop(job.claim, None)
        self._cancelled.discard(job.id)
        self._lost.discard(job.claim)

    def _finish(self, job: Job, result, target: Path, thumbnail: Path) -> None:
        """On the writer thread: the job's mp4 and thumbnail written (hidden names, then moved), then the job
        completed; a write that fails fails the job."""
        try:
            start = time.perf_counter()
            save_video(check_output_path(str(target), True), target.name, result.frames, result.settings["fps"])
            write_png(result.frames[0], thumbnail)
            result.timings["saving"] = time.perf_counter() - start
        except Exception as exc:  # noqa: BLE001 -- a job's failure is its status, the worker goes on
            try:
                self._failed(job, exc, target, thumbnail)
            finally:
                self._release(job)
            return
        self._complete(job, target, thumbnail, result.timings)

    def _complete(self, job: Job, target: Path, thumbnail: Path, timings: dict[str, float]) -> None:
        """On the writer thread: the job's files are in place; the job completed (its files removed when the row
        is no longer this claim's)."""
        try:
            if self.store.finish(job.id, job.claim, video=str(target), thumbnail=str(thumbnail)):
                logger.info("video %s: completed (%s)", job.id, spent(timings))
            else:  # deleted as it completed, or claimed again: the row is not this claim's
                remove(target, thumbnail)
                if self.store.get(job.id) is not None:
                    return  # the upload is the new claim's
            remove(*uploads(job))
        finally:
            self._release(job)

    def _failed(self, job: Job, exc: Exception, target: Path, thumbnail: Path) -> None:
        """The job failed with ``exc``: its error recorded (a user error as invalid_request), its files removed."""
        if isinstance(exc, UserError):
            error = {"code": "invalid_request", "message": one_line(exc)}
        else:
            logger.error("video %s failed", job.id, exc_info=exc)
            error = {"code": "generation_failed", "message": f"{type(exc).__name__}: {exc}"}
        remove(target, thumbnail)
        if self.store.finish(job.id, job.claim, error=error):
            logger.info("video %s: failed (%s)", job.id, error["message"])
        elif self.store.get(job.id) is not None:
            return  # claimed again meanwhile: the uploads are the new claim's
        remove(*uploads(job))
