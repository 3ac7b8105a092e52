"""A real ``fastwan serve`` process on a free loopback port, for the server's tests, and plain HTTP calls to it."""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

KEY = "test-key-0123456789abcdef"
START_TIMEOUT = 150.0  # seconds for the interpreter, torch, the tiny checkpoint and the model load on 2 busy cores


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(method: str, url: str, body: bytes | dict | None = None, *, key: str | None = KEY,
         content_type: str = "application/json", timeout: float = 30.0) -> tuple[int, dict | bytes]:
    """(status, the parsed JSON answer or its bytes) of one request; a dict ``body`` is sent as JSON."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    request = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        request.add_header("Content-Type", content_type)
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            status, raw, kind = answer.status, answer.read(), answer.headers.get("content-type", "")
    except urllib.error.HTTPError as exc:
        status, raw, kind = exc.code, exc.read(), exc.headers.get("content-type", "")
    return status, json.loads(raw) if kind.startswith("application/json") else raw


def stop_process(process: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 20) -> None:
    """Send ``sig`` to ``process`` if it runs, and wait for it; killed when it still runs ``timeout`` s later."""
    if process.poll() is None:
        process.send_signal(sig)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class Server:
    """``python -m fastwan serve`` with ``args`` on a free port, its data in ``data_dir``, its output in
    ``data_dir``/../server.log; :meth:`start` waits until /ready answers 200."""

    def __init__(self, tmp: Path, *args: str, data_dir: Path | None = None, key: str | None = KEY):
        self.tmp, self.args, self.key = Path(tmp), list(args), key
        self.data_dir = data_dir or self.tmp / "data"
        self.log = self.tmp / "server.log"
        self.port = None
        self.process = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Server:
        self.port = free_port()
        argv = [sys.executable, "-m", "fastwan", "serve", "--port", str(self.port), "--data-dir", str(self.data_dir),
                "--device", "cpu", *self.args]
        if self.key is not None:
            key_file = self.tmp / "key.txt"
            key_file.write_text(self.key + "\n")
            argv += ["--api-key-file", str(key_file)]
        log = open(self.log, "ab")
        self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.tmp)
        log.close()
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited ({self.process.returncode}):\n{self.log.read_text()}")
            try:
                if call("GET", self.url + "/ready", key=self.key, timeout=5)[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"the server was not ready in {START_TIMEOUT} s:\n{self.log.read_text()}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process is not None:
            stop_process(self.process, sig, timeout=20)

    def client(self, key: str | None = None):
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key=key or self.key or "unused", max_retries=0, timeout=30)


def wait(client, video_id: str, timeout: float = 90.0, until=("completed", "failed")):
    """The video once its status is in ``until`` (polled through the openai client)."""
    deadline = time.monotonic() + timeout
    while True:
        video = client.videos.retrieve(video_id)
        if video.status in until or time.monotonic() > deadline:
            return video
        time.sleep(0.1)


def wait_started(client, video_id: str, timeout: float = 60.0) -> None:
    """Return once the video has run a denoising step (its progress at least 1), or ``timeout`` passed."""
    deadline = time.monotonic() + timeout
    while client.videos.retrieve(video_id).progress < 1 and time.monotonic() < deadline:
        time.sleep(0.05)


def nearest_4k_plus_1(target: float) -> int:
    """The reference of the seconds rule: of the frame counts 1, 5, 9, ..., the one nearest ``target`` (the larger
    on a tie), by search."""
    counts = range(1, 4 * int(target) + 10, 4)
    return min(counts, key=lambda n: (abs(n - target), -n))
