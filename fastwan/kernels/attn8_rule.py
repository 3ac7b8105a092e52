"""The arithmetic rule's constants and pieces shared by :mod:`fastwan.kernels.attn8` (the reference and the op) and
its fused Triton quantizer (:mod:`fastwan.kernels.attn8_quant_triton`): the blocks, the 8-bit formats' ranges,
:class:`Quantized` and the scale formulas both sides compute the same way."""
from __future__ import annotations

from typing import NamedTuple

import torch

from fastwan.kernels.attn8_configs import DEFAULT

BLOCK_M = DEFAULT.block_m  # query rows per INT8 scale (and per kernel program) unless a configuration says
BLOCK_N = DEFAULT.block_n  # key rows per INT8 scale (and per kernel step) unless a configuration says
HEAD_DIMS = (64, 128)  # the kernel's head dims (tl.arange needs a power of two)
INT8_MAX = 127.0
E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
P_SCALE = E4M3_MAX  # p in [0, 1] is stored as e4m3(448 p)
TINY = 1e-30  # an all-zero block's amax, so that its scale divides


class Quantized(NamedTuple):
    """The 8-bit inputs of one attention call (:func:`quantize`).

    q8 int8 [B, Sq, H, D]; qs fp32 [B, ceil(Sq / block_m), H]: Q's block scales times softmax scale times
    log2(e); k8 int8 [B, Skv, H, D] (smoothed K); ks fp32 [B, ceil(Skv / block_n), H]; v8 e4m3 [B, Skv, H, D],
    its memory laid out token-fastest ([B, H, D, Skv]: the layout FP8 tensor cores read P·V's right operand in);
    vs fp32 [B, H, D]: V's channel scales divided by ``P_SCALE``; ``block_m`` / ``block_n`` the rows per scale.
    The fused quantizer's q8 / k8 / v8 are views of head-major buffers padded with zeros to whole blocks."""
    q8: torch.Tensor
    qs: torch.Tensor
    k8: torch.Tensor
    ks: torch.Tensor
    v8: torch.Tensor
    vs: torch.Tensor
    block_m: int = BLOCK_M
    block_n: int = BLOCK_N


def exact_div(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """``x / divisor`` correctly rounded (CUDA's division by a Python scalar multiplies by its reciprocal)."""
    return x / torch.full_like(x, divisor)


def smooth_mean(ksum: torch.Tensor, tokens: int) -> torch.Tensor:
    """K's token mean fp32 [B, H, D] from its float64 token sum [B, H, D] (the quantizer's and the reference's)."""
    return (ksum / tokens).float()


def v_scales(vmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """V's channel amax fp32 [B, H, D] -> (its e4m3 scale, that scale divided by ``P_SCALE``: ``Quantized.vs``)."""
    vscale = exact_div(vmax.clamp_min(TINY), E4M3_MAX)
    return vscale, exact_div(vscale, P_SCALE)
