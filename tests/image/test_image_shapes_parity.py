"""Image-to-video against diffusers' WanImageToVideoPipeline at shapes and inputs the other parity tests skip (fp32,
CPU, tiny checkpoints; uint8 frames within 1 and the decoded latents within 1e-5, the latents being what sees the
image on tiny random DiTs): portrait and landscape sizes that are multiples of 16 but not 32, images whose aspect
ratio differs from the video's and far smaller or larger than it, 1 and 13 frames, a last image of another size,
guidance 1, Wan2.2-I2V-A14B with one expert only (its boundary_ratio past every timestep, or below every one),
TI2V-5B at multiples of 32 but not 64; and images as a diffusers user hands them over through ``load_image``
(greyscale, RGBA, palette with transparency, CMYK, a photo with an EXIF orientation) or as strided uint8 views;
16-bit greyscale is the one deliberate difference (load_image clips it, fastwan keeps the high byte:
test_image_modes.py).
Where diffusers rounds with a warning (num_frames to 4k+1, TI2V-5B's sides down to 32), fastwan raises before any
compute, naming the two nearest values."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from fastwan import VideoGenerator
from fastwan.errors import InvalidArgument
from fastwan.checkpoint.tiny import write_tiny_checkpoint
from tests.pipelines.latents import generate_with_latents
from tests.pipelines.test_cfg import record_batches

I2V, FLF, A14B, TI2V = "wan2.1-i2v", "wan2.1-flf2v", "wan2.2-i2v-a14b", "wan2.2-ti2v"
ONLY_LOW, ONLY_HIGH = 0.9995, 0.01  # A14B boundary ratios: above the first timestep (999), below the last


def picture(h: int, w: int, seed: int = 0) -> Image.Image:
    """A gradient with noise (so that resizing and cropping change it), h x w RGB."""
    y, x = np.mgrid[0:h, 0:w]
    grad = np.stack([x * 255 / max(w - 1, 1), y * 255 / max(h - 1, 1), (x + y) * 97 % 256], -1)
    noise = np.random.default_rng(seed).integers(0, 60, (h, w, 3))
    return Image.fromarray((grad + noise).clip(0, 255).astype(np.uint8))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (fastwan generator, diffusers pipeline), loaded on first use: the four image variants and two A14B
    copies whose boundary_ratio leaves one expert."""
    from diffusers import WanImageToVideoPipeline

    root = tmp_path_factory.mktemp("image-shapes")
    loaded = {}

    def get(name: str):
        if name not in loaded:
            variant, _, ratio = name.partition("@")
            path = root / name
            if ratio:  # a copy of the variant's checkpoint with another boundary_ratio
                get(variant)
                shutil.copytree(root / variant, path)
                index = json.loads((path / "model_index.json").read_text())
                (path / "model_index.json").write_text(json.dumps({**index, "boundary_ratio": float(ratio)}))
            else:
                write_tiny_checkpoint(path, variant)
            pipe = WanImageToVideoPipeline.from_pretrained(path, dtype=torch.float32)
            pipe.set_progress_bar_config(disable=True)
            loaded[name] = VideoGenerator.from_pretrained(path, device="cpu", dtype=torch.float32), pipe
        return loaded[name]

    return get


def diffusers_video(pipe, image, **kw):
    """diffusers' uint8 frames and the normalised latents its VAE decoded (as fastwan's decode receives them)."""
    seen = {}
    decode = pipe.vae.decode

    def keep(z, *a, **k):
        seen["z"] = z.detach().clone()
        return decode(z, *a, **k)

    pipe.vae.decode = keep
    try:
        frames = pipe(image=image, output_type="np", **kw).frames[0]
    finally:
        del pipe.vae.decode
    cfg = pipe.vae.config
    mean = torch.tensor(cfg.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(cfg.latents_std).view(1, -1, 1, 1, 1)
    return (frames * 255).round().astype(np.uint8), (seen["z"] - mean) / std


def compare(models, name, image, reference=None, *, last=None, negative=None, **kw):
    """fastwan's video of ``image`` (and ``last``) against diffusers' of ``reference`` (``load_image``'s reading of
    ``image`` when None); returns the latents' largest difference. A None negative prompt is fastwan's default
    (Wan's own), given to diffusers explicitly."""
    from diffusers.utils import load_image

    from fastwan.checkpoint.presets import WAN_NEGATIVE_PROMPT

    gen, pipe = models(name)
    extra = {} if last is None else {"last_image": last}
    res, latents = generate_with_latents(gen, "a fox in the snow", image=image, negative_prompt=negative, seed=4,
                                         save_video=False, **extra, **kw)
    s = res.settings
    if last is not None:
        extra = {"last_image": load_image(last)}
    scales = {k: s[k] for k in ("guidance_scale", "guidance_scale_2") if s[k] is not None}
    want, want_z = diffusers_video(
        pipe, load_image(image) if reference is None else reference, prompt="a fox in the snow",
        negative_prompt=WAN_NEGATIVE_PROMPT if negative is None else negative, height=s["height"],
        width=s["width"], num_frames=s["num_frames"], num_inference_steps=s["num_inference_steps"],
        generator=torch.Generator("cpu").manual_seed(4), **scales, **extra)
    assert res.frames.shape == want.shape == (s["num_frames"], s["height"], s["width"], 3)
    assert want.std() > 5  # a picture, not a constant
    assert np.abs(res.frames.astype(int) - want.astype(int)).max() <= 1
    assert latents.shape == want_z.shape
    return float((latents - want_z).abs().max())


SHAPES = [  # (model, image, last image, generate_video arguments)
    (I2V, (30, 70), None, dict(height=80, width=48, num_frames=5)),  # portrait video of a landscape image
    (I2V, (7, 5), None, dict(height=48, width=112, num_frames=1)),  # a tiny image, one frame
    (I2V, (300, 500), None, dict(height=32, width=48, num_frames=13, guidance_scale=1.0)),
    (I2V, (90, 40), None, dict(num_frames=5, width=48)),  # height from the image's aspect ratio: 96
    (FLF, (40, 60), (100, 30), dict(height=48, width=80, num_frames=5, negative="")),  # last in latent frame 1
    (A14B, (40, 60), None, dict(height=48, width=80, num_frames=1, num_inference_steps=6)),
    (A14B, (40, 60), (10, 90), dict(height=80, width=48, num_frames=5, num_inference_steps=6, guidance_scale=3.0,
                                   guidance_scale_2=1.0)),
    (TI2V, (50, 30), None, dict(height=32, width=96, num_frames=1)),  # the image alone, at timestep 0
    (TI2V, (300, 200), None, dict(height=96, width=32, num_frames=13, guidance_scale=1.0)),
]


@pytest.mark.parametrize("name,size,last,kw", SHAPES, ids=[
    "i2v-portrait", "i2v-1-frame", "i2v-large-image-13-frames-g1", "i2v-height-from-image",
    "flf2v-5-frames-empty-negative", "a14b-1-frame", "a14b-last-low-expert-g1", "ti2v-1-frame",
    "ti2v-portrait-13-frames-g1"])
def test_shapes_match_diffusers(models, name, size, last, kw):
    kw = {"num_inference_steps": 2, **kw}
    last = None if last is None else picture(*last, seed=1)
    assert compare(models, name, picture(*size), last=last, **kw) <= 1e-5


@pytest.mark.parametrize("ratio,experts", [(ONLY_LOW, {1}), (ONLY_HIGH, {0})])
def test_a14b_with_one_expert_matches_diffusers(models, ratio, experts):
    """A boundary_ratio above every timestep runs the low-noise expert alone, one below every timestep the
    high-noise one alone, as diffusers' ``t >= boundary`` rule does."""
    name = f"{A14B}@{ratio}"
    calls = record_batches(models(name)[0])
    assert compare(models, name, picture(40, 60), height=48, width=48, num_frames=5, num_inference_steps=3) <= 1e-5
    assert {expert for expert, _ in calls} == experts


def _exif_photo(path, pixels, orientation):
    exif = Image.Exif()
    exif[0x0112] = orientation  # the EXIF orientation tag
    Image.fromarray(pixels).save(path, exif=exif.tobytes())
    return str(path)


BASE = np.asarray(picture(60, 44))
RGBA = np.concatenate([BASE, np.random.default_rng(1).integers(0, 256, (60, 44, 1), dtype=np.uint8)], -1)


def _palette_with_transparency():
    img = Image.fromarray(BASE).quantize(16)
    img.info["transparency"] = 3
    return img


IMAGES = {  # PIL images and files as a user passes them
    "greyscale": lambda tmp: Image.fromarray(BASE).convert("L"),
    "bilevel": lambda tmp: Image.fromarray(BASE).convert("1"),
    "greyscale-alpha": lambda tmp: Image.fromarray(RGBA).convert("LA"),
    "rgba": lambda tmp: Image.fromarray(RGBA),
    "palette": lambda tmp: Image.fromarray(BASE).quantize(16),
    "palette-transparency": lambda tmp: _palette_with_transparency(),
    "cmyk": lambda tmp: Image.fromarray(BASE).convert("CMYK"),
    "ycbcr": lambda tmp: Image.fromarray(BASE).convert("YCbCr"),
    "exif-rotated-jpeg": lambda tmp: _exif_photo(tmp / "phone.jpg", BASE, 6),
    "exif-mirrored-png": lambda tmp: _exif_photo(tmp / "mirrored.png", BASE, 5),
}
VIEWS = {  # uint8 arrays that are views with odd strides
    "bgr-view": BASE[..., ::-1],
    "every-2nd-row-3rd-column": BASE[::2, ::3],
    "transposed": BASE.transpose(1, 0, 2),
    "flipped": BASE[::-1, ::-1],
    "fortran-order": np.asfortranarray(BASE),
    "rgb-of-rgba": RGBA[..., :3],
    "rgba-of-wider-array": np.dstack([RGBA, RGBA])[..., 2:6],
    "grey-channel": BASE[..., 1],
}


def _user_and_diffusers_images(kind, tmp):
    """(what a user passes, what diffusers' pipeline gets for it)."""
    from diffusers.utils import load_image

    if kind in VIEWS:
        view = VIEWS[kind]
        assert not view.flags.c_contiguous
        return view, load_image(Image.fromarray(np.ascontiguousarray(view)))
    image = IMAGES[kind](tmp)
    return image, load_image(image)


@pytest.mark.parametrize("kind", sorted(IMAGES) + sorted(VIEWS))
def test_image_kinds_read_as_diffusers_load_image(tmp_path, kind):
    """Every kind reads to load_image's RGB pixels exactly (EXIF orientation applied, modes converted as Pillow
    converts them to RGB, alpha dropped), so everything after (resize, VAE, CLIP) is diffusers' own."""
    from fastwan.pipelines.image import read_image

    image, want = _user_and_diffusers_images(kind, tmp_path)
    got = read_image(image)
    assert got.mode == want.mode == "RGB" and got.size == want.size
    assert np.array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("kind", ["rgba", "exif-rotated-jpeg", "bgr-view"])
def test_image_kinds_match_diffusers(models, tmp_path, kind):
    """The whole pipeline on three of those kinds: Wan2.1-I2V reads the image twice, for the VAE and for CLIP."""
    image, reference = _user_and_diffusers_images(kind, tmp_path)
    assert compare(models, I2V, image, reference, height=48, width=32, num_frames=1, num_inference_steps=2) <= 1e-5


def test_the_comparison_sees_the_image(models):
    """The latents tell images apart where frames on tiny random DiTs hardly do: a mirrored reference moves them
    far past the 1e-5 the tests above allow."""
    image = picture(60, 44)
    with pytest.raises(AssertionError):  # frames may still agree; latents do not
        assert compare(models, I2V, image, image.transpose(Image.Transpose.FLIP_LEFT_RIGHT), height=48, width=32,
                       num_frames=1, num_inference_steps=2) <= 1e-3


@pytest.mark.parametrize("name,kw,match", [
    (I2V, dict(num_frames=8), r"num_frames=8 is not 4k\+1.*use 5 or 9"),  # diffusers: 9 frames
    (A14B, dict(num_frames=10), r"num_frames=10 is not 4k\+1.*use 9 or 13"),  # diffusers: 9 frames
    (TI2V, dict(height=48, width=64), r"height=48 is not a multiple of 32.*use 32 or 64"),  # diffusers: 32
    (TI2V, dict(height=64, width=80), r"width=80 is not a multiple of 32.*use 64 or 96"),  # diffusers: 64
    (FLF, dict(height=40, width=48), r"height=40 is not a multiple of 16.*use 32 or 48"),  # diffusers raises too
])
def test_what_diffusers_rounds_is_refused_before_compute(models, forbid_compute, name, kw, match):
    """fastwan's rule: an invalid size is a clear error before compute, never a silent change; diffusers warns
    and rounds num_frames (n // 4 * 4 + 1) and sides that are multiples of 16 (down to 32 for TI2V-5B)."""
    gen = forbid_compute(models(name)[0])
    extra = {"last_image": picture(20, 20, seed=1)} if name == FLF else {}
    with pytest.raises(InvalidArgument, match=match):
        gen.generate_video("a fox", image=picture(40, 40), save_video=False, **extra, **kw)
