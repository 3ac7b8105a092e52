"""Step caching (fastwan.cache) on tiny checkpoints, fp32 on the CPU: First-Block cache and MagCache skip the
same steps and give the same frames (within 1) as diffusers' hooks; TeaCache follows an independent float64
reference of its published rule; a threshold of 0 is no cache bit for bit; A14B starts fresh at the switch; bad
settings raise before any compute."""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from fastwan import VideoGenerator
from fastwan.cache import FirstBlockCache, MagCache, SkipSteps, TaylorSeer, TeaCache, parse_cache, teacache_model
from fastwan.errors import InvalidArgument, InvalidArgumentType
from fastwan.checkpoint.tiny import tiny_checkpoint

STEPS, SIZE = 10, dict(height=64, width=64, num_frames=9)
PROMPT, NEG = "a fox in the snow", "blurry"


@pytest.fixture(scope="module")
def gen():
    return VideoGenerator.from_pretrained("tiny", device="cpu", dtype=torch.float32)


def run(gen, **kw):
    return gen.generate_video(PROMPT, negative_prompt=NEG, seed=3, num_inference_steps=STEPS, guidance_scale=5.0,
                              save_video=False, **SIZE, **kw)


def diffusers_run(config, monkeypatch):
    """diffusers' WanPipeline on the tiny checkpoint with ``config`` enabled -> (frames, computed steps per pass):
    a transformer call computed its step when its last block's own forward ran."""
    from diffusers import WanPipeline
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock

    pipe = WanPipeline.from_pretrained(tiny_checkpoint("wan2.1"), torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    tail = pipe.transformer.blocks[-1]
    events: list[str] = []
    original = WanTransformerBlock.forward

    @functools.wraps(original)  # diffusers' hooks read the forward's signature
    def counted(self, *a, **k):
        if self is tail:
            events.append("tail")
        return original(self, *a, **k)

    monkeypatch.setattr(WanTransformerBlock, "forward", counted)  # before the hooks bind the forward
    pipe.transformer.register_forward_pre_hook(lambda *_: events.append("call"))
    pipe.transformer.enable_cache(config)
    out = pipe(PROMPT, negative_prompt=NEG, num_inference_steps=STEPS, guidance_scale=5.0, output_type="np",
               generator=torch.Generator().manual_seed(3), **SIZE).frames[0]
    calls = [i for i, e in enumerate(events) if e == "call"] + [len(events)]
    ran = ["tail" in events[a:b] for a, b in zip(calls, calls[1:])]
    computed = {"cond": [i for i, r in enumerate(ran[0::2]) if r], "uncond": [i for i, r in enumerate(ran[1::2]) if r]}
    return (out * 255).round().astype(np.uint8), computed


def expert_switch(g) -> int:
    """The first of STEPS steps that an A14B generator ``g`` runs on its low-noise expert (the timesteps of its
    scheduler against the checkpoint's boundary)."""
    sched = type(g.scheduler).from_config(g.scheduler.config)
    sched.set_timesteps(STEPS)
    boundary = g.checkpoint.boundary_ratio * sched.config.num_train_timesteps
    return next(i for i, t in enumerate(sched.timesteps.tolist()) if t < boundary)


def max_diff(a, b):
    return int(np.abs(a.astype(int) - b.astype(int)).max())


def test_first_block_cache_matches_diffusers(gen, monkeypatch):
    from diffusers.hooks import FirstBlockCacheConfig

    threshold = 0.2
    ours = run(gen, cache=FirstBlockCache(threshold))
    frames, computed = diffusers_run(FirstBlockCacheConfig(threshold=threshold), monkeypatch)
    assert ours.cache["computed"] == computed
    assert 2 <= len(computed["cond"]) < STEPS  # the threshold both skips and computes here
    assert max_diff(ours.frames, frames) <= 1


def test_magcache_matches_diffusers(gen, monkeypatch):
    from diffusers.hooks import MagCacheConfig

    # resampled to the step count by both; near 1 early (runs end at max_skip_steps), falling later (at the error)
    ratios = [1.0, 0.999, 0.998, 0.997, 0.99, 0.96, 0.93]
    ours = run(gen, cache=MagCache(threshold=0.05, max_skip_steps=2, retention_ratio=0.2, mag_ratios=ratios))
    frames, computed = diffusers_run(MagCacheConfig(threshold=0.05, max_skip_steps=2, retention_ratio=0.2,
                                                    num_inference_steps=STEPS, mag_ratios=ratios), monkeypatch)
    assert ours.cache["computed"] == computed
    assert 2 <= len(computed["cond"]) < STEPS
    assert max_diff(ours.frames, frames) <= 1


def teacache_reference(gen, threshold, coefficients, use_ret_steps) -> list[int]:
    """TeaCache's published rule in float64, on the tiny model's time embedding (e) or projection (e0) at the
    scheduler's timesteps: the steps whose blocks run."""
    model = gen.transformers[0]
    sched = type(gen.scheduler).from_config(gen.scheduler.config)
    sched.set_timesteps(STEPS)
    poly = np.poly1d(coefficients)
    ret, cutoff = (5, STEPS) if use_ret_steps else (1, STEPS - 1)
    computed, acc, prev = [], 0.0, None
    with torch.no_grad():
        for i, t in enumerate(sched.timesteps):
            temb, mod = model.condition_embedder.time(t.reshape(1), torch.float32)
            inp = (mod if use_ret_steps else temb).double()
            if i < ret or i >= cutoff:
                run_it, acc = True, 0.0
            else:
                acc += poly(((inp - prev).abs().mean() / prev.abs().mean()).item())
                run_it = acc >= threshold
                acc = 0.0 if run_it else acc
            prev = inp
            if run_it:
                computed.append(i)
    return computed


@pytest.mark.parametrize("use_ret_steps", [True, False])
def test_teacache_follows_the_published_rule(gen, use_ret_steps):
    coefficients, threshold = (0.5, 0.6, 0.0), 1.0  # 0.5x^2 + 0.6x: a rescaling of the published form
    want = teacache_reference(gen, threshold, coefficients, use_ret_steps)
    assert 2 <= len(want) < STEPS
    ours = run(gen, cache=TeaCache(threshold, coefficients=coefficients, use_ret_steps=use_ret_steps))
    assert ours.cache["computed"] == {"cond": want, "uncond": want}
    fixed = run(gen, cache=SkipSteps(tuple(i for i in range(STEPS) if i not in want)))
    assert np.array_equal(ours.frames, fixed.frames)  # a skipped step reuses the last computed residual


def test_published_teacache_coefficients_by_model():
    assert teacache_model("wan2.1", 1536, 480, 832) == "t2v-1.3b"
    assert teacache_model("wan2.1", 5120, 720, 1280) == "t2v-14b"
    assert teacache_model("wan2.1-i2v", 5120, 480, 832) == "i2v-480p"
    assert teacache_model("wan2.1-i2v", 5120, 720, 1280) == "i2v-720p"
    assert teacache_model("wan2.2-a14b", 5120, 720, 1280) is None
    with pytest.raises(InvalidArgument, match="no published coefficients"):
        VideoGenerator.from_pretrained("tiny", device="cpu", dtype=torch.float32, cache=TeaCache())


@pytest.mark.parametrize("cache", [FirstBlockCache(0), TeaCache(0, coefficients=(1.0, 0.0)),
                                   MagCache(threshold=0, mag_ratios=[1.0]), "first_block:threshold=0", "none"])
def test_threshold_zero_is_no_cache(gen, cache):
    base = run(gen)
    got = run(gen, cache=cache)
    assert got.cache is None and np.array_equal(got.frames, base.frames)


def test_fixed_first_block_schedule_equals_first_block_cache(gen):
    """SkipSteps(first_block=True) on the steps a First-Block cache skipped gives that run's frames bit for bit."""
    fbc = run(gen, cache=FirstBlockCache(0.2))
    skipped = tuple(i for i in range(STEPS) if i not in fbc.cache["computed"]["cond"])
    assert skipped and fbc.cache["computed"]["cond"] == fbc.cache["computed"]["uncond"]
    fixed = run(gen, cache=SkipSteps(skipped, first_block=True))
    assert fixed.cache["computed"] == fbc.cache["computed"] and np.array_equal(fixed.frames, fbc.frames)


def test_cache_composes_with_cfg_gating():
    g = VideoGenerator.from_pretrained("tiny", device="cpu", dtype=torch.float32, cfg_gate_step=0.5,
                                       cache=SkipSteps((3, 6)))
    r = run(g)
    assert r.cache["computed"] == {"cond": [0, 1, 2, 4, 5, 7, 8, 9], "uncond": [0, 1, 2, 4]}


def test_a14b_starts_fresh_at_the_switch():
    g = VideoGenerator.from_pretrained("tiny-wan2.2-a14b", device="cpu", dtype=torch.float32)
    switch = expert_switch(g)
    assert 1 < switch < STEPS - 1
    r = g.generate_video(PROMPT, negative_prompt=NEG, seed=3, num_inference_steps=STEPS, save_video=False,
                         cache=SkipSteps(tuple(range(1, STEPS))), **SIZE)
    # everything after step 0 would reuse a residual, but the second expert has none of its own at the switch
    assert r.cache["computed"] == {"cond": [0, switch], "uncond": [0, switch]}


@pytest.mark.parametrize("make,err", [
    (lambda: FirstBlockCache(-0.1), InvalidArgument),
    (lambda: FirstBlockCache("0.1"), InvalidArgumentType),
    (lambda: MagCache(), InvalidArgument),
    (lambda: MagCache(mag_ratios=[1.0, -0.5]), InvalidArgument),
    (lambda: MagCache(mag_ratios=[1.0], max_skip_steps=0), InvalidArgument),
    (lambda: MagCache(mag_ratios=[1.0], retention_ratio=1.5), InvalidArgument),
    (lambda: TeaCache(coefficients=[]), InvalidArgument),
    (lambda: TeaCache(use_ret_steps="yes"), InvalidArgumentType),
    (lambda: SkipSteps((0, 2)), InvalidArgument),
    (lambda: parse_cache("deepcache"), InvalidArgument),
    (lambda: parse_cache("teacache:thresh=0.1"), InvalidArgument),
    (lambda: parse_cache("magcache:threshold=abc"), InvalidArgument),
    (lambda: parse_cache("magcache:mag_ratios=@/nonexistent.json"), InvalidArgument),
])
def test_bad_settings_raise(make, err):
    with pytest.raises(err):
        make()


def test_bad_cache_raises_before_compute(gen, monkeypatch):
    monkeypatch.setattr(type(gen), "_generate", lambda *a, **k: pytest.fail("computed"))
    with pytest.raises(InvalidArgumentType, match="cache=42"):
        run(gen, cache=42)
    with pytest.raises(InvalidArgument, match="no published coefficients"):
        run(gen, cache=TeaCache())


def test_parse_cache_forms(tmp_path):
    f = tmp_path / "r.json"
    f.write_text("[1.0, 0.98, 0.95]")
    assert parse_cache("magcache:threshold=0.1,mag_ratios=@" + str(f)) == MagCache(0.1, mag_ratios=[1.0, 0.98, 0.95])
    assert parse_cache("skip_steps:steps=2-4/7") == SkipSteps((2, 3, 4, 7))
    assert parse_cache("teacache:use_ret_steps=false,coefficients=1/0") == TeaCache(coefficients=(1.0, 0.0),
                                                                                      use_ret_steps=False)
    assert parse_cache("skip_steps:steps=3,first_block=true") == SkipSteps((3,), first_block=True)
    assert parse_cache("none") is None and parse_cache("first_block") == FirstBlockCache()


@pytest.mark.parametrize("block", ["fast", "reference"])
@pytest.mark.parametrize("config", [FirstBlockCache(0.5), SkipSteps((1, 3)), SkipSteps((2,), first_block=True),
                                    TaylorSeer(2, 1, max_order=2, taylor_factors_dtype="float32")])
def test_cached_forward_cfg_equals_two_cached_forwards(block, config):
    """forward_cfg with both passes' caches (block 0's video half shared, the fast block adding into the stream in
    place) gives what two forward() calls with their own caches give, step after step, skipped or computed."""
    from fastwan.attention import AttentionDispatch
    from fastwan.cache import CacheRun
    from fastwan.models import load_transformer
    from fastwan.models.wan.step_cache import apply_step_cache, remove_step_cache
    from fastwan.options import DiTOptions

    attn = AttentionDispatch.resolve("TORCH_SDPA", device="cpu", dtype=torch.float32, head_dim=12)
    model = load_transformer(tiny_checkpoint("wan2.1") / "transformer", dtype=torch.float32, device="cpu",
                             attention=attn, options=DiTOptions(block=block))
    g = torch.Generator().manual_seed(0)
    text = torch.randn(1, 512, model.config.text_dim, generator=g)
    text[:, 6:] = 0
    uncond = torch.zeros_like(text)
    pair, single = CacheRun(config, 4), CacheRun(config, 4)
    with torch.no_grad():
        for step, t in enumerate((900.0, 700.0, 500.0, 300.0)):
            x = torch.randn(1, 16, 3, 8, 8, generator=g)
            tt = torch.tensor([t])
            apply_step_cache(model, pair)
            got = model.forward_cfg(x, tt, text, uncond, batched=False, step_index=step, num_steps=4)
            remove_step_cache(model)
            hook, want = apply_step_cache(model, single), []
            for name, c in zip(("cond", "uncond"), (text, uncond)):
                hook.select(name)
                want.append(model(x, tt, c, step_index=step, num_steps=4))
            remove_step_cache(model)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert pair.report()["computed"] == single.report()["computed"]
    assert len(pair.report()["computed"]["cond"]) < 4  # something was skipped


def test_cache_errors_name_the_argument_and_a_reachable_range():
    with pytest.raises(InvalidArgument, match=r"^cache='none:threshold=1' \(CLI --cache\): 'none' takes no settings"):
        parse_cache("none:threshold=1")
    with pytest.raises(InvalidArgument, match=r"^cache='bogus' \(CLI --cache\): unknown type 'bogus'"):
        parse_cache("bogus")
    with pytest.raises(InvalidArgument, match=r"threshold=inf\): must be a finite number >= 0.0\.$"):
        FirstBlockCache(threshold=float("inf"))
