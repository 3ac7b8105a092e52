"""Batched vs sequential CFG, and CFG gating (Adaptive Guidance); the denoising loop against diffusers' WanPipeline
(fp32, tiny checkpoints): CFG gating's numbers against diffusers with the gating rule applied to its passes, the
expert switch at a boundary that equals a timestep in the scheduler's precision."""
import json
import shutil

import numpy as np
import pytest
import torch
from diffusers import WanPipeline

from fastwan import VideoGenerator
from tests.pipelines.latents import generate_with_latents

SIZE = dict(height=64, width=64, num_frames=5)


def record_batches(gen):
    """Wrap every expert's forward and forward_cfg; return the list of (expert, passes) per call (a CFG call
    counts its two passes, batched or not)."""
    calls = []
    for i, m in enumerate(gen.transformers):
        orig, orig_cfg = m.forward, m.forward_cfg

        def fwd(x, *a, _orig=orig, _i=i, **k):
            calls.append((_i, x.shape[0]))
            return _orig(x, *a, **k)

        def fwd_cfg(x, *a, _orig=orig_cfg, _i=i, **k):
            calls.append((_i, 2 * x.shape[0]))
            return _orig(x, *a, **k)

        m.forward, m.forward_cfg = fwd, fwd_cfg
    return calls


def make(path, **kw):
    return VideoGenerator.from_pretrained(path, device="cpu", dtype=torch.float32, **kw)


def run(gen, steps=8, **kw):
    return gen.generate_video("a boat at sea", negative_prompt="ugly", seed=5, save_video=False,
                              num_inference_steps=steps, **SIZE, **kw)


def test_gate_one_is_plain_cfg_byte_identical(tiny_ckpts):
    plain = run(make(tiny_ckpts["wan2.1"]))
    gated = run(make(tiny_ckpts["wan2.1"], cfg_gate_step=1.0))
    assert np.array_equal(plain.frames, gated.frames)
    assert plain.num_transformer_forwards == gated.num_transformer_forwards == 16


def test_gate_half_skips_exactly_the_second_half(tiny_ckpts):
    gen = make(tiny_ckpts["wan2.1"], cfg_gate_step=0.5)
    calls = record_batches(gen)
    res = run(gen, steps=8)
    assert [b for _, b in calls] == [2, 2, 2, 2, 1, 1, 1, 1]
    assert res.num_transformer_forwards == 12
    plain = run(make(tiny_ckpts["wan2.1"]))
    assert not np.array_equal(plain.frames, res.frames)  # gating changes the result (it is an approximation)


def test_gate_from_env(tiny_ckpts, monkeypatch):
    monkeypatch.setenv("FASTVIDEO_CFG_GATE_STEP", "0.25")
    gen = make(tiny_ckpts["wan2.1"])
    calls = record_batches(gen)
    run(gen, steps=8)
    assert [b for _, b in calls] == [2, 2, 1, 1, 1, 1, 1, 1]


def test_gate_refreshes_after_expert_switch(tiny_ckpts):
    gen = make(tiny_ckpts["wan2.2-a14b"], cfg_gate_step=0.0)
    calls = record_batches(gen)
    run(gen, steps=8, guidance_scale=4.0, guidance_scale_2=3.0)
    experts = [e for e, _ in calls]
    switch = experts.index(1)
    assert 0 < switch < 8
    # first step of each expert runs full CFG (batch 2) to get its own delta; the rest are gated
    expected = [2] + [1] * (switch - 1) + [2] + [1] * (8 - switch - 1)
    assert [b for _, b in calls] == expected


def record_block_batches(gen):
    """A forward pre-hook on every DiT block of every expert; returns the list of (expert, block, batch size of the
    hidden states) per block call."""
    calls = []
    for e, model in enumerate(gen.transformers):
        for b, block in enumerate(model.blocks):
            block.register_forward_pre_hook(lambda mod, args, _e=e, _b=b: calls.append((_e, _b, args[0].x.shape[0])))
    return calls


def test_sequential_equals_batched(tiny_ckpts):
    """forward_cfg runs block 0 as its halves (the self-attention half once, at batch 1) and calls blocks 1.. per
    pass: sequential CFG as two batch-1 passes per step, batched CFG as one batch-2 pass. The frames agree up to
    rounding."""
    steps = 4
    gens = {mode: make(tiny_ckpts["wan2.1"], cfg_mode=mode) for mode in ("batched", "sequential")}
    layers = len(gens["batched"].transformers[0].blocks)
    assert layers >= 2  # else no block is called per pass
    after_start = list(range(1, layers))
    expected = {"batched": [(0, b, 2) for b in after_start] * steps,
                "sequential": [(0, b, 1) for b in after_start] * 2 * steps}
    frames = {}
    for mode, gen in gens.items():
        passes, blocks = record_batches(gen), record_block_batches(gen)
        frames[mode] = run(gen, steps=steps).frames
        assert [b for _, b in passes] == [2] * steps, mode  # one CFG call (two passes) per step
        assert blocks == expected[mode], mode
    assert np.abs(frames["batched"].astype(int) - frames["sequential"].astype(int)).max() <= 1


@pytest.mark.parametrize("variant", ["wan2.1", "wan2.2-ti2v"])
def test_forward_cfg_equals_two_forwards(tiny_ckpts, variant):
    """forward_cfg computes the passes' shared start once; its outputs equal two plain forwards (fp32, eager:
    the same ops on the same values, so equal to rounding of the batch-2 GEMMs)."""
    gen = make(tiny_ckpts[variant])
    model = gen.transformers[0]
    cfg = model.config
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, cfg.in_channels, 2, 8, 6, generator=g)
    tokens = 2 * 4 * 3
    t = torch.tensor([500.0])
    ts = t.expand(1, tokens) if gen.checkpoint.expand_timesteps else t
    cond, uncond = (torch.randn(1, 7, cfg.text_dim, generator=g) for _ in range(2))
    with torch.no_grad():
        want = model(x, ts, cond), model(x, ts, uncond)
        assert not torch.allclose(want[0], want[1], atol=1e-3)  # the two passes differ
        for batched in (True, False):
            got = model.forward_cfg(x, ts, cond, uncond, batched=batched)
            for a, b in zip(got, want):
                assert a.shape == b.shape == x.shape[:1] + b.shape[1:]
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="one sample"):
        model.forward_cfg(torch.cat([x, x]), ts, cond, uncond)
    with pytest.raises(ValueError, match="same length"):
        model.forward_cfg(x, ts, cond, uncond[:, :5])


def test_auto_cfg_mode(tiny_ckpts):
    gen = make(tiny_ckpts["wan2.1"])
    assert gen.cfg_mode == "auto"
    assert gen._cfg_batched(10**6)  # off CUDA: one batch
    gen.device = torch.device("cuda")  # the decision alone (nothing runs)
    from fastwan.pipelines.setup import AUTO_SEQUENTIAL_TOKENS
    assert gen._cfg_batched(AUTO_SEQUENTIAL_TOKENS - 1) and not gen._cfg_batched(AUTO_SEQUENTIAL_TOKENS)


def test_no_cfg_when_scale_is_one(tiny_ckpts):
    gen = make(tiny_ckpts["wan2.1"])
    calls = record_batches(gen)
    run(gen, steps=3, guidance_scale=1.0)
    assert [b for _, b in calls] == [1, 1, 1]


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan")])
def test_gate_out_of_range_raises(tiny_ckpts, bad):
    with pytest.raises(ValueError, match="cfg_gate_step"):
        make(tiny_ckpts["wan2.1"], cfg_gate_step=bad)


def test_gate_env_out_of_range_raises(tiny_ckpts, monkeypatch):
    monkeypatch.setenv("FASTVIDEO_CFG_GATE_STEP", "2")
    with pytest.raises(ValueError, match="FASTVIDEO_CFG_GATE_STEP"):
        make(tiny_ckpts["wan2.1"])


# ---- the denoising loop against diffusers -------------------------------------------------------------------------
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
