"""Fused norm ops (fastwan.kernels.norms): their math against float64 formulas and their schemas/fake impls. The
Triton kernels themselves need a GPU (tests/gpu) or the interpreter (test_norm_kernels_interpreted.py); here the
ops run their PyTorch reference. The fast block's wiring of them: tests/models/test_fast_block.py."""
from __future__ import annotations

import pytest
import torch

from fastwan.kernels import norms as fused
from fastwan.models.wan.layers import rope_tables

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
