"""GPU: fastwan's 8-bit attention kernel (fastwan::attn8, Triton) at Wan2.1 1.3B's 480p self-attention shape
(B=1, S=21x30x52=32760, H=12, D=128, bf16; S a multiple of neither quantization block): against the PyTorch
reference of its roundings (fp32, block by block), and against exact attention (fp32, the memory-efficient SDPA
kernel) next to bf16 SDPA's error. The errors and times are printed (pytest -s). The CPU tests:
tests/kernels/test_attn8.py."""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fastwan.attention.synthetic import wan_like_qkv
from fastwan.kernels import attn8 as A
from fastwan.kernels.attn8_configs import config_for

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                reason="needs CUDA sm90+")

GRID, HEADS, D = (21, 30, 52), 12, 128


def _inputs(k_offset: float):
    """Wan-like bf16 q, k, v [1, 32760, 12, 128]; k with a per-channel offset of ``k_offset`` (the same for every
    token, what K smoothing removes)."""
    q, k, v = wan_like_qkv(GRID, HEADS, D, device="cuda", seed=0)
    g = torch.Generator(device="cuda").manual_seed(1)
    k = k + k_offset * torch.randn(1, 1, HEADS, D, device="cuda", generator=g)
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def _exact(q, k, v):
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):  # fp32 without an S x S matrix
        return F.scaled_dot_product_attention(*(t.float().transpose(1, 2) for t in (q, k, v))).transpose(1, 2)


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def _ms(fn, iters=10):
    fn()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / iters


@pytest.mark.parametrize("k_offset", [0.0, 4.0])
def test_kernel_matches_its_reference_and_exact_attention(k_offset):
    q, k, v = _inputs(k_offset)
    scale = D ** -0.5
    out = torch.ops.fastwan.attn8(q, k, v, scale, True)
    cfg = config_for(D, A.capability("cuda"))  # the op's configuration: its quantization blocks
    ref = A.attention_reference(A.quantize(q, k, v, scale, True, cfg.block_m, cfg.block_n))
    exact = _exact(q, k, v)
    bf16 = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    to_ref, to_exact, bf16_err = _rel(out, ref), _rel(out, exact), _rel(bf16, exact)
    t8 = _ms(lambda: torch.ops.fastwan.attn8(q, k, v, scale, True))
    tq = _ms(lambda: A.quantize_fused(q, k, v, scale, True, cfg.block_m, cfg.block_n))
    tsdpa = _ms(lambda: F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))))
    print(f"\nattn8 {cfg.label} k_offset={k_offset}: rel. L2 to its reference {to_ref:.2e}, to exact {to_exact:.2e} "
          f"(bf16 SDPA {bf16_err:.2e}); {t8:.2f} ms ({tq:.2f} ms of it quantizing), bf16 SDPA {tsdpa:.2f} ms")
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and bool(torch.isfinite(out).all())
    assert to_ref <= 5e-3  # the output's bf16 rounding and the tensor cores' accumulation order
    assert to_exact <= 3e-2
