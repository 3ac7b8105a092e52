"""The job store in PostgreSQL (``fastwan serve --store postgresql://...``), which the API and worker processes of
several hosts share.

Rules: a worker claims the oldest claimable job in one statement whose row lock skips the rows other workers are
claiming (``FOR UPDATE SKIP LOCKED``), so two workers never claim one job; leases run on the database's clock, so
the hosts' clocks need not agree; the schema is created once, under an advisory lock, by whichever process comes
first. A connection that broke is opened again at the next call (the call that met the break fails).
"""
from __future__ import annotations

from fastwan.errors import InvalidArgument
from fastwan.serve.store import COLUMNS, STALE, JobStore, _job, schema

SCHEMA = (schema("BIGSERIAL PRIMARY KEY", "BIGINT", "DOUBLE PRECISION")
          + "CREATE INDEX IF NOT EXISTS jobs_status_seq ON jobs (status, seq);\n")
SCHEMA_LOCK = 0x66617374  # the advisory lock key that serializes the schema's creation


def redact(url: str) -> str:
    """``url`` without its password."""
    head, at, tail = url.rpartition("@")
    if not at:
        return url
    scheme, _, user = head.partition("://")
    return f"{scheme}://{user.split(':')[0]}@{tail}"


class PostgresStore(JobStore):
    """The jobs of the PostgreSQL database at ``url`` (a libpq URL, e.g. ``postgresql://fastwan@db/fastwan``)."""

    shared = True
    NOW = "EXTRACT(EPOCH FROM clock_timestamp())::double precision"

    def __init__(self, url: str):
        super().__init__()
        try:
            import psycopg
        except ImportError:
            raise InvalidArgument("--store postgresql://... needs the psycopg driver; install it with pip install "
                                  "'fastwan[postgres]'.") from None
        self.url, self._psycopg = url, psycopg
        self._db = self._connect()
        with self._db.transaction():
            self._db.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK,))
            self._db.execute(SCHEMA)

    def _connect(self):
        try:
            return self._psycopg.connect(self.url, autocommit=True, connect_timeout=10)
        except self._psycopg.OperationalError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise InvalidArgument(f"--store {redact(self.url)}: cannot connect ({first}); check the host, the "
                                  "port, the database and the user, and that the server runs.") from None

    def _execute(self, sql: str, args: tuple = ()):
        if self._db.closed or self._db.broken:
            self._db = self._connect()
        return self._db.execute(sql.replace("?", "%s"), args)

    def _claim_row(self, claim, model, lease_s):
        claimable = f"(status = 'queued' OR {STALE.format(now=self.NOW)})"
        inner, args = claimable, [lease_s]
        if model is not None:
            inner, args = inner + " AND model = ?", [*args, model]
        row = self._execute(
            f"UPDATE jobs SET status = 'in_progress', progress = 0, claim = ?, heartbeat_at = {self.NOW} "
            f"WHERE seq = (SELECT seq FROM jobs WHERE {inner} ORDER BY seq LIMIT 1 FOR UPDATE SKIP LOCKED) "
            f"RETURNING {', '.join(COLUMNS)}", (claim, *args)).fetchone()
        return None if row is None else _job(row)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def describe(self) -> str:
        return f"PostgreSQL {redact(self.url)}"
