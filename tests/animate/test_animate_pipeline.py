"""Wan2.2-Animate end to end: fastwan's segment loop against diffusers' WanAnimatePipeline on the same tiny random
checkpoint (fastwan's tiny "wan2.2-animate" layout, loaded by both), in animate mode without CFG and in replace
mode with CFG, over several segments with overlaps of 1 and 5 frames: frames within 1 of diffusers'."""
import numpy as np
import pytest
import torch
from PIL import Image

from fastwan import VideoGenerator
from fastwan.checkpoint.tiny import write_tiny_checkpoint
from fastwan.errors import InvalidArgument

PROMPT, NEGATIVE = "a dancer on a stage", "blurry, static"


@pytest.fixture(scope="module")
def animate_ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("animate") / "ckpt", "wan2.2-animate", seed=5)


@pytest.fixture(scope="module")
def animate_gen(animate_ckpt):
    return VideoGenerator.from_pretrained(animate_ckpt, device="cpu", dtype=torch.float32)


def _video(frames: int, height: int, width: int, seed: int) -> list:
    """Smooth random RGB frames (a coarse random field, upsampled), as PIL images."""
    g = np.random.default_rng(seed)
    coarse = g.integers(0, 256, size=(frames, 4, 5, 3)).astype(np.uint8)
    return [Image.fromarray(f).resize((width, height), Image.BILINEAR) for f in coarse]


def _diffusers(ckpt, image, videos: dict, seed: int, **kw) -> np.ndarray:
    from diffusers import WanAnimatePipeline

    pipe = WanAnimatePipeline.from_pretrained(ckpt, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    out = pipe(image=image, prompt=PROMPT, negative_prompt=NEGATIVE, generator=torch.Generator().manual_seed(seed),
               output_type="np", **videos, **kw).frames[0]
    return (out * 255).round().astype(np.uint8)


CASES = {
    "animate": dict(frames=13, fastwan=dict(segment_frames=9, overlap=1, guidance_scale=1.0),
                    diffusers=dict(segment_frame_length=9, prev_segment_conditioning_frames=1, guidance_scale=1.0)),
    "replace-cfg": dict(frames=20, fastwan=dict(segment_frames=13, overlap=5, guidance_scale=2.5, mode="replace"),
                        diffusers=dict(segment_frame_length=13, prev_segment_conditioning_frames=5,
                                       guidance_scale=2.5, mode="replace")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_frames_match_diffusers_animate_pipeline(animate_ckpt, animate_gen, case):
    c, seed, steps = CASES[case], 11, 3
    n = c["frames"]
    image = _video(1, 40, 28, 1)[0]  # taller than the frame: fitted inside it on black
    videos = {"pose_video": _video(n, 24, 40, 2), "face_video": _video(n, 20, 20, 3)}
    if c["fastwan"].get("mode") == "replace":
        videos["background_video"] = _video(n, 24, 40, 4)
        videos["mask_video"] = _video(n, 24, 40, 6)
    want = _diffusers(animate_ckpt, image, videos, seed, height=32, width=32, num_inference_steps=steps,
                      **c["diffusers"])
    steps_seen = []
    got = animate_gen.generate(animate_gen.resolve(__import__("fastwan").GenerationRequest(
        PROMPT, negative_prompt=NEGATIVE, image=image, height=32, width=32, num_inference_steps=steps, seed=seed,
        save_video=False, **{k: [np.asarray(f) for f in v] for k, v in videos.items()}, **c["fastwan"])),
        on_step=lambda done, total: steps_seen.append((done, total)))
    segments = 2
    assert got.frames.shape == want.shape == (n, 32, 32, 3)
    assert steps_seen[-1] == (segments * steps, segments * steps)
    assert got.num_transformer_forwards == segments * steps * (2 if c["fastwan"]["guidance_scale"] > 1 else 1)
    diff = np.abs(got.frames.astype(int) - want.astype(int))
    assert diff.max() <= 1, f"max diff {diff.max()}"
    assert want.std() > 5  # a video with content, not a constant


def test_animate_checkpoint_needs_its_inputs(animate_gen):
    with pytest.raises(InvalidArgument, match="pose_video= and face_video="):
        animate_gen.resolve(__import__("fastwan").GenerationRequest(PROMPT, image=_video(1, 8, 8, 0)[0]))
    frames = [np.zeros((16, 16, 3), np.uint8)] * 9
    with pytest.raises(InvalidArgument, match="without image="):
        animate_gen.resolve(__import__("fastwan").GenerationRequest(PROMPT, pose_video=frames, face_video=frames))
    with pytest.raises(InvalidArgument, match="num_frames=17, but the driving videos have 9 frames"):
        animate_gen.resolve(__import__("fastwan").GenerationRequest(
            PROMPT, image=_video(1, 8, 8, 0)[0], pose_video=frames, face_video=frames, num_frames=17))
    with pytest.raises(InvalidArgument, match="step cache"):
        animate_gen.resolve(__import__("fastwan").GenerationRequest(
            PROMPT, image=_video(1, 8, 8, 0)[0], pose_video=frames, face_video=frames, cache="teacache"))


def test_driving_videos_are_part_of_the_video_identity(animate_gen, tmp_path):
    """Two videos differing only in a driving frame get different automatic file names; the same inputs, the same."""
    from fastwan import GenerationRequest

    image = _video(1, 8, 8, 0)[0]
    pose, face = [np.asarray(f) for f in _video(9, 16, 16, 1)], [np.asarray(f) for f in _video(9, 16, 16, 2)]
    other = [f.copy() for f in pose]
    other[4][0, 0, 0] ^= 1

    def made(p):
        r = GenerationRequest(PROMPT, image=image, pose_video=p, face_video=face, seed=3, num_inference_steps=1,
                              output_path=str(tmp_path), overwrite=True)
        return animate_gen.generate(r).video_path

    first, again, changed = made(pose), made(pose), made(other)
    assert first == again and changed != first


@pytest.mark.parametrize("load", [
    dict(enable_torch_compile=True, torch_compile_kwargs={"fullgraph": True, "backend": "aot_eager"}),
    dict(attention_backend="SLIDING_TILE_ATTN", attention_config={"tile": [2, 2, 2], "window": [3, 3, 3]}),
], ids=["compiled-fullgraph", "sliding-tile"])
def test_animate_composes_with_compile_and_sparse_attention(animate_ckpt, animate_gen, load):
    """Compiled blocks (no graph break) give the eager frames; a sparse backend whose window covers every token
    (4 x 4 tokens per frame in 2 x 2 x 2 tiles) gives the dense frames."""
    from fastwan import GenerationRequest

    pose, face = [np.asarray(f) for f in _video(13, 24, 24, 7)], [np.asarray(f) for f in _video(13, 16, 16, 8)]
    r = GenerationRequest(PROMPT, negative_prompt=NEGATIVE, image=_video(1, 20, 20, 9)[0], pose_video=pose,
                          face_video=face, seed=2, guidance_scale=2.0, height=64, width=64, save_video=False)
    other = VideoGenerator.from_pretrained(animate_ckpt, device="cpu", dtype=torch.float32, **load)
    want, got = animate_gen.generate(r).frames, other.generate(r).frames
    assert np.abs(want.astype(int) - got.astype(int)).max() <= 1
