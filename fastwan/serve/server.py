"""``fastwan serve``: its flags and its start.

Start: the load options are checked, the store opened and the jobs a former process left running queued again,
then the server binds at once (``/health`` answers) while the worker thread loads the model (``/ready`` and creates
answer 503 until it has); a model that fails to load stops the server, and the command reports why (one line for
a user error, exit code 2). With no flag it serves the tiny model on 127.0.0.1:8000 with its data in
``./fastwan-serve``. Bound to an address other than the loopback without ``--api-key-file``, it warns: anyone who
reaches the port can use the GPU.
"""
from __future__ import annotations

import ipaddress
import logging
from pathlib import Path

from fastwan.errors import InvalidArgument, MissingFileError

logger = logging.getLogger("fastwan.serve")

DEFAULT_DATA_DIR = "fastwan-serve"
SKIPPED_LOAD_FLAGS = ("model", "cfg_parallel")  # --model has its own default here; one process, one GPU per server


def _check_numbers(args) -> None:
    """The server's numeric flags in range (before anything starts)."""
    if not 0 <= args.port <= 65535:
        raise InvalidArgument(f"--port {args.port} must be in [0, 65535], e.g. 8000.")
    if args.keep_days is not None and not 0 < args.keep_days < float("inf"):
        raise InvalidArgument(f"--keep-days {args.keep_days} must be a positive number of days, e.g. 7.")
    for flag in ("max_queue", "max_upload_bytes", "max_image_pixels"):
        if getattr(args, flag) < 1:
            raise InvalidArgument(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be >= 1.")


def add_parser(sub) -> None:
    """The ``serve`` subcommand: the server's own flags, then every load option's flag (their help is the
    fields')."""
    from fastwan.fields import add_flags
    from fastwan.pipelines.load_options import LoadOptions

    p = sub.add_parser("serve", help="serve OpenAI's Videos API over HTTP (one model, a durable job queue)")
    p.add_argument("--model", default="tiny", help="Hub id, Diffusers-format folder, or a tiny model name (default: "
                                                   "tiny, which runs anywhere)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind; another than the loopback exposes the "
                                                       "server to the network (give --api-key-file)")
    p.add_argument("--port", type=int, default=8000, help="TCP port")
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR, metavar="DIR",
                   help="the job database (SQLite), the videos and the uploads; jobs and videos survive restarts")
    p.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="a file holding the API key clients send as 'Authorization: Bearer KEY' (default: no key)")
    p.add_argument("--max-queue", type=int, default=64, metavar="N",
                   help="queued videos at most; a create beyond it is answered 429")
    p.add_argument("--max-upload-bytes", type=int, default=20 << 20, metavar="BYTES",
                   help="the largest input_reference upload accepted (413 beyond)")
    p.add_argument("--max-image-pixels", type=int, default=4096 * 4096, metavar="PIXELS",
                   help="the most pixels (width x height) an uploaded image may decode to (413 beyond)")
    p.add_argument("--keep-days", type=float, default=None, metavar="DAYS",
                   help="delete finished videos (and their files) this many days after they finish; sets each "
                        "video's expires_at (default: keep them)")
    add_flags(p, LoadOptions, skip=SKIPPED_LOAD_FLAGS)


def read_key(path: str | None) -> str | None:
    """The API key in ``path`` (surrounding whitespace dropped), None without a path."""
    if path is None:
        return None
    file = Path(path).expanduser()
    if not file.is_file():
        raise MissingFileError(f"--api-key-file {path}: no such file; write the key into a file (e.g. "
                               "'openssl rand -hex 32 > key.txt') and pass its path.")
    key = file.read_text().strip()
    if not key:
        raise InvalidArgument(f"--api-key-file {path} is empty; write the key into it.")
    return key


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, key: str | None) -> str | None:
    """What to warn of when the server is reachable from other machines without a key (None: nothing)."""
    if key is not None or is_loopback(host):
        return None
    return (f"bound to {host} without --api-key-file: anyone who reaches this port can make videos on this machine; "
            "give --api-key-file or bind 127.0.0.1.")


def run(args) -> int:
    """Serve until SIGINT / SIGTERM: then stop accepting, stop the running job at its next step and queue it again
    (a job past its last step completes), exit."""
    from fastwan.fields import flag_values
    from fastwan.pipelines.load_options import LoadOptions

    _check_numbers(args)
    options = LoadOptions(**flag_values(args, LoadOptions))  # --model is this command's own flag, default tiny
    key = read_key(args.api_key_file)
    try:
        import uvicorn

        from fastwan.serve.app import ServerState, create_app
    except ImportError as exc:
        raise InvalidArgument(f"fastwan serve needs FastAPI and uvicorn ({exc}); install them with "
                              "pip install 'fastwan[serve]'.") from None
    from fastwan.serve.requests import Limits
    from fastwan.serve.store import JobStore
    from fastwan.serve.worker import Worker

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    warning = exposure_warning(args.host, key)
    if warning is not None:
        logger.warning(warning)
    data = Path(args.data_dir).expanduser()
    store = JobStore(data / "jobs.sqlite3")
    requeued = store.requeue()
    if requeued:
        logger.info("queued again after a restart: %s", ", ".join(requeued))
    worker = Worker(options, store, data, keep_s=None if args.keep_days is None else args.keep_days * 86400)
    state = ServerState(store, worker, args.model, key, args.max_queue,
                        Limits(max_upload_bytes=args.max_upload_bytes, max_image_pixels=args.max_image_pixels))
    server = uvicorn.Server(uvicorn.Config(create_app(state), host=args.host, port=args.port, log_level="info"))
    worker.on_load_failure = lambda: setattr(server, "should_exit", True)  # uvicorn's documented way to stop
    worker.start()
    try:  # until SIGINT / SIGTERM: stop accepting, finish the requests, stop the worker (the app's lifespan)
        server.run()
    finally:
        worker.stop(timeout=0)
    if worker.load_failure is not None:  # a user error is the command's one line; anything else a bug
        raise worker.load_failure
    return 0
