"""Image-to-video on the tiny Wan2.1 I2V, FLF2V and Wan2.2 I2V-A14B checkpoints: diffusers' WanImageToVideoPipeline
loads and runs them; fastwan's DiT reads their transformers with the inputs of fastwan.pipelines.image as
diffusers' does; generate_video(image=, last_image=) gives diffusers' frames; the task rules hold before compute."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from fastwan import VideoGenerator
from fastwan.attention import AttentionDispatch
from fastwan.errors import InvalidArgument
from fastwan.models import load_transformer
from fastwan.options import DiTOptions
from fastwan.pipelines.image import clip_tokens, condition_latents, pixels
from fastwan.checkpoint.tiny import IMAGE_VARIANTS, write_tiny_checkpoint
from tests.pipelines.latents import generate_with_latents


@pytest.fixture(scope="module", params=IMAGE_VARIANTS)
def image_ckpt(request, tmp_path_factory):
    return request.param, write_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


def frames(seed):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8))


def test_diffusers_runs_the_tiny_image_checkpoints(image_ckpt):
    from diffusers import WanImageToVideoPipeline

    variant, path = image_ckpt
    pipe = WanImageToVideoPipeline.from_pretrained(path)
    extra = {"last_image": frames(1)} if variant == "wan2.1-flf2v" else {}
    out = pipe(image=frames(0), prompt="a fox", height=32, width=32, num_frames=5, num_inference_steps=2,
               output_type="np", generator=torch.Generator().manual_seed(0), **extra).frames[0]
    assert out.shape == (5, 32, 32, 3) and np.isfinite(out).all()


@pytest.mark.parametrize("block", ["reference", "fast"])
def test_fastwan_dit_reads_the_tiny_image_transformers(image_ckpt, block):
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import CLIPImageProcessor, CLIPVisionModel

    variant, path = image_ckpt
    ref = WanTransformer3DModel.from_pretrained(path / "transformer").eval()
    attn = AttentionDispatch.resolve("TORCH_SDPA", device="cpu", dtype=torch.float32, head_dim=12)
    model = load_transformer(path / "transformer", dtype=torch.float32, device="cpu", attention=attn,
                             options=DiTOptions(block=block))
    vae = AutoencoderKLWan.from_pretrained(path / "vae").eval()
    last = pixels(frames(1), 32, 32, 8) if variant == "wan2.1-flf2v" else None
    cond = condition_latents(vae, pixels(frames(0), 32, 32, 8), last, 5)
    x = torch.cat([torch.randn(1, 16, *cond.shape[2:], generator=torch.Generator().manual_seed(0)), cond], dim=1)
    text = torch.zeros(1, 512, 32)
    text[:, :4] = torch.randn(1, 4, 32)
    image = None
    if variant != "wan2.2-i2v-a14b":  # Wan2.2 I2V reads no CLIP tokens
        images = [frames(0)] + ([frames(1)] if variant == "wan2.1-flf2v" else [])
        image = clip_tokens(CLIPVisionModel.from_pretrained(path / "image_encoder").eval(),
                            CLIPImageProcessor.from_pretrained(path / "image_processor"), images)
    t = torch.tensor([600.0])
    with torch.no_grad():
        want = ref(x, t, text, encoder_hidden_states_image=image, return_dict=False)[0]
        got = model(x, t, text, image=image)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("guidance,negative", [(5.0, "blurry"), (4.0, None), (1.0, None)])
def test_pipeline_matches_diffusers(image_ckpt, guidance, negative):
    """generate_video(image=[, last_image=]) against diffusers' WanImageToVideoPipeline: same frames (fp32, CPU),
    with and without a negative prompt (fastwan's default is Wan's own, given to diffusers explicitly), A14B across
    its expert switch (6 steps)."""
    from diffusers import WanImageToVideoPipeline

    from fastwan.checkpoint.presets import WAN_NEGATIVE_PROMPT

    variant, path = image_ckpt
    extra = {"last_image": frames(1)} if variant in ("wan2.1-flf2v", "wan2.2-i2v-a14b") else {}
    kw = dict(height=64, width=64, num_frames=9, num_inference_steps=4, guidance_scale=guidance)
    if variant == "wan2.2-i2v-a14b":
        kw.update(guidance_scale_2=guidance - 0.5 if guidance > 1 else guidance, num_inference_steps=6)
    gen = VideoGenerator.from_pretrained(path, device="cpu", dtype=torch.float32)
    # frames within 1 hardly see the conditioning on tiny random DiTs (another first image moves them by 2 to 4):
    # the decoded latents do
    res, latents = generate_with_latents(gen, "a fox in the snow", image=frames(0), negative_prompt=negative, seed=5,
                                         save_video=False, **extra, **kw)
    pipe = WanImageToVideoPipeline.from_pretrained(path, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    seen = {}

    def last_latents(pipe, i, t, tensors):  # after the last step: what diffusers decodes (no expand_timesteps here)
        seen["z"] = tensors["latents"].detach().clone()
        return {}

    want = pipe(image=frames(0), prompt="a fox in the snow", negative_prompt=negative or WAN_NEGATIVE_PROMPT,
                output_type="np", generator=torch.Generator("cpu").manual_seed(5), callback_on_step_end=last_latents,
                **extra, **kw).frames[0]
    want = (want * 255).round().astype(np.uint8)
    assert res.frames.shape == want.shape == (9, 64, 64, 3) and want.std() > 5
    assert np.abs(res.frames.astype(int) - want.astype(int)).max() <= 1
    torch.testing.assert_close(latents, seen["z"], rtol=0, atol=1e-5)


def test_image_rules_before_any_compute(image_ckpt, tiny_ckpts):
    variant, path = image_ckpt
    gen = VideoGenerator.from_pretrained(path, device="cpu", dtype=torch.float32)
    with pytest.raises(InvalidArgument, match="makes a video from an image: pass image="):
        gen.generate_video("a fox", save_video=False)
    if variant == "wan2.1-flf2v":
        with pytest.raises(InvalidArgument, match="needs last_image="):
            gen.generate_video("a fox", image=frames(0), save_video=False)
    if variant == "wan2.1-i2v":
        with pytest.raises(InvalidArgument, match="needs a first-last-frame checkpoint"):
            gen.generate_video("a fox", image=frames(0), last_image=frames(1), save_video=False)
    t2v = VideoGenerator.from_pretrained(tiny_ckpts["wan2.1"], device="cpu", dtype=torch.float32)
    with pytest.raises(InvalidArgument, match="is text-to-video"):
        t2v.generate_video("a fox", image=frames(0), save_video=False)


def test_default_size_follows_the_image(image_ckpt):
    variant, _ = image_ckpt
    gen = VideoGenerator.from_pretrained(f"tiny-{variant}", device="cpu", dtype=torch.float32)  # 64 x 64 preset
    wide = Image.fromarray(np.zeros((30, 60, 3), dtype=np.uint8))
    extra = {"last_image": wide} if variant != "wan2.1-i2v" else {}
    res = gen.generate_video("a fox", image=wide, seed=1, save_video=False, num_inference_steps=1, num_frames=5,
                             **extra)
    assert res.frames.shape[1:3] == (32, 80)  # the 64 x 64 preset area at 2:1, each side rounded down to 16


def test_ti2v_image_mode_matches_diffusers(tiny_ckpts):
    """Wan2.2-TI2V-5B with an image: the first latent frame is the image's, at timestep 0 through the per-token
    timesteps (diffusers' WanImageToVideoPipeline with expand_timesteps); frames equal to diffusers'."""
    from diffusers import WanImageToVideoPipeline

    path = tiny_ckpts["wan2.2-ti2v"]
    kw = dict(height=64, width=64, num_frames=9, num_inference_steps=4, guidance_scale=5.0)
    gen = VideoGenerator.from_pretrained(path, device="cpu", dtype=torch.float32)
    res, latents = generate_with_latents(gen, "a fox", image=frames(0), negative_prompt="blurry", seed=2,
                                         save_video=False, **kw)
    pipe = WanImageToVideoPipeline.from_pretrained(path, dtype=torch.float32)
    assert pipe.config.expand_timesteps
    pipe.set_progress_bar_config(disable=True)
    want = pipe(image=frames(0), prompt="a fox", negative_prompt="blurry", output_type="np",
                generator=torch.Generator("cpu").manual_seed(2), **kw).frames[0]
    want = (want * 255).round().astype(np.uint8)
    assert res.frames.shape == want.shape and want.std() > 5
    assert np.abs(res.frames.astype(int) - want.astype(int)).max() <= 1
    want_z = pipe(image=frames(0), prompt="a fox", negative_prompt="blurry", output_type="latent",
                  generator=torch.Generator("cpu").manual_seed(2), **kw).frames  # the first frame the image's
    torch.testing.assert_close(latents, want_z, rtol=0, atol=1e-5)
    text_only = gen.generate_video("a fox", negative_prompt="blurry", seed=2, save_video=False, **kw)
    assert np.abs(text_only.frames.astype(int) - res.frames.astype(int)).max() > 8  # the image really conditions
    with pytest.raises(InvalidArgument, match="TI2V-5B: its image mode fixes the first frame only"):
        gen.generate_video("a fox", image=frames(0), last_image=frames(1), save_video=False, **kw)


def test_wan21_i2v_area_follows_the_checkpoint_name(tmp_path, monkeypatch):
    """Wan2.1-I2V-14B-480P and -720P share one config: the name (folder or Hub id) picks the preset's area, and
    the default size follows it with the image's aspect ratio. (A tiny DiT gets the tiny preset under any name:
    here the tiny checkpoints stand for published-width ones.)"""
    from huggingface_hub import constants

    from fastwan.checkpoint.resolver import resolve
    from fastwan.checkpoint.tiny import write_hub_cache

    monkeypatch.setattr("fastwan.checkpoint.presets.PUBLISHED_MIN_WIDTH", 0)
    src = write_tiny_checkpoint(tmp_path / "src", "wan2.1-i2v")
    (tmp_path / "exports_720p").mkdir()
    for name, area in [("Wan2.1-I2V-14B-720P-Diffusers", 720 * 1280), ("Wan2.1-I2V-14B-480P-Diffusers", 480 * 832),
                       ("my-i2v", 480 * 832), ("exports_720p/Wan2.1-I2V-14B-480P-Diffusers", 480 * 832),
                       ("exports_720p/i2v", 480 * 832), ("i2v-720p-not-480p", 480 * 832)]:
        folder = tmp_path / name  # only the checkpoint's own folder name counts, not its parents'
        folder.symlink_to(src, target_is_directory=True)
        preset = resolve(folder).preset
        assert (preset.height * preset.width, preset.num_inference_steps) == (area, 40), name
    cache = tmp_path / "hub"
    write_hub_cache(src, cache, "Wan-AI/Wan2.1-I2V-14B-720P-Diffusers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert resolve("Wan-AI/Wan2.1-I2V-14B-720P-Diffusers").preset.height == 720
    snapshot = next((cache / "models--Wan-AI--Wan2.1-I2V-14B-720P-Diffusers" / "snapshots").iterdir())
    assert resolve(snapshot).preset.height == 720  # a snapshot folder passed as a path: its repository's name
    flf = write_tiny_checkpoint(tmp_path / "Wan2.1-FLF2V-14B-720P-Diffusers", "wan2.1-flf2v")
    assert resolve(flf).preset.height == 720  # FLF2V is a 720P model whatever its name
