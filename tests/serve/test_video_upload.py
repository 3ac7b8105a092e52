"""Video-to-video through ``fastwan serve``: the video comes as the uploaded file ``video`` beside ``strength``, and
the served video is the one ``generate_video`` makes from the same file; a video that is no video, over the byte or
pixel caps, or given as a path is refused before anything is queued, and the upload leaves with its job."""
from __future__ import annotations

import io

import imageio.v3 as iio
import numpy as np
import openai
import pytest
from openai.types import Video

from tests.serve.helpers import Server, call

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
ASK = {"prompt": "the same street at night", "size": "48x32", "strength": "0.6", "num_inference_steps": "5",
       "seed": "3"}


def mp4(frames: int = 9, height: int = 32, width: int = 48, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    iio.imwrite(buf, rng.integers(0, 256, (frames, height, width, 3), dtype=np.uint8), extension=".mp4", fps=8,
                codec="libx264")
    return buf.getvalue()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("serve-v2v"), "--max-video-bytes", "200000", "--max-video-pixels",
                 "20000").start()
    yield srv
    srv.stop()


def create(client, data: bytes, **fields) -> Video:
    return client.post("/videos", cast_to=Video, body={**ASK, **fields},
                       files=[("video", ("street.mp4", data, "video/mp4"))],
                       options={"headers": {"Content-Type": "multipart/form-data"}})


def refused(call_it) -> dict:
    with pytest.raises(openai.APIStatusError) as exc:
        call_it()
    return {"status": exc.value.status_code, **exc.value.body}


def test_the_served_video_is_the_python_api_video_of_the_same_file(server, tmp_path):
    from fastwan import VideoGenerator
    from tests.serve.helpers import wait

    client = server.client()
    data = mp4()
    done = wait(client, create(client, data).id)
    assert done.status == "completed", done.error
    served = iio.imread(io.BytesIO(client.videos.download_content(done.id).read()), extension=".mp4")
    assert not list((server.data_dir / "uploads").iterdir())  # the upload went with its job
    (tmp_path / "street.mp4").write_bytes(data)
    gen = VideoGenerator.from_pretrained("tiny", device="cpu")
    local = gen.generate_video(ASK["prompt"], video=str(tmp_path / "street.mp4"), strength=0.6, width=48, height=32,
                               num_inference_steps=5, seed=3, output_path=str(tmp_path / "v.mp4"))
    assert served.shape == (9, 32, 48, 3) and np.array_equal(served, iio.imread(local.video_path))


def test_bad_videos_are_refused_before_anything_is_queued(server):
    client = server.client()
    before = len(client.videos.list(limit=100).data)
    cases = [
        (lambda: create(client, b"not a video"), 400, "video"),
        (lambda: create(client, mp4(height=64, width=64)), 413, "video"),  # 9 x 4096 pixels: over 20,000
        (lambda: create(client, mp4(frames=8)), 400, None),  # 8 frames: not 4k+1
        (lambda: create(client, b"\0" * 200_001), 413, "video"),
    ]
    for attempt, status, param in cases:
        answer = refused(attempt)
        assert answer["status"] == status, answer
        if param is not None:
            assert answer["param"] == param, answer
    status, body = call("POST", f"{server.url}/v1/videos", {"prompt": "x", "video": "/etc/passwd"})
    assert status == 400 and body["error"]["param"] == "video" and "upload the video" in body["error"]["message"]
    status, body = call("POST", f"{server.url}/v1/videos", {"prompt": "x", "strength": 0.5})
    assert status == 400 and "without video" in body["error"]["message"]
    assert len(client.videos.list(limit=100).data) == before  # nothing was queued
    assert not list((server.data_dir / "uploads").iterdir())  # no refused upload stays
