"""The routes: OpenAI's Videos API under ``/v1`` (create, retrieve, list, delete, content), a progress stream per
video (``/v1/videos/{id}/events``, Server-Sent Events), a causal model's mp4 while it is made
(``/v1/videos/{id}/stream``, :mod:`fastwan.serve.streaming`), ``/health``, ``/ready`` and ``/metrics``
(:mod:`fastwan.serve.metrics`), and the web page at ``/`` (:mod:`fastwan.serve.site`; its files need no key).

Rules: every route but ``/health`` needs ``Authorization: Bearer <key>`` when the server has a key (compared in
constant time, :func:`hmac.compare_digest`); every error is OpenAI's ``{"error": {...}}`` with its status
(:mod:`fastwan.serve.errors`), the framework's own (unknown route, bad query parameter) included; a create is
checked completely (the request's rules and the loaded checkpoint's) and committed to the store before it is
answered; a body over its cap is refused (413) while it is read, before it is parsed.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from fastwan.serve.animate_uploads import ANIMATE_UPLOADS
from fastwan.serve.errors import ApiError
from fastwan.serve.metrics import CONTENT_TYPE as METRICS_TYPE
from fastwan.serve.metrics import render as render_metrics
from fastwan.serve.cors import add_cors
from fastwan.serve.loras import ServedLoras
from fastwan.serve.requests import (LAST_IMAGE_KEY, Limits, accept, check_video, form_body, json_body, read_image,
                                    uploads)
from fastwan.serve.site import add_page
from fastwan.serve.store import JobStore, new_id
from fastwan.serve.streaming import is_causal, stream_response
from fastwan.serve.uploads import MASK, MAX_REFERENCE_IMAGES, REFERENCES, REFERENCES_KEY, VACE_UPLOADS, check_count
from fastwan.serve.uploads import file_field, refuse_uploads
from fastwan.serve.worker import Worker, remove

logger = logging.getLogger("fastwan.serve")
EVENT_POLL_S = 0.5  # how often an event stream reads its video when this process changed nothing


@dataclass
class ServerState:
    """What the routes share: the store, this process's workers (each with its model; none with ``--role api``),
    the served model's name, the key (None: no key), the queue cap, the upload caps, the wait for the running jobs
    at shutdown, the data folder (default: the first worker's), the retention (None: keep), the checkpoint's rules
    that check creates where no worker runs (a :class:`~fastwan.pipelines.rules.CheckpointRules`) and the workers'
    lease."""

    store: JobStore
    workers: list[Worker]
    model: str
    api_key: str | None = None
    max_queue: int = 64
    limits: Limits = Limits()
    stop_wait_s: float = 60.0  # at shutdown, how long the running jobs have to reach their next step
    data_dir: Path | None = None
    keep_s: float | None = None
    rules: Any = None
    lease_s: float = 60.0
    loras: ServedLoras | None = None  # --lora-dir: the LoRAs a create may name (None: none)
    cors_origins: tuple[str, ...] = ()  # --cors-origin: the web origins allowed to call the API (none: CORS off)
    admit: threading.Lock = field(default_factory=threading.Lock)  # one create checks the queue and adds at a time
    closing: threading.Event = field(default_factory=threading.Event)  # set when the server starts to stop

    def __post_init__(self):
        if self.data_dir is None:
            self.data_dir = self.workers[0].data_dir

    @property
    def uploads(self) -> Path:
        return self.data_dir / "uploads"

    def video_path(self, video_id: str) -> Path:
        """Where the server writes the video ``video_id`` (a create's request is checked with it)."""
        return self.data_dir / "videos" / f"{video_id}.mp4"

    def stop_workers(self, timeout: float) -> bool:
        """Stop every worker here (their running jobs go back to the queue at their next step), waiting up to
        ``timeout`` seconds in all; False when one still runs then."""
        for worker in self.workers:
            worker.stop(timeout=0)
        deadline = time.monotonic() + timeout
        return all([worker.stop(max(0.0, deadline - time.monotonic())) for worker in self.workers])


def _authorize(state: ServerState):
    def check(request: Request) -> None:
        if state.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if not given:
            raise ApiError(401, "no API key: send the header 'Authorization: Bearer <key>' with this server's key.",
                           code="missing_api_key")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), state.api_key.encode()):
            raise ApiError(401, "the API key is not this server's; send 'Authorization: Bearer <key>' with the key "
                                "in the server's --api-key-file.", code="invalid_api_key")
    return check


async def _read(request: Request, cap: int, what: str) -> bytes:
    """The body, refused with 413 once it passes ``cap`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > cap:
        raise ApiError(413, f"the {what} is {declared} bytes, over this server's cap of {cap}.",
                       code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > cap:
            raise ApiError(413, f"the {what} is over this server's cap of {cap} bytes.", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


UPLOADS = ("input_reference", "last_image", "video", *VACE_UPLOADS, *ANIMATE_UPLOADS)  # a create's file fields
VIDEOS = ("video", MASK, *ANIMATE_UPLOADS)  # the file fields that are videos
MAX_VIDEOS = 4  # the most video files one request reads (Animate's replace mode: pose, face, background, mask)


def _save_upload(data: bytes, path: Path) -> None:
    """The upload at ``path``, on disk before the job that names it is committed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


async def _create_body(request: Request, limits: Limits) -> tuple[dict, dict[str, bytes]]:
    """The create body's typed fields and the uploaded files' bytes by field (:data:`UPLOADS`; ``reference_images``:
    a list of them)."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind == "multipart/form-data":
        cap = ((2 + MAX_REFERENCE_IMAGES) * limits.max_upload_bytes + MAX_VIDEOS * limits.max_video_bytes
               + limits.max_body_bytes)
        data = await _read(request, cap, "multipart body")

        async def replay():
            return {"type": "http.request", "body": data, "more_body": False}

        try:
            form = await Request(request.scope, replay).form(max_files=len(UPLOADS) + MAX_REFERENCE_IMAGES,
                                                             max_fields=64, max_part_size=limits.max_body_bytes)
        except Exception as exc:  # noqa: BLE001 -- a malformed form is the client's
            raise ApiError(400, f"the multipart body could not be read ({exc}).", code="invalid_body") from None
        texts, files = [], {}
        for key, value in form.multi_items():
            name = file_field(key)
            if isinstance(value, str):
                texts.append((key, value))
            elif name not in UPLOADS or (name in files and name != REFERENCES):
                raise ApiError(400, f"the file field {key!r} is not read; upload the first frame as input_reference "
                                    "(and a first-last-frame video's last frame as last_image), or the video to "
                                    "redo as video, once each; VACE: the mask as mask, the reference images as "
                                    "reference_images (repeated); Wan2.2-Animate: the driving videos as pose_video "
                                    "and face_video (replace mode: background_video, mask_video).",
                               code="unknown_parameter", param=key)
            elif name == REFERENCES:
                files.setdefault(name, []).append(await value.read())
            else:
                files[name] = await value.read()
        check_count(files.get(REFERENCES, []))
        for key, uploaded in files.items():
            most = limits.max_video_bytes if key in VIDEOS else limits.max_upload_bytes
            for upload in uploaded if key == REFERENCES else [uploaded]:
                if len(upload) > most:
                    raise ApiError(413, f"{key} is {len(upload)} bytes, over this server's cap of {most}.",
                                   code="upload_too_large", param=key)
        return form_body(texts), files
    if kind not in ("application/json", ""):
        raise ApiError(400, f"the body's Content-Type is {kind!r}; send application/json or multipart/form-data.",
                       code="invalid_body")
    return json_body(await _read(request, limits.max_body_bytes, "JSON body")), {}


async def _event_stream(state: ServerState, video_id: str):
    """The events of :func:`create_app`'s ``events`` route, as SSE text."""
    loop = asyncio.get_running_loop()
    changes: asyncio.Queue = asyncio.Queue()

    def watcher(job) -> None:  # on the thread that committed the change, under the store's lock
        with contextlib.suppress(RuntimeError):  # the loop closed: the stream is gone
            loop.call_soon_threadsafe(changes.put_nowait, job)

    job = await run_in_threadpool(state.store.watch, video_id, watcher)
    last = None
    try:
        while True:
            if job is None:
                yield f"event: deleted\ndata: {json.dumps({'id': video_id, 'deleted': True})}\n\n"
                return
            video = job.public(state.keep_s)
            if (video["status"], video["progress"]) != last:
                last = video["status"], video["progress"]
                yield f"data: {json.dumps(video)}\n\n"
            if video["status"] in ("completed", "failed") or state.closing.is_set():
                return  # a stopping server ends its streams: uvicorn waits for every open answer before it stops
            try:
                job = await asyncio.wait_for(changes.get(), EVENT_POLL_S)
            except asyncio.TimeoutError:  # nothing changed here; another host may have changed the row
                await run_in_threadpool(state.store.refresh, video_id)  # the row now joins the queue in order
    finally:  # no await here: a stream the client left is closed by the loop, which awaits nothing more
        state.store.unwatch(video_id, watcher)


def create_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        # shutting down (SIGINT / SIGTERM; requests finished): the running job stops at its next step and is queued
        # again, before uvicorn hands the signal back to the process
        if not await run_in_threadpool(state.stop_workers, state.stop_wait_s):
            logger.warning("a running job did not reach its next step in %g s; it is queued again at the next "
                           "start (or once its lease lapses, with a shared store)", state.stop_wait_s)

    app = FastAPI(title="fastwan", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    api = APIRouter(dependencies=[Depends(_authorize(state))])

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(Exception)
    async def bug(request: Request, exc: Exception):  # a bug: logged with its traceback, answered in OpenAI's shape
        logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        body = ApiError(500, f"the server failed on this request ({type(exc).__name__}); its log has the details.",
                        code="internal_error").body()
        return JSONResponse(body, status_code=500)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = first.get("loc", ("", ""))[-1]
        return JSONResponse(ApiError(400, f"{where}: {first.get('msg', 'invalid')}.", code="invalid_value",
                                     param=str(where)).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        code = "not_found" if exc.status_code == 404 else "method_not_allowed" if exc.status_code == 405 else "http"
        body = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code).body()
        return JSONResponse(body, status_code=exc.status_code)

    def model_ready():
        """What checks a create: the loaded generator of a worker here, else the checkpoint's rules."""
        if not state.workers:
            return state.rules
        failed = [w.load_error for w in state.workers if w.load_error is not None]
        if failed:
            raise ApiError(503, f"the model did not load: {failed[0]}", code="model_not_loaded")
        if not all(w.ready() for w in state.workers):
            raise ApiError(503, "the model is still loading; retry in a moment (GET /ready says when).",
                           code="model_loading")
        return state.workers[0].rules

    def job_or_404(video_id: str):
        job = state.store.get(video_id)
        if job is None:
            raise ApiError(404, f"no video {video_id!r} here (it was deleted or never created).", code="not_found",
                           param="video_id")
        return job

    @app.get("/health")
    def health():
        return {"status": "ok"}

    @api.get("/ready")
    def ready():
        rules = model_ready()
        if not state.workers and not state.store.live_workers(state.model, state.lease_s):
            raise ApiError(503, f"no worker serving {state.model!r} is alive; start one (fastwan serve --role "
                                "worker with this --store and --model); creates are queued meanwhile.",
                           code="no_worker")
        return {"status": "ready", "model": state.model, "queued": state.store.count("queued"),
                "streams": is_causal(rules)}

    @api.get("/metrics")
    def metrics():
        return PlainTextResponse(render_metrics(state.store.counts(), state.workers), media_type=METRICS_TYPE)

    @api.post("/v1/videos")
    async def create(request: Request):
        body, files = await _create_body(request, state.limits)
        gen = model_ready()
        refuse_uploads(gen.checkpoint, [key for key in ANIMATE_UPLOADS if key in files], "animate")
        images = {key: await run_in_threadpool(read_image, data, state.limits, key) for key, data in files.items()
                  if key not in (*VIDEOS, REFERENCES)}
        references = [await run_in_threadpool(read_image, data, state.limits, REFERENCES)
                      for data in files.get(REFERENCES, ())]
        video_id = new_id()
        videos = {}
        try:
            for key in VIDEOS:  # on disk before it is read (frame by frame) and checked; removed unless admitted
                if key in files:
                    videos[key] = state.uploads / f"{video_id}.{key}.mp4"
                    await run_in_threadpool(_save_upload, files.pop(key), videos[key])
                    await run_in_threadpool(check_video, videos[key], state.limits, key)
            checked = await run_in_threadpool(accept, body, images.get("input_reference"), gen, state.model,
                                              state.video_path(video_id), images.get("last_image"), state.loras,
                                              videos.get("video"), videos.get(MASK), references or None, videos)
            return await run_in_threadpool(_admit, state, video_id, checked, files)
        except BaseException:
            remove(*videos.values())
            raise

    @api.get("/v1/videos")
    def list_videos(limit: int = Query(20, ge=1, le=100), after: str | None = None,
                    order: str = Query("desc", pattern="^(asc|desc)$")):
        page = state.store.page(limit, after, order)
        if page is None:
            raise ApiError(404, f"after={after!r} names no video here.", code="not_found", param="after")
        jobs, more = page
        data = [j.public(state.keep_s) for j in jobs]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": more}

    @api.get("/v1/videos/{video_id}")
    def retrieve(video_id: str):
        return job_or_404(video_id).public(state.keep_s)

    @api.delete("/v1/videos/{video_id}")
    def delete(video_id: str):
        job = state.store.delete(video_id)
        if job is None:
            job_or_404(video_id)
        if job.status == "in_progress":  # stopped at its next step (any host's); its files are the worker's
            for worker in state.workers:
                worker.cancel(video_id)
        else:  # a queued job is never claimed now (the row went in one transaction)
            remove(job.video, job.thumbnail, *uploads(job))
        logger.info("video %s: deleted (was %s)", video_id, job.status)
        return {"id": video_id, "object": "video.deleted", "deleted": True}

    @api.get("/v1/videos/{video_id}/events")
    async def events(video_id: str):
        """Server-Sent Events: the video object at once and after each change of its status or progress, until it
        is completed or failed (an ``event: deleted`` ends the stream of a video deleted meanwhile). Changes this
        process makes arrive as they commit, every step included; those of other hosts sharing the store are
        read every ``EVENT_POLL_S``."""
        job_or_404(video_id)
        return StreamingResponse(_event_stream(state, video_id), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @api.get("/v1/videos/{video_id}/stream")
    def stream(video_id: str):
        """A causal model's mp4 while it is made, then to its end (:mod:`fastwan.serve.streaming`)."""
        job = job_or_404(video_id)
        causal = job.status in ("completed", "failed") or is_causal(model_ready())
        return stream_response(state.store, state.data_dir / "videos", job, causal, state.closing)

    @api.get("/v1/videos/{video_id}/content")
    def content(video_id: str, variant: str = Query("video", pattern="^(video|thumbnail|spritesheet)$")):
        job = job_or_404(video_id)
        if job.status != "completed":
            raise ApiError(409, f"video {video_id} is {job.status}; its content exists once it is completed.",
                           code="video_not_ready")
        if variant == "spritesheet":
            raise ApiError(400, "variant 'spritesheet' is not served; ask for 'video' or 'thumbnail'.",
                           code="invalid_value", param="variant")
        path, kind = (job.video, "video/mp4") if variant == "video" else (job.thumbnail, "image/png")
        if not path or not Path(path).is_file():
            raise ApiError(404, f"video {video_id}'s {variant} file is missing from the data folder.",
                           code="not_found")
        return FileResponse(path, media_type=kind, filename=Path(path).name)

    app.include_router(api)
    add_cors(app, state.cors_origins)  # wraps every route: CORS headers on each answer, preflights answered
    add_page(app)  # the web page at /, without the key
    return app


def _admit(state: ServerState, video_id: str, checked, files: dict[str, bytes]) -> dict:
    """Queue the checked job (429 when the queue is full): its uploads written (the first frame the row's image,
    the last one named in its fields), its row committed, the worker woken; the video object."""
    with state.admit:
        queued = state.store.count("queued")
        if queued >= state.max_queue:
            raise ApiError(429, f"the queue is full ({queued} videos waiting, --max-queue {state.max_queue}); retry "
                                "once some have started.", code="queue_full")
        image_path = state.uploads / f"{video_id}.img" if "input_reference" in files else None
        last_path = state.uploads / f"{video_id}.last.img" if "last_image" in files else None
        ref_paths = [state.uploads / f"{video_id}.ref{i}.img" for i in range(len(files.get(REFERENCES, ())))]
        fields = checked.fields if last_path is None else {**checked.fields, LAST_IMAGE_KEY: str(last_path)}
        if ref_paths:
            fields = {**fields, REFERENCES_KEY: [str(p) for p in ref_paths]}
        try:
            for path, data in ((image_path, files.get("input_reference")), (last_path, files.get("last_image")),
                               *zip(ref_paths, files.get(REFERENCES, ()))):
                if path is not None:
                    _save_upload(data, path)
            job = state.store.add(id=video_id, model=state.model, prompt=checked.prompt, size=checked.size,
                                  seconds=checked.seconds, fields=fields,
                                  image=None if image_path is None else str(image_path))
        except BaseException:
            remove(image_path, last_path, *ref_paths)
            raise
    logger.info("video %s: queued (%s, %s s)", video_id, checked.size, checked.seconds)
    for worker in state.workers:
        worker.notify()
    return job.public(state.keep_s)
