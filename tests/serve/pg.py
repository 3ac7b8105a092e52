"""A throwaway PostgreSQL server for the shared store's tests: Debian's binaries, a new temporary folder, a free
loopback port, trust authentication for the user ``fastwan``; each test gets a database of its own."""
from __future__ import annotations

import glob
import os
import secrets
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.serve.helpers import free_port


def binaries() -> Path | None:
    """The newest installed PostgreSQL's bin folder (Debian's layout), or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    return Path(found[-1]).parent if found else None


class Postgres:
    """``start`` runs initdb and pg_ctl (as the ``postgres`` system user when this process is root, which initdb
    refuses to be); ``database`` makes a new empty database and returns its URL; ``stop`` ends the server and
    removes its folder."""

    def __init__(self):
        self.bin = binaries()
        if self.bin is None:
            pytest.skip("needs Debian's postgresql package (apt-get install postgresql; .ci/run installs it)")
        self.dir = Path(tempfile.mkdtemp(prefix="fastwan-pg-"))
        self.port = free_port()

    def _run(self, *argv) -> None:
        prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        done = subprocess.run(prefix + [str(a) for a in argv], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{argv[0]} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")

    def start(self) -> Postgres:
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres", "postgres")
        data = self.dir / "data"
        self._run(self.bin / "initdb", "-D", data, "-U", "fastwan", "--auth=trust", "-E", "UTF8")
        self._run(self.bin / "pg_ctl", "-D", data, "-l", self.dir / "server.log", "-w", "-t", "60", "-o",
                  f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1", "start")
        return self

    def database(self) -> str:
        import psycopg

        name = "t_" + secrets.token_hex(6)
        with psycopg.connect(f"postgresql://fastwan@127.0.0.1:{self.port}/postgres", autocommit=True) as db:
            db.execute(f"CREATE DATABASE {name}")
        return f"postgresql://fastwan@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        try:
            self._run(self.bin / "pg_ctl", "-D", self.dir / "data", "-m", "immediate", "stop")
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
