"""VACE through ``fastwan serve``: the control video, the mask and the reference images come as the multipart files
``video``, ``mask`` and ``reference_images`` (repeated) beside ``conditioning_scale``, and the served video is the
one ``generate_video`` makes from the same files; a mask of another length or size is refused before anything is
queued, the JSON (path) forms stay refused, the fields are refused on a model without VACE, and the uploads leave
with their job (completed or deleted)."""
from __future__ import annotations

import io
import time

import imageio.v3 as iio
import numpy as np
import openai
import pytest
from openai.types import Video
from PIL import Image

from tests.serve.helpers import call, wait

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
ASK = {"prompt": "a cat walks on the grass", "num_inference_steps": "3", "seed": "5",
       "conditioning_scale": [0.5, 1.5]}
FRAMES, HEIGHT, WIDTH = 9, 32, 48


def mp4(frames: int = FRAMES, height: int = HEIGHT, width: int = WIDTH, box: bool = False, seed: int = 0) -> bytes:
    """Random frames, or a mask: white (generated) inside a box, black around it."""
    if box:
        pixels = np.zeros((frames, height, width, 3), np.uint8)
        pixels[:, 8:24, 16:32] = 255
    else:
        pixels = np.random.default_rng(seed).integers(0, 256, (frames, height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    iio.imwrite(buf, pixels, extension=".mp4", fps=8, codec="libx264")
    return buf.getvalue()


def png(height: int, width: int, seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


REFS = (png(40, 24, 1), png(16, 56, 2))


def create(client, video: bytes | None = None, mask: bytes | None = None, refs=REFS, **fields) -> Video:
    files = [("video", ("control.mp4", video, "video/mp4"))] if video is not None else []
    files += [("mask", ("mask.mp4", mask, "video/mp4"))] if mask is not None else []
    files += [("reference_images", (f"ref{i}.png", data, "image/png")) for i, data in enumerate(refs)]
    return client.post("/videos", cast_to=Video, body={**ASK, **fields}, files=files,
                       options={"headers": {"Content-Type": "multipart/form-data"}})


def refused(call_it) -> dict:
    with pytest.raises(openai.APIStatusError) as exc:
        call_it()
    return {"status": exc.value.status_code, **exc.value.body}


def uploads_gone(server, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while list((server.data_dir / "uploads").iterdir()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not list((server.data_dir / "uploads").iterdir())


def test_the_served_vace_video_is_the_python_api_video_of_the_same_files(vace_server, tmp_path):
    from fastwan import VideoGenerator

    client = vace_server.client()
    control, mask = mp4(), mp4(box=True)
    done = wait(client, create(client, control, mask).id, timeout=180)
    assert done.status == "completed", done.error
    assert done.size == f"{WIDTH}x{HEIGHT}"
    served = iio.imread(io.BytesIO(client.videos.download_content(done.id).read()), extension=".mp4")
    assert uploads_gone(vace_server)  # the uploads went with their job
    paths = {}
    for name, data in (("control.mp4", control), ("mask.mp4", mask), ("ref0.png", REFS[0]), ("ref1.png", REFS[1])):
        paths[name] = tmp_path / name
        paths[name].write_bytes(data)
    gen = VideoGenerator.from_pretrained(str(vace_server.model), device="cpu")
    local = gen.generate_video(ASK["prompt"], video=str(paths["control.mp4"]), mask=str(paths["mask.mp4"]),
                               reference_images=[str(paths["ref0.png"]), str(paths["ref1.png"])],
                               conditioning_scale=[0.5, 1.5], num_inference_steps=3, seed=5,
                               output_path=str(tmp_path / "v.mp4"))
    mine = iio.imread(local.video_path)
    assert served.shape == (FRAMES, HEIGHT, WIDTH, 3) == mine.shape
    assert np.abs(served.astype(int) - mine.astype(int)).max() <= 1


def test_bad_vace_uploads_are_refused_before_anything_is_queued(vace_server):
    client = vace_server.client()
    before = len(client.videos.list(limit=100).data)
    cases = [
        (lambda: create(client, mp4(), mp4(frames=5, box=True)), "mask", "5 frames"),  # another length
        (lambda: create(client, mp4(), mp4(height=48, width=32, box=True)), "mask", "32x48"),  # another size
        (lambda: create(client, mp4(), b"not a video"), "mask", "not a readable video"),
        (lambda: create(client, None, mp4(box=True)), "mask", "without video"),
        (lambda: create(client, mp4(), refs=(b"no image",)), "reference_images", "not an image"),
        (lambda: create(client, mp4(), refs=REFS * 3), "reference_images", "1 to 4"),
    ]
    for attempt, param, words in cases:
        answer = refused(attempt)
        assert answer["status"] == 400 and answer["param"] == param and words in answer["message"], answer
    for body in ({"mask": "/etc/passwd"}, {"reference_images": ["/etc/passwd"]}):
        status, answer = call("POST", f"{vace_server.url}/v1/videos", {"prompt": "x", **body})
        assert status == 400 and answer["error"]["param"] == next(iter(body)), answer
        assert "upload" in answer["error"]["message"]
    assert len(client.videos.list(limit=100).data) == before  # nothing was queued
    assert not list((vace_server.data_dir / "uploads").iterdir())  # no refused upload stays


def test_a_deleted_vace_job_leaves_no_upload(vace_server):
    client = vace_server.client()
    video = create(client, mp4(seed=3), mp4(box=True), num_inference_steps="40")
    assert len(list((vace_server.data_dir / "uploads").iterdir())) == 4  # the control video, the mask, two images
    client.videos.delete(video.id)
    assert uploads_gone(vace_server)


def test_vace_fields_are_refused_on_a_model_without_vace(server):
    client = server.client()
    cases = [({"mask": mp4(box=True)}, "mask"), ({"mask": None}, "reference_images"),
             ({"mask": None, "refs": ()}, "conditioning_scale")]
    for files, param in cases:
        answer = refused(lambda files=files: create(client, mp4(), **files))
        assert answer["status"] == 400 and answer["param"] == param, answer
        assert "VACE" in answer["message"] and "uploads" not in answer["message"], answer  # no server path named
    assert not list((server.data_dir / "uploads").iterdir())
