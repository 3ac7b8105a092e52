"""Cross-attention keys/values computed once per prompt (WanTransformer.text_kv_cache) and the collapsed text
attention with the q RMSNorm in its kernel (WanAttention.text_normq): the same predictions as computing everything
in every forward, and a cache that follows the text tensors, the weights and the options."""
from __future__ import annotations

import pytest
import torch

from fastwan.attention import AttentionDispatch
from fastwan.models import load_transformer
from fastwan.kernels import norms as fused
from fastwan.models.wan import transformer as wan_mod
from tests.test_text_cross import padded


@pytest.fixture
def counting(monkeypatch):
    """Counts WanAttention.text_kv calls (one per block when a prompt's keys/values are computed)."""
    calls = []
    real = wan_mod.WanAttention.text_kv

    def text_kv(self, context, fused_ok=False):
        calls.append(fused_ok)
        return real(self, context, fused_ok)

    monkeypatch.setattr(wan_mod.WanAttention, "text_kv", text_kv)
    return calls


def _model(tiny_ckpts, variant="wan2.1"):
    attn = AttentionDispatch.resolve("TORCH_SDPA", device="cpu", dtype=torch.float32, head_dim=12)
    return load_transformer(tiny_ckpts[variant] / "transformer", dtype=torch.float32, device="cpu", attention=attn)


def _inputs(model, seed=3):
    g = torch.Generator().manual_seed(seed)
    x, t = torch.randn(1, model.config.in_channels, 3, 6, 10, generator=g), torch.tensor([700.0])
    text, text_u = padded(2, 24, model.config.text_dim, [9, 3], seed=seed + 1, dtype=torch.float32).split(1)
    return x, t, text, text_u


@pytest.mark.parametrize("variant", ["wan2.1", "wan2.2-a14b"])
@pytest.mark.parametrize("route", ["plain", "fused", "fused+collapse"])
def test_cached_text_kv_gives_the_uncached_predictions(tiny_ckpts, monkeypatch, counting, variant, route):
    if route.startswith("fused"):
        monkeypatch.setattr(fused, "usable", lambda x: True)  # the fused ops run their references on the CPU
    if route.endswith("collapse"):
        monkeypatch.setattr(wan_mod, "text_cross_ok", lambda x, head_dim: True)
    model = _model(tiny_ckpts, variant)
    n = model.config.num_layers
    x, t, text, text_u = _inputs(model)
    with torch.no_grad():
        model.set_fast_paths(text_kv_cache=False)
        want = [model(x, t, text), model(x, t, text_u)]
        want_cfg = {b: model.forward_cfg(x, t, text, text_u, batched=b) for b in (True, False)}
        assert counting == []  # off: every block projects the text itself
        model.set_fast_paths(text_kv_cache=True)
        got = [model(x, t, text) for _ in range(3)]
        assert len(counting) == n and all(c == route.startswith("fused") for c in counting)  # once, then hits
        got_cfg = {b: model.forward_cfg(x, t, text, text_u, batched=b) for b in (True, False)}
        assert len(counting) == 3 * n  # new: the batched pair, then text_u alone (text alone is a hit)
    for a in got:
        torch.testing.assert_close(a, want[0], rtol=1e-6, atol=1e-6)
    for b in (True, False):
        for a, w in zip(got_cfg[b], want):
            torch.testing.assert_close(a, w, rtol=1e-5, atol=1e-5)
        for a, w in zip(got_cfg[b], want_cfg[b]):
            torch.testing.assert_close(a, w, rtol=1e-6, atol=1e-6)


def test_cache_follows_texts_weights_and_options(tiny_ckpts, counting):
    model = _model(tiny_ckpts)
    n = model.config.num_layers
    x, t, text, _ = _inputs(model)

    def fresh():
        model.set_fast_paths(text_kv_cache=False)
        out = model(x, t, text)
        model.set_fast_paths(text_kv_cache=True)  # also empties the cache
        return out

    with torch.no_grad():
        model(x, t, text)
        model(x, t, text.clone())  # another tensor with the same values: computed again
        assert len(counting) == 2 * n
        text.mul_(2.0)  # in place: a new version of the same tensor
        got = model(x, t, text)
        assert len(counting) == 3 * n
        torch.testing.assert_close(got, fresh(), rtol=1e-6, atol=1e-6)
        model(x, t, text)
        model.blocks[1].attn2.to_k.weight.mul_(1.5)  # weights changed in place
        got = model(x, t, text)
        assert len(counting) == 5 * n
        torch.testing.assert_close(got, fresh(), rtol=1e-6, atol=1e-6)
        model(x, t, text)
        model.condition_embedder.text_embedder.linear_1.bias.add_(0.25)
        got = model(x, t, text)
        torch.testing.assert_close(got, fresh(), rtol=1e-6, atol=1e-6)
        before = len(counting)
        model.set_fast_paths(fused_norms=False)  # another norm route: its own keys
        model(x, t, text)
        assert len(counting) == before + n
        texts = [torch.randn_like(text) for _ in range(6)]
        for tx in texts:
            model(x, t, tx)
        assert len(model._kv_cache) <= 4  # only the latest prompts are held
    with torch.enable_grad():  # autograd on: nothing cached (the projections stay in the graph)
        before = len(counting)
        model(x, t, text)
        assert len(counting) == before


def test_collapsed_text_attention_takes_the_q_norm_in_its_kernel(tiny_ckpts, monkeypatch):
    monkeypatch.setattr(fused, "usable", lambda x: True)
    monkeypatch.setattr(wan_mod, "text_cross_ok", lambda x, head_dim: True)
    model = _model(tiny_ckpts)
    n = model.config.num_layers
    x, t, text, text_u = _inputs(model)

    def run():
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        with prof:
            out = model.forward_cfg(x, t, text, text_u, batched=False)
        names = [e.name for e in prof.events()]
        return out, names.count("fastwan::text_cross_attention_normq"), names.count("fastwan::text_cross_attention")

    with torch.no_grad():
        got, fused_calls, plain_calls = run()
        for blk in model.blocks:
            blk.attn2.text_normq = False
        want, fused_off, plain_off = run()
    assert (fused_calls, plain_calls) == (2 * n, 0) and (fused_off, plain_off) == (0, 2 * n)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
