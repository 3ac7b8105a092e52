"""The VAE decoder's kernels (fastwan.kernels.vae): the ``rms_silu`` op against a float64 formula, its ``pre_bias``
rounding and fake; ``time_pad`` against diffusers' cat + pad; the PyTorch routes of the bias adds; and, under
Triton's interpreter (TRITON_INTERPRET=1, in a subprocess), each kernel route (``*_triton``) against its reference
on the CPU. Roundings are checked on the GPU (tests/gpu/test_gpu_fastpath.py): the interpreter truncates to bf16
where the GPU rounds to nearest even."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from fastwan.kernels import vae as vk

CL3D = torch.channels_last_3d
ops = torch.ops.fastwan


@pytest.mark.parametrize("bias", [False, True])
def test_rms_silu_matches_float64_formula(bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 3, 4, 5, generator=g)
    x[0, :, 0, 0, 0] = 0.0  # an all-zero position: F.normalize's eps keeps it finite (0 out)
    gamma = torch.randn(6, 1, 1, 1, generator=g)
    b = torch.randn(6, 1, 1, 1, generator=g) if bias else None
    x64 = x.double()
    h = x64 / x64.norm(dim=1, keepdim=True).clamp_min(1e-12) * 6 ** 0.5 * gamma.double().view(1, 6, 1, 1, 1)
    if b is not None:
        h = h + b.double().view(1, 6, 1, 1, 1)
    want = h * torch.sigmoid(h)
    got = ops.rms_silu(x, gamma, b)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(got).all()


def test_rms_silu_rejects_mismatched_parameters():
    with pytest.raises(ValueError, match=r"do not have the 6 channels"):
        ops.rms_silu(torch.randn(1, 6, 2, 2, 2), torch.randn(5), None)


def test_rms_silu_pre_bias_is_the_rounded_bias_add():
    g = torch.Generator().manual_seed(4)
    x, gamma, bias, pre = (torch.randn(2, 6, 3, 4, 5, generator=g).to(torch.bfloat16), torch.randn(6, generator=g),
                           torch.randn(6, generator=g), torch.randn(6, generator=g).to(torch.bfloat16))
    want = ops.rms_silu(x.clone().add_(pre.view(1, 6, 1, 1, 1)), gamma, bias)
    assert torch.equal(ops.rms_silu(x, gamma, bias, pre), want)
    assert torch.equal(ops.rms_silu(x, gamma, bias, pre.float()), want)  # fp32 sum, one rounding
    with pytest.raises(ValueError, match="pre_bias"):
        ops.rms_silu(x, gamma, bias, pre[:5])


def test_rms_silu_fake():
    x = torch.randn(1, 6, 2, 3, 4).contiguous(memory_format=CL3D)
    torch.library.opcheck(ops.rms_silu.default, (x, torch.randn(6), torch.randn(6), torch.randn(6)))
    torch.library.opcheck(ops.rms_silu.default, (x.contiguous(), torch.randn(6), None, None))


@pytest.mark.parametrize("cache_t", [None, 0, 1, 2, 3])
@pytest.mark.parametrize("layout", ["cf", "cl"])
def test_time_pad_is_diffusers_cat_and_pad(cache_t, layout):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 4, 5, 6, generator=g)
    cache = None if cache_t is None else torch.randn(2, 3, cache_t, 5, 6, generator=g)
    fmt = CL3D if layout == "cl" else torch.contiguous_format
    pad = [0, 0, 0, 0, 2, 0]
    want = x
    if cache is not None:  # diffusers' WanCausalConv3d.forward with H/W pads left out
        want = torch.cat([cache, x], 2)
        pad[4] -= cache_t
    want = F.pad(want, pad)
    got = vk.time_pad(x.contiguous(memory_format=fmt), cache, 2, fmt)
    assert torch.equal(got, want)
    assert got.is_contiguous(memory_format=fmt)


def test_time_pad_rejects_mismatched_cache():
    for fn in (lambda x, c: vk.time_pad(x, c, 2), lambda x, c: vk.stack_time_taps(x, c, 2, 3)):
        with pytest.raises(ValueError, match="does not fit"):
            fn(torch.zeros(1, 3, 2, 4, 4), torch.zeros(1, 3, 2, 4, 5))


def test_bias_routes_and_predicates():
    g = torch.Generator().manual_seed(5)
    y, h, b = torch.randn(2, 20, 3, 4, 5, generator=g), torch.randn(2, 20, 3, 4, 5, generator=g), torch.randn(20)
    want = y + b.view(1, -1, 1, 1, 1)
    yy = y.clone()
    assert vk.add_channel_bias_(yy, b) is yy and torch.equal(yy, want)
    assert torch.equal(vk.add_bias_residual(y.clone(), b, h), want + h)
    assert torch.equal(vk.add_bias_residual(y.clone(), None, h), y + h)
    cl = y.contiguous(memory_format=CL3D)
    assert vk.dense_layout(y) == "cf" and vk.dense_layout(cl) == "cl" and vk.dense_layout(y[:, :, 1:]) is None
    assert vk.bias_fits(y, b) and vk.bias_fits(cl, b) and not vk.bias_fits(y[:, :, 1:], b)
    assert not vk.bias_fits(y, b[:5]) and not vk.bias_fits(y, b.double())
    assert vk.residual_fits(y, b, h) and vk.residual_fits(cl, b, h.contiguous(memory_format=CL3D))
    assert not vk.residual_fits(cl, b, h)  # mixed layouts: the two-step route
    assert not vk.residual_fits(y, b, h.double()) and not vk.residual_fits(y, b, h[:1])
    with torch.enable_grad():
        assert not vk.bias_fits(y, b.clone().requires_grad_())  # no backward: the PyTorch route


SCRIPT = r"""
import torch
from fastwan.kernels import vae as vk

CL = torch.channels_last_3d
n = {"bias": 0, "fold": 0, "stack": 0, "rms": 0}


def trunc_bf16(v):
    return (v.float().view(torch.int32) & -65536).view(torch.float32).bfloat16()


# ---- the bias add alone: any channel count, both layouts, 4-D and 5-D = PyTorch's add (fp32)
for shape in [(2, 5, 3, 4, 7), (1, 96, 2, 3, 5), (1, 3, 1, 9, 8), (2, 6, 5, 7), (1, 384, 1, 2, 3)]:
    g = torch.Generator().manual_seed(shape[1])
    y, b = torch.randn(*shape, generator=g), torch.randn(shape[1], generator=g)
    want = y + b.view((1, -1) + (1,) * (y.dim() - 2))
    cl = CL if y.dim() == 5 else torch.channels_last
    for yin in (y.clone(), y.contiguous(memory_format=cl)):
        got = vk.add_bias_triton(yin, b)
        assert got is yin and torch.equal(got, want), shape
        n["bias"] += 1

# ---- the folds: conv1's bias in the norm = the bias kernel, then the norm kernel; conv2's bias in the residual
# add = round(round(y + b) + h), with the rounding the kernels have here (the interpreter truncates to bf16)
two_roundings_show = False
for shape in [(2, 5, 3, 4, 7), (1, 96, 2, 3, 5), (1, 24, 1, 9, 8), (1, 3, 2, 2, 3)]:
    c = shape[1]
    g = torch.Generator().manual_seed(c)
    y, h = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
    b, gamma, nb = (torch.randn(c, generator=g) for _ in range(3))
    for dtype in (torch.float32, torch.bfloat16):
        for fmt in (torch.contiguous_format, CL):
            yd, hd = y.to(dtype).contiguous(memory_format=fmt), h.to(dtype).contiguous(memory_format=fmt)
            bd = b.to(dtype)
            assert vk.residual_fits(yd, bd, hd) and vk.rms_silu_fits(yd, bd), shape
            ub = vk.add_bias_triton(yd.clone(), bd)
            got = vk.rms_silu_triton(yd, gamma, nb, bd)
            assert got.stride() == yd.stride() and torch.equal(got, vk.rms_silu_triton(ub, gamma, nb)), (shape, dtype)
            if dtype == torch.float32:
                want = vk.rms_silu_reference(y + b.view(1, -1, 1, 1, 1), gamma, nb)
                assert float((got - want).abs().max()) <= 1e-5
            s = yd.float() + bd.float().view(1, -1, 1, 1, 1)
            rnd = trunc_bf16 if dtype == torch.bfloat16 and torch.equal(ub, trunc_bf16(s)) else (
                lambda v, dtype=dtype: v.to(dtype))
            assert torch.equal(ub, rnd(s))
            yy = yd.clone()
            got = vk.add_bias_triton(yy, bd, hd)
            assert got is yy and got.stride() == yd.stride(), (shape, dtype)
            assert torch.equal(got, rnd(rnd(s).float() + hd.float())), (shape, dtype)
            if dtype == torch.float32:
                assert torch.equal(got, y + b.view(1, -1, 1, 1, 1) + h)
            else:
                two_roundings_show |= not torch.equal(got, rnd(s + hd.float()))
            n["fold"] += 1
assert two_roundings_show  # the bf16 check tells the two-step rounding from a single one

# ---- the stacked time taps = time_pad's frames stacked along channels (caches of 0-3 frames, batch 2)
g = torch.Generator().manual_seed(0)
CASES = [(1, 5, 3, None, 2), (2, 3, 1, 1, 2), (1, 4, 2, 2, 2), (1, 6, 1, 3, 2), (2, 4, 3, 2, 1)]
for (b, c, t, cache_t, pad_t) in CASES:
    x = torch.randn(b, c, t, 3, 5, generator=g).contiguous(memory_format=CL)
    cache = None if cache_t is None else torch.randn(b, c, cache_t, 3, 5, generator=g).contiguous(memory_format=CL)
    got = vk.stack_time_taps_triton(x, cache, pad_t, pad_t + 1)
    padded = vk.time_pad(x, cache, pad_t)
    want = torch.cat([padded[:, :, i:i + t] for i in range(pad_t + 1)], 1).permute(0, 2, 1, 3, 4).reshape(
        b * t, (pad_t + 1) * c, 3, 5)
    assert torch.equal(got, want), (b, c, t, cache_t, pad_t)
    assert torch.equal(vk.stack_time_taps_reference(x, cache, pad_t, pad_t + 1), want)
    n["stack"] += 1

# ---- rms_silu: C not a power of two, channels-first and channels-last, with and without bias
for C, shape, bias in [(5, (2, 5, 3, 7, 9), True), (96, (1, 96, 2, 4, 33), False), (3, (1, 3, 1, 1, 2), True)]:
    g = torch.Generator().manual_seed(C)
    x = torch.randn(*shape, generator=g)
    gamma, b = torch.randn(C, 1, 1, 1, generator=g), (torch.randn(C, 1, 1, 1, generator=g) if bias else None)
    want = vk.rms_silu_reference(x, gamma, b)
    for xin in (x, x.contiguous(memory_format=CL)):
        got = vk.rms_silu_triton(xin, gamma, b)
        assert got.shape == want.shape and got.stride() == xin.stride()
        assert float(((got - want).abs() / (want.abs() + 1)).max()) <= 1e-5, (C, xin.stride())
        n["rms"] += 1
print("CHECKED", sorted(n.items()))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs the triton package")
def test_kernels_match_references_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "CHECKED [('bias', 10), ('fold', 16), ('rms', 6), ('stack', 5)]" in out.stdout, out.stdout
