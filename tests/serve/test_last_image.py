"""First-last-frame videos through ``fastwan serve --model tiny-wan2.1-flf2v``: the last frame comes as the uploaded
file ``last_image`` beside ``input_reference``, and the served video is the one ``generate_video`` makes from the
same two images; a last frame without a first one, over the caps, not an image, given twice or as a path is
refused; a text-to-video server refuses it (the image-to-video one: tests/serve/test_image.py)."""
from __future__ import annotations

import io

import imageio.v3 as iio
import numpy as np
import openai
import pytest
from openai.types import Video

from tests.serve.helpers import call, nearest_4k_plus_1, wait
from tests.serve.test_image import MAX_BYTES, capped_server, png

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
FIRST, LAST = png(80, 60, seed=1), png(70, 50, seed=2)
ASK = {"prompt": "a door opens", "size": "64x48", "seconds": "1", "num_inference_steps": "2", "seed": "3"}


@pytest.fixture(scope="module")
def flf_server(tmp_path_factory):
    yield from capped_server(tmp_path_factory, "tiny-wan2.1-flf2v")


def create(client, files: list, **fields) -> Video:
    """A create with ``files`` [(field, bytes)], through the openai client's generic post (its videos.create uploads
    input_reference only)."""
    return client.post("/videos", cast_to=Video, body={**ASK, **fields},
                       files=[(key, (f"{key}.png", data, "image/png")) for key, data in files],
                       options={"headers": {"Content-Type": "multipart/form-data"}})


def refused(client, files: list, **fields) -> dict:
    with pytest.raises(openai.APIStatusError) as exc:
        create(client, files, **fields)
    return {"status": exc.value.status_code, **exc.value.body}


def test_the_served_video_is_the_python_api_video_of_both_frames(flf_server, tmp_path):
    from fastwan import VideoGenerator

    client = flf_server.client()
    created = create(client, [("input_reference", FIRST), ("last_image", LAST)])
    done = wait(client, created.id)
    assert done.status == "completed", done.error
    served = iio.imread(io.BytesIO(client.videos.download_content(created.id).read()), extension=".mp4")
    assert not list((flf_server.data_dir / "uploads").iterdir())  # both uploads go once the job is done

    (tmp_path / "first.png").write_bytes(FIRST)
    (tmp_path / "last.png").write_bytes(LAST)
    gen = VideoGenerator.from_pretrained("tiny-wan2.1-flf2v", device="cpu")
    local = gen.generate_video("a door opens", image=str(tmp_path / "first.png"), last_image=str(tmp_path / "last.png"),
                               width=64, height=48, num_frames=nearest_4k_plus_1(8), num_inference_steps=2, seed=3,
                               output_path=str(tmp_path / "v.mp4"))
    assert np.array_equal(served, iio.imread(local.video_path))
    other = gen.generate_video("a door opens", image=str(tmp_path / "first.png"),
                               last_image=str(tmp_path / "first.png"), width=64, height=48,
                               num_frames=nearest_4k_plus_1(8), num_inference_steps=2, seed=3, save_video=False)
    assert not np.array_equal(other.frames, local.frames)  # the last frame counts


def test_bad_last_frames_are_refused_before_queueing(flf_server):
    client = flf_server.client()
    before = [v.id for v in client.videos.list(limit=100).data]
    cases = [([("last_image", LAST)], 400, "missing_required_parameter", "upload the first frame as input_reference"),
             ([("input_reference", FIRST)], 400, "invalid_value", "needs last_image"),
             ([("input_reference", FIRST), ("last_image", png(120, 100))], 413, "image_too_large", "pixels"),
             ([("input_reference", FIRST), ("last_image", png(90, 90) + b"\0" * MAX_BYTES)], 413, "upload_too_large",
              "bytes"),
             ([("input_reference", FIRST), ("last_image", b"not an image")], 400, "invalid_image", "not an image"),
             ([("last_image", LAST), ("last_image", LAST)], 400, "unknown_parameter", "once each")]
    for files, status, code, says in cases:
        error = refused(client, files)
        assert (error["status"], error["code"]) == (status, code) and says in error["message"], error
        assert error["param"] == "last_image", error
    error = refused(client, [("input_reference", FIRST)], last_image="/etc/hostname")  # a path, as form text
    assert (error["status"], error["code"], error["param"]) == (400, "unsupported_parameter", "last_image")
    status, body = call("POST", f"{flf_server.url}/v1/videos", {"prompt": "x", "last_image": "/etc/hostname"})
    assert status == 400 and body["error"]["code"] == "unsupported_parameter"
    assert "upload the last frame as the file last_image" in body["error"]["message"]
    assert [v.id for v in client.videos.list(limit=100).data] == before  # nothing refused was queued
    assert not list((flf_server.data_dir / "uploads").iterdir())


def test_a_text_to_video_server_refuses_a_last_frame(server):
    client = server.client()
    for files in ([("last_image", LAST)], [("input_reference", FIRST), ("last_image", LAST)]):
        error = refused(client, files)
        assert error["status"] == 400 and error["param"] in ("last_image", "input_reference"), error
    assert refused(client, [("last_image", LAST)])["param"] == "last_image"
