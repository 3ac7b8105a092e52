"""The job store: one SQLite database (WAL journal, synchronous FULL) in the server's data folder.

Rules: a job is committed before its creation is answered; jobs run in the order they were created (``seq``); at
start, a job left ``in_progress`` by a process that died is queued again (:meth:`JobStore.requeue`), so no accepted
job is lost; a job completes once (:meth:`JobStore.finish` changes only an ``in_progress`` row); a deleted job's
row is gone, and its files are removed by the caller; so are a finished job's past the retention
(:meth:`JobStore.expire`). Each method is one transaction on the store's connection,
under its lock (the routes' threads and the worker share it). A watcher (:meth:`JobStore.watch`) is called with
the job's row after each change this store commits to it (None once it is deleted), in commit order, starting
after the row :meth:`JobStore.watch` returns.
"""
from __future__ import annotations

import json
import math
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    status TEXT NOT NULL,
    progress INTEGER NOT NULL DEFAULT 0,
    created_at INTEGER NOT NULL,
    completed_at INTEGER,
    model TEXT NOT NULL,
    prompt TEXT NOT NULL,
    size TEXT NOT NULL,
    seconds TEXT NOT NULL,
    fields TEXT NOT NULL,
    image TEXT,
    video TEXT,
    thumbnail TEXT,
    error TEXT
)
"""
COLUMNS = ("seq", "id", "status", "progress", "created_at", "completed_at", "model", "prompt", "size", "seconds",
           "fields", "image", "video", "thumbnail", "error")


def new_id() -> str:
    """A video id: 'video_' and 128 random bits in hex."""
    return "video_" + secrets.token_hex(16)


@dataclass(frozen=True)
class Job:
    """One row. ``fields``: the GenerationRequest fields the client set (JSON form; the server adds the output and
    the image); ``image``: the uploaded first frame's file, or None; ``video`` / ``thumbnail``: the files of a
    completed job; ``error``: {"code", "message"} of a failed one."""

    seq: int
    id: str
    status: str
    progress: int
    created_at: int
    completed_at: int | None
    model: str
    prompt: str
    size: str
    seconds: str
    fields: dict
    image: str | None
    video: str | None
    thumbnail: str | None
    error: dict | None

    def public(self, keep_s: float | None = None) -> dict[str, Any]:
        """The OpenAI ``video`` object of this job; ``keep_s``: how long a finished video is kept (None: always),
        which sets ``expires_at``."""
        expires = None if keep_s is None or self.completed_at is None else self.completed_at + math.ceil(keep_s)
        return {"id": self.id, "object": "video", "model": self.model, "status": self.status,
                "progress": self.progress, "created_at": self.created_at, "completed_at": self.completed_at,
                "expires_at": expires, "prompt": self.prompt, "size": self.size, "seconds": self.seconds,
                "remixed_from_video_id": None, "error": self.error}


def _job(row: tuple) -> Job:
    values = dict(zip(COLUMNS, row))
    values["fields"] = json.loads(values["fields"])
    values["error"] = None if values["error"] is None else json.loads(values["error"])
    return Job(**values)


class JobStore:
    """The jobs of one data folder (``path``: the database file)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._watchers: dict[str, list[Callable[[Job | None], None]]] = {}
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # a committed job survives power loss too, not only a kill
        self._db.execute(SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _one(self, sql: str, args: tuple = ()) -> Job | None:
        row = self._db.execute(f"SELECT {', '.join(COLUMNS)} FROM jobs {sql}", args).fetchone()
        return None if row is None else _job(row)

    def watch(self, id: str, watcher: Callable[[Job | None], None]) -> Job | None:
        """Call ``watcher`` with the row after each change of the job ``id`` from now on; the row now (None: no
        such job). ``watcher`` runs under the store's lock: it must only hand the row on."""
        with self._lock:
            self._watchers.setdefault(id, []).append(watcher)
            return self._one("WHERE id = ?", (id,))

    def unwatch(self, id: str, watcher: Callable[[Job | None], None]) -> None:
        with self._lock:
            watchers = self._watchers.get(id, [])
            if watcher in watchers:
                watchers.remove(watcher)
            if not watchers:
                self._watchers.pop(id, None)

    def refresh(self, id: str) -> None:
        """Hand the job's row as it is now to its watchers (a change another process committed)."""
        with self._lock:
            self._changed(id)

    def _changed(self, id: str, job: Job | None = ...) -> None:
        """Hand the job's row (read now unless given) to its watchers; under the lock, after the commit."""
        watchers = self._watchers.get(id)
        if watchers:
            row = self._one("WHERE id = ?", (id,)) if job is ... else job
            for watcher in list(watchers):
                watcher(row)

    def add(self, *, id: str, model: str, prompt: str, size: str, seconds: str, fields: dict,
            image: str | None) -> Job:
        """A new queued job, committed."""
        with self._lock:
            self._db.execute(
                "INSERT INTO jobs (id, status, created_at, model, prompt, size, seconds, fields, image) "
                "VALUES (?, 'queued', ?, ?, ?, ?, ?, ?, ?)",
                (id, int(time.time()), model, prompt, size, seconds, json.dumps(fields), image))
            return self._one("WHERE id = ?", (id,))

    def get(self, id: str) -> Job | None:
        with self._lock:
            return self._one("WHERE id = ?", (id,))

    def count(self, status: str) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM jobs WHERE status = ?", (status,)).fetchone()[0]

    def counts(self) -> dict[str, int]:
        """Jobs by status."""
        with self._lock:
            return dict(self._db.execute("SELECT status, COUNT(*) FROM jobs GROUP BY status").fetchall())

    def page(self, limit: int, after: str | None, order: str) -> tuple[list[Job], bool] | None:
        """Up to ``limit`` jobs in creation order (``order`` "asc" or "desc"), after the job ``after``, and whether
        more follow; None when ``after`` names no job."""
        with self._lock:
            where, args = "", ()
            if after is not None:
                row = self._db.execute("SELECT seq FROM jobs WHERE id = ?", (after,)).fetchone()
                if row is None:
                    return None
                where, args = ("WHERE seq > ?" if order == "asc" else "WHERE seq < ?"), (row[0],)
            rows = self._db.execute(
                f"SELECT {', '.join(COLUMNS)} FROM jobs {where} ORDER BY seq {order.upper()} LIMIT ?",
                (*args, limit + 1)).fetchall()
        return [_job(r) for r in rows[:limit]], len(rows) > limit

    def claim(self) -> Job | None:
        """The oldest queued job, now ``in_progress`` (None: the queue is empty)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                job = self._one("WHERE status = 'queued' ORDER BY seq LIMIT 1")
                if job is not None:
                    self._db.execute("UPDATE jobs SET status = 'in_progress', progress = 0 WHERE id = ?", (job.id,))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            if job is None:
                return None
            job = self._one("WHERE id = ?", (job.id,))
            self._changed(job.id, job)
            return job

    def progress(self, id: str, percent: int) -> None:
        with self._lock:
            cur = self._db.execute("UPDATE jobs SET progress = ? WHERE id = ? AND status = 'in_progress'",
                                   (percent, id))
            if cur.rowcount:
                self._changed(id)

    def finish(self, id: str, *, video: str | None = None, thumbnail: str | None = None,
               error: dict | None = None) -> bool:
        """An ``in_progress`` job completed (its files) or failed (``error``); False when no such job runs (it was
        deleted meanwhile)."""
        status = "failed" if error is not None else "completed"
        with self._lock:
            cur = self._db.execute(
                "UPDATE jobs SET status = ?, progress = ?, completed_at = ?, video = ?, thumbnail = ?, error = ? "
                "WHERE id = ? AND status = 'in_progress'",
                (status, 100 if error is None else 0, int(time.time()), video, thumbnail,
                 None if error is None else json.dumps(error), id))
            if cur.rowcount:
                self._changed(id)
            return cur.rowcount == 1

    def release(self, id: str) -> bool:
        """An ``in_progress`` job back to ``queued`` (the server stops before it completes); False when none runs."""
        with self._lock:
            cur = self._db.execute("UPDATE jobs SET status = 'queued', progress = 0 WHERE id = ? AND "
                                   "status = 'in_progress'", (id,))
            if cur.rowcount:
                self._changed(id)
            return cur.rowcount == 1

    def delete(self, id: str) -> Job | None:
        """Remove the job ``id``; the row as it was, or None when there was none."""
        with self._lock:
            job = self._one("WHERE id = ?", (id,))
            if job is not None:
                self._db.execute("DELETE FROM jobs WHERE id = ?", (id,))
                self._changed(id, None)
            return job

    def expire(self, before: float) -> list[Job]:
        """Remove the completed and failed jobs that finished before the time ``before``; the rows removed (their
        files are the caller's to delete)."""
        with self._lock:
            rows = self._db.execute(f"SELECT {', '.join(COLUMNS)} FROM jobs WHERE status IN ('completed', 'failed') "
                                    "AND completed_at < ?", (before,)).fetchall()
            self._db.execute("DELETE FROM jobs WHERE status IN ('completed', 'failed') AND completed_at < ?",
                             (before,))
            jobs = [_job(r) for r in rows]
            for job in jobs:
                self._changed(job.id, None)
        return jobs

    def requeue(self) -> list[str]:
        """At start: the jobs a former process left ``in_progress`` queued again, in their order; their ids."""
        with self._lock:
            ids = [r[0] for r in self._db.execute("SELECT id FROM jobs WHERE status = 'in_progress' ORDER BY seq")]
            self._db.execute("UPDATE jobs SET status = 'queued', progress = 0 WHERE status = 'in_progress'")
            return ids
