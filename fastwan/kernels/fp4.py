"""NVFP4 reference: quantize / dequantize / pack in pure PyTorch, on any device.

NVFP4 (NVIDIA's 4-bit float format for Blackwell tensor cores):

* element values are E2M1: sign + magnitude in ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``, stored as 4-bit codes
  (bit 3 = sign, bits 0-2 = index into that grid);
* every block of 16 consecutive elements along the last dim shares one scale stored as ``float8_e4m3fn``:
  ``scale = e4m3(amax(|block|) / 6 / global_scale)``;
* an optional per-tensor fp32 ``global_scale`` (``amax(|x|) / (6 * 448)``) brings the block scales into
  E4M3's range, so tiny or huge tensors keep their resolution.

Decoding: ``x ≈ e2m1(code) * float(scale) * global_scale``. Elements are encoded against the *rounded*
scale (as the hardware converter does) with round-to-nearest-even on the E2M1 grid, saturating at ±6.
"""
from __future__ import annotations

import torch

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# magnitude of codes 0..7
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Rounding thresholds between neighbouring grid points; at an exact midpoint the even code wins, so a
# threshold is inclusive (>=) when the upper neighbour has the even code, exclusive (>) otherwise.
_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def _check_last_dim(x: torch.Tensor, block: int) -> None:
    if x.shape[-1] % block:
        raise ValueError(
            f"NVFP4 quantizes blocks of {block} elements along the last dim; got last dim {x.shape[-1]} "
            f"(shape {tuple(x.shape)}), which is not a multiple of {block}. Pad the head dim first."
        )


def e2m1_encode(a: torch.Tensor) -> torch.Tensor:
    """Magnitude codes 0..7 (uint8) of ``|a|`` rounded to nearest-even on the E2M1 grid, saturating at 6."""
    a = a.abs()
    code = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for t, inclusive in _THRESHOLDS:
        code += (a >= t if inclusive else a > t).to(torch.uint8)
    return code


def e2m1_decode(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """4-bit codes (uint8, bit 3 = sign) -> values in ``dtype``."""
    grid = torch.tensor(E2M1_GRID, dtype=dtype, device=codes.device)
    mag = grid[(codes & 7).long()]
    return torch.where((codes & 8).bool(), -mag, mag)


def nvfp4_global_scale(x: torch.Tensor) -> torch.Tensor:
    """Per-tensor fp32 decode scale ``amax(|x|) / (6 * 448)`` (1.0 for an all-zero tensor). Scalar tensor."""
    amax = x.detach().abs().amax().float()
    return torch.where(amax > 0, amax / (E2M1_MAX * E4M3_MAX), torch.ones_like(amax))


def nvfp4_quantize(
    x: torch.Tensor,
    global_scale: torch.Tensor | float | None = None,
    *,
    block: int = BLOCK,
    check_finite: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` [..., D] to NVFP4.

    Returns ``(codes, scales)``: ``codes`` uint8 [..., D] (one 4-bit code per element, see :func:`nvfp4_pack`),
    ``scales`` float8_e4m3fn [..., D // 16]. ``global_scale`` (fp32 scalar, see :func:`nvfp4_global_scale`)
    divides the block scales; pass the same value to :func:`nvfp4_dequantize`. Without it, blocks whose
    ``amax / 6`` is below E4M3's smallest subnormal (2**-9) flush to zero and ``amax / 6 > 448`` saturates.
    """
    _check_last_dim(x, block)
    if not x.is_floating_point():
        raise TypeError(f"nvfp4_quantize takes a floating-point tensor, got {x.dtype}.")
    if check_finite and not bool(torch.isfinite(x).all()):
        raise ValueError("nvfp4_quantize got NaN/inf values; NVFP4 has no encoding for them.")
    xf = x.float().unflatten(-1, (x.shape[-1] // block, block))  # [..., nb, 16]
    gs = torch.as_tensor(1.0 if global_scale is None else global_scale, dtype=torch.float32, device=x.device)
    amax = xf.abs().amax(dim=-1)  # [..., nb]
    scales = (amax / E2M1_MAX / gs).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    denom = (scales.float() * gs).unsqueeze(-1)  # the rounded scale, as the hardware uses
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))
    scaled = torch.where(denom > 0, xf / safe, torch.zeros_like(xf))
    codes = e2m1_encode(scaled) | ((scaled < 0).to(torch.uint8) << 3)
    return codes.flatten(-2), scales


def nvfp4_dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor | float | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    block: int = BLOCK,
) -> torch.Tensor:
    """Inverse of :func:`nvfp4_quantize`: codes [..., D] uint8, scales [..., D // 16] -> [..., D] in ``dtype``."""
    if codes.shape[:-1] != scales.shape[:-1] or codes.shape[-1] != scales.shape[-1] * block:
        raise ValueError(
            f"codes {tuple(codes.shape)} and scales {tuple(scales.shape)} do not match: "
            f"expected scales [..., D // {block}] for codes [..., D]."
        )
    vals = e2m1_decode(codes).unflatten(-1, (scales.shape[-1], block))
    out = vals * scales.float().unsqueeze(-1)
    if global_scale is not None:
        out = out * torch.as_tensor(global_scale, dtype=torch.float32, device=codes.device)
    return out.flatten(-2).to(dtype)


def nvfp4_fake_quantize(x: torch.Tensor, use_global_scale: bool = False, *, check_finite: bool = True):
    """``dequantize(quantize(x))`` in ``x.dtype``: what an FP4 tensor-core kernel actually multiplies."""
    gs = nvfp4_global_scale(x) if use_global_scale else None
    codes, scales = nvfp4_quantize(x, gs, check_finite=check_finite)
    return nvfp4_dequantize(codes, scales, gs, dtype=x.dtype)


def nvfp4_pack(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte, element ``2i`` in the low nibble: uint8 [..., D] -> uint8 [..., D // 2]."""
    if codes.shape[-1] % 2:
        raise ValueError(f"nvfp4_pack needs an even last dim, got {codes.shape[-1]}.")
    return (codes[..., 0::2] & 15) | ((codes[..., 1::2] & 15) << 4)


def nvfp4_unpack(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`nvfp4_pack`: uint8 [..., D // 2] -> uint8 [..., D]."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


def nvfp4_scales_to_mma_layout(scales: torch.Tensor) -> torch.Tensor:
    """Block scales [B, S, H, D // 16] -> the tcgen05 block-scaled MMA layout (a strided view).

    Result shape ``(32, 4, S // 128, 4, D // 64, H, B)``: element ``[m0, m1, rm, kk, rk, h, b]`` is the scale
    of row ``rm*128 + m1*32 + m0`` and scale column ``rk*4 + kk`` (NVIDIA's 128x4 scale-factor atom; each
    atom is 512 contiguous bytes, ``kk`` has stride 1). S must be a multiple of 128 and D of 64.
    """
    b, s, h, nk = scales.shape
    if s % 128 or nk % 4:
        raise ValueError(
            f"MMA scale layout needs S % 128 == 0 and D % 64 == 0; got S={s}, D={nk * BLOCK}. Pad S to 128."
        )
    t = scales.reshape(b, s // 128, 4, 32, h, nk // 4, 4)  # b, rm, m1, m0, h, rk, kk
    t = t.permute(0, 4, 1, 5, 3, 2, 6).contiguous()  # b, h, rm, rk, m0, m1, kk
    return t.permute(4, 5, 2, 6, 3, 1, 0)  # m0, m1, rm, kk, rk, h, b
