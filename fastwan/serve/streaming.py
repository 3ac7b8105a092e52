"""A causal model's videos streamed while they are made: the worker's side (:func:`stream_job`) and the route
``GET /v1/videos/{id}/stream`` (:func:`stream_response`).

Rules of the worker: a causal checkpoint's job (:class:`~fastwan.checkpoint.causal.CausalRecipe`) is made with
``gen.stream_video`` and written chunk by chunk as a fragmented mp4 that plays while it grows
(:class:`~fastwan.pipelines.stream_output.VideoStreamWriter`), at a hidden name tied to the job's claim
(:func:`stream_path`; a hidden file is swept at the next start if the process dies). After each chunk the step
callback runs (progress, cancellation, a lost claim, a stopping server: ``on_step(chunks done, chunks)``); a stream
that does not finish is removed. A finished stream is moved to the claim's video name and its first frame written
as the thumbnail, before the job completes; the file is the stream's bytes as they were written.

Rules of the route: a completed video is its whole mp4 (any model); a failed one is 409 ``video_not_ready``; a video
a model that is not causal makes (queued or in progress) is 409 ``not_streamable``; a queued one is 409
``video_not_ready`` (its stream opens once it is in progress); one in progress is answered at once (200,
``video/mp4``, chunked) with the bytes written so far, then each new byte as the file grows. The answer follows the
claim that ran the video when it opened: it ends once that claim's video is completed (the whole file sent: its
bytes equal ``/content``'s), or when the video is deleted, fails, or goes back to the queue, or the server starts to
stop (then it is cut short).
"""
from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import numpy as np
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, StreamingResponse

from fastwan.serve.errors import ApiError

READ_BYTES = 1 << 20  # the most one read of a growing stream takes
FILE_POLL_S = 0.1  # how often a stream that sent all it had looks for new bytes
ROW_POLL_S = 0.5  # how often it reads the video's row meanwhile (completed, deleted, failed, queued again)


def is_causal(rules) -> bool:
    """Whether the served checkpoint (a loaded generator's or its files' rules) makes its videos chunk by chunk."""
    return getattr(getattr(rules, "checkpoint", None), "causal", None) is not None


def stream_path(videos: Path, id: str, claim: str) -> Path:
    """The growing mp4 of the job ``id`` as the claim ``claim`` streams it (hidden: it is not the finished video)."""
    return videos / f".{id}-{claim.rsplit('/', 1)[-1]}.mp4"


def stream_job(gen, request, videos: Path, job, target: Path,
               on_step: Callable[[int, int], None]) -> tuple[dict[str, float], np.ndarray]:
    """Make ``job``'s video (``request``, its GenerationRequest) with the causal generator ``gen`` as a stream
    (the module's rules) -> (the timings the worker logs, the first frame); the video is at ``target`` on return."""
    from fastwan.pipelines.output import OutputTarget
    from fastwan.pipelines.stream_output import VideoStreamWriter

    plan = gen.resolve(request)
    r, s = plan.request, plan.settings
    stream = gen.stream_video(r.prompt, height=s.height, width=s.width, num_frames=s.num_frames, seed=r.seed,
                              fps=s.fps)
    total = stream.settings.chunks
    hidden = stream_path(videos, job.id, job.claim)
    timings = {"text_encoding": 0.0, "denoising": 0.0, "decoding": 0.0, "saving": 0.0}
    first = None
    with stream, VideoStreamWriter(OutputTarget(videos, hidden.name, True), hidden.name, s.fps) as writer:
        for chunk in stream:
            start = time.perf_counter()
            writer.append(chunk.frames)
            timings["saving"] += time.perf_counter() - start
            first = chunk.frames[0] if first is None else first
            t = chunk.timings
            timings["text_encoding"] += t["text"]
            timings["denoising"] += t["dit"] + t["kv_write"]
            timings["decoding"] += t["decode"]
            on_step(chunk.index + 1, total)
        start = time.perf_counter()
        writer.close()
    try:
        os.replace(hidden, target)
    except BaseException:
        hidden.unlink(missing_ok=True)
        raise
    timings["saving"] += time.perf_counter() - start
    return timings, first


def stream_response(store, videos: Path, job, causal: bool, closing: threading.Event):
    """The answer of ``GET /v1/videos/{id}/stream`` for ``job`` (the module's rules); ``causal``: whether the
    served model streams; ``closing``: set when the server starts to stop (the answer then ends)."""
    if job.status == "completed":
        if not job.video or not Path(job.video).is_file():
            raise ApiError(404, f"video {job.id}'s file is missing from the data folder.", code="not_found")
        return FileResponse(job.video, media_type="video/mp4", filename=Path(job.video).name)
    if job.status == "failed":
        raise ApiError(409, f"video {job.id} failed; it has no video to stream (its error is in GET /v1/videos/"
                            f"{job.id}).", code="video_not_ready")
    if not causal:
        raise ApiError(409, f"video {job.id} is {job.status} on model {job.model!r}, which is not causal: only a "
                            "causal checkpoint's videos (Self-Forcing, CausVid) stream while they are made; GET "
                            f"/v1/videos/{job.id}/content once it is completed.", code="not_streamable")
    if job.status != "in_progress":
        raise ApiError(409, f"video {job.id} is {job.status}; its stream opens once it is in_progress (GET "
                            f"/v1/videos/{job.id}/events says when).", code="video_not_ready")
    return StreamingResponse(_follow(store, videos, job, closing), media_type="video/mp4",
                             headers={"Cache-Control": "no-cache"})


def _open(path: Path | str | None):
    try:
        return open(path, "rb") if path else None
    except FileNotFoundError:
        return None


async def _follow(store, videos: Path, job, closing: threading.Event) -> AsyncIterator[bytes]:
    """The stream of the claim that runs ``job`` (in progress when the answer opened), as its file grows."""
    path = stream_path(videos, job.id, job.claim)
    file = None
    checked = time.monotonic()
    try:
        while True:
            if file is None:
                file = await run_in_threadpool(_open, path)
            if file is not None:
                data = await run_in_threadpool(file.read, READ_BYTES)
                if data:
                    yield data
                    continue
            if closing.is_set():  # the video goes back to the queue at its next chunk
                return
            if time.monotonic() - checked < ROW_POLL_S:
                await asyncio.sleep(FILE_POLL_S)
                continue
            checked = time.monotonic()
            row = await run_in_threadpool(store.get, job.id)
            if row is None or row.claim != job.claim or row.status not in ("in_progress", "completed"):
                return  # deleted, failed, or queued again: the stream ends short
            if row.status == "completed":  # the stream was closed before the row changed: the rest is in the file
                if file is None:  # moved into place before this answer opened it
                    file = await run_in_threadpool(_open, row.video)
                while file is not None and (data := await run_in_threadpool(file.read, READ_BYTES)):
                    yield data
                return
    finally:
        if file is not None:
            file.close()
