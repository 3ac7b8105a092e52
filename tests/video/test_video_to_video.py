"""Video-to-video (``video=``, ``strength=``) against diffusers' ``WanVideoToVideoPipeline`` on the same tiny
checkpoint, video and seed (fp32): frames within 1 at two strengths and with the frames resized; the steps that
run; the inputs it reads (a file, frames, an array, JSON); the rules checked before any compute."""
from __future__ import annotations

import imageio.v3 as iio
import numpy as np
import pytest
import torch
from diffusers import WanVideoToVideoPipeline
from PIL import Image

from fastwan import GenerationRequest, VideoGenerator
from fastwan.checkpoint.tiny import write_tiny_checkpoint
from fastwan.errors import InvalidArgument, InvalidArgumentType
from fastwan.fields import from_json, to_json

PROMPT, NEGATIVE = "a cat walks on the grass", "blurry"


def clip(frames: int = 9, height: int = 64, width: int = 64, seed: int = 0) -> list:
    """A moving picture: smooth colour fields that drift, as PIL frames."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (height // 8 + 2, width // 8 + 2, 3), dtype=np.uint8)
    big = np.asarray(Image.fromarray(base).resize((width + 16, height + 16), Image.BILINEAR))
    return [Image.fromarray(np.ascontiguousarray(big[k:k + height, k:k + width])) for k in range(frames)]


def reference(path, video, seed, **kw):
    pipe = WanVideoToVideoPipeline.from_pretrained(path, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    out = pipe(video=video, prompt=PROMPT, negative_prompt=NEGATIVE, generator=torch.Generator("cpu").manual_seed(seed),
               output_type="np", **kw).frames[0]
    return (out * 255).round().astype(np.uint8)


@pytest.fixture(scope="module")
def gen(tiny_ckpts):
    return VideoGenerator.from_pretrained(tiny_ckpts["wan2.1"], device="cpu", dtype=torch.float32)


@pytest.mark.parametrize("strength,size", [(0.5, (64, 64)), (0.8, (64, 64)), (0.7, (48, 80))],
                         ids=["strength-0.5", "strength-0.8", "resized"])
def test_video_to_video_matches_diffusers(tiny_ckpts, gen, strength, size):
    video = clip()
    height, width = size
    kw = dict(height=height, width=width, num_inference_steps=6, guidance_scale=5.0, strength=strength)
    steps = []
    got = gen.generate(GenerationRequest(prompt=PROMPT, negative_prompt=NEGATIVE, video=video, seed=11,
                                         save_video=False, **kw), on_step=lambda d, t: steps.append(t)).frames
    want = reference(tiny_ckpts["wan2.1"], video, 11, **kw)
    assert got.shape == want.shape == (9, height, width, 3) and want.std() > 5
    assert np.abs(got.astype(int) - want.astype(int)).max() <= 1
    assert steps == [int(6 * strength)] * int(6 * strength)  # the last int(n x strength) steps run


def test_a_file_frames_an_array_and_json_make_one_video(gen, tmp_path):
    video = clip()
    path = tmp_path / "in.gif"
    video[0].save(path, save_all=True, append_images=video[1:], duration=100, loop=0)
    array = np.stack([np.asarray(f) for f in video])
    common = dict(strength=0.6, num_inference_steps=5, seed=5, height=64, width=64, save_video=False)
    want = gen.generate_video(PROMPT, video=video, **common).frames
    assert (gen.generate_video(PROMPT, video=array, **common).frames == want).all()
    with Image.open(path) as gif:  # a GIF holds a palette: its frames as Pillow reads them back
        stored = []
        for k in range(gif.n_frames):
            gif.seek(k)
            stored.append(gif.convert("RGB"))
    assert (gen.generate_video(PROMPT, video=str(path), **common).frames ==
            gen.generate_video(PROMPT, video=stored, **common).frames).all()
    request = GenerationRequest(prompt=PROMPT, video=video, **common)
    again = from_json(GenerationRequest, to_json(request))
    assert (gen.generate(again).frames == want).all()
    mp4 = tmp_path / "in.mp4"
    iio.imwrite(mp4, array, fps=8, codec="libx264")
    frames = gen.generate_video(PROMPT, video=mp4, **common).frames  # read through ffmpeg: 9 frames
    assert frames.shape == (9, 64, 64, 3)


def test_rules_before_compute(gen, tmp_path):
    video = clip()
    bad = [
        (dict(strength=0.5), "without video"),
        (dict(video=video, strength=0.0), r"must be in \(0, 1\]"),
        (dict(video=video, strength=1.5), r"must be in \(0, 1\]"),
        (dict(video=video, num_frames=13), "differs from the video's 9 frames"),
        (dict(video=video, strength=0.1, num_inference_steps=5), "runs no step"),
        (dict(video=video, image=video[0]), "text-to-video|give one"),
        (dict(video=video, cache="teacache"), "does not run with video"),
        (dict(video=str(tmp_path / "missing.mp4")), "no such file"),
        (dict(video=[]), "has no frames"),
        (dict(video=video[:1] + [video[1].resize((32, 32))]), "differ in size"),
        (dict(video=clip(frames=8)), "num_frames"),
    ]
    (tmp_path / "junk.mp4").write_bytes(b"not a video")
    bad.append((dict(video=str(tmp_path / "junk.mp4")), "not a readable video"))
    for kw, words in bad:
        with pytest.raises(InvalidArgument, match=words):
            gen.resolve(GenerationRequest(prompt=PROMPT, save_video=False, **kw))
    with pytest.raises(InvalidArgumentType, match="video="):
        GenerationRequest(prompt=PROMPT, video=3)


def test_image_checkpoints_refuse_a_video(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "i2v", "wan2.1-i2v")
    gen = VideoGenerator.from_pretrained(path, device="cpu", dtype=torch.float32)
    with pytest.raises(InvalidArgument, match="needs a text-to-video checkpoint"):
        gen.resolve(GenerationRequest(prompt=PROMPT, image=clip()[0], video=clip()))


def test_a_parallel_generator_makes_the_same_video(tiny_ckpts, gen):
    """num_gpus=2 (sequence parallel, gloo): each rank reads the video; frames within 1 of one process's."""
    kw = dict(video=clip(), strength=0.7, num_inference_steps=4, seed=2, height=64, width=64, save_video=False)
    want = gen.generate_video(PROMPT, **kw).frames
    with VideoGenerator.from_pretrained(tiny_ckpts["wan2.1"], device="cpu", dtype=torch.float32, num_gpus=2) as par:
        got = par.generate_video(PROMPT, **kw).frames
    assert np.abs(got.astype(int) - want.astype(int)).max() <= 1


def test_the_command_line_redoes_a_video_file(tmp_path):
    import subprocess
    import sys

    source = tmp_path / "in.mp4"
    iio.imwrite(source, np.stack([np.asarray(f) for f in clip(height=32, width=48)]), fps=8, codec="libx264")
    out = tmp_path / "out.mp4"
    run = subprocess.run([sys.executable, "-m", "fastwan", "generate", "--model", "tiny", "--device", "cpu",
                          "--prompt", "x", "--video", str(source), "--strength", "0.6", "--steps", "5", "--height",
                          "32", "--width", "48", "--output", str(out)], capture_output=True, text=True,
                         cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "from a video at strength 0.6 (its last 3 steps)" in run.stdout
    assert iio.imread(out).shape == (9, 32, 48, 3)
    bad = subprocess.run([sys.executable, "-m", "fastwan", "generate", "--model", "tiny", "--device", "cpu",
                          "--prompt", "x", "--strength", "0.6", "--output", str(tmp_path / "x.mp4")],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1] == (
        "fastwan: error: --strength 0.6 is given without --video; strength says how much of an input video is "
        "regenerated: pass --video too, or leave the strength out.")
