"""The cross-attention's output projection folded into the per-prompt values.

``fastwan::text_cross_probs_normq`` (the attention weights over the collapsed text keys) is checked in float64
against the softmax over every duplicated padding key with the padding's weights summed; the fold
(``P @ fold_values(v, W_o)``) against the attention output projected by ``W_o``; the Triton kernel under the
interpreter. The DiT's folded route: tests/models/test_fast_block.py; bf16 on the GPU: tests/gpu/test_gpu_text_cross.py.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch


import fastwan.kernels.norms  # noqa: F401  (registers residual_bmm_)
from fastwan.models.wan.cross import fold_values, fold_width
from tests.kernels.test_text_cross_normq import EPS, composed64, normq_inputs
from tests.kernels.interpreter import worst_error

ops = torch.ops.fastwan


def weights64(q, w, k, keys, width):
    """float64: the softmax weights of the normalized q over every key, the padding keys' weights summed into
    key n - 1, as [B, S, H, width] (zeros after key n - 1)."""
    q, w, k = (t.double() for t in (q, w, k))
    B, L, H, D = k.shape
    qn = (q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + EPS) * w).unflatten(-1, (H, D))
    p = torch.einsum("bshd,blhd->bshl", qn, k).div(D ** 0.5).softmax(-1)
    out = torch.zeros(*p.shape[:3], width, dtype=torch.float64)
    for b, n in enumerate(keys.tolist()):
        out[b, ..., :n - 1] = p[b, ..., :n - 1]
        out[b, ..., n - 1] = p[b, ..., n - 1:].sum(-1)
    return out


@pytest.mark.parametrize("B, S, L, H, D, lengths, width", [
    (2, 11, 16, 3, 8, [5, 13], 16),
    (3, 7, 12, 2, 16, [11, 0, 4], 12),  # n == width; all padding (n == 1)
    (1, 5, 6, 4, 4, [3], 16),  # width beyond the text's length
])
def test_probs_equal_the_weights_over_all_keys(B, S, L, H, D, lengths, width):
    q, w, k, v, keys = normq_inputs(B, S, L, H, D, lengths)
    got = ops.text_cross_probs_normq(q, w, EPS, k, keys, width)
    assert got.shape == (B, S, H, width) and got.dtype == q.dtype
    torch.testing.assert_close(got, weights64(q, w, k, keys, width), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("lengths", [[5, 13], [0, 15]])
def test_fold_gives_the_projected_attention(lengths):
    B, S, L, H, D = 2, 9, 16, 3, 8
    q, w, k, v, keys = normq_inputs(B, S, L, H, D, lengths, seed=1)
    wo = torch.randn(20, H * D, dtype=torch.float64)  # to_out's weight (output width 20 != H * D)
    width = fold_width(int(keys.max()), head_dim=64)
    u = fold_values(v, keys, width, wo)
    assert u.shape == (B, H * width, 20)
    got = ops.text_cross_probs_normq(q, w, EPS, k, keys, width).flatten(2) @ u
    want = composed64(q, w, k, v).flatten(2) @ wo.t()
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    x = torch.randn(B, S, 20, dtype=torch.float64)
    for uu in (u, u[:1]):  # per-sample u, and one u for the whole batch
        y = x.clone()
        ops.residual_bmm_(y, ops.text_cross_probs_normq(q, w, EPS, k, keys, width).flatten(2), uu)
        torch.testing.assert_close(y, x + ops.text_cross_probs_normq(q, w, EPS, k, keys, width).flatten(2) @ uu,
                                   rtol=1e-12, atol=1e-12)


def test_fold_width_rule():
    assert fold_width(21, 128) == 24  # rounded up to FOLD_ALIGN
    assert fold_width(64, 128) == 64  # at most half the head dim
    assert fold_width(65, 128) is None
    assert fold_width(1, 16) == 8
    with pytest.raises(ValueError, match="max_keys must be >= 1"):
        fold_width(0, 128)


def test_bad_inputs_raise():
    q, w, k, v, keys = normq_inputs(2, 4, 6, 2, 8, [2, 5])
    with pytest.raises(ValueError, match=r"more than width=4"):
        ops.text_cross_probs_normq(q, w, EPS, k, keys, 4)  # 6 keys in the second sample
    with pytest.raises(ValueError, match=r"width=200 must be in 1..128"):
        ops.text_cross_probs_normq(q, w, EPS, k, keys, 200)
    with pytest.raises(ValueError, match=r"weight must be \[16\]"):
        ops.text_cross_probs_normq(q, w[:8], EPS, k, keys, 8)
    with pytest.raises(ValueError, match=r"weight must be \[N, H \* D = 16\]"):
        fold_values(v, keys, 8, torch.randn(16, 8, dtype=torch.float64))
    x = torch.randn(2, 4, 10, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"u \[B or 1, K, N\] expected"):
        ops.residual_bmm_(x, torch.randn(2, 4, 8, dtype=torch.float64), torch.randn(3, 8, 10, dtype=torch.float64))
    with pytest.raises(ValueError, match="must be contiguous"):
        ops.residual_bmm_(x.transpose(0, 1), torch.randn(4, 2, 8, dtype=torch.float64),
                          torch.randn(1, 8, 10, dtype=torch.float64))


def test_opcheck():
    q, w, k, v, keys = normq_inputs(2, 4, 6, 2, 8, [2, 3], dtype=torch.float32)
    result = torch.library.opcheck(ops.text_cross_probs_normq.default, (q, w, EPS, k, keys, 8))
    assert all(r == "SUCCESS" for r in result.values()), result
    x, a, u = torch.randn(2, 4, 10), torch.randn(2, 4, 8), torch.randn(2, 8, 10)
    result = torch.library.opcheck(ops.residual_bmm_.default, (x, a, u))
    assert all(r == "SUCCESS" for r in result.values()), result


KERNEL_SCRIPT = r"""
import torch
from fastwan.kernels import interpreted_kernels, text_cross
from tests.kernels.test_text_cross_normq import EPS, normq_inputs
from tests.kernels.test_text_fold import weights64
worst = 0.0
with interpreted_kernels():
    for B, S, L, H, D, lengths, width, wide in [(2, 70, 20, 3, 16, [3, 19], 24, False),
                                                (2, 33, 70, 2, 32, [60, 0], 64, True),
                                                (1, 5, 4, 2, 16, [4], 8, True)]:
        q, w, k, v, keys = normq_inputs(B, S, L, H, D, lengths, seed=S, dtype=torch.float32, wide=wide)
        assert text_cross.kernel_runs(q, w, k, head_dim=D)  # the kernel runs, not the reference
        got = torch.ops.fastwan.text_cross_probs_normq(q, w, EPS, k, keys, width)
        assert got.shape == (B, S, H, width)
        worst = max(worst, float((got.double() - weights64(q, w, k, keys, width)).abs().max()))
print(f"WORST {worst:.3e}")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs the triton package")
def test_kernel_under_the_interpreter():
    assert worst_error(KERNEL_SCRIPT) <= 1e-6
