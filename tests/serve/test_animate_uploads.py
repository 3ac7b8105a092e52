"""Wan2.2-Animate through ``fastwan serve``: the character image comes as the upload ``input_reference``, the
driving videos as the multipart files ``pose_video`` and ``face_video`` (replace mode: ``background_video`` and
``mask_video`` too) beside the plain fields ``mode``, ``segment_frames``, ``overlap`` and ``motion_batch_size``;
the served video is the one ``VideoGenerator.generate`` makes from the same files; bad uploads are refused naming
their field before anything is queued, the JSON (path) forms stay refused, the uploads are refused on a model that
is not Animate's, and they leave with their job (completed or deleted)."""
from __future__ import annotations

import io
from types import SimpleNamespace

import imageio.v3 as iio
import numpy as np
import pytest
from openai.types import Video

from tests.serve.helpers import call, wait
from tests.serve.test_vace_upload import mp4, png, refused, uploads_gone

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
PROMPT = "a dancer on a stage"
IMAGE = png(40, 28, 1)  # the character: taller than the 32x32 frame, fitted inside it


def create(client, fields: dict | None = None, image: bytes | None = IMAGE, **videos: bytes) -> Video:
    """A multipart create of the character ``image`` and the Animate ``videos`` (mp4 bytes by field)."""
    files = [("input_reference", ("character.png", image, "image/png"))] if image is not None else []
    files += [(name, (f"{name}.mp4", data, "video/mp4")) for name, data in videos.items()]
    return client.post("/videos", cast_to=Video, body={"prompt": PROMPT, **(fields or {})}, files=files,
                       options={"headers": {"Content-Type": "multipart/form-data"}})


@pytest.fixture(scope="module")
def local_gen(animate_server):
    """The same checkpoint in this process (the reference the served videos are compared with)."""
    from fastwan import VideoGenerator

    return VideoGenerator.from_pretrained(str(animate_server.model), device="cpu")


def local_video(gen, tmp_path, videos: dict, **fields) -> np.ndarray:
    """The frames of the mp4 ``gen.generate`` writes for the character image and ``videos`` saved as files."""
    from fastwan import GenerationRequest

    paths = {}
    for name, data in {"image": IMAGE, **videos}.items():
        paths[name] = tmp_path / (f"{name}.png" if name == "image" else f"{name}.mp4")
        paths[name].write_bytes(data)
    result = gen.generate(GenerationRequest(PROMPT, **{k: str(v) for k, v in paths.items()},
                                            output_path=str(tmp_path / "local.mp4"), **fields))
    return iio.imread(result.video_path)


def served_video(server, client, video_id: str) -> tuple[np.ndarray, float]:
    """The frames and fps of a completed served video."""
    data = client.videos.download_content(video_id).read()
    return iio.imread(io.BytesIO(data), extension=".mp4"), iio.immeta(io.BytesIO(data), extension=".mp4")["fps"]


def test_the_served_animate_video_is_the_python_api_video_of_the_same_files(animate_server, local_gen, tmp_path):
    client = animate_server.client()
    frames = 17  # two segments of 13 frames overlapping by 5
    videos = {"pose_video": mp4(frames, 32, 48, seed=2), "face_video": mp4(frames, 32, 32, seed=3)}
    fields = {"seed": 7, "segment_frames": 13, "overlap": 5, "motion_batch_size": 4}
    video = create(client, {**{k: str(v) for k, v in fields.items()}, "mode": "animate"}, **videos)
    done = wait(client, video.id, timeout=300)
    assert done.status == "completed", done.error
    served, fps = served_video(animate_server, client, done.id)
    assert done.size == "32x32" and done.seconds == f"{frames / fps:g}"  # the driving videos' length, not a segment's
    assert uploads_gone(animate_server)  # the uploads went with their job
    mine = local_video(local_gen, tmp_path, videos, mode="animate", **fields)
    assert served.shape == (frames, 32, 32, 3) == mine.shape
    assert np.abs(served.astype(int) - mine.astype(int)).max() <= 1
    assert served.std() > 5  # a video with content


def test_replace_mode_takes_the_background_and_mask_uploads(animate_server, local_gen, tmp_path):
    client = animate_server.client()
    frames = 9
    videos = {"pose_video": mp4(frames, 32, 48, seed=4), "face_video": mp4(frames, 32, 32, seed=5),
              "background_video": mp4(frames, 32, 48, seed=6), "mask_video": mp4(frames, 32, 48, box=True)}
    done = wait(client, create(client, {"mode": "replace", "seed": "3"}, **videos).id, timeout=300)
    assert done.status == "completed", done.error
    served, _ = served_video(animate_server, client, done.id)
    mine = local_video(local_gen, tmp_path, videos, mode="replace", seed=3)
    assert served.shape == (frames, 32, 32, 3) == mine.shape
    assert np.abs(served.astype(int) - mine.astype(int)).max() <= 1
    assert uploads_gone(animate_server)


def test_animate_uploads_are_refused_on_a_model_that_is_not_animate(server):
    client = server.client()
    for videos, param in (({"pose_video": mp4(), "face_video": mp4()}, "pose_video"),
                          ({"background_video": mp4()}, "background_video"),
                          ({"mask_video": b"not even a video"}, "mask_video")):  # refused before it is read
        answer = refused(lambda videos=videos: create(client, **videos))
        assert answer["status"] == 400 and answer["param"] == param, answer
        assert "Wan2.2-Animate" in answer["message"] and "uploads" not in answer["message"], answer
    uploads = server.data_dir / "uploads"
    assert not uploads.exists() or not list(uploads.iterdir())  # nothing was saved


def test_bad_animate_uploads_are_refused_before_anything_is_queued(animate_server):
    client = animate_server.client()
    before = len(client.videos.list(limit=100).data)
    pose, face = mp4(9, 32, 48, seed=1), mp4(9, 32, 32, seed=2)
    background, mask = mp4(9, 32, 48, seed=3), mp4(9, 32, 48, box=True)
    cases = [
        ({}, dict(pose_video=pose, face_video=mp4(5, 32, 32)), "face_video", "differ in length"),
        ({}, dict(pose_video=mp4(5, 32, 48), face_video=face), "face_video", "differ in length"),
        ({"mode": "replace"}, dict(pose_video=pose, face_video=face, background_video=mp4(13, 32, 48),
                                   mask_video=mp4(13, 32, 48, box=True)), "background_video", "differ in length"),
        ({"mode": "replace"}, dict(pose_video=pose, face_video=face, background_video=background,
                                   mask_video=mp4(9, 48, 32, box=True)), "mask_video", "32x48"),
        ({}, dict(pose_video=pose, face_video=b"not a video"), "face_video", "not a readable video"),
        ({}, dict(pose_video=pose), "pose_video", "without face_video"),
        ({"mode": "replace"}, dict(pose_video=pose, face_video=face), "mode", "needs background_video"),
        ({}, dict(pose_video=pose, face_video=face, mask_video=mask), "mask_video", "only mode='replace'"),
        ({"overlap": "3"}, dict(pose_video=pose, face_video=face), "overlap", "1 or 5"),
        ({}, dict(pose_video=pose, face_video=face), "input_reference", "without image"),
        ({"segment_frames": "13"}, {}, "segment_frames", "given without pose_video and face_video"),
    ]
    for fields, videos, param, words in cases:
        image = None if param == "input_reference" else IMAGE
        answer = refused(lambda: create(client, fields, image, **videos))  # noqa: B023 -- called at once
        assert answer["status"] == 400 and answer["param"] == param and words in answer["message"], answer
    answer = refused(lambda: create(client, {}, IMAGE))
    assert answer["status"] == 400 and answer["param"] == "pose_video", answer  # an Animate model needs them
    for name in ("pose_video", "face_video", "background_video", "mask_video"):
        status, answer = call("POST", f"{animate_server.url}/v1/videos", {"prompt": "x", name: "/etc/passwd"})
        assert status == 400 and answer["error"]["param"] == name, answer
        assert f"as the file {name}" in answer["error"]["message"]
    assert len(client.videos.list(limit=100).data) == before  # nothing was queued
    assert not list((animate_server.data_dir / "uploads").iterdir())  # no refused upload stays


def test_an_errors_param_is_the_field_its_rule_names_not_a_word_of_its_message(tmp_path):
    from fastwan.errors import InvalidArgument
    from fastwan.pipelines.animate import read_animate_videos
    from fastwan.serve.errors import from_user_error

    files = {"pose_video": mp4(9, 32, 48), "face_video": mp4(5, 32, 32)}
    for name, data in files.items():
        (tmp_path / f"{name}.mp4").write_bytes(data)
    r = SimpleNamespace(background_video=None, mask_video=None, segment_frames=None, overlap=None,
                        **{name: str(tmp_path / f"{name}.mp4") for name in files})
    with pytest.raises(InvalidArgument, match="differ in length") as exc:
        read_animate_videos(r, 13)
    assert exc.value.field == "face_video"  # the video whose length is not pose_video's
    # a message reworded to start with another field's name keeps the param its rule set
    reworded = InvalidArgument("pose_video= and face_video= are of two lengths; cut them to one.", field="face_video")
    assert from_user_error(reworded).param == "face_video"
    # an error with no field has no param (OpenAI's null): the words of its message name none
    assert from_user_error(InvalidArgument("pose_video= is bad.")).param is None


def test_a_deleted_animate_job_leaves_no_upload(animate_server):
    client = animate_server.client()
    uploads = animate_server.data_dir / "uploads"
    long = {"num_inference_steps": "300"}  # minutes on a CPU: still running when deleted
    running = create(client, long, pose_video=mp4(9, 32, 48, seed=8), face_video=mp4(9, 32, 32, seed=9))
    queued = create(client, {"mode": "replace", **long}, pose_video=mp4(9, 32, 48), face_video=mp4(9, 32, 32),
                    background_video=mp4(9, 32, 48), mask_video=mp4(9, 32, 48, box=True))
    mine = sorted(p.name for p in uploads.iterdir() if p.name.startswith(queued.id))
    assert len(mine) == 5, mine  # the image and four videos
    assert client.videos.retrieve(queued.id).status == "queued"
    client.videos.delete(queued.id)
    assert not [p for p in uploads.iterdir() if p.name.startswith(queued.id)]
    client.videos.delete(running.id)  # queued or in progress: its files go too
    assert uploads_gone(animate_server)
