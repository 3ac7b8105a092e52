"""Bounded load on the shared tiny server (it queues one video at most): creates from concurrent clients while
others poll. Every create is accepted or refused with 429; every accepted video completes; nothing refused appears
in the list; the status polls stay answered (their p99 latency is printed)."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.serve.helpers import call, wait

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
CLIENTS, CREATES_EACH = 8, 5


def test_concurrent_creates_are_accepted_or_429_and_none_is_lost(server):
    before = {v["id"] for v in call("GET", f"{server.url}/v1/videos?limit=100")[1]["data"]}
    accepted, refused, latencies = [], [], []
    lock, done = threading.Lock(), threading.Event()

    def creator(n: int) -> None:
        client = server.client()
        for i in range(CREATES_EACH):
            try:
                video = client.videos.create(prompt=f"load {n}.{i}", size="32x32", seconds="0.5",
                                             extra_body={"num_inference_steps": 1})
            except openai.RateLimitError as exc:
                assert exc.body["code"] == "queue_full"
                with lock:
                    refused.append(exc)
                time.sleep(0.05)
                continue
            with lock:
                accepted.append(video.id)

    def poller() -> None:
        while not done.is_set():
            with lock:
                ids = list(accepted)
            t0 = time.perf_counter()
            status = call("GET", f"{server.url}/v1/videos/{ids[-1]}" if ids else f"{server.url}/v1/videos?limit=5")[0]
            with lock:
                latencies.append(time.perf_counter() - t0)
            assert status == 200
            time.sleep(0.01)

    with ThreadPoolExecutor(CLIENTS + 2) as pool:
        polls = [pool.submit(poller) for _ in range(2)]
        for f in [pool.submit(creator, n) for n in range(CLIENTS)]:
            f.result()
        client = server.client()
        results = {video_id: wait(client, video_id, timeout=120).status for video_id in accepted}
        done.set()
        for f in polls:
            f.result()
    assert len(accepted) + len(refused) == CLIENTS * CREATES_EACH
    assert accepted and set(results.values()) == {"completed"}
    listed = {v["id"] for v in call("GET", f"{server.url}/v1/videos?limit=100")[1]["data"]} - before
    assert listed == set(accepted)  # every accepted job is there, nothing refused is
    latencies.sort()
    p99 = latencies[int(0.99 * (len(latencies) - 1))]
    print(f"\n{len(accepted)} accepted, {len(refused)} refused (429); {len(latencies)} polls, p99 {p99 * 1000:.1f} ms")
    assert p99 < 5.0
