"""The collapsed text cross-attention with the query's RMSNorm fused in (fastwan::text_cross_attention_normq).

Checked in float64 against an explicit RMSNorm followed by a dense softmax over every (duplicated) padding key:
the PyTorch reference, and the Triton kernel under the interpreter (fp32; bf16 on the GPU:
tests/gpu/test_gpu_text_cross.py)."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from fastwan.kernels import text_cross  # noqa: F401 (registers the ops)
from tests.kernels.interpreter import worst_error

ops = torch.ops.fastwan
EPS = 1e-6


def normq_inputs(B, S, L, H, D, lengths, seed=0, dtype=torch.float64, wide=False):
    """q [B, S, H * D] raw, weight [H * D], k, v [B, L, H, D] with one repeated padding key/value after
    lengths[b] keys, keys int32 [B] (lengths + 1, at most L). ``wide``: q is a view of a [B, S, 2 * H * D] buffer
    (row stride 2C, as a slice of a fused projection)."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, S, 2 * H * D if wide else H * D, generator=g, dtype=dtype) * 3)[..., :H * D]
    w = torch.rand(H * D, generator=g, dtype=dtype) + 0.5
    k, v = (torch.randn(B, L, H, D, generator=g, dtype=dtype) for _ in range(2))
    for b, n in enumerate(lengths):
        if n < L:
            k[b, n:], v[b, n:] = k[b, n].clone(), v[b, n].clone()
    keys = torch.tensor([min(n + 1, L) for n in lengths], dtype=torch.int32)
    return q, w, k, v, keys


def composed64(q, w, k, v, eps=EPS):
    """float64: x * rsqrt(mean(x^2) + eps) * w over all C, then plain softmax attention over every key."""
    q, w, k, v = (t.double() for t in (q, w, k, v))
    qn = (q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + eps) * w).unflatten(-1, k.shape[2:])
    s = torch.einsum("bshd,blhd->bhsl", qn, k) / k.shape[-1] ** 0.5
    return torch.einsum("bhsl,blhd->bshd", s.softmax(-1), v)


@pytest.mark.parametrize("B, S, L, H, D, lengths", [
    (2, 11, 16, 3, 8, [5, 13]),
    (3, 7, 12, 2, 16, [12, 0, 4]),  # no padding (n == L); all padding (n == 1)
    (1, 5, 9, 4, 4, [9]),
])
def test_reference_equals_norm_then_attention_over_all_keys(B, S, L, H, D, lengths):
    q, w, k, v, keys = normq_inputs(B, S, L, H, D, lengths)
    got = ops.text_cross_attention_normq(q, w, EPS, k, v, keys)
    assert got.shape == (B, S, H, D) and got.dtype == q.dtype
    torch.testing.assert_close(got, composed64(q, w, k, v), rtol=1e-10, atol=1e-10)


def test_bad_inputs_raise():
    q, w, k, v, keys = normq_inputs(2, 4, 6, 2, 8, [2, 3])
    with pytest.raises(ValueError, match=r"q must be the raw projection \[B, S, C\]"):
        ops.text_cross_attention_normq(q.unflatten(-1, (2, 8)), w, EPS, k, v, keys)
    with pytest.raises(ValueError, match=r"weight must be \[16\]"):
        ops.text_cross_attention_normq(q, w[:8], EPS, k, v, keys)
    with pytest.raises(ValueError, match=r"H \* D = C = 16"):
        ops.text_cross_attention_normq(q, w, EPS, k[:, :, :1], v[:, :, :1], keys)
    with pytest.raises(ValueError, match="int32"):
        ops.text_cross_attention_normq(q, w, EPS, k, v, keys.long())


def test_opcheck():
    q, w, k, v, keys = normq_inputs(2, 4, 6, 2, 8, [2, 3], dtype=torch.float32)
    result = torch.library.opcheck(ops.text_cross_attention_normq.default, (q, w, EPS, k, v, keys))
    assert all(r == "SUCCESS" for r in result.values()), result


KERNEL_SCRIPT = r"""
import torch
from fastwan.kernels import interpreted_kernels, text_cross
from tests.kernels.test_text_cross_normq import EPS, composed64, normq_inputs
worst = 0.0
with interpreted_kernels():
    for B, S, L, H, D, lengths, wide in [(2, 70, 20, 3, 16, [3, 19], False), (2, 33, 70, 3, 32, [66, 0], True),
                                         (1, 5, 4, 2, 16, [4], True)]:
        q, w, k, v, keys = normq_inputs(B, S, L, H, D, lengths, seed=S, dtype=torch.float32, wide=wide)
        assert text_cross.kernel_runs(q, w, k, v, head_dim=D)  # the kernel runs, not the reference
        got = torch.ops.fastwan.text_cross_attention_normq(q, w, EPS, k, v, keys)
        assert got.shape == (B, S, H, D)
        worst = max(worst, float((got.double() - composed64(q, w, k, v)).abs().max()))
print(f"WORST {worst:.3e}")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs the triton package")
def test_kernel_under_the_interpreter():
    assert worst_error(KERNEL_SCRIPT) <= 1e-5  # bf16: tests/gpu/test_gpu_text_cross.py
