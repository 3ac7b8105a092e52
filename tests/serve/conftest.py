"""One ``fastwan serve --model tiny --max-queue 1`` for the server's test modules (a server start costs seconds)."""
from __future__ import annotations

import pytest

from tests.serve.helpers import Server


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("serve-tiny"), "--max-queue", "1").start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def postgres():
    from tests.serve.pg import Postgres

    pg = Postgres().start()
    yield pg
    pg.stop()
