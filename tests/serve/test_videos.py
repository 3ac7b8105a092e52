"""The official ``openai`` client against ``fastwan serve --model tiny`` on a loopback port: create and poll,
retrieve, list (limit / after / order), delete (queued, running, finished) and the content (the mp4 and its
thumbnail), each answer checked against what the request asked. The server: tests/serve/conftest.py."""
from __future__ import annotations

import io
import json
import re
import time
import urllib.request
from pathlib import Path

import imageio.v3 as iio
import pytest

from tests.serve.helpers import KEY, call, nearest_4k_plus_1, wait, wait_started

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # openai marks its Videos API deprecated
TINY_FPS = 8  # the tiny checkpoints' preset fps (docs/models.md)


def test_create_poll_download_list_delete(server):
    client = server.client()
    created = client.videos.create(prompt="a red ball bouncing", size="64x48", seconds="1",
                                   extra_body={"num_inference_steps": 2, "seed": 5, "negative_prompt": "blur"})
    assert created.object == "video" and created.status == "queued" and created.progress == 0
    assert created.id.startswith("video_") and len(created.id) == len("video_") + 32
    assert (created.size, created.seconds, created.model, created.prompt) == ("64x48", "1", "tiny",
                                                                            "a red ball bouncing")
    done = wait(client, created.id)
    assert done.status == "completed", done.error
    assert done.progress == 100 and done.completed_at >= done.created_at and done.error is None

    frames = iio.imread(io.BytesIO(client.videos.download_content(created.id).read()), extension=".mp4")
    assert frames.shape == (nearest_4k_plus_1(1 * TINY_FPS), 48, 64, 3)
    thumb = iio.imread(io.BytesIO(client.videos.download_content(created.id, variant="thumbnail").read()),
                       extension=".png")
    assert thumb.shape == (48, 64, 3)
    assert abs(thumb.astype(float) - frames[0].astype(float)).mean() < 20  # the first frame (the mp4 is lossy)

    assert created.id in [v.id for v in client.videos.list(limit=100).data]
    assert client.videos.retrieve(created.id).status == "completed"
    deleted = client.videos.delete(created.id)
    assert (deleted.id, deleted.deleted, deleted.object) == (created.id, True, "video.deleted")
    assert call("GET", f"{server.url}/v1/videos/{created.id}")[0] == 404
    assert not list((server.data_dir / "videos").glob(f"{created.id}*"))  # its files went with it


def test_list_pages_in_both_orders(server):
    client = server.client()
    ids = []
    for i in range(3):  # one at a time: the server queues one video at most (--max-queue 1)
        ids.append(client.videos.create(prompt=f"clip {i}", size="32x32", seconds="0.5",
                                        extra_body={"num_inference_steps": 1}).id)
        wait(client, ids[-1])
    pages, after = [], {}
    while True:  # the whole list, two at a time, oldest first
        page = client.videos.list(limit=2, order="asc", **after)
        pages.append([v.id for v in page.data])
        if not page.has_more:
            break
        after = {"after": page.last_id}
    ascending = [i for p in pages for i in p]
    assert len(pages) >= 2 and all(len(p) == 2 for p in pages[:-1]) and len(set(ascending)) == len(ascending)
    assert ascending[-3:] == ids  # the newest three, in creation order
    descending = [v.id for v in client.videos.list(limit=100).data]  # desc by default: newest first
    assert descending == ascending[::-1]
    status, body = call("GET", f"{server.url}/v1/videos?after=video_{'0' * 32}")
    assert status == 404 and body["error"]["param"] == "after"


def test_delete_queued_and_running_jobs(server):
    client = server.client()
    running = client.videos.create(prompt="a long one", size="64x64", seconds="1",
                                   extra_body={"num_inference_steps": 200})
    queued = client.videos.create(prompt="waits behind it", size="32x32", seconds="0.5",
                                  extra_body={"num_inference_steps": 1})
    assert wait(client, running.id, until=("in_progress",)).status == "in_progress"
    status, body = call("GET", f"{server.url}/v1/videos/{queued.id}/content")
    assert status == 409 and body["error"]["code"] == "video_not_ready"
    assert client.videos.delete(queued.id).deleted
    deadline = time.monotonic() + 60
    while client.videos.retrieve(running.id).progress < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert client.videos.delete(running.id).deleted
    after = client.videos.create(prompt="still serving", size="32x32", seconds="0.5",
                                 extra_body={"num_inference_steps": 1})
    assert wait(client, after.id).status == "completed"  # the worker stopped the deleted job and went on
    for gone in (queued.id, running.id):
        assert call("GET", f"{server.url}/v1/videos/{gone}")[0] == 404
        assert not list((server.data_dir / "videos").glob(f"*{gone}*"))  # no file, partial or whole
    assert f"video {running.id}: cancelled" in server.log.read_text()


def test_fastwan_fields_of_every_json_type_through_the_client(server):
    """The client sends extra_body as multipart text (lists as name[], objects as name[key]); each arrives typed."""
    client = server.client()
    created = client.videos.create(
        prompt="a kite", size="32x32", seconds="0.5",
        extra_body={"sampler": "euler", "timesteps": [1000, 500.5], "guidance_scale": 1.0, "flow_shift": 3,
                    "cache": {"type": "skip_steps", "steps": [1]}, "fps": 16, "seed": 2**63})
    assert created.seconds == "0.5"
    assert wait(client, created.id).status == "completed"
    frames = iio.imread(io.BytesIO(client.videos.download_content(created.id).read()), extension=".mp4")
    assert frames.shape == (nearest_4k_plus_1(0.5 * 16), 32, 32, 3)  # seconds at the request's own fps
    status, body = call("POST", f"{server.url}/v1/videos", {"prompt": "a kite", "timesteps": [1000, 1200]})
    assert status == 400 and body["error"]["param"] == "timesteps"


def test_the_server_makes_the_video_the_python_api_makes(server, tmp_path):
    """The same request through the server and through ``generate_video`` on the same checkpoint: equal frames."""
    from fastwan import VideoGenerator

    client = server.client()
    created = client.videos.create(prompt="a green tree", size="48x32", seconds="0.5",
                                   extra_body={"num_inference_steps": 3, "seed": 11, "guidance_scale": 4.0})
    assert wait(client, created.id).status == "completed"
    served = iio.imread(io.BytesIO(client.videos.download_content(created.id).read()), extension=".mp4")
    gen = VideoGenerator.from_pretrained("tiny", device="cpu")
    local = gen.generate_video("a green tree", width=48, height=32, num_frames=nearest_4k_plus_1(0.5 * TINY_FPS),
                               num_inference_steps=3, seed=11, guidance_scale=4.0, output_path=str(tmp_path / "v.mp4"))
    assert (served == iio.imread(local.video_path)).all()


def test_the_serving_guide_example_runs_as_written(server, tmp_path, monkeypatch):
    """docs/serving.md's Python block against this server, at a tiny size: it writes cat.mp4."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    block = re.search(r"^```python\n(.*?)^```$", text, re.S | re.M).group(1)
    for old, new in (('"http://127.0.0.1:8000/v1"', repr(server.url + "/v1")), ('"the key in key.txt"', repr(KEY)),
                     ('size="832x480", seconds="5"', 'size="32x32", seconds="0.5"'),
                     ('"num_inference_steps": 50', '"num_inference_steps": 1'), ("time.sleep(2)", "time.sleep(0.1)")):
        assert old in block, old
        block = block.replace(old, new)
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "docs/serving.md", "exec"), {})
    assert iio.imread(tmp_path / "cat.mp4").shape == (nearest_4k_plus_1(0.5 * TINY_FPS), 32, 32, 3)


def test_progress_events_stream_every_step_until_completed(server):
    """GET /v1/videos/{id}/events, opened while the video waits behind another: the video as it is, then one event
    per change, every denoising step included (progress 100*k//steps, at most 99, after step k), the last one the
    completed video."""
    client = server.client()
    steps = 20
    blocker = client.videos.create(prompt="a long night", size="32x32", seconds="0.5",
                                   extra_body={"num_inference_steps": 300})
    wait_started(client, blocker.id)
    created = client.videos.create(prompt="a slow dawn", size="32x32", seconds="0.5",
                                   extra_body={"num_inference_steps": steps})
    request = urllib.request.Request(f"{server.url}/v1/videos/{created.id}/events",
                                     headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        assert answer.headers["content-type"].startswith("text/event-stream")
        client.videos.delete(blocker.id)  # the stream is open: the video starts now
        events = [json.loads(line[len(b"data: "):]) for line in answer if line.startswith(b"data: ")]
    states = [(e["status"], e["progress"]) for e in events]
    running = [min(99, 100 * k // steps) for k in range(1, steps + 1)]
    assert states == [("queued", 0), ("in_progress", 0), *(("in_progress", p) for p in running), ("completed", 100)]
    assert all(e["id"] == created.id and e["object"] == "video" for e in events)
    assert call("GET", f"{server.url}/v1/videos/video_{'0' * 32}/events")[0] == 404


def test_metrics_in_prometheus_text(server):
    client = server.client()
    video = client.videos.create(prompt="counted", size="32x32", seconds="0.5", extra_body={"num_inference_steps": 3})
    assert wait(client, video.id).status == "completed"
    status, text = call("GET", f"{server.url}/metrics")
    assert status == 200
    samples = {}
    for line in text.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    listed = [v.status for v in client.videos.list(limit=100).data]
    for state in ("queued", "in_progress", "completed", "failed"):
        assert samples[f'fastwan_videos{{status="{state}"}}'] == listed.count(state)
    assert samples["fastwan_queue_depth"] == listed.count("queued")
    assert samples["fastwan_steps_total"] >= 3 and samples['fastwan_step_seconds{device="cpu"}'] > 0
    assert samples["fastwan_model_ready"] == 1
    assert call("GET", f"{server.url}/metrics", key=None)[0] == 401


def test_the_log_holds_lines_not_progress_bars(server):
    """The workers' generators draw no denoising or decoding bar into the server's log (progress goes to the
    store); one line per change of a job's state is there, a completion's with where its seconds went."""
    client = server.client()
    video = client.videos.create(prompt="a quiet log", size="32x32", seconds="0.5",
                                 extra_body={"num_inference_steps": 3})
    assert wait(client, video.id).status == "completed"
    log = server.log.read_text()
    assert re.search(rf"video {video.id}: completed \(text [\d.]+ s, steps [\d.]+ s, vae [\d.]+ s, file [\d.]+ s\)\n",
                     log), log[-2000:]
    assert "denoising" not in log and "decoding" not in log and "\r" not in log
