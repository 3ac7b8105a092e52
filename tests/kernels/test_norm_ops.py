"""Fused norm ops (fastwan.kernels.norms): their math against float64 formulas and their schemas/fake impls. The
Triton kernels themselves need a GPU (tests/gpu) or the interpreter (test_norm_kernels_interpreted.py); here the
ops run their PyTorch reference. The fast block's wiring of them: tests/models/test_fast_block.py.

fastwan's custom ops at odd inputs: each op's output (reference route) has its fake's shape, dtype and strides
for transposed / strided / one-row / empty inputs in fp32, bf16 and fp16 (``torch.library.opcheck``), values
against float64 formulas written here, inputs an op cannot take raise ValueError naming the rule, and the norm
kernel's affine step with a weight or a bias alone (under Triton's interpreter) against the float64 formula."""
from __future__ import annotations

import importlib.util

import pytest
import torch

import fastwan.kernels.text_cross  # noqa: F401  (registers the text cross-attention ops)
import fastwan.kernels.vae  # noqa: F401  (registers rms_silu)
from fastwan.kernels import norms as fused
from fastwan.models.wan.layers import rope_tables
from tests.kernels.interpreter import worst_error

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
    return h * (1 if w is None else w.double()) + (0 if b is None else b.double())


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


# ---- every op at odd inputs ---------------------------------------------------------------------------------------
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def rnd(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def opcheck(op, args):
    result = torch.library.opcheck(op.default, args)
    assert all(v == "SUCCESS" for v in result.values()), result


@pytest.mark.parametrize("dtype", DTYPES)
def test_residual_norm_mod_of_a_strided_stream_matches_its_fake_and_float64(dtype):
    """r comes back contiguous (as the kernel and the fake give it) for a transposed x, and the values are
    x + y * gate and its LayerNorm."""
    x = rnd(2, 24, 5, dtype=dtype).transpose(1, 2)  # [2, 5, 24], channel stride 5
    xb = rnd(5, 2, 24, dtype=dtype, seed=1).transpose(0, 1)  # batch-major view
    y, gate, w, b = rnd(2, 5, 24, dtype=dtype, seed=2), rnd(2, 1, 24, seed=3), rnd(24, seed=4), rnd(24, seed=5)
    for xi in (x, xb):
        opcheck(ops.residual_norm_mod, (xi, y, gate, w, b, None, None, 1e-6))
        r, h = ops.residual_norm_mod(xi, y, gate, w, b, None, None, 1e-6)
        assert r.is_contiguous() and h.is_contiguous() and r.dtype == h.dtype == dtype
        r64 = xi.double() + y.double() * gate.double()
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(r.double(), r64, rtol=tol, atol=tol)
        torch.testing.assert_close(h.double(), ln64(r.double(), w, b), rtol=10 * tol, atol=10 * tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_text_cross_normq_with_transposed_keys_matches_its_fake_and_float64(dtype):
    """k as a [B, L, H, D] view of [B, H, L, D] storage, v of [B, D, L, H] storage (unit stride off the head dim;
    also one sample): the output is contiguous like the fake (whichever layout SDPA returns), and equals float64
    RMSNorm + softmax attention over all L keys with the padding repeated."""
    B, S, H, D, L, lengths = 2, 5, 2, 8, 9, (2, 9)
    q, w = rnd(B, S, H * D, dtype=dtype) * 3, rnd(H * D, dtype=dtype, seed=1).abs() + 0.5
    k, v = rnd(B, H, L, D, seed=2).transpose(1, 2), rnd(B, D, L, H, seed=3).permute(0, 2, 3, 1)  # padding below
    for bi, n in enumerate(lengths):
        if n < L:
            k[bi, n:], v[bi, n:] = k[bi, n].clone(), v[bi, n].clone()
    k, v = k.to(dtype), v.to(dtype)
    keys = torch.tensor([min(n + 1, L) for n in lengths], dtype=torch.int32)
    for args in ((q, w, 1e-6, k, v, keys), (q[:1], w, 1e-6, k[:1], v[:1], keys[:1])):
        opcheck(ops.text_cross_attention_normq, args)
        out = ops.text_cross_attention_normq(*args)
        assert out.is_contiguous() and out.dtype == dtype
        q64, w64, k64, v64 = (t.double() for t in (args[0], w, args[3], args[4]))
        qn = (q64 * torch.rsqrt(q64.pow(2).mean(-1, keepdim=True) + 1e-6) * w64).unflatten(-1, (H, D))
        s = torch.einsum("bshd,blhd->bhsl", qn, k64) / D ** 0.5
        want = torch.einsum("bhsl,blhd->bshd", s.softmax(-1), v64)
        tol = 1e-5 if dtype == torch.float32 else 5e-2
        torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)


def test_rms_rope_refuses_a_weight_in_another_dtype():
    """The op's output is x's dtype (its fake's); a weight of another dtype would make the reference compute and
    return the weight's dtype, so it is refused with the fix."""
    x, w = rnd(2, 3, 24, dtype=torch.bfloat16), rnd(24)
    with pytest.raises(ValueError, match=r"weight is torch.float32 but x is torch.bfloat16.*x's dtype"):
        ops.rms_rope(x, w, None, 1e-6, 12)
    out = ops.rms_rope(x, w.bfloat16(), None, 1e-6, 12)  # the fix named in the message
    assert out.dtype == torch.bfloat16


def test_norm_ops_refuse_inputs_they_cannot_take():
    x, y, w, b, sc = rnd(2, 5, 24), rnd(2, 5, 24, seed=1), rnd(24, seed=2), rnd(24, seed=3), rnd(2, 1, 24, seed=4)
    cases = [
        (lambda: ops.norm_mod(x, None, None, sc, None, 1e-6), "scale and shift go together"),
        (lambda: ops.norm_mod(x, w[:12], b, None, None, 1e-6), r"weight must be \[24\]"),
        (lambda: ops.norm_mod(x, w, b, rnd(3, 1, 24), rnd(3, 1, 24), 1e-6), r"scale must be \[B or 1, S or 1, C\]"),
        (lambda: ops.norm_mod(x[0], w, b, None, None, 1e-6), r"x must be \[B, S, C\]"),
        (lambda: ops.offset_norm_mod(x, rnd(1, 1, 12), w, b, None, None, 1e-6), r"offset must be"),
        (lambda: ops.residual_norm_mod(x, y[:1], None, w, b, None, None, 1e-6), "y must have x's shape"),
        (lambda: ops.residual_norm_mod(x, y, rnd(2, 3, 24), w, b, None, None, 1e-6), "gate must be"),
        (lambda: ops.rms_rope(x, w, torch.zeros(1, 5, 1, 14), 1e-6, 7), "an even head_dim"),
        (lambda: ops.rms_rope(x, w, torch.zeros(1, 5, 1, 20), 1e-6, 10), "dividing C = 24"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()


@pytest.mark.parametrize("dtype", DTYPES)
def test_fakes_match_at_odd_shapes(dtype):
    """One row, a width that is no power of two, a zero-size batch, strided views: every op's real output has
    its fake's metadata."""
    x1, x0 = rnd(1, 1, 7, dtype=dtype), rnd(0, 5, 24, dtype=dtype)
    xs = rnd(2, 5, 48, dtype=dtype)[..., ::2]  # channel stride 2
    w24 = rnd(24, seed=1)
    opcheck(ops.norm_mod, (x1, None, None, None, None, 1e-6))
    opcheck(ops.norm_mod, (x0, None, None, None, None, 1e-6))
    opcheck(ops.norm_mod, (xs, w24, None, rnd(2, 5, 24), rnd(2, 5, 24, seed=2), 1e-6))
    opcheck(ops.offset_norm_mod, (xs, rnd(1, 1, 24), None, w24, None, None, 1e-6))
    opcheck(ops.rms_rope, (xs, w24.to(dtype), None, 1e-6, 12))
    opcheck(ops.rms_rope, (rnd(1, 1, 6, dtype=dtype), rnd(6, dtype=dtype), None, 1e-6, 6))
    opcheck(ops.residual_bmm_, (rnd(2, 5, 24, dtype=dtype), rnd(2, 7, 5, dtype=dtype).transpose(1, 2),
                                rnd(2, 24, 7, dtype=dtype).transpose(1, 2)))
    v = rnd(2, 8, 3, 4, 10, dtype=dtype)[..., ::2]  # not dense
    opcheck(ops.rms_silu, (v, rnd(8, dtype=dtype), None, rnd(8, dtype=dtype)))
    opcheck(ops.rms_silu, (rnd(3, 8, dtype=dtype), rnd(8, dtype=dtype), rnd(8, dtype=dtype), None))
    q, kk = rnd(2, 1, 16, dtype=dtype), rnd(2, 9, 2, 8, dtype=dtype)
    opcheck(ops.text_cross_probs_normq, (q, rnd(16, dtype=dtype), 1e-6, kk, torch.tensor([3, 9], dtype=torch.int32),
                                         9))


SCRIPT = r"""
import torch
import fastwan.kernels.norms  # registers the ops
from fastwan.kernels import interpreted_kernels

g = torch.Generator().manual_seed(0)
x, y = torch.randn(2, 5, 40, generator=g), torch.randn(2, 5, 40, generator=g)
w, b = torch.randn(40, generator=g), torch.randn(40, generator=g)
sc, sh = torch.randn(2, 1, 40, generator=g), torch.randn(2, 1, 40, generator=g)

def ln64(x, w, b):
    x = x.double()
    h = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + 1e-6)
    return h * (1 if w is None else w.double()) + (0 if b is None else b.double())

worst = 0.0
with interpreted_kernels():
    for ww, bb in ((w, None), (None, b), (w, b)):
        pairs = [(torch.ops.fastwan.norm_mod(x, ww, bb, None, None, 1e-6), ln64(x, ww, bb)),
                 (torch.ops.fastwan.norm_mod(x, ww, bb, sc, sh, 1e-6),
                  ln64(x, ww, bb) * (1 + sc.double()) + sh.double()),
                 (torch.ops.fastwan.residual_norm_mod(x, y, None, ww, bb, None, None, 1e-6)[1], ln64(x + y, ww, bb)),
                 (torch.ops.fastwan.offset_norm_mod(x, sc, ww, bb, None, None, 1e-6), ln64(x + sc, ww, bb))]
        for got, want in pairs:
            worst = max(worst, float(((got.double() - want).abs() / (want.abs() + 1)).max()))
print(f"WORST {worst:.3e}")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs the triton package")
def test_norm_kernel_affine_with_a_weight_or_a_bias_alone():
    """A LayerNorm with a weight and no bias (or a bias and no weight): the kernel route applies exactly what is
    given (under the interpreter, fp32), as the reference does."""
    assert worst_error(SCRIPT) <= 1e-5


def test_stack_time_taps_refuses_too_little_time_padding():
    """Every tap of the last output frame must exist (pad_t >= kt - 1): the kernel would read past x's frames."""
    from fastwan.kernels.vae import stack_time_taps

    x = rnd(1, 4, 3, 2, 2)
    with pytest.raises(ValueError, match=r"kt=3 taps need pad_t >= kt - 1 = 2.*got pad_t=1"):
        stack_time_taps(x, None, 1, 3)
    out = stack_time_taps(x, None, 2, 3)  # [B * T, kt * C, H, W]: frame t holds frames t-2, t-1, t of x
    want = torch.cat([torch.zeros(1, 4, 2, 2, 2), x], 2)
    for t in range(3):
        torch.testing.assert_close(out[t], torch.cat([want[0, :, t + i] for i in range(3)]), rtol=0, atol=0)
