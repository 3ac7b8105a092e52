"""GPU: the ring step's attention kernels (fastwan.parallel.ring_kernels: FA4 and PyTorch's flash kernel with their
log-sum-exp) against fp32 attention written in torch, on bf16 chunks whose lengths are no tile multiple; and the
kernel a FLASH_ATTN model's ring picks. The CPU tests: tests/parallel/test_ring_kernels.py."""
import pytest
import torch

from fastwan.attention.backends.packages import flash_import_error
from fastwan.attention.registry import create_backend
from fastwan.parallel.ring import merge
from fastwan.parallel.ring_kernels import KERNELS, attention_lse, ring_kernel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                reason="needs CUDA sm90+")
GPU_KERNELS = [k for k in ("fa4", "sdpa_flash") if k != "fa4" or flash_import_error(4) is None]


def _qkv(sq: int, sk: int, heads: int = 6, d: int = 128, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, sq, heads, d, device="cuda", generator=g).bfloat16()
    k = torch.randn(1, sk, heads, d, device="cuda", generator=g).bfloat16()
    v = torch.randn(1, sk, heads, d, device="cuda", generator=g).bfloat16()
    return q, k, v


@pytest.mark.parametrize("kernel", GPU_KERNELS)
def test_step_kernel_matches_exact_attention_and_its_lse(kernel):
    q, k, v = _qkv(1000, 1531)
    scale = 128 ** -0.5
    out, lse = KERNELS[kernel](q, k, v, scale)
    want, want_lse = attention_lse(q, k, v, scale)
    assert out.shape == q.shape and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=2e-3)  # natural log, [B, Sq, H]
    err = (out.float() - want).norm() / want.norm()
    assert err < 1e-2, f"{kernel}: relative L2 {err:.2e}"


@pytest.mark.parametrize("kernel", GPU_KERNELS)
def test_ring_steps_merged_equal_attention_over_all_keys(kernel):
    """Three key chunks of unequal length, merged by their log-sum-exp, equal attention over every key."""
    q, k, v = _qkv(777, 2500, seed=1)
    scale = 0.1
    parts = None
    for keys in (slice(0, 900), slice(900, 1000), slice(1000, 2500)):
        parts = merge(*(parts or (None, None)), *KERNELS[kernel](q, k[:, keys], v[:, keys], scale))
    want = attention_lse(q, k, v, scale)[0]
    err = (parts[0] - want).norm() / want.norm()
    assert parts[0].dtype == torch.float32 and err < 1e-2, f"{kernel}: relative L2 {err:.2e}"


def test_flash_attn_model_rings_on_fa4():
    if flash_import_error(4) is not None:
        pytest.skip("flash_attn.cute does not import")
    assert ring_kernel(create_backend("FLASH_ATTN")) == "fa4"
    assert ring_kernel(create_backend("TORCH_SDPA")) == "sdpa_flash"
