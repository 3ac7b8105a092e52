"""VACE's rules, checked before any compute: each bad input raises the fastwan error its kind names, its message
naming the value and the fix; VACE's inputs on a checkpoint without VACE, and the settings that do not compose
with VACE, are refused by name; the CLI's flags reach the request."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from fastwan import GenerationRequest, VideoGenerator, cli
from fastwan.errors import InvalidArgument, InvalidArgumentType
from fastwan.fields import from_json, to_json
from tests.cli.helpers import assert_one_error_line
from tests.vace.test_vace_pipeline import box_mask, clip, references


@pytest.fixture(scope="module")
def vace_gen(vace_ckpts):
    return VideoGenerator.from_pretrained(vace_ckpts["wan2.1-vace"], device="cpu", dtype=torch.float32)


def bad_cases(tmp_path) -> list:
    video = clip()
    (tmp_path / "junk.mp4").write_bytes(b"not a video")
    return [
        (dict(mask=box_mask(True)), "mask= is given without video="),
        (dict(video=video, mask=box_mask(True, frames=5)), "mask has 5 frames but video has 9"),
        (dict(video=video, mask=box_mask(True, size=32)), "mask frames are 32x32 but video frames are 64x64"),
        (dict(video=str(tmp_path / "missing.mp4")), f"video={str(tmp_path / 'missing.mp4')!r}: no such file"),
        (dict(video=str(tmp_path / "junk.mp4")), "not a readable video"),
        (dict(video=video, mask=str(tmp_path / "junk.mp4")), f"mask={str(tmp_path / 'junk.mp4')!r}"),
        (dict(video=video, strength=0.5), "strength=0.5 is video-to-video's"),
        (dict(video=video, image=video[0]), "image= / last_image= are image-to-video inputs"),
        (dict(video=video, num_frames=13), "num_frames=13 differs from the control video's 9"),
        (dict(video=video, height=48), "height=48 differs from the control video's 64"),
        (dict(video=clip(width=72)), "72x64 (width x height); both must be multiples of 16"),
        (dict(video=clip(frames=8)), "num_frames"),
        (dict(video=video, conditioning_scale=[1.0, 2.0, 3.0]), r"conditioning_scale=(1.0, 2.0, 3.0) must be a "
                                                                r"number or a list of 2"),
        (dict(reference_images=[str(tmp_path / "missing.png")], height=64, width=64),
         f"reference_images[0]={str(tmp_path / 'missing.png')!r}"),
        (dict(video=video, cache="teacache"), "does not run with VACE"),
        (dict(video=video, sampler="euler", chords_cores=2), "parallel_sampling='chords'"),
    ]


def test_bad_inputs_raise_before_compute(vace_gen, forbid_compute, tmp_path):
    gen = forbid_compute(vace_gen)
    for kw, words in bad_cases(tmp_path):
        with pytest.raises(InvalidArgument) as info:
            gen.generate(GenerationRequest(prompt="a cat", save_video=False, num_inference_steps=2, **kw))
        assert words in str(info.value), (kw.keys(), str(info.value))


def test_vace_inputs_refused_elsewhere(gen, forbid_compute, tmp_path):
    """A checkpoint without VACE refuses mask, reference_images and conditioning_scale by name, with the value."""
    gen = forbid_compute(gen)
    path = str(tmp_path / "mask.mp4")
    cases = [(dict(video=clip(), mask=path), f"mask={path!r}"),
             (dict(reference_images=["a.png", "b.png"]), "reference_images=['a.png', 'b.png']"),
             (dict(conditioning_scale=0.5), "conditioning_scale=0.5")]
    for kw, words in cases:
        with pytest.raises(InvalidArgument, match="is not a VACE checkpoint") as info:
            gen.generate(GenerationRequest(prompt="a cat", save_video=False, **kw))
        assert words in str(info.value)


def test_field_types():
    with pytest.raises(InvalidArgumentType, match="conditioning_scale='x'"):
        GenerationRequest(prompt="a", conditioning_scale="x")
    with pytest.raises(InvalidArgumentType, match="conditioning_scale=\\[1.0, inf\\]"):
        GenerationRequest(prompt="a", conditioning_scale=[1.0, float("inf")])
    with pytest.raises(InvalidArgumentType, match="mask=3"):
        GenerationRequest(prompt="a", mask=3)
    request = GenerationRequest(prompt="a", video=clip(), mask=box_mask(False), reference_images=references()[0],
                                conditioning_scale=[0.5, 2])
    again = from_json(GenerationRequest, to_json(request))
    assert again.conditioning_scale == (0.5, 2.0) and len(again.reference_images) == 1
    assert [np.asarray(f).tolist() for f in again.mask] == [np.asarray(f).tolist() for f in request.mask]


def test_the_generator_refuses_what_it_cannot_place(vace_ckpts):
    """A memory budget is refused for a VACE checkpoint (the planner does not place its control blocks); several
    processes are not (tests/vace/test_vace_parallel.py)."""
    from fastwan.checkpoint import resolve
    from fastwan.pipelines.vace import check_vace_generator

    ckpt = resolve(vace_ckpts["wan2.1-vace"])
    with pytest.raises(InvalidArgument, match="max_gpu_memory='10GiB': the memory planner does not place VACE"):
        check_vace_generator(ckpt, "10GiB")
    check_vace_generator(ckpt, None)


class Stop(Exception):
    pass


def test_cli_flags_reach_the_request(vace_ckpts, tmp_path, monkeypatch, capsys):
    seen = {}

    def fake(self, request, **kw):
        seen["request"] = request.request
        raise Stop

    monkeypatch.setattr(VideoGenerator, "generate", fake)
    frames = tmp_path / "v.gif"
    video = clip()
    video[0].save(frames, save_all=True, append_images=video[1:], duration=100, loop=0)
    mask = tmp_path / "m.gif"
    # distinct frames: a GIF stores a repeated frame once
    m = [Image.fromarray(np.roll(np.asarray(f), k, axis=1)) for k, f in enumerate(box_mask(True))]
    m[0].save(mask, save_all=True, append_images=m[1:], duration=100, loop=0)
    refs = []
    for i, img in enumerate(references()):
        refs += ["--reference-image", str(tmp_path / f"r{i}.png")]
        img.save(tmp_path / f"r{i}.png")
    args = ["generate", "--prompt", "a cat", "--model", str(vace_ckpts["wan2.1-vace"]), "--steps", "1",
            "--output", str(tmp_path / "out"), "--video", str(frames)]
    with pytest.raises(Stop):
        cli.main([*args, "--mask", str(mask), *refs, "--conditioning-scale", "0.5"])
    r = seen["request"]
    assert (r.mask, r.reference_images, r.conditioning_scale) == (str(mask), tuple(refs[1::2]), 0.5)
    assert cli.main([*args, "--strength", "0.5"]) == 2
    assert_one_error_line(capsys.readouterr().err, ["--strength 0.5", "video-to-video"], "strength")


def test_cli_refuses_vace_flags_elsewhere(tiny_ckpts, tmp_path, capsys):
    path = tmp_path / "r.png"
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(path)
    code = cli.main(["generate", "--prompt", "a cat", "--model", str(tiny_ckpts["wan2.1"]), "--output",
                     str(tmp_path / "out"), "--reference-image", str(path)])
    assert code == 2
    assert_one_error_line(capsys.readouterr().err, [str(path), "not a VACE checkpoint"], "reference")


def test_conditioning_scale_text():
    """--conditioning-scale (and a form field's text): one number, or one per VACE layer separated by commas."""
    from fastwan.fields import options

    parse = next(opt.parse for f, opt in options(GenerationRequest) if f.name == "conditioning_scale")
    assert parse("0.5") == 0.5 and parse("1,0.5") == [1.0, 0.5]
    with pytest.raises(ValueError, match="'1,x' is not a number or numbers separated by commas"):
        parse("1,x")
