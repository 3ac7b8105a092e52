"""``GET /v1/videos/{id}/stream`` on a real ``fastwan serve`` of a tiny causal checkpoint (tests/serve/conftest.py):
the mp4 read while the video is made decodes to its first chunk's frames before the video is completed, and the
bytes sent end as the finished file, whose frames are those the same request makes in this process; a completed
video's stream is its file; the refusals (404 in OpenAI's shape, 409 for a queued video and for a model that is not
causal, 401 without the key); a video deleted while it streams, or a server that stops, ends the answer and leaves
no file of the video."""
from __future__ import annotations

import io
import signal
import time
import urllib.request

import imageio.v3 as iio
import numpy as np
import pytest

from tests.serve.helpers import KEY, call

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # openai marks its Videos API deprecated
FIRST_CHUNK = 9  # the tiny causal checkpoint's first chunk: 3 latent frames, 1 + 4 x 2 video frames
MOST_CHUNKS = 21  # the tiny DiT's rope_max_seq_len 64 holds 64 latent frames: 21 chunks of 3
TIMEOUT = 120.0  # seconds for anything the server is waited on to do (2 busy cores)


def frames_of(chunks: int) -> int:
    """The frame count of a video of ``chunks`` chunks: 9 frames, then 12 a chunk."""
    return FIRST_CHUNK + 12 * (chunks - 1)


def create(server, prompt: str, chunks: int, seed: int = 5) -> str:
    status, video = call("POST", f"{server.url}/v1/videos", {"prompt": prompt, "size": "32x32",
                                                             "num_frames": frames_of(chunks), "seed": seed})
    assert status == 200, video
    return video["id"]


def status_of(server, video_id: str) -> str | None:
    status, video = call("GET", f"{server.url}/v1/videos/{video_id}")
    return video["status"] if status == 200 else None


def wait_status(server, video_id: str, wanted: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while status_of(server, video_id) != wanted:
        assert time.monotonic() < deadline, f"video {video_id} never became {wanted}"
        time.sleep(0.05)


def open_stream(server, video_id: str):
    request = urllib.request.Request(f"{server.url}/v1/videos/{video_id}/stream",
                                     headers={"Authorization": f"Bearer {KEY}"})
    return urllib.request.urlopen(request, timeout=TIMEOUT)


def decoded(data: bytes) -> np.ndarray:
    """The frames of an mp4, or of the start of one (a fragmented mp4's prefix decodes to its whole fragments)."""
    try:
        return iio.imread(io.BytesIO(data), extension=".mp4")
    except Exception:  # noqa: BLE001 -- no whole frame yet (the header alone, or a part of the first fragment)
        return np.zeros((0, 32, 32, 3), np.uint8)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)


def test_a_causal_video_streams_while_it_is_made_and_ends_as_its_file(causal_server, tmp_path):
    from fastwan import GenerationRequest
    from fastwan.pipelines.generator import VideoGenerator
    from fastwan.pipelines.output import OutputTarget
    from fastwan.pipelines.stream_output import VideoStreamWriter

    prompt, chunks = "a red fox crossing fresh snow", 16
    video_id = create(causal_server, prompt, chunks, seed=11)
    wait_status(causal_server, video_id, "in_progress")
    early = None
    with open_stream(causal_server, video_id) as answer:
        assert answer.status == 200
        assert answer.headers["content-type"] == "video/mp4" and answer.headers["transfer-encoding"] == "chunked"
        sent = b""
        while data := answer.read1(1 << 16):
            sent += data
            if early is None and len(frames := decoded(sent)) >= FIRST_CHUNK:
                early = frames
                assert status_of(causal_server, video_id) == "in_progress"  # read before the video was completed
    assert early is not None
    assert status_of(causal_server, video_id) == "completed"
    status, content = call("GET", f"{causal_server.url}/v1/videos/{video_id}/content")
    assert status == 200 and sent == content  # the answer ended with the whole file
    final = decoded(content)
    assert len(final) == frames_of(chunks)
    assert np.array_equal(early, final[:len(early)])
    status, again = call("GET", f"{causal_server.url}/v1/videos/{video_id}/stream")  # a completed video: its file
    assert status == 200 and again == content

    # the frames are the same request's, made here without the server, through the same encoder (H.264 is lossy)
    gen = VideoGenerator.from_pretrained(str(causal_server.model), device="cpu")
    reference = gen.generate(GenerationRequest(prompt, height=32, width=32, num_frames=frames_of(chunks), seed=11,
                                               save_video=False, return_frames=True)).frames
    with VideoStreamWriter(OutputTarget(tmp_path, "reference.mp4", False), "reference.mp4", 8) as writer:
        writer.append(reference)
    expected = iio.imread(tmp_path / "reference.mp4")
    assert psnr(final, expected) > 45, (psnr(final, expected), psnr(final, reference))
    call("DELETE", f"{causal_server.url}/v1/videos/{video_id}")


def test_the_stream_refusals(causal_server, server):
    missing = f"{causal_server.url}/v1/videos/video_{'0' * 32}/stream"
    status, body = call("GET", missing)
    assert status == 404
    assert body["error"]["code"] == "not_found" and body["error"]["param"] == "video_id"
    assert body["error"]["type"] == "invalid_request_error" and "video_" in body["error"]["message"]
    assert call("GET", missing, key=None)[0] == 401

    client = server.client()  # the tiny model is not causal: its videos are not streamed while they are made
    video = client.videos.create(prompt="a slow river", size="32x32", seconds="1",
                                 extra_body={"num_inference_steps": 333})
    try:
        status, body = call("GET", f"{server.url}/v1/videos/{video.id}/stream")
    finally:
        client.videos.delete(video.id)
    assert status == 409 and body["error"]["code"] == "not_streamable", body
    assert "not causal" in body["error"]["message"]


def test_a_queued_video_waits_and_a_deleted_videos_stream_ends_without_a_file(causal_server):
    videos = causal_server.data_dir / "videos"
    running = create(causal_server, "a lighthouse at dusk", MOST_CHUNKS)
    queued = create(causal_server, "a lighthouse at dawn", 2)
    try:
        wait_status(causal_server, running, "in_progress")
        status, body = call("GET", f"{causal_server.url}/v1/videos/{queued}/stream")
        assert status == 409 and body["error"]["code"] == "video_not_ready", body
        assert "queued" in body["error"]["message"]
        with open_stream(causal_server, running) as answer:
            sent = b""
            while len(decoded(sent)) < FIRST_CHUNK:
                sent += answer.read1(1 << 16)
            assert list(videos.glob(f".{running}-*.mp4"))  # the growing file
            assert call("DELETE", f"{causal_server.url}/v1/videos/{running}")[0] == 200
            start = time.monotonic()
            answer.read()  # the answer ends (the video was far from its end)
            assert time.monotonic() - start < 30
        deadline = time.monotonic() + TIMEOUT
        while list(videos.glob(f"*{running}*")):
            assert time.monotonic() < deadline, list(videos.glob(f"*{running}*"))
            time.sleep(0.1)
    finally:
        for video_id in (running, queued):
            call("DELETE", f"{causal_server.url}/v1/videos/{video_id}")


def test_a_stopping_server_ends_the_stream_and_removes_the_partial_file(causal_server, tmp_path):
    from tests.serve.helpers import Server

    server = Server(tmp_path, "--model", str(causal_server.model)).start()
    try:
        video_id = create(server, "a train in the rain", MOST_CHUNKS)
        wait_status(server, video_id, "in_progress")
        with open_stream(server, video_id) as answer:
            sent = b""
            while len(decoded(sent)) < FIRST_CHUNK:
                sent += answer.read1(1 << 16)
            assert list(server.data_dir.glob(f"videos/.{video_id}-*.mp4"))  # the growing file
            server.stop()  # the job goes back to the queue at its next chunk
            answer.read()  # the answer ends
        assert server.process.returncode in (0, -signal.SIGTERM)  # uvicorn hands the signal back once stopped
        assert not list(server.data_dir.glob(f"videos/*{video_id}*"))
        assert "queued again (the server is stopping)" in server.log.read_text()
    finally:
        server.stop()
