"""The key count of padded text (:func:`fastwan.models.wan.cross.text_keys`) and the collapse rule it feeds: the
collapsed reference attention equals attention over every (duplicated) padding key, in float64. The ops and their
kernels: tests/kernels/; the DiT's wiring: tests/models/test_fast_block.py."""
from __future__ import annotations


import pytest
import torch

from fastwan.kernels import text_cross
from fastwan.models.wan.cross import text_keys



def padded(B, L, D, lengths, seed=0, dtype=torch.float64):
    """[B, L, D] rows: ``lengths[b]`` random rows, then copies of one padding row (zeros, as Wan pads)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.zeros(B, L, D, dtype=dtype)
    for b, n in enumerate(lengths):
        t[b, :n] = torch.randn(n, D, generator=g, dtype=dtype)
    return t


def dense64(q, k, v):
    """Plain softmax attention over every key, float64. q [B, S, H, D], k/v [B, L, H, D]."""
    q, k, v = (t.double() for t in (q, k, v))
    s = torch.einsum("bshd,blhd->bhsl", q, k) / q.shape[-1] ** 0.5
    return torch.einsum("bhsl,blhd->bshd", s.softmax(-1), v)


def qkv_with_padding(B, S, L, H, D, lengths, seed=0):
    """q random; k, v random for the first lengths[b] keys, then one repeated padding key/value per sample."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, H, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, L, H, D, generator=g, dtype=torch.float64) for _ in range(2))
    for b, n in enumerate(lengths):
        if n < L:
            k[b, n:], v[b, n:] = k[b, n].clone(), v[b, n].clone()
    return q, k, v


def test_text_keys():
    t = padded(4, 10, 3, [4, 10, 0, 9])
    assert text_keys(t).tolist() == [5, 10, 1, 10]  # 4 tokens + 1; none; all padding; 9 + 1 = 10
    t2 = t.clone()
    t2[0, 7] = 1.0  # a non-padding row inside the tail ends the run later
    assert text_keys(t2)[0].item() == 9
    t3 = t.clone()
    t3[1, -1] = float("nan")  # NaN rows never compare equal: no collapse
    assert text_keys(t3)[1].item() == 10
    assert text_keys(t).dtype == torch.int32
    with pytest.raises(ValueError, match=r"\[B, L, D\]"):
        text_keys(torch.zeros(2, 0, 3))


@pytest.mark.parametrize("lengths", [[5, 13], [16, 1], [0, 7]])
def test_reference_equals_attention_over_all_padding_keys(lengths):
    B, S, L, H, D = 2, 11, 16, 3, 8
    q, k, v = qkv_with_padding(B, S, L, H, D, lengths)
    keys = torch.tensor([min(n + 1, L) for n in lengths], dtype=torch.int32)
    got = text_cross.text_cross_reference(q, k, v, keys)
    torch.testing.assert_close(got, dense64(q, k, v), rtol=1e-12, atol=1e-12)
    # more keys than needed stay exact, fewer drop a real key
    more = text_cross.text_cross_reference(q, k, v, (keys + 2).clamp(max=L))
    torch.testing.assert_close(more, dense64(q, k, v), rtol=1e-12, atol=1e-12)
    wrong = text_cross.text_cross_reference(q, k, v, (keys - 1).clamp(min=1))
    assert (wrong - dense64(q, k, v)).abs().max() > 1e-3
