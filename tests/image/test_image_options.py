"""Image to video with the other options (tiny checkpoints, fp32, CPU), each against an independent reference:
step caches against diffusers' hooks on ``WanImageToVideoPipeline`` (the same computed steps per pass, frames
within 1; TI2V's image mode and FLF2V's last frame included), tiled VAE against diffusers' ``enable_tiling`` (which
tiles the image's encoding too), LoRAs on every layer (image cross-attention and the layers outside the blocks)
loaded after a video against a fresh generator with them, and the DMD checkpoint under step caches and LoRAs
against its plain path."""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from fastwan import VideoGenerator
from fastwan.cache import FirstBlockCache, MagCache, TeaCache
from fastwan.options import DiTOptions
from fastwan.checkpoint.tiny import tiny_checkpoint
from tests.image.test_image_shapes_parity import picture

pytest.importorskip("peft")
PROMPT, NEG, SIZE = "a fox in the snow", "blurry", dict(height=64, width=64, num_frames=9)
IMAGES = dict(image=picture(40, 60), last_image=picture(50, 50, 1))
RATIOS = [1.0, 0.999, 0.998, 0.997, 0.99, 0.96, 0.93]  # MagCache: near 1 early, falling later


def image_kw(variant: str) -> dict:
    return dict(IMAGES) if "flf2v" in variant else {"image": IMAGES["image"]}


def diffusers_i2v(variant: str, monkeypatch, *, cache=None, tiles=None, steps: int):
    """diffusers' WanImageToVideoPipeline on the tiny checkpoint -> (uint8 frames, computed steps per pass; a
    transformer call computed its step when its last block's own forward ran)."""
    from diffusers import WanImageToVideoPipeline
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock

    pipe = WanImageToVideoPipeline.from_pretrained(tiny_checkpoint(variant), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    dits = [t for t in (pipe.transformer, pipe.transformer_2) if t is not None]
    tails, events = [t.blocks[-1] for t in dits], []
    original = WanTransformerBlock.forward

    @functools.wraps(original)  # diffusers' hooks read the forward's signature
    def counted(self, *a, **k):
        if any(self is t for t in tails):
            events.append("tail")
        return original(self, *a, **k)

    monkeypatch.setattr(WanTransformerBlock, "forward", counted)  # before the hooks bind the forward
    for dit in dits:
        dit.register_forward_pre_hook(lambda *_: events.append("call"))
        if cache is not None:
            dit.enable_cache(cache)
    if tiles:
        pipe.vae.enable_tiling(**tiles)
    out = pipe(prompt=PROMPT, negative_prompt=NEG, num_inference_steps=steps, guidance_scale=5.0, output_type="np",
               generator=torch.Generator().manual_seed(3), **SIZE, **image_kw(variant)).frames[0]
    calls = [i for i, e in enumerate(events) if e == "call"] + [len(events)]
    ran = ["tail" in events[a:b] for a, b in zip(calls, calls[1:])]
    computed = {"cond": [i for i, r in enumerate(ran[0::2]) if r], "uncond": [i for i, r in enumerate(ran[1::2]) if r]}
    return (out * 255).round().astype(int), computed


def load(variant: str, **kw) -> VideoGenerator:
    return VideoGenerator.from_pretrained(tiny_checkpoint(variant), device="cpu", dtype=torch.float32, **kw)


def run(gen, variant: str, steps: int, **kw):
    return gen.generate_video(PROMPT, negative_prompt=NEG, seed=3, num_inference_steps=steps, guidance_scale=5.0,
                              save_video=False, **SIZE, **image_kw(variant), **kw)


# -- step caches on image-to-video ----------------------------------------------------------------------------------
@pytest.mark.parametrize("variant,method", [
    ("wan2.1-i2v", "first_block"), ("wan2.1-i2v", "magcache"), ("wan2.1-flf2v", "magcache"),
    ("wan2.2-ti2v", "first_block"), ("wan2.2-ti2v", "magcache"), ("wan2.2-i2v-a14b", "first_block"),
])
def test_image_to_video_step_cache_matches_diffusers_hooks(variant, method, monkeypatch):
    """Each pass computes the steps diffusers' hooks compute (CLIP image tokens, FLF2V's last frame, TI2V's
    per-token timesteps with the image at t=0, A14B's second expert fresh at the switch), frames within 1."""
    from diffusers.hooks import FirstBlockCacheConfig, MagCacheConfig

    steps = 10
    if method == "first_block":
        ours, theirs = FirstBlockCache(0.2), FirstBlockCacheConfig(threshold=0.2)
    else:
        ours = MagCache(threshold=0.05, max_skip_steps=2, retention_ratio=0.2, mag_ratios=RATIOS)
        theirs = MagCacheConfig(threshold=0.05, max_skip_steps=2, retention_ratio=0.2, num_inference_steps=steps,
                                mag_ratios=RATIOS)
    res = run(load(variant), variant, steps, cache=ours)
    want, computed = diffusers_i2v(variant, monkeypatch, cache=theirs, steps=steps)
    assert res.cache["computed"] == computed
    assert 1 <= len(computed["cond"]) < steps  # the cache skipped steps here
    assert want.std() > 5 and np.abs(res.frames.astype(int) - want).max() <= 1


@pytest.mark.parametrize("variant", ["wan2.1-flf2v", "wan2.2-i2v-a14b", "wan2.2-ti2v"])
def test_image_to_video_caches_computing_every_step_are_no_cache(variant):
    """Thresholds no step's change stays under: the frames of no cache, bit for bit under the reference block; within 1
    under the fast block, whose First-Block path settles its deferred residual add after block 0 (rounding)."""
    caches = [FirstBlockCache(1e-9), TeaCache(1e-9, coefficients=(1.0, 0.0), use_ret_steps=False),
              MagCache(1e-9, mag_ratios=(0.5, 0.5))]
    for block in ("fast", "reference"):
        gen = load(variant, dit_options=DiTOptions(block=block))
        base = run(gen, variant, 6).frames
        for cache in caches:
            res = run(gen, variant, 6, cache=cache)
            assert res.cache["computed"]["cond"] == list(range(6)), (block, cache)
            tolerance = 0 if block == "reference" else 1
            assert np.abs(res.frames.astype(int) - base.astype(int)).max() <= tolerance, (block, cache)


# -- tiled VAE with an image ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["wan2.1-i2v", "wan2.1-flf2v", "wan2.2-ti2v"])
def test_image_to_video_vae_tiling_matches_diffusers_tiled(variant, monkeypatch):
    tiles = dict(tile_sample_min_height=32, tile_sample_min_width=32, tile_sample_stride_height=16,
                 tile_sample_stride_width=16)
    got = run(load(variant, vae_tiling=tiles), variant, 3).frames.astype(int)
    want, _ = diffusers_i2v(variant, monkeypatch, tiles=tiles, steps=3)
    assert np.abs(got - want).max() <= 1
    assert np.abs(got - run(load(variant), variant, 3).frames.astype(int)).max() > 5  # the tiles really blend


# -- LoRAs on every layer, loaded after a video ---------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["wan2.1-i2v", "wan2.1-flf2v", "wan2.2-i2v-a14b", "wan2.2-ti2v"])
def test_full_lora_after_an_image_video_equals_a_fresh_generator(variant, tmp_path):
    """A LoRA on the image cross-attention (add_k_proj / add_v_proj), the image and text embedders, the time
    projection and the head, per expert, loaded after a video under the fast block (which caches each request's
    image and text keys / values): a fresh generator's frames; unloading gives the first video again."""
    from tests.lora.test_lora_formats import Lora

    used, fresh = (load(variant, dit_options=DiTOptions(block="fast")) for _ in range(2))
    base = run(used, variant, 3).frames
    for i, model in enumerate(used.transformers):
        lo = Lora(model, seed=5 + i)
        lo.add(lo.modules(image="blocks.0.attn2.add_k_proj" in dict(model.named_modules()), top=True),
               "diffusion_model.")
        path = tmp_path / f"expert{i}.safetensors"
        save_file(lo.sd, str(path))
        expert = i if len(used.transformers) > 1 else None
        used.load_lora(path, 1.0, expert=expert)
        fresh.load_lora(path, 1.0, expert=expert)
    got = run(used, variant, 3).frames
    assert np.array_equal(got, run(fresh, variant, 3).frames)
    assert np.abs(got.astype(int) - base.astype(int)).max() > 10
    used.unload_lora()
    assert np.array_equal(run(used, variant, 3).frames, base)


# -- DMD (FastWan) --------------------------------------------------------------------------------------------------
def dmd_frames(gen, **kw):
    return gen.generate_video(PROMPT, negative_prompt=NEG, seed=3, save_video=False, **SIZE, **kw)


def test_dmd_caches_computing_every_step_are_no_cache():
    gen = load("fastwan2.1")
    base = dmd_frames(gen).frames
    for cache in (FirstBlockCache(1e-9), MagCache(1e-9, mag_ratios=(0.5, 0.5)), MagCache(calibrate=True)):
        res = dmd_frames(gen, cache=cache)
        assert res.cache["computed"]["cond"] == [0, 1, 2] and np.array_equal(res.frames, base), cache


def test_dmd_lora_fast_block_sequential_equals_reference_block(tmp_path):
    """FastWan with a LoRA (and its VSA gates): the fast block under sequential CFG gives the reference block's
    frames within 1, with guidance 1 (the preset) and with CFG."""
    from tests.lora.helpers import random_lora

    ref = load("fastwan2.1", dit_options=DiTOptions(block="reference"), cfg_mode="batched")
    path = tmp_path / "dmd.safetensors"
    save_file(random_lora(ref.transformers[0], "wan", seed=2, alpha=4.0), str(path))
    base = dmd_frames(ref).frames.astype(int)
    ref.load_lora(path, 0.8)
    fast = load("fastwan2.1", dit_options=DiTOptions(block="fast"), cfg_mode="sequential", lora=(path, 0.8))
    for kw in ({}, {"guidance_scale": 4.0}):
        want = dmd_frames(ref, **kw).frames.astype(int)
        assert np.abs(dmd_frames(fast, **kw).frames.astype(int) - want).max() <= 1
    assert np.abs(want - base).max() > 10


def magcache_reference(ratios, steps: int, switch: int, threshold: float, max_skip: int, retention: float) -> list:
    """MagCache's rule as the README states it for A14B: the ratio curve (nearest-resampled to the step count) and
    the retention steps by the request's step index, the accumulators and the residual fresh at the switch."""
    curve = [ratios[round(i * (len(ratios) - 1) / (steps - 1))] for i in range(steps)]
    computed, have, ratio, run_length, err = [], False, 1.0, 0, 0.0
    for i in range(steps):
        if i == switch:
            have, ratio, run_length, err = False, 1.0, 0, 0.0
        if i >= int(retention * steps + 0.5):
            ratio, run_length = ratio * curve[i], run_length + 1
            err += abs(1.0 - ratio)
            if have and err <= threshold and run_length <= max_skip:
                continue
            ratio, run_length, err = 1.0, 0, 0.0
        computed.append(i)
        have = True
    return computed


def test_a14b_image_magcache_indexes_ratios_by_the_request_step():
    gen = load("wan2.2-i2v-a14b")
    sched = type(gen.scheduler).from_config(gen.scheduler.config)
    sched.set_timesteps(10)
    boundary = gen.checkpoint.boundary_ratio * sched.config.num_train_timesteps
    switch = next(i for i, t in enumerate(sched.timesteps.tolist()) if t < boundary)
    assert 2 < switch < 9
    res = run(gen, "wan2.2-i2v-a14b", 10, cache=MagCache(threshold=0.05, max_skip_steps=2, retention_ratio=0.2,
                                                          mag_ratios=RATIOS))
    want = magcache_reference(RATIOS, 10, switch, 0.05, 2, 0.2)
    assert res.cache["computed"] == {"cond": want, "uncond": want}
    assert switch in want and len(want) < 10
