"""TaylorSeer (fastwan.cache.TaylorSeer) against diffusers' TaylorSeer hook with every block's output predicted
(``cache_identifiers=[r"blocks\\.\\d+"]``): the same steps computed and frames within 1 through WanPipeline, the
same DiT outputs step after step (computed or predicted, each CFG pass with its own state); the rule under CFG
gating and on A14B; bad settings refused before compute."""
from __future__ import annotations

import math

import pytest
import torch

from fastwan import VideoGenerator
from fastwan.cache import (
    CacheRun,
    FirstBlockCache,
    MagCache,
    SkipSteps,
    TaylorSeer,
    TeaCache,
    check_cache,
    check_steps,
    parse_cache,
)
from fastwan.checkpoint.tiny import tiny_checkpoint
from fastwan.errors import InvalidArgument, InvalidArgumentType
from fastwan.hooks import Hook, HookRegistry
from tests.cache.test_step_cache import STEPS, diffusers_run, expert_switch, max_diff, run

BLOCKS = [r"blocks\.\d+"]


@pytest.fixture(scope="module")
def gen():
    return VideoGenerator.from_pretrained("tiny", device="cpu", dtype=torch.float32)


def diffusers_config(c: TaylorSeer):
    from diffusers.hooks import TaylorSeerCacheConfig

    return TaylorSeerCacheConfig(cache_interval=c.cache_interval, disable_cache_before_step=c.disable_cache_before_step,
                                 disable_cache_after_step=c.disable_cache_after_step, max_order=c.max_order,
                                 taylor_factors_dtype=getattr(torch, c.taylor_factors_dtype), cache_identifiers=BLOCKS)


def rule(c: TaylorSeer, n: int, start: int = 0) -> list[int]:
    """The steps ``start`` .. ``n - 1`` that compute, by TaylorSeer's schedule counted from ``start``."""
    b, after = c.disable_cache_before_step, c.disable_cache_after_step
    return [s for s in range(start, n)
            if s - start < b or (s - start - b - 1) % c.cache_interval == 0 or after is not None and s >= after]


@pytest.mark.parametrize("config", [
    TaylorSeer(cache_interval=3, disable_cache_before_step=2, max_order=2, taylor_factors_dtype="float32"),
    TaylorSeer(cache_interval=4, disable_cache_before_step=1, disable_cache_after_step=8),  # bf16 factors
])
def test_taylorseer_matches_diffusers_pipeline(gen, monkeypatch, config):
    ours = run(gen, cache=config)
    frames, computed = diffusers_run(diffusers_config(config), monkeypatch)
    assert ours.cache["computed"] == computed == {"cond": rule(config, STEPS), "uncond": rule(config, STEPS)}
    assert len(computed["cond"]) <= STEPS - 4
    assert max_diff(ours.frames, frames) <= 1


@pytest.mark.parametrize("config", [
    TaylorSeer(cache_interval=3, disable_cache_before_step=3, max_order=2, taylor_factors_dtype="float32"),
    TaylorSeer(cache_interval=2, disable_cache_before_step=2, max_order=1, taylor_factors_dtype="float32"),
    TaylorSeer(cache_interval=3, disable_cache_before_step=2, max_order=0, taylor_factors_dtype="float32"),
])
def test_taylorseer_dit_outputs_match_diffusers(config):
    """Each step's prediction of fastwan's DiT under the cache equals diffusers' transformer under its hook, on the
    same weights and inputs, for both passes in turn (diffusers' cache contexts)."""
    from diffusers import WanTransformer3DModel

    from fastwan.attention import AttentionDispatch
    from fastwan.models import load_transformer
    from fastwan.models.wan.step_cache import apply_step_cache

    path = tiny_checkpoint("wan2.1") / "transformer"
    attn = AttentionDispatch.resolve("TORCH_SDPA", device="cpu", dtype=torch.float32, head_dim=12)
    ours = load_transformer(path, dtype=torch.float32, device="cpu", attention=attn)
    theirs = WanTransformer3DModel.from_pretrained(path, torch_dtype=torch.float32).eval()
    theirs.enable_cache(diffusers_config(config))
    steps, g = 9, torch.Generator().manual_seed(0)
    texts = [torch.randn(1, 512, ours.config.text_dim, generator=g) for _ in range(2)]
    for t in texts:
        t[:, 7:] = 0
    hook = apply_step_cache(ours, CacheRun(config, steps))
    predicted = 0
    with torch.no_grad():
        for step, t in enumerate(torch.linspace(950, 50, steps)):
            x = torch.randn(1, 16, 3, 8, 8, generator=g)
            for name, text in zip(("cond", "uncond"), texts):
                hook.select(name)
                got = ours(x, t.reshape(1), text, step_index=step, num_steps=steps)
                with theirs.cache_context(name):
                    want = theirs(x, t.reshape(1), text, return_dict=False)[0]
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            predicted += step not in rule(config, steps)
    assert predicted >= 3
    assert hook.run.report()["computed"] == {"cond": rule(config, steps), "uncond": rule(config, steps)}


def test_taylorseer_composes_with_cfg_gating(gen):
    """With CFG gating the unconditional pass stops at the gate; both passes keep their own schedule, and each
    computed or predicted step gives what the ungated run's conditional pass gives up to the gate."""
    config = TaylorSeer(cache_interval=3, disable_cache_before_step=2)
    g = VideoGenerator.from_pretrained("tiny", device="cpu", dtype=torch.float32, cfg_gate_step=0.5, cache=config)
    r = run(g)
    assert r.cache["computed"] == {"cond": rule(config, STEPS), "uncond": rule(config, STEPS // 2)}
    plain = VideoGenerator.from_pretrained("tiny", device="cpu", dtype=torch.float32, cfg_gate_step=0.5)
    assert max_diff(run(plain).frames, r.frames) > 0  # the prediction is used


def test_a14b_expert_counts_its_steps_from_the_switch():
    g = VideoGenerator.from_pretrained("tiny-wan2.2-a14b", device="cpu", dtype=torch.float32)
    switch = expert_switch(g)
    config = TaylorSeer(cache_interval=2, disable_cache_before_step=1)
    r = g.generate_video("a fox", negative_prompt="blurry", seed=3, num_inference_steps=STEPS, save_video=False,
                         cache=config, height=64, width=64, num_frames=9)
    want = rule(config, switch) + rule(config, STEPS, start=switch)
    assert r.cache["computed"] == {"cond": want, "uncond": want}


def test_parse_and_json_forms(gen):
    assert parse_cache("taylorseer") == TaylorSeer()
    assert parse_cache("taylorseer:cache_interval=4,max_order=2,disable_cache_after_step=40,"
                       "taylor_factors_dtype=float32") == TaylorSeer(4, max_order=2, disable_cache_after_step=40,
                                                                     taylor_factors_dtype="float32")
    assert parse_cache("taylorseer:disable_cache_after_step=none") == TaylorSeer()
    assert TaylorSeer(taylor_factors_dtype=torch.float16) == TaylorSeer(taylor_factors_dtype="float16")
    from fastwan.pipelines.params import _decode_cache, _encode_cache

    config = TaylorSeer(4, 2, 30, 2, "float32")
    assert _decode_cache(_encode_cache(config)) == config
    assert _encode_cache(config) == {"type": "taylorseer", "cache_interval": 4, "disable_cache_before_step": 2,
                                     "disable_cache_after_step": 30, "max_order": 2,
                                     "taylor_factors_dtype": "float32"}


@pytest.mark.parametrize("make,err,match", [
    (lambda: TaylorSeer(cache_interval=1), InvalidArgument, "every step would compute"),
    (lambda: TaylorSeer(cache_interval=0), InvalidArgument, r"cache_interval=0\): must be"),
    (lambda: TaylorSeer(cache_interval=2.5), InvalidArgumentType, "must be an int"),
    (lambda: TaylorSeer(disable_cache_before_step=0), InvalidArgument, "predicted from no computed step"),
    (lambda: TaylorSeer(disable_cache_before_step=5, disable_cache_after_step=5), InvalidArgument, "above the"),
    (lambda: TaylorSeer(max_order=5), InvalidArgument, r"max_order=5\): must be a finite number in \[0, 4\]"),
    (lambda: TaylorSeer(max_order=-1), InvalidArgument, "max_order"),
    (lambda: TaylorSeer(taylor_factors_dtype="int8"), InvalidArgument, "bfloat16, float16, float32"),
    (lambda: TaylorSeer(taylor_factors_dtype=16), InvalidArgumentType, "dtype name"),
    (lambda: parse_cache("taylorseer:interval=3"), InvalidArgument, "unknown setting 'interval'"),
    (lambda: parse_cache("taylorseer:cache_interval=two"), InvalidArgument, "an int >= 2"),
    (lambda: check_steps(TaylorSeer(), 3), InvalidArgument, "cannot skip any step of a request of 3"),
])
def test_bad_settings_raise(make, err, match):
    with pytest.raises(err, match=match):
        make()


def test_bad_settings_raise_before_compute(gen, monkeypatch):
    monkeypatch.setattr(type(gen), "_generate", lambda *a, **k: pytest.fail("computed"))
    with pytest.raises(InvalidArgument, match="cannot skip any step of a request of 3"):
        gen.generate_video("a fox", num_inference_steps=3, save_video=False, cache="taylorseer",
                           height=64, width=64, num_frames=9)
    with pytest.raises(InvalidArgument, match="every step would compute"):
        gen.generate_video("a fox", save_video=False, cache="taylorseer:cache_interval=1", height=64, width=64,
                           num_frames=9)


@pytest.mark.parametrize("cache", [TaylorSeer(4, 2, 30, 2, "float32"), TaylorSeer(), "taylorseer:cache_interval=3",
                                   FirstBlockCache(0.1), TeaCache(0.1, coefficients=(1.0, 0.0)), SkipSteps((2, 3)),
                                   MagCache(0.1, mag_ratios=(1.0, 0.9)), MagCache(calibrate=True)])
def test_request_json_of_each_cache_obeys_the_schema(cache):
    import jsonschema

    from fastwan.fields import from_json, json_schema, to_json
    from fastwan.pipelines.params import GenerationRequest

    doc = to_json(GenerationRequest("a fox", cache=cache))
    jsonschema.validate(doc, json_schema(GenerationRequest))
    assert from_json(GenerationRequest, doc).cache == check_cache(cache)


@pytest.mark.parametrize("cache", [{"type": "taylorseer", "cache_interval": 1}, {"type": "taylorseer", "max_order": 5},
                                   {"type": "taylorseer", "taylor_factors_dtype": "int8"},
                                   {"type": "taylorseer", "interval": 3}, {"type": "teacache", "max_order": 1}])
def test_the_schema_refuses_what_the_request_refuses(cache):
    import jsonschema

    from fastwan.fields import from_json, json_schema
    from fastwan.pipelines.params import GenerationRequest

    doc = {"prompt": "a fox", "cache": cache}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, json_schema(GenerationRequest))
    with pytest.raises(InvalidArgument):
        from_json(GenerationRequest, doc)


def reference_prediction(history: list[tuple[int, torch.Tensor]], step: int, max_order: int) -> torch.Tensor:
    """TaylorSeer's prediction at ``step`` in float64 from every computed (step, stream) so far: order k's factor
    at a computed step is the change of order k - 1's since the computed step before it, over the gap between the
    two (the last gap, as diffusers' recursion divides); the prediction is sum_k factor_k * gap**k / k!."""
    def factor(i: int, k: int) -> torch.Tensor:
        if k == 0:
            return history[i][1].double()
        return (factor(i, k - 1) - factor(i - 1, k - 1)) / (history[i][0] - history[i - 1][0])

    last = len(history) - 1
    gap = step - history[last][0]
    return sum(factor(last, k) * gap ** k / math.factorial(k) for k in range(min(max_order, last) + 1))


class Reference(Hook):
    """The blocks run at the steps TaylorSeer computes (their streams recorded); at the others the stream is
    :func:`reference_prediction`'s."""

    name = "reference"

    def __init__(self, config: TaylorSeer, steps: int):
        self.config, self.computes, self.history, self.layouts = config, rule(config, steps), [], []

    def points(self, module):
        return {"run_blocks": self._run}

    def _run(self, module, inner, e, contexts, step_index, num_steps):
        self.layouts.append(e.layout is not None)
        if step_index in self.computes:
            out = inner(e, contexts, step_index, num_steps)
            self.history.append((step_index, out.clone()))
            return out
        return reference_prediction(self.history, step_index, self.config.max_order).to(e.x.dtype)


@pytest.mark.parametrize("backend,fullgraph", [("VIDEO_SPARSE_ATTN", None), ("VIDEO_SPARSE_ATTN", False),
                                               ("TORCH_SDPA", True)])
def test_taylorseer_under_sparse_attention_and_compiled_blocks(backend, fullgraph):
    """Under a sparse backend (the stream in its compact layout order) and compiled blocks (None: eager; the sparse
    kernel call is kept out of the graph, so fullgraph=True, where any graph break raises, runs with dense
    attention), the cached DiT's predictions equal the float64 reference of the rule on the same DiT."""
    from fastwan.attention import AttentionDispatch
    from fastwan.models import load_transformer
    from fastwan.models.wan.step_cache import apply_step_cache, remove_step_cache

    torch._dynamo.reset()
    config, steps = TaylorSeer(cache_interval=3, disable_cache_before_step=3, max_order=2,
                               taylor_factors_dtype="float32"), 10
    sparse = {"tile": [1, 2, 2], "sparsity": 0.5} if backend == "VIDEO_SPARSE_ATTN" else None
    attn = AttentionDispatch.resolve(backend, device="cpu", dtype=torch.float32, head_dim=12, config=sparse)
    model = load_transformer(tiny_checkpoint("wan2.1") / "transformer", dtype=torch.float32, device="cpu",
                             attention=attn)
    if fullgraph is not None:
        model.compile_blocks(fullgraph=fullgraph, backend="aot_eager")
    g = torch.Generator().manual_seed(1)
    text = torch.randn(1, 9, model.config.text_dim, generator=g)
    x0, noise = torch.randn(2, 1, 16, 3, 8, 8, generator=g)
    got, want = [], []
    with torch.no_grad():
        ref = Reference(config, steps)
        for hook, out in ((ref, want), (None, got)):
            if hook is None:
                apply_step_cache(model, CacheRun(config, steps))
            else:
                HookRegistry.of(model).add(hook)
            for step, t in enumerate(torch.linspace(950, 50, steps)):
                x = x0 + (noise - x0) * (t / 1000)  # a smooth path, as denoising's latents
                out.append(model(x, t.reshape(1), text, step_index=step, num_steps=steps))
            remove_step_cache(model)
            HookRegistry.of(model).remove("reference")
    assert ref.layouts and all(ref.layouts) == (sparse is not None)  # the sparse backend's layout was in use
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"step {step}")
