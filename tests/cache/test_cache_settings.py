"""Step-cache settings, each refused or honoured as written (never accepted and then ignored or misread): the CLI
form's duplicate keys and bad step ranges, a SkipSteps that skips nothing or names steps the request lacks, a
calibrating MagCache turned off by its (unused) threshold, calibration output fed back as MagCache's curve;
MagCache's calibration against diffusers' and TeaCache's coefficients against the published TeaCache4Wan2.1
tables."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fastwan import VideoGenerator
from fastwan.cache import (
    FirstBlockCache,
    MagCache,
    SkipSteps,
    TeaCache,
    check_cache,
    parse_cache,
    resolve_coefficients,
)
from fastwan.errors import InvalidArgument, InvalidArgumentType
from fastwan.checkpoint.tiny import tiny_checkpoint

STEPS, SIZE = 6, dict(height=64, width=64, num_frames=9)
PROMPT, NEG = "a fox in the snow", "blurry"


@pytest.fixture(scope="module")
def gen():
    return VideoGenerator.from_pretrained("tiny", device="cpu", dtype=torch.float32)


def run(gen, **kw):
    kw = {"num_inference_steps": STEPS, **kw}
    return gen.generate_video(PROMPT, negative_prompt=NEG, seed=3, guidance_scale=5.0, save_video=False, **SIZE, **kw)


@pytest.mark.parametrize("text,match", [
    ("teacache:threshold=0.1,threshold=0.2", "threshold is given twice"),
    ("skip_steps:steps=2,steps=3", "steps is given twice"),
    ("skip_steps:steps=5-2", "a <= b"),  # used to be an empty range: nothing skipped
    ("skip_steps:steps=1--3", "a <= b"),
    ("skip_steps:steps=1-100000000000", "at most"),  # used to be a MemoryError
    ("skip_steps", "no step to skip"),
    ("skip_steps:steps=-3", "step indices >= 1"),
    ("teacache:use_ret_steps=yes", "must be true or false"),  # the specific message is kept
    ("magcache:mag_ratios=@/nonexistent/r.json", "cannot read a JSON list"),
    ("magcache:calibrate=true,mag_ratios=1/0.9", "ratios would be ignored"),
])
def test_cli_form_refuses(text, match):
    with pytest.raises(InvalidArgument, match=match):
        parse_cache(text)


def test_empty_skip_steps_refused():
    with pytest.raises(InvalidArgument, match="no step to skip"):
        SkipSteps(())


def test_skip_steps_beyond_the_request_refused_before_denoising(gen, monkeypatch):
    monkeypatch.setattr(type(gen), "_denoise", lambda *a, **k: pytest.fail("denoised"))
    for cache in (SkipSteps((2, STEPS)), "skip_steps:steps=4-9"):
        with pytest.raises(InvalidArgument, match=f"do not exist in this request of {STEPS} step"):
            run(gen, cache=cache)
    with pytest.raises(InvalidArgument, match="of 1 step"):
        resolve_coefficients(SkipSteps((1,)), "wan2.1", 1536, 480, 832, num_steps=1)
    resolve_coefficients(SkipSteps((STEPS - 1,)), "wan2.1", 1536, 480, 832, num_steps=STEPS)


def test_last_step_still_skippable(gen):
    r = run(gen, cache=SkipSteps((STEPS - 1,)))
    want = list(range(STEPS - 1))
    assert r.cache["computed"] == {"cond": want, "uncond": want}


@pytest.mark.parametrize("cache,fewest", [
    (FirstBlockCache(1e9), 2),
    (TeaCache(1e9, coefficients=(1.0, 0.0), use_ret_steps=True), 6),
    (TeaCache(1e9, coefficients=(1.0, 0.0), use_ret_steps=False), 3),
    (MagCache(1e9, max_skip_steps=100, retention_ratio=0.9, mag_ratios=[1.0]), 6),
])
def test_cache_that_cannot_skip_refused(gen, monkeypatch, cache, fewest):
    """Thresholds that skip whenever the rule allows: at ``fewest`` steps the run skips a step; one step fewer,
    where the rule can skip nothing, is refused before denoising (it used to run silently as no cache)."""
    r = run(gen, cache=cache, num_inference_steps=fewest)
    assert len(r.cache["computed"]["cond"]) < fewest and len(r.cache["computed"]["uncond"]) < fewest
    monkeypatch.setattr(type(gen), "_denoise", lambda *a, **k: pytest.fail("denoised"))
    for steps in range(1, fewest):
        with pytest.raises(InvalidArgument, match=f"cannot skip any step of a request of {steps} step"):
            run(gen, cache=cache, num_inference_steps=steps)
    with pytest.raises(InvalidArgument, match="cannot skip any step"):  # a few-step DMD request
        run(gen, cache=cache, sampler="dmd", num_inference_steps=None, timesteps=(1000, 757, 522, 300, 99)[:fewest - 1])


def test_calibration_runs_at_any_step_count(gen):
    r = run(gen, cache=MagCache(calibrate=True), num_inference_steps=1)
    assert r.cache["computed"] == {"cond": [0], "uncond": [0]} and r.cache["calibration"]["cond"] == [1.0]


def diffusers_calibration(monkeypatch) -> dict:
    """diffusers' MagCache calibration on the tiny checkpoint: the ratios each pass's state recorded."""
    from diffusers import WanPipeline
    from diffusers.hooks import MagCacheConfig
    from diffusers.hooks import mag_cache as mc

    recorded: dict[int, list[float]] = {}
    original = mc.MagCacheBlockHook._perform_calibration_step

    def record(self, state, residual):
        original(self, state, residual)
        recorded.setdefault(id(state), []).append(state.calibration_ratios[-1])

    monkeypatch.setattr(mc.MagCacheBlockHook, "_perform_calibration_step", record)
    pipe = WanPipeline.from_pretrained(tiny_checkpoint("wan2.1"), torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    pipe.transformer.enable_cache(MagCacheConfig(calibrate=True, num_inference_steps=STEPS))
    pipe(PROMPT, negative_prompt=NEG, num_inference_steps=STEPS, guidance_scale=5.0, output_type="np",
         generator=torch.Generator().manual_seed(3), **SIZE)
    cond, uncond = recorded.values()  # the conditional pass runs first
    return {"cond": cond, "uncond": uncond}


def test_calibration_matches_diffusers_and_ignores_threshold(gen, monkeypatch):
    want = diffusers_calibration(monkeypatch)
    for cache in (MagCache(calibrate=True), MagCache(threshold=0, calibrate=True), "magcache:calibrate=1,threshold=0"):
        r = run(gen, cache=cache)
        assert r.cache is not None, cache  # a threshold of 0 used to turn the calibration off
        assert r.cache["computed"] == {"cond": list(range(STEPS)), "uncond": list(range(STEPS))}
        for name in ("cond", "uncond"):
            np.testing.assert_allclose(r.cache["calibration"][name], want[name], rtol=1e-4)


def test_calibration_output_feeds_magcache(gen):
    calibration = run(gen, cache=MagCache(calibrate=True)).cache["calibration"]
    with pytest.raises(InvalidArgumentType, match=r"\['cond'\]"):
        MagCache(mag_ratios=calibration)
    assert MagCache(mag_ratios=calibration["cond"]).mag_ratios == tuple(calibration["cond"])
    with pytest.raises(InvalidArgument, match=r"result.cache\['calibration'\]\['cond'\]"):
        MagCache()


def test_threshold_zero_is_off_except_calibration():
    assert check_cache("teacache:threshold=0") is None and check_cache("magcache:threshold=0,mag_ratios=1") is None
    assert check_cache(MagCache(threshold=0, calibrate=True)) == MagCache(threshold=0, calibrate=True)


# TeaCache4Wan2.1 (teacache_generate.py): use_ret_steps reads the time projection with these polynomials...
RET = {"t2v-1.3b": [-5.21862437e+04, 9.23041404e+03, -5.28275948e+02, 1.36987616e+01, -4.99875664e-02],
       "t2v-14b": [-3.03318725e+05, 4.90537029e+04, -2.65530556e+03, 5.87365115e+01, -3.15583525e-01],
       "i2v-480p": [2.57151496e+05, -3.54229917e+04, 1.40286849e+03, -1.35890334e+01, 1.32517977e-01],
       "i2v-720p": [8.10705460e+03, 2.13393892e+03, -3.72934672e+02, 1.66203073e+01, -4.17769401e-02]}
# ... and without it the time embedding with these
PLAIN = {"t2v-1.3b": [2.39676752e+03, -1.31110545e+03, 2.01331979e+02, -8.29855975e+00, 1.37887774e-01],
         "t2v-14b": [-5784.54975374, 5449.50911966, -1811.16591783, 256.27178429, -13.02252404],
         "i2v-480p": [-3.02331670e+02, 2.23948934e+02, -5.25463970e+01, 5.87348440e+00, -2.01973289e-01],
         "i2v-720p": [-114.36346466, 65.26524496, -18.82220707, 4.91518089, -0.23412683]}


@pytest.mark.parametrize("model,variant,dim,size", [
    ("t2v-1.3b", "wan2.1", 1536, (480, 832)), ("t2v-14b", "wan2.1", 5120, (720, 1280)),
    ("i2v-480p", "wan2.1-i2v", 5120, (480, 832)), ("i2v-720p", "wan2.1-i2v", 5120, (720, 1280))])
@pytest.mark.parametrize("ret", [True, False])
def test_teacache_published_coefficients(model, variant, dim, size, ret):
    got = resolve_coefficients(TeaCache(0.1, use_ret_steps=ret), variant, dim, *size)
    assert list(got) == (RET if ret else PLAIN)[model]


@pytest.mark.parametrize("variant,dim", [("wan2.2-a14b", 5120), ("wan2.2-ti2v", 3072), ("wan2.1-flf2v", 5120),
                                         ("wan2.2-i2v-a14b", 5120), ("wan2.1-i2v", 1536)])
def test_teacache_without_published_coefficients_refused(variant, dim):
    with pytest.raises(InvalidArgument, match="no published coefficients"):
        resolve_coefficients(TeaCache(0.1), variant, dim, 720, 1280)
    assert resolve_coefficients(TeaCache(0.1, coefficients=(1.0, 0.0)), variant, dim, 720, 1280) == (1.0, 0.0)
