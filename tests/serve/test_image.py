"""Image-to-video through ``fastwan serve --model tiny-wan2.1-i2v``: the official client uploads the first frame as
``input_reference`` (multipart); uploads over the byte or pixel cap are 413, a file that is no image 400, and so
is a last frame (``last_image``), which this checkpoint does not take."""
from __future__ import annotations

import io

import imageio.v3 as iio
import numpy as np
import openai
import pytest
from PIL import Image

from tests.serve.helpers import Server, nearest_4k_plus_1, wait

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
MAX_BYTES, MAX_PIXELS = 64 * 1024, 100 * 100


def png(width: int, height: int, seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def capped_server(tmp_path_factory, model: str):
    """``fastwan serve --model MODEL`` with the upload caps MAX_BYTES and MAX_PIXELS, for a module's tests."""
    srv = Server(tmp_path_factory.mktemp(f"serve-{model}"), "--model", model, "--max-upload-bytes", str(MAX_BYTES),
                 "--max-image-pixels", str(MAX_PIXELS)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from capped_server(tmp_path_factory, "tiny-wan2.1-i2v")


def test_image_to_video_with_input_reference(server):
    client = server.client()
    created = client.videos.create(prompt="the picture comes alive", size="64x48", seconds="1",
                                   input_reference=("first.png", png(80, 60), "image/png"),
                                   extra_body={"num_inference_steps": 2, "seed": 1})
    done = wait(client, created.id)
    assert done.status == "completed", done.error
    frames = iio.imread(io.BytesIO(client.videos.download_content(created.id).read()), extension=".mp4")
    assert frames.shape == (nearest_4k_plus_1(8), 48, 64, 3)  # the tiny checkpoints' 8 fps
    assert not list((server.data_dir / "uploads").iterdir())  # the upload goes once its job is done


def test_uploads_over_the_caps_and_broken_images(server):
    client = server.client()
    before = [v.id for v in client.videos.list(limit=100).data]
    cases = [(png(120, 100), 413, "image_too_large"),  # 12,000 pixels > 10,000, a small file
             (png(90, 90) + b"\0" * MAX_BYTES, 413, "upload_too_large"),
             (b"not an image at all", 400, "invalid_image"),
             (png(64, 48)[:200], 400, "invalid_image")]  # a truncated PNG
    for data, status, code in cases:
        with pytest.raises(openai.APIStatusError) as exc:
            client.videos.create(prompt="x", size="64x48", input_reference=("f.png", data, "image/png"))
        assert exc.value.status_code == status and exc.value.body["code"] == code, exc.value.body
        assert exc.value.body["param"] == "input_reference"
    with pytest.raises(openai.BadRequestError) as exc:  # this checkpoint needs its first frame
        client.videos.create(prompt="x", size="64x48")
    assert exc.value.status_code == 400
    assert [v.id for v in client.videos.list(limit=100).data] == before  # nothing refused was queued


def test_a_last_frame_is_refused_by_a_first_frame_checkpoint(server):
    """Wan2.1-I2V conditions on the first frame only: an uploaded ``last_image`` is refused (400), nothing queued
    (first-last-frame videos: tests/serve/test_last_image.py)."""
    from openai.types import Video

    client = server.client()
    before = [v.id for v in client.videos.list(limit=100).data]
    files = [(key, (f"{key}.png", png(64, 48, seed), "image/png")) for seed, key in enumerate(("input_reference",
                                                                                              "last_image"))]
    with pytest.raises(openai.BadRequestError) as exc:
        client.post("/videos", cast_to=Video, body={"prompt": "x", "size": "64x48"}, files=files,
                    options={"headers": {"Content-Type": "multipart/form-data"}})
    assert exc.value.body["param"] == "last_image" and "first-last-frame checkpoint" in exc.value.body["message"]
    assert [v.id for v in client.videos.list(limit=100).data] == before
