"""Guidance per expert: a two-expert video runs CFG where an expert's scale is above 1, also when only
guidance_scale_2 is (diffusers ignores guidance_scale_2 unless guidance_scale > 1); a step whose expert's scale is
1 runs the conditional pass alone; guidance_scale_2 on a one-DiT checkpoint is refused."""
import numpy as np
import pytest
import torch

from fastwan import VideoGenerator
from fastwan.errors import InvalidArgument
from tests.pipelines.test_pipeline_parity import SIZE, reference_frames


def test_low_noise_guidance_alone_matches_diffusers(tiny_ckpts):
    """guidance 1 on the high-noise expert and 40 on the low-noise one (large enough to show in a tiny random
    model): diffusers at a high-noise scale of 1 + 1e-6 (so that it runs CFG at all) is the reference; the
    high-noise steps run one forward each, the others two."""
    path = tiny_ckpts["wan2.2-a14b"]
    gen = VideoGenerator.from_pretrained(path, device="cpu", dtype=torch.float32)
    kw = dict(num_inference_steps=6, guidance_scale_2=40.0)
    res = gen.generate_video("a cat walks on the grass", negative_prompt="blurry", seed=11, save_video=False,
                             guidance_scale=1.0, **SIZE, **kw)
    want = reference_frames(path, "a cat walks on the grass", "blurry", 11, guidance_scale=1.0 + 1e-6, **SIZE, **kw)
    assert np.abs(res.frames.astype(int) - want.astype(int)).max() <= 1
    sched = type(gen.scheduler).from_config(gen.scheduler.config)
    sched.set_timesteps(6)
    high = sum(t >= gen.checkpoint.boundary_ratio * 1000 for t in sched.timesteps.tolist())
    assert 0 < high < 6 and res.num_transformer_forwards == high + 2 * (6 - high)
    plain = gen.generate_video("a cat walks on the grass", negative_prompt="blurry", seed=11, save_video=False,
                               guidance_scale=1.0, guidance_scale_2=1.0, **SIZE, num_inference_steps=6)
    assert plain.num_transformer_forwards == 6
    assert np.abs(res.frames.astype(int) - plain.frames.astype(int)).max() > 1  # the low-noise guidance acts


def test_guidance_scale_2_needs_two_experts(tiny_ckpts):
    gen = VideoGenerator.from_pretrained(tiny_ckpts["wan2.1"], device="cpu", dtype=torch.float32)
    with pytest.raises(InvalidArgument, match=r"guidance_scale_2=9.0 .* this checkpoint has one DiT"):
        gen.generate_video("a fox", guidance_scale_2=9.0, save_video=False, **SIZE)


def test_guidance_scale_alone_sets_both_experts(tiny_ckpts):
    """As in diffusers, a guidance_scale without guidance_scale_2 is both experts' scale (not the preset's 3.0 for
    the low-noise one); guidance_scale=1 alone therefore runs no CFG at all (a step-distilled LoRA's setting)."""
    path = tiny_ckpts["wan2.2-a14b"]
    gen = VideoGenerator.from_pretrained(path, device="cpu", dtype=torch.float32)
    res = gen.generate_video("a red kite", negative_prompt="blurry", seed=2, save_video=False, guidance_scale=6.0,
                             num_inference_steps=4, **SIZE)
    want = reference_frames(path, "a red kite", "blurry", 2, guidance_scale=6.0, num_inference_steps=4, **SIZE)
    assert np.abs(res.frames.astype(int) - want.astype(int)).max() <= 1
    assert res.settings["guidance_scale_2"] == 6.0
    one = gen.generate_video("a red kite", seed=2, save_video=False, guidance_scale=1.0, num_inference_steps=4, **SIZE)
    assert one.num_transformer_forwards == 4
