"""The request's Wan2.2-Animate fields: each alone and together (diffusers' WanAnimatePipeline.check_inputs rules:
pose and face videos both, replace mode with background and mask videos), the videos' lengths and sizes, and the
refusal on a checkpoint whose DiT is not Animate's, and what an Animate checkpoint needs."""
from types import SimpleNamespace

import numpy as np
import pytest

from fastwan import GenerationRequest
from fastwan.errors import InvalidArgument
from fastwan.fields import options
from fastwan.pipelines.animate import check_animate_request, read_animate_videos


def _video(frames: int, height: int = 16, width: int = 24) -> np.ndarray:
    return np.zeros((frames, height, width, 3), dtype=np.uint8)


def _checkpoint(animate: bool):
    return SimpleNamespace(transformer_config=SimpleNamespace(animate=animate), variant="tiny",
                           preset=SimpleNamespace(num_frames=9))


def test_animate_fields_are_request_fields_with_flags():
    flags = {f.name: opt.flag for f, opt in options(GenerationRequest)}
    assert {flags[n] for n in ("pose_video", "face_video", "background_video", "mask_video", "mode",
                               "segment_frames", "overlap", "motion_batch_size")} == {
        "--pose-video", "--face-video", "--background-video", "--mask-video", "--mode", "--segment-frames",
        "--overlap", "--motion-batch-size"}


def test_replace_request_keeps_its_values():
    r = GenerationRequest("a", pose_video=_video(5), face_video=_video(5), mode="replace",
                          background_video=_video(5), mask_video=_video(5), segment_frames=13, overlap=5,
                          motion_batch_size=2)
    assert (r.mode, r.segment_frames, r.overlap, r.motion_batch_size) == ("replace", 13, 5, 2)


@pytest.mark.parametrize("kw, words", [
    (dict(pose_video="p.mp4"), ["pose_video is given without face_video", "pass face_video"]),
    (dict(face_video="f.mp4"), ["face_video is given without pose_video", "pass pose_video"]),
    (dict(mode="animate"), ["mode given without pose_video", "leave them out"]),
    (dict(overlap=5), ["overlap given without pose_video"]),
    (dict(pose_video="p", face_video="f", mode="replace"), ["needs background_video and mask_video"]),
    (dict(pose_video="p", face_video="f", mode="replace", background_video="b"), ["needs mask_video"]),
    (dict(pose_video="p", face_video="f", background_video="b"), ["background_video given with mode='animate'",
                                                                   "pass mode='replace'"]),
    (dict(pose_video="p", face_video="f", overlap=5, segment_frames=9), ["segment_frames=9", "twice overlap=5"]),
    (dict(segment_frames=10), ["segment_frames=10", "4 n + 1"]),
    (dict(overlap=3), ["overlap=3", "1 or 5"]),
    (dict(mode="swap"), ["mode='swap'", "'replace'"]),
    (dict(motion_batch_size=0), ["motion_batch_size=0", ">= 1"]),
])
def test_bad_animate_fields_raise_naming_the_rule(kw, words):
    with pytest.raises(InvalidArgument) as info:
        GenerationRequest("a", **kw)
    for word in words:
        assert word in str(info.value)


def test_driving_videos_of_different_lengths_are_refused():
    r = GenerationRequest("a", pose_video=_video(9), face_video=_video(8))
    with pytest.raises(InvalidArgument, match="pose_video 9, face_video 8 frames"):
        read_animate_videos(r)
    r = GenerationRequest("a", pose_video=_video(9), face_video=_video(9), mode="replace",
                          background_video=_video(7), mask_video=_video(9))
    with pytest.raises(InvalidArgument, match="background_video 7"):
        read_animate_videos(r)


def test_mask_of_another_size_is_refused():
    r = GenerationRequest("a", pose_video=_video(9), face_video=_video(9), mode="replace",
                          background_video=_video(9), mask_video=_video(9, 8, 24))
    with pytest.raises(InvalidArgument, match="mask_video frames are 24x8 but background_video frames are 24x16"):
        read_animate_videos(r)


def test_videos_no_longer_than_the_overlap_are_refused():
    r = GenerationRequest("a", pose_video=_video(5), face_video=_video(5), overlap=5, segment_frames=13)
    with pytest.raises(InvalidArgument, match="more than overlap=5"):
        read_animate_videos(r)


def test_good_videos_are_read_by_name():
    r = GenerationRequest("a", pose_video=_video(9), face_video=_video(9, 16, 16), mode="replace",
                          background_video=_video(9), mask_video=_video(9))
    videos = read_animate_videos(r)
    assert {k: len(v) for k, v in videos.items()} == dict(pose_video=9, face_video=9, background_video=9,
                                                           mask_video=9)
    assert videos["face_video"][0].size == (16, 16)


def test_animate_inputs_are_refused_on_another_checkpoint():
    r = GenerationRequest("a", pose_video=_video(9), face_video=_video(9))
    with pytest.raises(InvalidArgument, match="not a Wan2.2-Animate checkpoint.*WanAnimatePipeline"):
        check_animate_request(_checkpoint(False), r)
    check_animate_request(_checkpoint(False), GenerationRequest("a"))  # no Animate inputs: nothing to refuse


def test_animate_checkpoint_checks_its_inputs():
    image = np.zeros((8, 8, 3), np.uint8)
    with pytest.raises(InvalidArgument, match="pass all three"):
        check_animate_request(_checkpoint(True), GenerationRequest("a", image=image))
    with pytest.raises(InvalidArgument, match="differ in length"):
        check_animate_request(_checkpoint(True), GenerationRequest("a", image=image, pose_video=_video(9),
                                                                   face_video=_video(7)))
    with pytest.raises(InvalidArgument, match="without image="):
        check_animate_request(_checkpoint(True), GenerationRequest("a", pose_video=_video(9), face_video=_video(9)))
    with pytest.raises(InvalidArgument, match="last_image= is a first-last-frame input"):
        check_animate_request(_checkpoint(True), GenerationRequest("a", image=image, last_image=image,
                                                                   pose_video=_video(9), face_video=_video(9)))
    a = check_animate_request(_checkpoint(True), GenerationRequest("a", image=image, pose_video=_video(20),
                                                                   face_video=_video(20)))
    assert (a.plan.segment_frames, a.plan.overlap, a.plan.frames, a.mode) == (9, 1, 20, "animate")  # the preset's
    assert "20 frames in 3 segments of 9" in a.describe()


def test_the_server_refuses_the_video_paths_of_its_host():
    from fastwan.serve.requests import HOST_FILE_FIELDS
    assert {"pose_video", "face_video", "background_video", "mask_video"} <= HOST_FILE_FIELDS
