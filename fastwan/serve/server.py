"""``fastwan serve``: its flags and its start.

Start: the flags and the load options are checked, the store opened (with SQLite, which one process uses, the jobs
a former process left running are queued again; a shared store requeues by lease), then the server binds at once
(``/health`` answers) while each worker thread loads its model (``/ready`` and creates answer 503 until all have);
a model that fails to load stops the server, and the command reports why (one line for a user error, exit code 2).
Roles: ``both`` (default) serves the API and runs the workers; ``api`` serves the API only (creates are checked by
the checkpoint's files, no weight loaded) and ``worker`` runs the workers only (no port): several hosts share one
PostgreSQL store (``--store``) and one ``--data-dir`` (videos and uploads). ``--gpus 0,1,...`` runs one worker per
GPU, each with its own copy of the model. With no flag it serves the tiny model on 127.0.0.1:8000 with its data in
``./fastwan-serve``. Bound to an address other than the loopback without ``--api-key-file``, it warns: anyone who
reaches the port can use the GPU.
"""
from __future__ import annotations

import ipaddress
import logging
from pathlib import Path

from fastwan.errors import InvalidArgument, MissingFileError
from fastwan.serve.cors import check_origins, cors_warning

logger = logging.getLogger("fastwan.serve")

DEFAULT_DATA_DIR = "fastwan-serve"
SKIPPED_LOAD_FLAGS = ("model", "num_gpus")  # --model has its own default here; --gpus and --sp place the workers
ROLES = ("both", "api", "worker")


def _check_numbers(args) -> None:
    """The server's numeric flags in range (before anything starts)."""
    if not 0 <= args.port <= 65535:
        raise InvalidArgument(f"--port {args.port} must be in [0, 65535], e.g. 8000.")
    if not 2 <= args.lease_seconds <= 86400:
        raise InvalidArgument(f"--lease-seconds {args.lease_seconds} must be in [2, 86400], e.g. 60 (a worker "
                              "silent that long is presumed dead, and its job runs elsewhere).")
    if args.keep_days is not None and not 0 < args.keep_days < float("inf"):
        raise InvalidArgument(f"--keep-days {args.keep_days} must be a positive number of days, e.g. 7.")
    for flag in ("max_queue", "max_upload_bytes", "max_image_pixels", "max_video_bytes", "max_video_pixels"):
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
                   help="the largest image upload accepted (input_reference, last_image; 413 beyond)")
    p.add_argument("--max-image-pixels", type=int, default=4096 * 4096, metavar="PIXELS",
                   help="the most pixels (width x height) an uploaded image may decode to (413 beyond)")
    p.add_argument("--max-video-bytes", type=int, default=256 << 20, metavar="BYTES",
                   help="the largest video upload accepted, for video-to-video (413 beyond)")
    p.add_argument("--max-video-pixels", type=int, default=1280 * 720 * 161, metavar="PIXELS",
                   help="the most pixels an uploaded video may decode to, all frames together (413 beyond)")
    p.add_argument("--keep-days", type=float, default=None, metavar="DAYS",
                   help="delete finished videos (and their files) this many days after they finish; sets each "
                        "video's expires_at (default: keep them)")
    p.add_argument("--store", default=None, metavar="URL",
                   help="the job store several hosts share: postgresql://USER[:PASSWORD]@HOST[:PORT]/DB (default: "
                        "SQLite in --data-dir, for one server process)")
    p.add_argument("--role", choices=ROLES, default="both",
                   help="both: the API and the workers; api: the API only; worker: the workers only (no port); "
                        "api and worker need a shared --store")
    p.add_argument("--gpus", default=None, metavar="LIST",
                   help="CUDA devices, one worker (and one copy of the model) each, e.g. 0,1,2,3 (default: one "
                        "worker on --device)")
    p.add_argument("--sp", type=int, default=None, metavar="N",
                   help="one worker whose N processes (one GPU each) make each video together (sequence "
                        "parallelism; add --cfg-parallel to split the CFG passes too)")
    p.add_argument("--lease-seconds", type=float, default=60.0, metavar="S",
                   help="a running job's lease, renewed every S/4 seconds; a job whose worker went silent that long "
                        "runs again on another worker")
    p.add_argument("--lora-dir", default=None, metavar="DIR",
                   help="a folder of LoRA files (NAME.safetensors) that a create may name in its lora field "
                        "(default: none)")
    p.add_argument("--cors-origin", action="append", default=None, metavar="ORIGIN",
                   help="a web origin (scheme://host[:port], e.g. https://app.example.com; '*' alone for any) whose "
                        "pages may call the API from a browser; repeatable (default: none, CORS off)")
    add_flags(p, LoadOptions, skip=SKIPPED_LOAD_FLAGS)


def parse_gpus(text: str | None, device: str | None) -> list[str] | None:
    """The devices of ``--gpus`` (None: not given): distinct CUDA indices that this machine has."""
    if text is None:
        return None
    if device is not None:
        raise InvalidArgument(f"--gpus {text} and --device {device}: give one (--gpus places one worker per GPU).")
    items = [t.strip() for t in text.split(",")]
    if not items or not all(t.isdigit() for t in items) or len(set(items)) != len(items):
        raise InvalidArgument(f"--gpus {text!r} must list distinct CUDA device indices, e.g. 0,1,2,3.")
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    missing = [t for t in items if int(t) >= have]
    if missing:
        raise InvalidArgument(f"--gpus {text}: this machine has {have} CUDA device(s), so there is no GPU "
                              f"{', '.join(missing)}; list indices below {have} (nvidia-smi -L lists them).")
    return [f"cuda:{int(t)}" for t in items]


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


def open_store(url: str | None, data_dir: Path):
    """The store ``--store`` names: None, the SQLite file in ``data_dir``; ``postgresql://...``, that database."""
    from fastwan.serve.store import SqliteStore

    if url is None:
        return SqliteStore(Path(data_dir) / "jobs.sqlite3")
    if url.startswith(("postgresql://", "postgres://")):
        from fastwan.serve.postgres import PostgresStore

        return PostgresStore(url)
    raise InvalidArgument(f"--store {url.split('@')[-1]!r} is not a PostgreSQL URL; give postgresql://USER@HOST/DB "
                          "(several hosts share it), or leave --store out for SQLite in --data-dir.")


def run(args) -> int:
    """Serve until SIGINT / SIGTERM: then stop accepting, stop the running jobs at their next step and queue them
    again (a job past its last step completes), exit."""
    import dataclasses

    from fastwan.fields import flag_values
    from fastwan.pipelines.load_options import LoadOptions

    _check_numbers(args)
    if args.sp is not None and args.gpus is not None:
        raise InvalidArgument(f"--gpus {args.gpus} and --sp {args.sp}: give one (--gpus: a worker per GPU; --sp: "
                              "one worker whose processes share each video).")
    if args.cfg_parallel and args.sp is None:
        raise InvalidArgument("--cfg-parallel splits the CFG passes of one worker's processes: give --sp N too.")
    # --model is this command's own flag (default tiny); --sp is the load options' num_gpus
    options = LoadOptions(**flag_values(args, LoadOptions), num_gpus=args.sp)
    devices = parse_gpus(args.gpus, options.device)
    if args.role != "both" and args.store is None:
        raise InvalidArgument(f"--role {args.role} needs a shared store: give --store postgresql://... (SQLite in "
                              "--data-dir serves one process, which is --role both).")
    key = read_key(args.api_key_file)
    origins = check_origins(args.cors_origin)
    from fastwan.serve.loras import ServedLoras

    loras = ServedLoras(args.lora_dir)
    try:
        import uvicorn

        from fastwan.serve.app import ServerState, create_app
    except ImportError as exc:
        raise InvalidArgument(f"fastwan serve needs FastAPI and uvicorn ({exc}); install them with "
                              "pip install 'fastwan[serve]'.") from None
    from fastwan.serve.requests import Limits
    from fastwan.serve.worker import Worker

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    warning = exposure_warning(args.host, key) if args.role != "worker" else None
    if warning is not None:
        logger.warning(warning)
    if cors_warning(origins, key) is not None:
        logger.warning(cors_warning(origins, key))
    data = Path(args.data_dir).expanduser()
    store = open_store(args.store, data)
    logger.info("jobs in %s; files in %s", store.describe(), data)
    if not store.shared:
        requeued = store.requeue()
        if requeued:
            logger.info("queued again after a restart: %s", ", ".join(requeued))
    keep_s = None if args.keep_days is None else args.keep_days * 86400
    workers = []
    if args.role != "api":
        placed = [(d, dataclasses.replace(options, device=d)) for d in devices] if devices else [
            (options.device or "default", options)]
        workers = [Worker(o, store, data, keep_s=keep_s, model=args.model, name=d, lease_s=args.lease_seconds,
                          loras=loras) for d, o in placed]
    if args.role == "worker":
        return _run_workers(workers)
    rules = None if workers else _rules(options)
    state = ServerState(store, workers, args.model, key, args.max_queue,
                        Limits(max_upload_bytes=args.max_upload_bytes, max_image_pixels=args.max_image_pixels,
                               max_video_bytes=args.max_video_bytes, max_video_pixels=args.max_video_pixels),
                        data_dir=data, keep_s=keep_s, rules=rules, lease_s=args.lease_seconds,
                        loras=loras, cors_origins=origins)
    server = uvicorn.Server(uvicorn.Config(create_app(state), host=args.host, port=args.port, log_level="info"))
    server.handle_exit = _closing(state, server.handle_exit)
    for worker in workers:
        worker.on_load_failure = lambda: setattr(server, "should_exit", True)  # uvicorn's documented way to stop
        worker.start()
    try:  # until SIGINT / SIGTERM: stop accepting, finish the requests, stop the workers (the app's lifespan)
        server.run()
    finally:
        for worker in workers:
            worker.stop(timeout=0)
    for worker in workers:
        if worker.load_failure is not None:  # a user error is the command's one line; anything else a bug
            raise worker.load_failure
    return 0


def _closing(state, handle_exit):
    """uvicorn's signal handler, which first marks the server closing: uvicorn waits for every open answer to end
    before the workers stop, so the video streams end at once (their videos go back to the queue)."""
    def handle(sig, frame) -> None:
        state.closing.set()
        handle_exit(sig, frame)
    return handle


def _rules(options):
    """The checkpoint's request rules from its files (``--role api``: no model loads here)."""
    from fastwan.checkpoint.causal_files import causal_checkpoint
    from fastwan.checkpoint.resolver import resolve
    from fastwan.pipelines.rules import CheckpointRules

    # a causal generator file is read here too: its recipe decides which requests a causal model takes
    ckpt = causal_checkpoint(resolve(options.model, allow_pickle=options.allow_pickle, revision=options.revision),
                             options)
    return CheckpointRules.of(ckpt, options.cache)


def _run_workers(workers) -> int:
    """``--role worker``: run the workers until SIGINT / SIGTERM, then stop them (their running jobs go back to the
    queue at their next step) and exit; a model that fails to load ends the command with its error."""
    import signal
    import threading

    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    for worker in workers:
        worker.on_load_failure = done.set
        worker.start()
    while not done.wait(1.0):  # a timed wait: the signal handlers run between waits
        pass
    for worker in workers:
        worker.stop(timeout=0)
    for worker in workers:
        worker.stop(timeout=60)
        if worker.load_failure is not None:
            raise worker.load_failure
    logger.info("workers stopped")
    return 0
