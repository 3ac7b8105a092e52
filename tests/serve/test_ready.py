"""``/health`` and ``/ready`` in-process (uvicorn on a thread, no model): ready and creates answer 503 while the model
loads or after it failed to load, liveness answers 200 throughout; the warning for a server reachable without a key."""
from __future__ import annotations

import threading
import time

import pytest

from fastwan.serve.server import exposure_warning
from tests.serve.helpers import KEY, call, free_port


@pytest.fixture
def app_server(tmp_path):
    import uvicorn

    from fastwan.serve.app import ServerState, create_app
    from fastwan.serve.store import SqliteStore
    from fastwan.serve.worker import Worker

    store = SqliteStore(tmp_path / "jobs.sqlite3")
    worker = Worker(None, store, tmp_path)  # never started: its model is "loading"
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(ServerState(store, [worker], "tiny", KEY)), host="127.0.0.1",
                                           port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", worker
    server.should_exit = True
    thread.join(10)


def test_ready_is_503_until_the_model_loads_and_health_is_200(app_server):
    url, worker = app_server
    assert call("GET", url + "/health", key=None) == (200, {"status": "ok"})
    for method, path, body in (("GET", "/ready", None), ("POST", "/v1/videos", {"prompt": "a cat"})):
        status, answer = call(method, url + path, body)
        assert status == 503 and answer["error"]["code"] == "model_loading", answer
    worker.load_error = "model 'x' is not a folder that exists"
    status, answer = call("GET", url + "/ready")
    assert status == 503 and answer["error"]["code"] == "model_not_loaded"
    assert "model 'x' is not a folder" in answer["error"]["message"]
    assert call("GET", url + "/health", key=None)[0] == 200


def test_exposure_warning():
    assert exposure_warning("127.0.0.1", None) is None and exposure_warning("0.0.0.0", "k") is None
    assert "without --api-key-file" in exposure_warning("0.0.0.0", None)
    assert "without --api-key-file" in exposure_warning("192.168.1.4", None)


def test_a_bug_is_a_500_in_openai_shape_and_the_server_goes_on(app_server, monkeypatch):
    url, worker = app_server
    monkeypatch.setattr(worker, "ready", lambda: True)  # "loaded", but its generator is None: resolving fails
    status, answer = call("POST", url + "/v1/videos", {"prompt": "a cat"})
    assert status == 500 and answer["error"]["type"] == "server_error" and answer["error"]["code"] == "internal_error"
    assert "AttributeError" in answer["error"]["message"]
    assert call("GET", url + "/health", key=None)[0] == 200
