"""One ``fastwan serve --model tiny --max-queue 1`` for the server's test modules (a server start costs seconds), and
one of a tiny causal checkpoint for the streaming tests."""
from __future__ import annotations

import pytest

from tests.serve.helpers import Server


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("serve-tiny"), "--max-queue", "1").start()
    yield srv
    srv.stop()


def tiny_server(tmp_path_factory, variant: str, seed: int) -> Server:
    """A started ``fastwan serve --max-queue 4`` of a tiny checkpoint of ``variant`` written for it (its folder:
    the server's ``model``)."""
    from fastwan.checkpoint.tiny import write_tiny_checkpoint

    tmp = tmp_path_factory.mktemp(f"serve-{variant}")
    model = write_tiny_checkpoint(tmp / variant, variant, seed=seed)
    srv = Server(tmp, "--model", str(model), "--max-queue", "4").start()
    srv.model = model
    return srv


@pytest.fixture(scope="session")
def causal_server(tmp_path_factory):
    """``fastwan serve`` of a tiny causal checkpoint (FastVideo's layout: 3 latent frames, 9 then 12 video frames a
    chunk), for the streaming tests."""
    srv = tiny_server(tmp_path_factory, "sfwan2.1", 4)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def vace_server(tmp_path_factory):
    """``fastwan serve`` of a tiny Wan2.1-VACE checkpoint (diffusers' WanVACEPipeline layout), for the VACE tests."""
    srv = tiny_server(tmp_path_factory, "wan2.1-vace", 41)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def animate_server(tmp_path_factory):
    """``fastwan serve`` of a tiny Wan2.2-Animate checkpoint (diffusers' WanAnimatePipeline layout: 32x32, segments
    of 9 frames, 3 steps), for the Animate upload tests."""
    srv = tiny_server(tmp_path_factory, "wan2.2-animate", 43)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def postgres():
    from tests.serve.pg import Postgres

    pg = Postgres().start()
    yield pg
    pg.stop()
