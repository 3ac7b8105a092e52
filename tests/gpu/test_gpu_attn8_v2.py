"""GPU: fastwan's 8-bit attention, second round: the fused Triton quantizer equal to ``quantize`` bit for bit on CUDA
(its divisions correctly rounded, e4m3 rounded by the GPU's conversion), and kernel versions 1 and 2 at several
configurations against the reference at their blocks and exact attention, on Wan-like bf16 inputs (1, 10920, 12,
128): 7 x 30 x 52 tokens, a multiple of neither block. The CPU tests: tests/kernels/test_attn8_v2.py; the sweep:
benchmarks/attn8_bench.py."""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fastwan.attention.synthetic import wan_like_qkv
from fastwan.kernels import attn8 as A
from fastwan.kernels.attn8_configs import CONFIGS, parse_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                reason="needs CUDA sm90+")

GRID, HEADS, D = (7, 30, 52), 12, 128


@pytest.fixture(scope="module")
def qkv():
    q, k, v = wan_like_qkv(GRID, HEADS, D, device="cuda", seed=0)
    k = k + 4.0 * torch.randn(1, 1, HEADS, D, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8) if x.dtype == A.E4M3 else x.view(torch.int32) if x.dtype == torch.float32 else x


@pytest.mark.parametrize("blocks", [(128, 64), (128, 128), (64, 128)])
def test_fused_quantizer_equals_quantize_bit_for_bit(qkv, blocks):
    q, k, v = qkv
    ref = A.quantize(q, k, v, D ** -0.5, True, *blocks)
    got = A.quantize_fused(q, k, v, D ** -0.5, True, *blocks)
    for name in ("q8", "qs", "k8", "ks", "v8", "vs"):
        a, b = getattr(ref, name), getattr(got, name)
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.equal(_bits(a), _bits(b)), f"{name}: {int((_bits(a) != _bits(b)).sum())} values differ"


LABELS = sorted({c.label for c in CONFIGS.values()} | {
    "v1-m128-n64-w8-s3", "v2-m128-n64-w8-s3-desc", "v2-m128-n128-w8-s3-desc-fold-ffma", "v2-m64-n128-w4-s3-desc",
    "v2-m128-n128-w8-s2-desc-poly2d3-fold-ffma"})


@pytest.mark.parametrize("label", LABELS)
def test_configs_match_the_reference_and_exact_attention(qkv, label):
    q, k, v = qkv
    cfg = parse_config(label)
    out = A.attn8_config(q, k, v, D ** -0.5, True, cfg)
    ref = A.attention_reference(A.quantize(q, k, v, D ** -0.5, True, cfg.block_m, cfg.block_n))
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        exact = F.scaled_dot_product_attention(*(t.float().transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    to_ref = float((out.float() - ref).norm() / ref.norm())
    to_exact = float((out.float() - exact).norm() / exact.norm())
    print(f"\n{label}: rel. L2 to its reference {to_ref:.2e}, to exact {to_exact:.2e}")
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and bool(torch.isfinite(out).all())
    assert to_ref <= 5e-3 and to_exact <= 3e-2
