"""Audit of the denoising loop against diffusers' WanPipeline (fp32, tiny checkpoints): CFG gating's numbers
against diffusers with the gating rule applied to its passes, the expert switch at a boundary that equals a
timestep in the scheduler's precision."""
import json
import shutil

import pytest
import torch
from diffusers import WanPipeline

from fastwan import VideoGenerator
from tests.pipelines.latents import generate_with_latents
from tests.pipelines.test_cfg import record_batches

SIZE = dict(height=64, width=64, num_frames=5)


def diffusers_latents(path, seed, gate=None, **kw):
    """WanPipeline's final latents (output_type="latent"); with ``gate`` (a fraction in [0, 1]) the unconditional
    pass of every step from ``int(steps * gate)`` on is replaced by cond - delta, delta = cond - uncond of the
    expert's last full step (FastVideo's CFG gating, written here on diffusers' own passes)."""
    pipe = WanPipeline.from_pretrained(path, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    if gate is not None:
        gate_at = int(kw["num_inference_steps"] * gate)
        state = {"calls": 0, "delta": None, "model": None, "cond": None}
        for name in ("transformer", "transformer_2"):
            model = getattr(pipe, name)
            if model is None:
                continue

            def forward(*a, _orig=model.forward, _name=name, **k):
                step, uncond = divmod(state["calls"], 2)
                state["calls"] += 1
                if state["model"] != _name:  # a new expert: its own delta
                    state["model"], state["delta"] = _name, None
                if not uncond:
                    state["cond"] = _orig(*a, **k)[0]
                    return (state["cond"],)
                if step >= gate_at and state["delta"] is not None:
                    return (state["cond"] - state["delta"],)
                out = _orig(*a, **k)[0]
                state["delta"] = state["cond"] - out
                return (out,)

            model.forward = forward
    return pipe("a boat at sea", negative_prompt="ugly", generator=torch.Generator("cpu").manual_seed(seed),
                output_type="latent", **SIZE, **kw).frames


def fastwan_latents(gen, **kw) -> torch.Tensor:
    """The final latents of one fastwan video (what its VAE decode receives)."""
    return generate_with_latents(gen, "a boat at sea", negative_prompt="ugly", seed=5, save_video=False, **SIZE,
                                 **kw)[1]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("variant,gate,kw,passes", [
    # 4 steps at 0.3: int(1.2) = 1 full step, then the uncond pass is skipped
    ("wan2.1", 0.3, dict(guidance_scale=30.0), [2, 1, 1, 1]),
    # A14B (switch after 2 of 4 steps) at 0.0: each expert's first step runs full CFG, low-noise scale 20
    ("wan2.2-a14b", 0.0, dict(guidance_scale=4.0, guidance_scale_2=20.0), [2, 1, 2, 1]),
])
def test_gated_cfg_matches_diffusers_with_the_gating_rule(tiny_ckpts, variant, gate, kw, passes):
    path = tiny_ckpts[variant]
    gen = VideoGenerator.from_pretrained(path, device="cpu", dtype=torch.float32, cfg_gate_step=gate)
    calls = record_batches(gen)
    got = fastwan_latents(gen, num_inference_steps=4, **kw)
    assert [b for _, b in calls] == passes
    want = diffusers_latents(path, 5, gate=gate, num_inference_steps=4, **kw)
    assert rel(got, want) < 2e-5
    plain = diffusers_latents(path, 5, num_inference_steps=4, **kw)
    assert rel(plain, want) > 2e-4  # the gating acts: plain CFG gives other latents (10x the tolerance)


def test_expert_switch_compares_in_the_timesteps_precision(tiny_ckpts, tmp_path):
    """diffusers picks the high-noise expert where ``t >= boundary_ratio * 1000`` with t a tensor element of the
    scheduler's timesteps (int64, compared in float32): a boundary 1e-5 above the timestep 900 still picks the
    high-noise expert at t = 900. The 4 steps' timesteps are 999, 900, 750, 500."""
    path = tmp_path / "a14b"
    shutil.copytree(tiny_ckpts["wan2.2-a14b"], path)
    index = json.loads((path / "model_index.json").read_text())
    index["boundary_ratio"] = 0.90000001
    (path / "model_index.json").write_text(json.dumps(index))
    gen = VideoGenerator.from_pretrained(path, device="cpu", dtype=torch.float32)
    calls = record_batches(gen)
    kw = dict(num_inference_steps=4, guidance_scale=4.0, guidance_scale_2=3.0)
    got = fastwan_latents(gen, **kw)
    sched = type(gen.scheduler).from_config(gen.scheduler.config)
    sched.set_timesteps(4)
    high = (sched.timesteps >= index["boundary_ratio"] * 1000).tolist()  # diffusers' comparison
    assert sched.timesteps.tolist()[1] == 900 and high == [True, True, False, False]
    assert [e for e, _ in calls] == [0, 0, 1, 1]
    assert rel(got, diffusers_latents(path, 5, **kw)) < 2e-5



@pytest.mark.parametrize("prompt", ["&nbsp;", "&amp;nbsp; &#32;", "\ufeff", "  \u3000 "])
def test_a_prompt_empty_once_cleaned_is_refused_before_compute(no_compute, prompt):
    """Wan's prompt cleaning (ftfy, HTML unescaped twice, whitespace collapsed) turns these into '': refused as an
    empty prompt, as '' is, before the text encoder runs."""
    from fastwan.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match=r"prompt=.* is empty once cleaned"):
        no_compute.generate_video(prompt, save_video=False, **SIZE)
