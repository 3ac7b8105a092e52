"""Fused norm ops (fastwan.kernels.norms): their math against float64 formulas, their schemas/fake impls, and the
block's fused wiring against the plain path. The Triton kernels themselves need a GPU (tests/gpu); here the ops
run their PyTorch reference, and ``fused.usable`` is forced on so the DiT takes the fused route on the CPU."""
from __future__ import annotations

import pytest
import torch

from fastwan.attention import AttentionDispatch
from fastwan.models import load_transformer
from fastwan.kernels import norms as fused
from fastwan.models.wan.transformer import rope_tables

ops = torch.ops.fastwan


def data(B=2, S=7, C=24, dtype=torch.float32, per_token=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, y = (torch.randn(B, S, C, generator=g).to(dtype) for _ in range(2))
    T = S if per_token else 1
    mods = torch.randn(B, T, 4, C, generator=g)  # a [B, T, 4, C] table whose unbind gives strided views
    gate, scale, shift, _ = mods.unbind(2)
    w, b = torch.randn(C, generator=g), torch.randn(C, generator=g)
    return x, y, gate, scale, shift, w, b


def ln64(x, w=None, b=None, eps=1e-6):
    x = x.double()
    h = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + eps)
    return h * w.double() + b.double() if w is not None else h


@pytest.mark.parametrize("per_token", [False, True])
def test_norm_mod_and_residual_match_float64_formulas(per_token):
    x, y, gate, scale, shift, w, b = data(per_token=per_token)
    h = ops.norm_mod(x, None, None, scale, shift, 1e-6)
    want = ln64(x) * (1 + scale.double()) + shift.double()
    torch.testing.assert_close(h.double(), want, rtol=1e-5, atol=1e-5)
    r, h2 = ops.residual_norm_mod(x, y, gate, w, b, None, None, 1e-6)
    r64 = x.double() + y.double() * gate.double()
    torch.testing.assert_close(r.double(), r64, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(h2.double(), ln64(r64, w, b), rtol=1e-4, atol=1e-4)
    r3, h3 = ops.residual_norm_mod(x, y, None, None, None, scale, shift, 1e-6)
    torch.testing.assert_close(r3.double(), x.double() + y.double(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(h3.double(), ln64(x.double() + y.double()) * (1 + scale.double()) + shift.double(),
                               rtol=1e-4, atol=1e-4)


def test_offset_norm_mod_and_residual_linear_match_float64_formulas():
    x, y, gate, scale, shift, w, b = data(B=1)
    offset = torch.randn(1, 1, 24, generator=torch.Generator().manual_seed(5))
    h = ops.offset_norm_mod(x, offset, None, None, scale, shift, 1e-6)
    want = ln64(x.double() + offset.double()) * (1 + scale.double()) + shift.double()
    torch.testing.assert_close(h.double(), want, rtol=1e-5, atol=1e-5)
    h2 = ops.offset_norm_mod(x, offset, w, b, None, None, 1e-6)
    torch.testing.assert_close(h2.double(), ln64(x.double() + offset.double(), w, b), rtol=1e-4, atol=1e-4)
    a, weight = torch.randn(1, 7, 10), torch.randn(24, 10)
    x0 = x.clone()
    assert ops.residual_linear_(x, a, weight) is None  # in place
    torch.testing.assert_close(x.double(), x0.double() + a.double() @ weight.double().t(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="must be contiguous"):
        ops.residual_linear_(torch.randn(1, 24, 7).transpose(1, 2), a, weight)


def test_rms_rope_matches_a_float64_rotation():
    B, (T, H, W), heads, D = 2, (2, 3, 2), 2, 12
    S, C = T * H * W, heads * D
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(B, S, C, generator=g), torch.randn(C, generator=g)
    table = rope_tables((T, H, W), D, 64, torch.device("cpu"))
    out = ops.rms_rope(x, w, table, 1e-6, D)
    x64 = x.double()
    y = (x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()).view(B, S, heads, D // 2, 2)
    # rotate each pair (2i, 2i+1) by its angle: cos/sin straight from the table's cos half and signed-sin half
    cos = table[0, :, 0, :D].double().view(1, S, 1, D // 2, 2)[..., 0]
    sin = table[0, :, 0, D + 1::2].double().view(1, S, 1, D // 2)
    a, bb = y[..., 0], y[..., 1]
    want = torch.stack((a * cos - bb * sin, a * sin + bb * cos), -1).view(B, S, C)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ops.rms_rope(x, w, None, 1e-6, D).double(), y.reshape(B, S, C), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="does not fit x"):
        ops.rms_rope(x[:, :5], w, table, 1e-6, D)


@pytest.mark.parametrize("op,args", [
    ("norm_mod", lambda d: (d[0], d[5], d[6], d[3], d[4], 1e-6)),
    ("residual_norm_mod", lambda d: (d[0], d[1], d[2], None, None, d[3], d[4], 1e-6)),
    ("rms_rope", lambda d: (d[0], d[5], None, 1e-6, 12)),
    ("offset_norm_mod", lambda d: (d[0], d[3][:1], None, None, d[3], d[4], 1e-6)),
    ("residual_linear_", lambda d: (d[0].clone(), d[1], d[5].view(24, 1).expand(24, 24).contiguous())),
])
def test_opcheck(op, args):
    result = torch.library.opcheck(getattr(ops, op).default, args(data()))
    assert all(v == "SUCCESS" for v in result.values()), result


def test_modulation_shape_is_checked():
    x, y, gate, scale, shift, w, b = data(S=7)
    with pytest.raises(ValueError, match="expected \\[B, 1, C\\] or \\[B, 7, C\\]"):
        fused._row_strides(scale.expand(2, 3, 24), 7)


@pytest.fixture
def fused_route(monkeypatch):
    """The DiT takes the fused route on the CPU (the ops run their PyTorch reference there)."""
    monkeypatch.setattr(fused, "usable", lambda x: True)


@pytest.mark.parametrize("variant,dtype,backend,conf", [
    ("wan2.1", torch.float32, "TORCH_SDPA", None),
    ("wan2.1", torch.bfloat16, "TORCH_SDPA", None),
    ("wan2.2-ti2v", torch.float32, "TORCH_SDPA", None),
    # sparse: tile-major token order with padded slots (3 x 3 x 5 tokens, tiles 2 x 2 x 4), per-token modulation
    ("wan2.1", torch.float32, "SLIDING_TILE_ATTN", {"tile": [2, 2, 4], "window": 1}),
    ("wan2.2-ti2v", torch.float32, "VIDEO_SPARSE_ATTN", {"tile": [2, 2, 4], "sparsity": 0.5}),
])
def test_fused_route_matches_plain_route(tiny_ckpts, fused_route, variant, dtype, backend, conf):
    attn = AttentionDispatch.resolve(backend, device="cpu", dtype=dtype, head_dim=12, config=conf)
    model = load_transformer(tiny_ckpts[variant] / "transformer", dtype=dtype, device="cpu", attention=attn)
    c = model.config.in_channels
    g = torch.Generator().manual_seed(3)
    x, text = torch.randn(2, c, 3, 6, 10, generator=g), torch.randn(2, 9, model.config.text_dim, generator=g)
    t = torch.stack([torch.full((45,), 901.0), torch.full((45,), 17.0)]) if variant == "wan2.2-ti2v" \
        else torch.tensor([700.0, 300.0])
    with torch.no_grad():
        model.set_fast_paths(fused_norms=False)
        want = model(x, t, text)
        model.set_fast_paths(fused_norms=True)
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        with prof:
            got = model(x, t, text)
    calls = [e.name for e in prof.events() if e.name.startswith("fastwan::")]
    n = model.config.num_layers
    # block 0 starts with a plain norm; every later block's first norm also adds the previous block's FFN residual
    assert calls.count("fastwan::norm_mod") == 1 and calls.count("fastwan::residual_norm_mod") == 3 * n - 1
    assert calls.count("fastwan::rms_rope") == 4 * n  # q and k of the self- (with RoPE) and cross-attention
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def _fastwan_calls(fn):
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    with prof:
        out = fn()
    calls = [e.name for e in prof.events() if e.name.startswith("fastwan::")]
    return out, {c: calls.count(c) for c in set(calls)}


@pytest.mark.parametrize("variant,dtype,backend,conf", [
    ("wan2.1", torch.float32, "TORCH_SDPA", None),
    ("wan2.1", torch.bfloat16, "TORCH_SDPA", None),
    ("wan2.2-a14b", torch.float32, "TORCH_SDPA", None),
    ("wan2.1", torch.float32, "SLIDING_TILE_ATTN", {"tile": [2, 2, 4], "window": 1}),  # tile-major tokens
])
def test_gemm_residual_route_matches_plain_route(tiny_ckpts, fused_route, variant, dtype, backend, conf):
    """Batch 1 (one modulation vector): the output projections add into x inside their GEMMs, their biases ride
    along as an fp32 offset that the norm kernels add; same output as the plain route, and as forward_cfg in
    both CFG modes (the sequential passes must not see each other's in-place updates)."""
    attn = AttentionDispatch.resolve(backend, device="cpu", dtype=dtype, head_dim=12, config=conf)
    model = load_transformer(tiny_ckpts[variant] / "transformer", dtype=dtype, device="cpu", attention=attn)
    c, n = model.config.in_channels, model.config.num_layers
    g = torch.Generator().manual_seed(3)
    x, t = torch.randn(1, c, 3, 6, 10, generator=g), torch.tensor([700.0])
    text, text_u = (torch.randn(1, 9, model.config.text_dim, generator=g) for _ in range(2))
    with torch.no_grad():
        model.set_fast_paths(fused_norms=False)
        want, want_u = model(x, t, text), model(x, t, text_u)
        model.set_fast_paths(fused_norms=True, gemm_residual=True)
        got, calls = _fastwan_calls(lambda: model(x, t, text))
        cfg = {b: model.forward_cfg(x, t, text, text_u, batched=b) for b in (True, False)}
        model.set_fast_paths(gemm_residual=False)
        _, calls_off = _fastwan_calls(lambda: model(x, t, text))
        model.set_fast_paths(gemm_residual=True)
    assert calls.get("fastwan::offset_norm_mod") == 3 * n and calls.get("fastwan::residual_linear_") == 3 * n
    assert "fastwan::residual_norm_mod" not in calls and "fastwan::residual_linear_" not in calls_off
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    for cond, uncond in cfg.values():
        torch.testing.assert_close(cond.float(), want.float(), rtol=tol, atol=tol)
        torch.testing.assert_close(uncond.float(), want_u.float(), rtol=tol, atol=tol)


def test_gemm_residual_only_for_one_modulation_vector(tiny_ckpts, fused_route):
    """Per-sample (batch 2, two timesteps) and per-token (TI2V) modulation keep the residual_norm_mod route."""
    for variant, t in (("wan2.1", torch.tensor([700.0, 300.0])), ("wan2.2-ti2v", torch.full((1, 45), 500.0))):
        attn = AttentionDispatch.resolve("TORCH_SDPA", device="cpu", dtype=torch.float32, head_dim=12)
        model = load_transformer(tiny_ckpts[variant] / "transformer", dtype=torch.float32, device="cpu",
                                 attention=attn)
        b = t.shape[0]
        x = torch.randn(b, model.config.in_channels, 3, 6, 10)
        with torch.no_grad():
            text = torch.randn(b, 9, model.config.text_dim)
            _, calls = _fastwan_calls(lambda m=model, x=x, t=t, text=text: m(x, t, text))
        assert "fastwan::residual_linear_" not in calls and calls["fastwan::residual_norm_mod"] > 0, variant


def test_gemm_residual_compiles_in_place(tiny_ckpts, fused_route):
    """Inductor (CPU) compiles the gemm-residual blocks with fullgraph=True and keeps the update of x in place
    (no copy of the block's input), for forward and both forward_cfg modes."""
    torch._dynamo.reset()
    attn = AttentionDispatch.resolve("TORCH_SDPA", device="cpu", dtype=torch.float32, head_dim=12)
    model = load_transformer(tiny_ckpts["wan2.1"] / "transformer", dtype=torch.float32, device="cpu", attention=attn)
    g = torch.Generator().manual_seed(1)
    x, t = torch.randn(1, 16, 3, 8, 8, generator=g), torch.tensor([700.0])
    text, text_u = torch.randn(1, 9, 32, generator=g), torch.randn(1, 9, 32, generator=g)
    with torch.no_grad():
        want, want_u = model(x, t, text), model(x, t, text_u)
        model.compile_blocks(fullgraph=True)
        blk = model.blocks[1]
        xin = torch.randn(1, 48, blk.norm1.normalized_shape[0])
        mod = torch.randn(1, 6, xin.shape[-1])
        ctx = torch.randn(1, 9, xin.shape[-1])
        rope = model._rope((3, 4, 4), xin.device)
        out, pending = blk(xin, ctx, mod, rope, model.attention, fused_ok=True, pending=(torch.zeros(1, 1, 24),))
        assert out.data_ptr() == xin.data_ptr() and len(pending) == 1  # updated in place
        got = model(x, t, text)
        cfg = {b: model.forward_cfg(x, t, text, text_u, batched=b) for b in (True, False)}
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for cond, uncond in cfg.values():
        torch.testing.assert_close(cond, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(uncond, want_u, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


def test_fused_route_compiles_fullgraph(tiny_ckpts, fused_route):
    torch._dynamo.reset()
    attn = AttentionDispatch.resolve("TORCH_SDPA", device="cpu", dtype=torch.float32, head_dim=12)
    model = load_transformer(tiny_ckpts["wan2.1"] / "transformer", dtype=torch.float32, device="cpu", attention=attn)
    x, t, text = torch.randn(1, 16, 3, 8, 8), torch.tensor([700.0]), torch.randn(1, 9, 32)
    with torch.no_grad():
        want = model(x, t, text)
        for blk in model.blocks:
            blk.compile(fullgraph=True, backend="aot_eager")  # any graph break raises
        got = model(x, t, text)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
