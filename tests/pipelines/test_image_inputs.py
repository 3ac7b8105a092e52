"""The image side of image-to-video (fastwan.pipelines.image) against diffusers' WanImageToVideoPipeline on the
tiny checkpoint's VAE and a tiny CLIP vision encoder: the condition latents with their frame mask, the CLIP tokens,
and the image reading and default size rules."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from fastwan.errors import InvalidArgument, InvalidArgumentType
from fastwan.pipelines.image import clip_tokens, condition_latents, default_size, pixels, read_image


def picture(h=40, w=56, seed=0, mode="RGB"):
    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    return img.convert(mode)


def test_read_image_accepts_pil_arrays_and_files(tmp_path):
    rgba = picture(mode="RGBA")
    assert read_image(rgba).mode == "RGB"
    grey = np.asarray(picture(mode="L"))
    assert read_image(grey).mode == "RGB" and read_image(grey).size == (56, 40)
    arr = np.asarray(picture())
    assert np.array_equal(np.asarray(read_image(arr)), arr)
    path = tmp_path / "first.png"
    picture().save(path)
    assert np.array_equal(np.asarray(read_image(str(path))), arr)


def test_read_image_refuses_what_it_cannot_read(tmp_path):
    with pytest.raises(InvalidArgument, match="no such file"):
        read_image(tmp_path / "missing.png")
    bad = tmp_path / "notes.png"
    bad.write_text("not an image")
    with pytest.raises(InvalidArgument, match="notes.png.*not a readable image"):
        read_image(bad)
    with pytest.raises(InvalidArgument, match="np.uint8"):
        read_image(np.zeros((4, 4, 3), dtype=np.float32))
    with pytest.raises(InvalidArgument, match="H x W x 3"):
        read_image(np.zeros((4, 4, 2), dtype=np.uint8))
    with pytest.raises(InvalidArgument, match="0 x 4 pixels; it must not be empty"):
        read_image(np.zeros((4, 0, 3), dtype=np.uint8))
    with pytest.raises(InvalidArgumentType, match="last_image=int"):
        read_image(3, name="last_image")


def test_default_size_keeps_the_aspect_at_the_area():
    # the Wan / diffusers example rule: round(sqrt(area * aspect)) // mod * mod
    assert default_size(picture(720, 1280), 480 * 832, 16) == (464, 832)
    assert default_size(picture(1280, 720), 480 * 832, 16) == (832, 464)
    assert default_size(picture(100, 100), 480 * 832, 16) == (624, 624)
    assert default_size(picture(1, 4000), 480 * 832, 16)[0] == 16  # never below one multiple
    # a derived side past the model's reach (max_side: RoPE range x multiple) names the image, not a given size
    assert default_size(picture(1, 4000), 480 * 832, 16, max_side=40000) == (16, 39968)
    with pytest.raises(InvalidArgument, match=r"image is 4000 x 1 pixels.*side of 39968 pixels, more than this "
                                              r"model's 16384; pass height= and width="):
        default_size(picture(1, 4000), 480 * 832, 16, max_side=16384)
    assert default_size(picture(1, 4000), 480 * 832, 16, 32, 64, max_side=16384) == (32, 64)  # given: as given


@pytest.fixture(scope="module")
def vae(tiny_ckpts):
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan.from_pretrained(tiny_ckpts["wan2.1"] / "vae").eval()


@pytest.mark.parametrize("last", [False, True])
def test_condition_latents_match_diffusers(vae, last):
    from diffusers import WanImageToVideoPipeline

    from fastwan.vae.decode import vae_scale_factors

    ft, fs = vae_scale_factors(vae)
    frames, h, w = 9, 32, 48
    first = pixels(picture(), h, w, fs)
    end = pixels(picture(seed=1), h, w, fs) if last else None
    fake = SimpleNamespace(vae=vae, vae_scale_factor_temporal=ft, vae_scale_factor_spatial=fs,
                           config=SimpleNamespace(expand_timesteps=False))
    noise = torch.zeros(1, vae.config.z_dim, (frames - 1) // ft + 1, h // fs, w // fs)
    with torch.no_grad():
        _, want = WanImageToVideoPipeline.prepare_latents(fake, first, 1, vae.config.z_dim, h, w, frames,
                                                          torch.float32, "cpu", None, noise, end)
    got = condition_latents(vae, first, end, frames)
    assert got.shape == want.shape == (1, ft + vae.config.z_dim, 3, h // fs, w // fs)
    assert torch.equal(got, want)
    assert got[0, :ft, 0].eq(1).all() and got[0, :ft, 1].eq(0).all()
    # the last latent frame's 4 slots are video frames 5..8: only the last one is given, for first-last-frame only
    assert got[0, ft - 1, -1].eq(1 if last else 0).all() and got[0, :ft - 1, -1].eq(0).all()


def test_clip_tokens_match_diffusers():
    from diffusers import WanImageToVideoPipeline
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(0)
    encoder = CLIPVisionModel(CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                                               num_attention_heads=2, image_size=32, patch_size=8)).eval()
    processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    images = [picture(), picture(seed=1)]
    fake = SimpleNamespace(image_encoder=encoder, image_processor=processor)
    with torch.no_grad():
        want = WanImageToVideoPipeline.encode_image(fake, images, device=torch.device("cpu"))
    got = clip_tokens(encoder, processor, images)
    assert got.shape == (2, 17, 16)  # 16 patches + the class token, penultimate layer
    assert torch.equal(got, want)
