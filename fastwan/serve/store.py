"""The job store: SQLite in the server's data folder (:class:`SqliteStore`, one server process) or a PostgreSQL
database that several hosts share (:mod:`fastwan.serve.postgres`); :func:`fastwan.serve.server.open_store` picks
one from ``--store``.

Rules: a job is committed before its creation is answered; jobs run in the order they were created (``seq``); a
worker claims a job atomically and holds it by a lease: the claim's token is written in the row and its
``heartbeat_at`` (the database's clock) renewed while the job runs; a job whose lease lapsed (its worker died) is
claimed again like a queued one, so no accepted job is lost. Only the claim that holds a job changes it (progress,
finish, release): a job completes once, and a worker that lost its job learns it at its next write. A deleted
job's row is gone, and its files are removed by the caller; so are a finished job's past the retention
(:meth:`JobStore.expire`). Each method is one transaction on the store's connection, under its lock (the routes'
threads and the workers share it). A watcher (:meth:`JobStore.watch`) is called with the job's row after each
change this store commits to it (None once it is deleted), in commit order, starting after the row
:meth:`JobStore.watch` returns.
"""
from __future__ import annotations

import fcntl
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

from fastwan.errors import InvalidArgument

# the jobs table: each column and its type, "{seq}" / "{int}" / "{real}" being the dialect's (:func:`schema`)
TABLE = (("seq", "{seq}"), ("id", "TEXT NOT NULL UNIQUE"), ("status", "TEXT NOT NULL"),
         ("progress", "INTEGER NOT NULL DEFAULT 0"), ("created_at", "{int} NOT NULL"), ("completed_at", "{int}"),
         ("model", "TEXT NOT NULL"), ("prompt", "TEXT NOT NULL"), ("size", "TEXT NOT NULL"),
         ("seconds", "TEXT NOT NULL"), ("fields", "TEXT NOT NULL"), ("image", "TEXT"), ("video", "TEXT"),
         ("thumbnail", "TEXT"), ("error", "TEXT"), ("claim", "TEXT"), ("heartbeat_at", "{real}"))
COLUMNS = tuple(name for name, _ in TABLE)
SELECT = f"SELECT {', '.join(COLUMNS)} FROM jobs"
STALE = "(status = 'in_progress' AND heartbeat_at < {now} - ?)"  # a job whose worker stopped renewing its lease


def new_id() -> str:
    """A video id: 'video_' and 128 random bits in hex."""
    return "video_" + secrets.token_hex(16)


def new_claim(owner: str) -> str:
    """A claim token: ``owner`` (who claims: host, process, worker) and 64 random bits."""
    return f"{owner}/{secrets.token_hex(8)}"


@dataclass(frozen=True)
class Job:
    """One row. ``fields``: the GenerationRequest fields the client set (JSON form; the server adds the output and
    the image); ``image``: the uploaded first frame's file, or None; ``video`` / ``thumbnail``: the files of a
    completed job; ``error``: {"code", "message"} of a failed one; ``claim``: the token of the worker's claim
    that runs or ran it; ``heartbeat_at``: when that claim was last renewed (the database's clock, seconds)."""

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
    claim: str | None = None
    heartbeat_at: float | None = None

    def public(self, keep_s: float | None = None) -> dict[str, Any]:
        """The OpenAI ``video`` object of this job; ``keep_s``: how long a finished video is kept (None: always),
        which sets ``expires_at``."""
        expires = None if keep_s is None or self.completed_at is None else self.completed_at + math.ceil(keep_s)
        return {"id": self.id, "object": "video", "model": self.model, "status": self.status,
                "progress": self.progress, "created_at": self.created_at, "completed_at": self.completed_at,
                "expires_at": expires, "prompt": self.prompt, "size": self.size, "seconds": self.seconds,
                "remixed_from_video_id": None, "error": self.error}


def _job(row) -> Job:
    values = dict(zip(COLUMNS, row))
    values["fields"] = json.loads(values["fields"])
    values["error"] = None if values["error"] is None else json.loads(values["error"])
    return Job(**values)


class JobStore:
    """The jobs table over a DB-API connection; subclasses give the connection, the schema, the clock and the
    claim. SQL here uses ``?`` placeholders (:meth:`_sql` turns them into the driver's)."""

    shared = False  # several processes may use the store at once (then no start may requeue what runs)
    NOW = ""  # the database's clock, in seconds since the epoch, as an SQL expression

    def __init__(self):
        self._lock = threading.Lock()
        self._watchers: dict[str, list[Callable[[Job | None], None]]] = {}

    # the driver's part
    def _execute(self, sql: str, args: tuple = ()):
        raise NotImplementedError

    def _claim_row(self, claim: str, model: str | None, lease_s: float):
        """Under the lock: the oldest claimable job (queued, or stale past ``lease_s``) of ``model`` (None: any),
        now ``in_progress`` under ``claim``, its row; None when there is none."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def describe(self) -> str:
        """Where the store is, for the log (no password)."""
        raise NotImplementedError

    # the shared part
    def _one(self, where: str, args: tuple = ()) -> Job | None:
        row = self._execute(f"{SELECT} {where}", args).fetchone()
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
            self._execute(
                "INSERT INTO jobs (id, status, progress, created_at, model, prompt, size, seconds, fields, image) "
                "VALUES (?, 'queued', 0, ?, ?, ?, ?, ?, ?, ?)",
                (id, int(time.time()), model, prompt, size, seconds, json.dumps(fields), image))
            return self._one("WHERE id = ?", (id,))

    def get(self, id: str) -> Job | None:
        with self._lock:
            return self._one("WHERE id = ?", (id,))

    def count(self, status: str) -> int:
        with self._lock:
            return self._execute("SELECT COUNT(*) FROM jobs WHERE status = ?", (status,)).fetchone()[0]

    def counts(self) -> dict[str, int]:
        """Jobs by status."""
        with self._lock:
            return dict(self._execute("SELECT status, COUNT(*) FROM jobs GROUP BY status").fetchall())

    def page(self, limit: int, after: str | None, order: str) -> tuple[list[Job], bool] | None:
        """Up to ``limit`` jobs in creation order (``order`` "asc" or "desc"), after the job ``after``, and whether
        more follow; None when ``after`` names no job."""
        with self._lock:
            where, args = "", ()
            if after is not None:
                row = self._execute("SELECT seq FROM jobs WHERE id = ?", (after,)).fetchone()
                if row is None:
                    return None
                where, args = ("WHERE seq > ?" if order == "asc" else "WHERE seq < ?"), (row[0],)
            direction = "ASC" if order == "asc" else "DESC"
            rows = self._execute(f"{SELECT} {where} ORDER BY seq {direction} LIMIT ?", (*args, limit + 1)).fetchall()
        return [_job(r) for r in rows[:limit]], len(rows) > limit

    def claim(self, owner: str = "worker", model: str | None = None, lease_s: float = 60.0) -> Job | None:
        """The oldest queued job of ``model`` (None: any model), or one whose worker let its lease of ``lease_s``
        seconds lapse, now ``in_progress`` under a new claim token (the job's ``claim``); None: nothing to run."""
        with self._lock:
            job = self._claim_row(new_claim(owner), model, lease_s)
            if job is not None:
                self._changed(job.id, job)
            return job

    def heartbeat(self, id: str, claim: str) -> bool:
        """Renew the lease of the claim ``claim`` on the job ``id``; False when the claim no longer holds it (the job
        was deleted, or claimed again after the lease lapsed)."""
        with self._lock:
            return self._execute(f"UPDATE jobs SET heartbeat_at = {self.NOW} WHERE id = ? AND claim = ? AND "
                                 "status = 'in_progress'", (id, claim)).rowcount == 1

    def progress(self, id: str, claim: str, percent: int) -> bool:
        """The job's progress, its lease renewed; False when the claim no longer holds it."""
        with self._lock:
            held = self._execute(f"UPDATE jobs SET progress = ?, heartbeat_at = {self.NOW} WHERE id = ? AND "
                                 "claim = ? AND status = 'in_progress'", (percent, id, claim)).rowcount == 1
            if held:
                self._changed(id)
            return held

    def finish(self, id: str, claim: str, *, video: str | None = None, thumbnail: str | None = None,
               error: dict | None = None) -> bool:
        """The job held by ``claim`` completed (its files) or failed (``error``); False when the claim no longer
        holds it (deleted, or claimed again), which then changes nothing."""
        status = "failed" if error is not None else "completed"
        with self._lock:
            done = self._execute(
                "UPDATE jobs SET status = ?, progress = ?, completed_at = ?, video = ?, thumbnail = ?, error = ? "
                "WHERE id = ? AND claim = ? AND status = 'in_progress'",
                (status, 100 if error is None else 0, int(time.time()), video, thumbnail,
                 None if error is None else json.dumps(error), id, claim)).rowcount == 1
            if done:
                self._changed(id)
            return done

    def release(self, id: str, claim: str) -> bool:
        """The job held by ``claim`` back to ``queued`` (its worker stops before it completes); False when the
        claim no longer holds it."""
        with self._lock:
            done = self._execute("UPDATE jobs SET status = 'queued', progress = 0, claim = NULL WHERE id = ? AND "
                                 "claim = ? AND status = 'in_progress'", (id, claim)).rowcount == 1
            if done:
                self._changed(id)
            return done

    def delete(self, id: str) -> Job | None:
        """Remove the job ``id``; the row as it was, or None when there was none."""
        with self._lock:
            job = self._one("WHERE id = ?", (id,))
            if job is not None and self._execute("DELETE FROM jobs WHERE id = ?", (id,)).rowcount == 1:
                self._changed(id, None)
                return job
            return None

    def expire(self, before: float) -> list[Job]:
        """Remove the completed and failed jobs that finished before the time ``before``; the rows removed (their
        files are the caller's to delete)."""
        with self._lock:
            rows = self._execute(f"{SELECT} WHERE status IN ('completed', 'failed') AND completed_at < ?",
                                 (before,)).fetchall()
            jobs = [_job(r) for r in rows]
            for job in jobs:
                if self._execute("DELETE FROM jobs WHERE id = ?", (job.id,)).rowcount == 1:
                    self._changed(job.id, None)
        return jobs

    def running_claims(self) -> set[str]:
        """The claim tokens of the jobs in progress (their files are being written)."""
        with self._lock:
            return {r[0] for r in self._execute("SELECT claim FROM jobs WHERE status = 'in_progress'").fetchall()
                    if r[0] is not None}

    def beat(self, owner: str, model: str) -> None:
        """The worker ``owner`` (serving ``model``) is alive now."""
        with self._lock:
            self._execute(f"INSERT INTO workers (name, model, heartbeat_at) VALUES (?, ?, {self.NOW}) ON CONFLICT "
                          "(name) DO UPDATE SET model = excluded.model, heartbeat_at = excluded.heartbeat_at",
                          (owner, model))

    def gone(self, owner: str) -> None:
        """The worker ``owner`` stopped."""
        with self._lock:
            self._execute("DELETE FROM workers WHERE name = ?", (owner,))

    def live_workers(self, model: str, lease_s: float) -> int:
        """How many workers of ``model`` were alive within the last ``lease_s`` seconds."""
        with self._lock:
            return self._execute(f"SELECT COUNT(*) FROM workers WHERE model = ? AND heartbeat_at >= {self.NOW} - ?",
                                 (model, lease_s)).fetchone()[0]

    def requeue(self) -> list[str]:
        """At the start of the only process that uses the store: the jobs a former process left ``in_progress``
        queued again, in their order; their ids."""
        if self.shared:
            raise RuntimeError("a shared store requeues by lease, never at a start")
        with self._lock:
            ids = [r[0] for r in self._execute("SELECT id FROM jobs WHERE status = 'in_progress' ORDER BY seq")]
            self._execute("UPDATE jobs SET status = 'queued', progress = 0, claim = NULL WHERE status = 'in_progress'")
            for id in ids:
                self._changed(id)
            return ids


def schema(seq: str, integer: str, real: str) -> str:
    """The tables' DDL in a dialect: ``seq`` the auto-numbered key's type, ``integer`` a 64-bit integer's,
    ``real`` a double's."""
    columns = ",\n    ".join(f"{name} {kind.format(seq=seq, int=integer, real=real)}" for name, kind in TABLE)
    return (f"CREATE TABLE IF NOT EXISTS jobs (\n    {columns}\n);\n"
            f"CREATE TABLE IF NOT EXISTS workers (name TEXT PRIMARY KEY, model TEXT NOT NULL, heartbeat_at {real} "
            "NOT NULL);\n")


SQLITE_SCHEMA = schema("INTEGER PRIMARY KEY AUTOINCREMENT", "INTEGER", "REAL")


class SqliteStore(JobStore):
    """The jobs of one data folder (``path``: the database file; WAL journal, synchronous FULL, so a committed job
    survives a kill and a power loss). One server process uses it."""

    NOW = "((julianday('now') - 2440587.5) * 86400.0)"

    def __init__(self, path: str | Path):
        super().__init__()
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._owner = open(self.path.with_name(self.path.name + ".lock"), "a")  # held while this store is open
        try:
            fcntl.flock(self._owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._owner.close()
            raise InvalidArgument(f"{self.path} is in use by another fastwan serve; stop it, give this one another "
                                  "--data-dir, or share jobs between processes with --store postgresql://...") from None
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(SQLITE_SCHEMA)
        have = {r[1] for r in self._db.execute("PRAGMA table_info(jobs)")}
        for name, kind in (("claim", "TEXT"), ("heartbeat_at", "REAL")):  # a store written before leases
            if name not in have:
                self._db.execute(f"ALTER TABLE jobs ADD COLUMN {name} {kind}")

    def _execute(self, sql: str, args: tuple = ()):
        return self._db.execute(sql, args)

    def _claim_row(self, claim, model, lease_s):
        self._db.execute("BEGIN IMMEDIATE")
        try:
            where = f"(status = 'queued' OR {STALE.format(now=self.NOW)})"
            args: tuple = (lease_s,)
            if model is not None:
                where, args = where + " AND model = ?", (*args, model)
            job = self._one(f"WHERE {where} ORDER BY seq LIMIT 1", args)
            if job is not None:
                self._db.execute(f"UPDATE jobs SET status = 'in_progress', progress = 0, claim = ?, "
                                 f"heartbeat_at = {self.NOW} WHERE id = ?", (claim, job.id))
                job = self._one("WHERE id = ?", (job.id,))
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        return job

    def close(self) -> None:
        with self._lock:
            self._db.close()
            self._owner.close()

    def describe(self) -> str:
        return f"SQLite {self.path}"
