"""The Triton kernel of :mod:`fastwan.kernels.attn8` (imported only where Triton is; the op launches it).

One program: ``BLOCK_M`` query rows of one (sample, head) against every key, ``BLOCK_N`` keys a step (the
quantization blocks of :func:`fastwan.kernels.attn8.quantize`): INT8 Q·K^T with an int32 accumulator, the online
softmax in fp32, e4m3 P·V with an fp32 accumulator; full key blocks run unmasked, the tail block masked.

``ROUND_BY_BITS``: p's rounding to e4m3 is done on its fp32 bits (nearest, ties to even) before the cast, which is
then exact. Triton's interpreter (the CPU tests) needs it: its float32 -> float8e4nv cast rounds values just below
a power of two down by a whole binade. On a GPU the cast rounds itself (``cvt.rn``), and the flag is off.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _e4m3_round(x):
    """x >= 0 fp32 -> the nearest e4m3 value (ties to even) as fp32: 3 mantissa bits kept for normals (>= 2^-6),
    multiples of 2^-9 below (e4m3's subnormals; adding 2^14 leaves fp32 an ulp of 2^-9)."""
    bits = x.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    return tl.where(x < 0.015625, (x + 16384.0) - 16384.0, normal)


@triton.jit
def _step(acc, m_i, l_i, q8, qs, K8, KS, V8, kbase, vbase, ksbase, sks, svs, svd, sksn, start, Skv, d,
          MASKED: tl.constexpr, BLOCK_N: tl.constexpr, P_SCALE: tl.constexpr, ROUND_BY_BITS: tl.constexpr):
    """One key block at ``start``: the online-softmax update of (acc, m_i, l_i)."""
    cols = start + tl.arange(0, BLOCK_N)
    if MASKED:
        kt = tl.load(K8 + kbase + cols[None, :] * sks + d[:, None], mask=(cols < Skv)[None, :], other=0)
        v = tl.load(V8 + vbase + cols[:, None] * svs + d[None, :] * svd, mask=(cols < Skv)[:, None], other=0.0)
    else:
        kt = tl.load(K8 + kbase + cols[None, :] * sks + d[:, None])
        v = tl.load(V8 + vbase + cols[:, None] * svs + d[None, :] * svd)
    ks = tl.load(KS + ksbase + (start // BLOCK_N) * sksn)
    s = tl.dot(q8, kt).to(tl.float32) * (qs * ks)
    if MASKED:
        s = tl.where((cols < Skv)[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p * P_SCALE
    if ROUND_BY_BITS:
        p = _e4m3_round(p)
    acc = acc * alpha[:, None] + tl.dot(p.to(tl.float8e4nv), v)
    return acc, m_new, l_i


@triton.jit
def attn8_fwd(Q8, QS, K8, KS, V8, VS, OUT, sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, svd, sob, sos, soh,
              sqsb, sqsm, sksb, sksn, Sq, Skv, H, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              P_SCALE: tl.constexpr, ROUND_BY_BITS: tl.constexpr):
    """Program (query block, b * H + h). Q8/K8 int8 and V8 e4m3 are [B, S, H, D] with any strides (``s*b``,
    ``s*s``, ``s*h``; V's channel stride ``svd``); QS [B, nM, H] / KS [B, nN, H] fp32 with strides (``sqsb``,
    ``sqsm``, 1 for H) and (``sksb``, ``sksn``, 1); VS fp32 [B, H, D] dense; OUT [B, Sq, H, D]."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    rmask = rows < Sq
    q8 = tl.load(Q8 + b * sqb + h * sqh + rows[:, None].to(tl.int64) * sqs + d[None, :], mask=rmask[:, None],
                 other=0)
    qs = tl.load(QS + b * sqsb + pid_m * sqsm + h)
    kbase = b * skb + h * skh
    vbase = b * svb + h * svh
    ksbase = b * sksb + h
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    full = (Skv // BLOCK_N) * BLOCK_N
    for start in range(0, full, BLOCK_N):
        acc, m_i, l_i = _step(acc, m_i, l_i, q8, qs, K8, KS, V8, kbase, vbase, ksbase, sks, svs, svd, sksn, start, Skv,
                              d, False, BLOCK_N, P_SCALE, ROUND_BY_BITS)
    if full < Skv:
        acc, m_i, l_i = _step(acc, m_i, l_i, q8, qs, K8, KS, V8, kbase, vbase, ksbase, sks, svs, svd, sksn, full, Skv,
                              d, True, BLOCK_N, P_SCALE, ROUND_BY_BITS)
    vs = tl.load(VS + (b * H + h) * D + d)
    out = (acc / l_i[:, None]) * vs[None, :]
    optr = OUT + b * sob + h * soh + rows[:, None].to(tl.int64) * sos + d[None, :]
    tl.store(optr, out.to(OUT.dtype.element_ty), mask=rmask[:, None])


def launch(t, out: torch.Tensor, block_m: int, block_n: int, p_scale: float) -> None:
    """Run :func:`attn8_fwd` on the quantized inputs ``t`` (:class:`fastwan.kernels.attn8.Quantized`, blocks of
    ``block_m`` / ``block_n`` rows, P stored as e4m3(``p_scale`` p)) into ``out`` [B, Sq, H, D] (channel stride 1)."""
    B, Sq, H, D = t.q8.shape
    Skv = t.k8.shape[1]
    qs, ks, vs = t.qs.contiguous(), t.ks.contiguous(), t.vs.contiguous()
    grid = (triton.cdiv(Sq, block_m), B * H)
    attn8_fwd[grid](
        t.q8, qs, t.k8, ks, t.v8, vs, out, t.q8.stride(0), t.q8.stride(1), t.q8.stride(2), t.k8.stride(0),
        t.k8.stride(1), t.k8.stride(2), t.v8.stride(0), t.v8.stride(1), t.v8.stride(2), t.v8.stride(3),
        out.stride(0), out.stride(1), out.stride(2), qs.stride(0), qs.stride(1), ks.stride(0), ks.stride(1),
        Sq, Skv, H, D=D, BLOCK_M=block_m, BLOCK_N=block_n, P_SCALE=p_scale, ROUND_BY_BITS=out.device.type != "cuda",
        num_warps=8, num_stages=3)
