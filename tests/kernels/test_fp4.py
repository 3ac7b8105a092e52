"""NVFP4 reference quantizer (exact), and the fidelity of attention with NVFP4-quantized Q/K on Wan-like inputs
(:func:`fp4_emulated_attention`, the numerics an NVFP4 Q/K kernel aims for; tests/gpu compares the kernel to it)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fastwan.attention.synthetic import reference_attention, wan_like_qkv
from fastwan.kernels import fp4

GRID = torch.tensor(fp4.E2M1_GRID)


def fp4_emulated_attention(q, k, v, scale: float | None = None, *, use_global_scale: bool = False) -> torch.Tensor:
    """Attention with NVFP4-quantized Q and K and full-precision V, computed exactly in fp32: q [B, Sq, H, D],
    k/v [B, Skv, H, D] -> [B, Sq, H, D] in v's dtype. FP4 QK^T with fp32 accumulation, without an FP4 kernel's
    rounding of P."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    qd = fp4.nvfp4_fake_quantize(q.float(), use_global_scale, check_finite=False)
    kd = fp4.nvfp4_fake_quantize(k.float(), use_global_scale, check_finite=False)
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(qd.transpose(1, 2), kd.transpose(1, 2), v.float().transpose(1, 2),
                                             scale=scale)
    return out.transpose(1, 2).to(v.dtype).contiguous()


def all_e4m3_values() -> torch.Tensor:
    """Every finite, non-negative float8_e4m3fn value, from the raw bit patterns (independent of .to())."""
    v = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(torch.float8_e4m3fn).float()
    return torch.unique(v[torch.isfinite(v) & (v >= 0)])


def nearest_even_e4m3(x: float) -> float:
    """Round to nearest representable e4m3 (ties: even mantissa), computed by search over all values."""
    vals = all_e4m3_values().double()
    d = (vals - x).abs()
    best = torch.nonzero(d == d.min()).flatten()
    if len(best) == 1:
        return float(vals[best[0]])
    bits = [int(torch.tensor(float(vals[i])).to(torch.float8_e4m3fn).view(torch.uint8)) for i in best]
    return float(vals[best[[b % 2 == 0 for b in bits].index(True)]])


def test_e2m1_rounding_table():
    x = torch.tensor([0, 0.2, 0.25, 0.26, 0.5, 0.74, 0.75, 1.0, 1.25, 1.3, 1.5, 1.75, 2.0, 2.5, 2.6, 3.0, 3.5,
                      4.0, 5.0, 5.1, 6.0, 7.0, 1e9])
    expected = [0, 0, 0, 0.5, 0.5, 0.5, 1, 1, 1, 1.5, 1.5, 2, 2, 2, 3, 3, 4, 4, 4, 6, 6, 6, 6]
    got = GRID[fp4.e2m1_encode(x).long()]
    assert got.tolist() == expected


def test_quantized_values_lie_on_the_grid_times_block_scale():
    x = torch.randn(3, 5, 64) * torch.logspace(-2, 2, 64)
    codes, scales = fp4.nvfp4_quantize(x)
    assert codes.dtype == torch.uint8 and scales.dtype == torch.float8_e4m3fn
    assert codes.shape == x.shape and scales.shape == (3, 5, 4)
    assert int(codes.max()) <= 15
    deq = fp4.nvfp4_dequantize(codes, scales).unflatten(-1, (4, 16))
    unit = (deq / scales.float().unsqueeze(-1)).abs()
    assert torch.isin(unit, GRID).all()
    # signs survive (values that round to 0 aside)
    nz = deq.flatten(-2) != 0
    assert torch.equal(torch.sign(deq.flatten(-2))[nz], torch.sign(x)[nz])


@pytest.mark.parametrize("amax", [6.0, 0.3, 1.0 / 7, 12.345, 100.0, 2e-3, 2000.0])
def test_block_scale_is_amax_over_6_rounded_to_e4m3(amax):
    x = torch.zeros(16)
    x[3], x[7] = amax, -amax / 3
    _, scales = fp4.nvfp4_quantize(x)
    assert float(scales.float()[0]) == nearest_even_e4m3(min(amax / 6, 448.0))


def test_scale_saturates_at_448_and_values_at_6():
    x = torch.full((16,), 1e6)
    codes, scales = fp4.nvfp4_quantize(x)
    assert float(scales.float()[0]) == 448.0
    assert torch.all(fp4.nvfp4_dequantize(codes, scales) == 6 * 448)


def test_round_trip_of_representable_values_is_exact():
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (4, 8, 64), generator=g, dtype=torch.uint8)
    codes[..., ::16] = 7  # every block holds a ±6, so amax / 6 is exactly its scale
    codes[..., 1::32] = 15
    e4m3 = all_e4m3_values()
    e4m3 = e4m3[(e4m3 > 0) & (e4m3 <= 448)]
    scales = e4m3[torch.randint(0, len(e4m3), (4, 8, 4), generator=g)].to(torch.float8_e4m3fn)
    x = fp4.nvfp4_dequantize(codes, scales)
    codes2, scales2 = fp4.nvfp4_quantize(x)
    assert torch.equal(scales2.float(), scales.float())
    # -0 and +0 decode alike; compare values, then codes away from zero
    assert torch.equal(fp4.nvfp4_dequantize(codes2, scales2), x)
    nonzero = (codes & 7) != 0
    assert torch.equal(codes2[nonzero], codes[nonzero])


def test_global_scale_keeps_tiny_and_huge_tensors():
    g = torch.Generator().manual_seed(2)
    for magnitude in (1e-6, 1e5):
        x = torch.randn(8, 64, generator=g) * magnitude
        plain = fp4.nvfp4_dequantize(*fp4.nvfp4_quantize(x))
        gs = fp4.nvfp4_global_scale(x)
        assert float(gs) == pytest.approx(float(x.abs().max()) / (6 * 448))
        scaled = fp4.nvfp4_dequantize(*fp4.nvfp4_quantize(x, gs), gs)
        assert F.cosine_similarity(scaled.flatten(), x.flatten(), dim=0) > 0.98
        assert F.cosine_similarity(plain.flatten(), x.flatten(), dim=0).nan_to_num(0.0) < 0.9


def test_quantization_error_is_bounded_per_block():
    # each element is within half a grid step of its block scale (the widest step, 4 -> 6, gives 1; clipping
    # above 6 after the scale rounds down by at most 1/16 costs < 0.4)
    x = torch.randn(64, 128)
    codes, scales = fp4.nvfp4_quantize(x)
    err = (fp4.nvfp4_dequantize(codes, scales) - x).abs().unflatten(-1, (8, 16))
    assert torch.all(err <= scales.float().unsqueeze(-1) * 1.0 + 1e-7)
    rel = float((fp4.nvfp4_fake_quantize(x) - x).norm() / x.norm())
    assert 0.03 < rel < 0.2  # FP4 is coarse, and not a no-op


def test_pack_unpack_and_nibble_order():
    codes = torch.tensor([1, 2, 15, 0, 7, 8], dtype=torch.uint8)
    packed = fp4.nvfp4_pack(codes)
    assert packed.tolist() == [0x21, 0x0F, 0x87]  # element 2i in the low nibble
    assert torch.equal(fp4.nvfp4_unpack(packed), codes)
    with pytest.raises(ValueError, match="even last dim"):
        fp4.nvfp4_pack(codes[:5])


def test_mma_scale_layout_index_mapping():
    b, s, h, nk = 2, 256, 3, 8  # D = 128
    scales = torch.arange(b * s * h * nk, dtype=torch.int32).reshape(b, s, h, nk)
    mma = fp4.nvfp4_scales_to_mma_layout(scales)
    assert mma.shape == (32, 4, 2, 4, 2, 3, 2) and mma.stride(3) == 1
    for m0, m1, rm, kk, rk, hh, bb in [(0, 0, 0, 0, 0, 0, 0), (5, 3, 1, 2, 1, 2, 1), (31, 1, 0, 3, 0, 1, 0)]:
        assert mma[m0, m1, rm, kk, rk, hh, bb] == scales[bb, rm * 128 + m1 * 32 + m0, hh, rk * 4 + kk]
    with pytest.raises(ValueError, match="S % 128"):
        fp4.nvfp4_scales_to_mma_layout(scales[:, :100])


def test_input_errors():
    with pytest.raises(ValueError, match="not a multiple of 16"):
        fp4.nvfp4_quantize(torch.randn(2, 24))
    with pytest.raises(ValueError, match="NaN/inf"):
        fp4.nvfp4_quantize(torch.tensor([float("nan")] + [0.0] * 15))
    with pytest.raises(TypeError, match="floating-point"):
        fp4.nvfp4_quantize(torch.ones(16, dtype=torch.int32))
    with pytest.raises(ValueError, match="do not match"):
        fp4.nvfp4_dequantize(torch.zeros(2, 32, dtype=torch.uint8), torch.zeros(2, 3).to(torch.float8_e4m3fn))


@pytest.mark.parametrize("grid", [(4, 16, 16), (4, 32, 32)])  # S = 1024, 4096
@pytest.mark.parametrize("use_global_scale", [False, True])
def test_fp4_emulated_attention_fidelity_on_wan_like_inputs(grid, use_global_scale):
    q, k, v = wan_like_qkv(grid, 2, 128, dtype=torch.bfloat16, outlier_gain=4.0, seed=3)
    ref = reference_attention(q, k, v)
    out = fp4_emulated_attention(q, k, v, use_global_scale=use_global_scale)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    cos = float(F.cosine_similarity(out.double().flatten(), ref.flatten(), dim=0))
    bf16 = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v))).transpose(1, 2)
    cos_bf16 = float(F.cosine_similarity(bf16.double().flatten(), ref.flatten(), dim=0))
    print(f"S={q.shape[1]} global_scale={use_global_scale}: cos(fp4)={cos:.5f} cos(bf16)={cos_bf16:.6f}")
    assert cos >= 0.99
    assert 1 - cos > 5 * (1 - cos_bf16)  # Q/K really were quantized: FP4 error dominates bf16 rounding
