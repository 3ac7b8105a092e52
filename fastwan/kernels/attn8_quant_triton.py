"""The fused quantizer of :mod:`fastwan.kernels.attn8` (imported only where Triton is): the values of
:func:`fastwan.kernels.attn8.quantize`, bit for bit, in three passes over the inputs.

1. :func:`kv_stats`: per (token chunk, sample, head) K's channel sums (float64: exact for bf16 / fp16 inputs, so
   the order of the sum does not matter) and V's channel amax; the chunks' partials are reduced by PyTorch
   with the reference's own formulas (:func:`~fastwan.kernels.attn8.smooth_mean`,
   :func:`~fastwan.kernels.attn8.v_scales`);
2. :func:`quant_rows`: Q (and smoothed K) per block of rows -> INT8 and the block's scale;
3. :func:`quant_v`: V / its channel scale -> e4m3, stored token-fastest.

The outputs are head-major buffers padded with zeros to whole blocks (q8, k8 [B, H, n * block, D], v8 [B, H, D,
n * block_n]); the returned :class:`~fastwan.kernels.attn8.Quantized` holds [B, S, H, D] views of them, the layout
kernel version 2 reads in place. Divisions are correctly rounded (``div_rn``), rounding to an integer is ties to
even (adding and subtracting 1.5 * 2^23). ``ROUND_BY_BITS``: as in :mod:`fastwan.kernels.attn8_triton`, e4m3
rounding on the fp32 bits for Triton's interpreter.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fastwan.kernels import attn8_rule as A
from fastwan.kernels.attn8_triton import _e4m3_round

STATS_ROWS = 64  # tokens a step in kv_stats
STATS_CHUNK = 16  # steps per kv_stats program (1024 tokens)


@triton.jit
def kv_stats(K, V, KSUM, VMAX, skb, sks, skh, svb, svs, svh, S, H, n_chunks, D: tl.constexpr, ROWS: tl.constexpr,
             STEPS: tl.constexpr, SMOOTH: tl.constexpr):
    """Program (chunk c, b * H + h): tokens [c * STEPS * ROWS, (c + 1) * STEPS * ROWS) of K and V [B, S, H, D]
    (strides ``s*b``, ``s*s``, ``s*h``, channel stride 1) -> KSUM float64 and VMAX fp32 [B * H, n_chunks, D]."""
    c = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    d = tl.arange(0, D)
    ksum = tl.zeros([D], tl.float64)
    vmax = tl.zeros([D], tl.float32)
    for i in range(STEPS):
        rows = (c * STEPS + i) * ROWS + tl.arange(0, ROWS)
        inside = (rows < S)[:, None]
        r = rows[:, None].to(tl.int64)
        if SMOOTH:
            k = tl.load(K + b * skb + h * skh + r * sks + d[None, :], mask=inside, other=0.0)
            ksum += tl.sum(k.to(tl.float32).to(tl.float64), 0)
        v = tl.load(V + b * svb + h * svh + r * svs + d[None, :], mask=inside, other=0.0)
        vmax = tl.maximum(vmax, tl.max(tl.abs(v.to(tl.float32)), 0))
    out = (bh * n_chunks + c) * D + d
    if SMOOTH:
        tl.store(KSUM + out, ksum)
    tl.store(VMAX + out, vmax)


@triton.jit
def quant_rows(X, MEAN, OUT, SCALE, sxb, sxs, sxh, S, H, n_blocks, factor, D: tl.constexpr, BLOCK: tl.constexpr,
               SMOOTH: tl.constexpr):
    """Program (block j, b * H + h): rows [j * BLOCK, (j + 1) * BLOCK) of X [B, S, H, D] (minus MEAN [B * H, D] when
    ``SMOOTH``) -> INT8 into OUT [B * H, n_blocks * BLOCK, D] (rows past S: 0), the block's scale times ``factor``
    into SCALE [B, n_blocks, H]."""
    j = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    d = tl.arange(0, D)
    rows = j * BLOCK + tl.arange(0, BLOCK)
    inside = (rows < S)[:, None]
    x = tl.load(X + b.to(tl.int64) * sxb + h.to(tl.int64) * sxh + rows[:, None].to(tl.int64) * sxs + d[None, :],
                mask=inside, other=0.0).to(tl.float32)
    if SMOOTH:
        x = tl.where(inside, x - tl.load(MEAN + bh * D + d)[None, :], 0.0)
    amax = tl.max(tl.max(tl.abs(x), 1), 0)
    scale = tl.math.div_rn(tl.maximum(amax, 1e-30), 127.0)
    y = tl.math.div_rn(x, tl.full([BLOCK, D], 1.0, tl.float32) * scale)
    y = (y + 12582912.0) - 12582912.0  # ties to even
    y = tl.minimum(tl.maximum(y, -127.0), 127.0)
    tl.store(OUT + (bh * n_blocks * BLOCK + rows)[:, None].to(tl.int64) * D + d[None, :], y.to(tl.int8))
    tl.store(SCALE + (b * n_blocks + j) * H + h, scale * factor)


@triton.jit
def quant_v(V, VSCALE, OUT, svb, svs, svh, S, H, n_blocks, D: tl.constexpr, BLOCK: tl.constexpr,
            ROUND_BY_BITS: tl.constexpr):
    """Program (block j, b * H + h): tokens [j * BLOCK, (j + 1) * BLOCK) of V [B, S, H, D] / VSCALE [B * H, D] ->
    e4m3 into OUT [B * H, D, n_blocks * BLOCK] (tokens contiguous; tokens past S: 0)."""
    j = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    d = tl.arange(0, D)
    rows = j * BLOCK + tl.arange(0, BLOCK)
    inside = (rows < S)[:, None]
    v = tl.load(V + b * svb + h * svh + rows[:, None].to(tl.int64) * svs + d[None, :], mask=inside,
                other=0.0).to(tl.float32)
    vscale = tl.load(VSCALE + bh * D + d)
    y = tl.math.div_rn(v, tl.full([BLOCK, D], 1.0, tl.float32) * vscale[None, :])
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    if ROUND_BY_BITS:  # |y| rounded on its bits, its sign (bit) put back
        r = _e4m3_round(tl.abs(y))
        y = tl.where(y.to(tl.int32, bitcast=True) < 0, -r, r)
    cols = n_blocks * BLOCK
    ptr = OUT + (bh * D + d)[None, :].to(tl.int64) * cols + rows[:, None]
    tl.store(ptr, y.to(tl.float8e4nv))


def quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, smooth_k: bool, block_m: int,
             block_n: int) -> A.Quantized:
    """:func:`fastwan.kernels.attn8.quantize`'s values (q [B, Sq, H, D], k / v [B, Skv, H, D], channel stride 1 or
    made so) as views of zero-padded head-major buffers (the module docstring)."""
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    B, Sq, H, D = q.shape
    Skv = k.shape[1]
    dev = q.device
    n_m, n_n = triton.cdiv(Sq, block_m), triton.cdiv(Skv, block_n)
    chunk = STATS_ROWS * STATS_CHUNK
    n_chunks = triton.cdiv(Skv, chunk)
    ksum = torch.empty(B * H, n_chunks, D, device=dev, dtype=torch.float64) if smooth_k else None
    vmax = torch.empty(B * H, n_chunks, D, device=dev, dtype=torch.float32)
    kv_stats[(n_chunks, B * H)](k, v, ksum if smooth_k else vmax, vmax, k.stride(0), k.stride(1), k.stride(2),
                                v.stride(0), v.stride(1), v.stride(2), Skv, H, n_chunks, D=D, ROWS=STATS_ROWS,
                                STEPS=STATS_CHUNK, SMOOTH=smooth_k, num_warps=4)
    mean = A.smooth_mean(ksum.sum(1), Skv) if smooth_k else vmax  # [B * H, D]
    vscale, vs = A.v_scales(vmax.amax(1))
    q8 = torch.empty(B, H, n_m * block_m, D, device=dev, dtype=torch.int8)
    k8 = torch.empty(B, H, n_n * block_n, D, device=dev, dtype=torch.int8)
    v8 = torch.empty(B, H, D, n_n * block_n, device=dev, dtype=A.E4M3)
    qs = torch.empty(B, n_m, H, device=dev, dtype=torch.float32)
    ks = torch.empty(B, n_n, H, device=dev, dtype=torch.float32)
    factor = scale * math.log2(math.e)
    quant_rows[(n_m, B * H)](q, mean, q8, qs, q.stride(0), q.stride(1), q.stride(2), Sq, H, n_m, factor, D=D,
                             BLOCK=block_m, SMOOTH=False, num_warps=4)
    quant_rows[(n_n, B * H)](k, mean, k8, ks, k.stride(0), k.stride(1), k.stride(2), Skv, H, n_n, 1.0, D=D,
                             BLOCK=block_n, SMOOTH=smooth_k, num_warps=4)
    quant_v[(n_n, B * H)](v, vscale, v8, v.stride(0), v.stride(1), v.stride(2), Skv, H, n_n, D=D, BLOCK=block_n,
                          ROUND_BY_BITS=dev.type != "cuda", num_warps=4)
    return A.Quantized(q8[:, :, :Sq].transpose(1, 2), qs, k8[:, :, :Skv].transpose(1, 2), ks,
                       v8[..., :Skv].permute(0, 3, 1, 2), vs.view(B, H, D), block_m, block_n)
