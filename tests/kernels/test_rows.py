"""fastwan::pad_rows: the reference and the Triton kernel (on the CPU under Triton's interpreter) against a
row-by-row Python copy; schema and fake checks."""
from __future__ import annotations

import pytest
import torch

from fastwan.kernels import rows, triton_importable
from tests.kernels.interpreter import worst_error

needs_triton = pytest.mark.skipif(not triton_importable(), reason="Triton is not importable")


def by_hand(x, src):
    """Row p of the result: x[:, src[p]] copied, or zeros for src[p] == -1 (a Python loop)."""
    out = torch.empty(x.shape[0], len(src), *x.shape[2:], dtype=x.dtype)
    for p, s in enumerate(src.tolist()):
        out[:, p] = x[:, s] if s >= 0 else 0
    return out


def sources(n, p, seed):
    """src of length p: each of the n rows once, in a random order, the rest -1, shuffled."""
    g = torch.Generator().manual_seed(seed)
    src = torch.cat([torch.randperm(n, generator=g), torch.full((p - n,), -1)])
    return src[torch.randperm(p, generator=g)]


@pytest.mark.parametrize("shape,p", [((2, 7, 3, 5), 11), ((1, 5, 16), 5), ((3, 4, 2, 1), 9), ((1, 1, 6), 3)])
def test_reference_and_op_equal_the_python_copy(shape, p):
    x = torch.randn(*shape, dtype=torch.float64)
    src = sources(shape[1], p, 0)
    want = by_hand(x, src)
    assert torch.equal(rows.pad_rows_reference(x, src), want)
    got = torch.ops.fastwan.pad_rows(x, src)
    assert torch.equal(got, want) and got.is_contiguous()
    strided = x.transpose(2, -1).contiguous().transpose(2, -1)  # any strides
    assert torch.equal(torch.ops.fastwan.pad_rows(strided, src), want)


def test_opcheck_and_bad_inputs():
    x = torch.randn(2, 6, 3, 4)
    torch.library.opcheck(torch.ops.fastwan.pad_rows.default, (x, sources(6, 10, 1)))
    with pytest.raises(ValueError, match="int64"):
        torch.ops.fastwan.pad_rows(x, sources(6, 10, 1).to(torch.int32))
    with pytest.raises(ValueError, match=r"\[B, N, \.\.\.\]"):
        torch.ops.fastwan.pad_rows(torch.randn(6), sources(6, 10, 1))


SCRIPT = r'''
import torch
from fastwan.kernels import rows, triton_importable
from tests.kernels.test_rows import by_hand, sources
worst = 0.0
cases = [((2, 7, 3, 5), 11, torch.float32), ((1, 9, 2, 2100), 13, torch.bfloat16), ((1, 4, 4096), 4, torch.float16),
         ((2, 3, 1), 8, torch.float32), ((1, 6, 2, 128), 6, torch.bfloat16), ((0, 3, 4), 5, torch.float32)]
for shape, p, dtype in cases:
    x = torch.randn(*shape).to(dtype)
    src = sources(shape[1], p, 2)
    got = rows.pad_rows_triton(x, src)
    want = by_hand(x, src)
    assert got.shape == want.shape and got.dtype == dtype, (shape, p)
    if got.numel():
        worst = max(worst, (got.float() - want.float()).abs().max().item())
    ones = torch.full((5,), -1)  # every row empty
    assert torch.equal(rows.pad_rows_triton(x, ones), torch.zeros(shape[0], 5, *shape[2:], dtype=dtype))
print(f"WORST {worst:.3e}")
'''


@needs_triton
def test_kernel_equals_the_python_copy_under_the_interpreter():
    assert worst_error(SCRIPT) == 0.0


def test_empty_batch():
    assert torch.ops.fastwan.pad_rows(torch.randn(0, 5, 3), sources(5, 7, 3)).shape == (0, 7, 3)
