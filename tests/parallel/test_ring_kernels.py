"""The ring step's kernels on the CPU (fastwan.parallel.ring_kernels): the choice a ring makes without a GPU, the
rule that a GPU kernel runs exact fp32 attention for a call it cannot take, and the merge of half-precision steps.
The GPU kernels themselves: tests/gpu/test_gpu_ring_kernels.py."""
import pytest
import torch

from fastwan.attention.registry import create_backend
from fastwan.parallel.ring import merge
from fastwan.parallel.ring_kernels import KERNELS, attention_lse, ring_kernel


def _reference(q, k, v, scale):
    """fp64 softmax attention and its log-sum-exp, [B, Sq, H, D] and [B, Sq, H]."""
    q, k, v = (t.double() for t in (q, k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v), scores.logsumexp(-1).transpose(1, 2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the choice without a GPU")
def test_without_a_gpu_every_backend_rings_exactly():
    for name in ("FLASH_ATTN", "TORCH_SDPA"):
        assert ring_kernel(create_backend(name)) == "exact"


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_call_no_gpu_kernel_takes_runs_exact_attention(kernel, dtype):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 7, 3, 16, generator=g).to(dtype) for _ in range(3))
    out, lse = KERNELS[kernel](q, k, v, 0.3)
    want, want_lse = _reference(q, k, v, 0.3)
    assert out.dtype == lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    empty = KERNELS[kernel](q, k[:, :0], v[:, :0], 0.3)
    assert not empty[0].any() and torch.isneginf(empty[1]).all()


def test_merge_of_bf16_steps_accumulates_in_fp32():
    """Steps whose outputs are bf16 (the GPU kernels') merge into an fp32 output equal to attention over every key
    to bf16's rounding of each step, not worse."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 9, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    parts = None
    for keys in (slice(0, 3), slice(3, 3), slice(3, 11)):
        out, lse = attention_lse(q, k[:, keys], v[:, keys], 0.5)
        parts = merge(*(parts or (None, None)), out.bfloat16(), lse)
    want = _reference(q, k, v, 0.5)[0]
    assert parts[0].dtype == torch.float32
    torch.testing.assert_close(parts[0].double(), want, rtol=0, atol=8e-3)
