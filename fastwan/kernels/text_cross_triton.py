"""Triton kernels of :mod:`fastwan.kernels.text_cross` (imported only where Triton is; the ops launch them).

Every kernel attends from a block of BM query rows of one sample to the first ``n`` keys of that sample, key
``n - 1`` counting ``L - n + 1`` times (the collapsed text padding): scores are in log2 units, so that key gets
``log2(L - n + 1)`` added. The shared pieces are module-level ``@triton.jit`` functions (Triton's interpreter,
which the CPU tests use, resolves globals but not closures):

* ``text_attn_normq``: q the raw projection [B, S, C], its RMSNorm over all H heads computed per query block
  (``rms_rope``'s roundings) -> out [B, S, H, D];
* ``text_probs_normq``: as ``text_attn_normq`` but it writes the attention weights P [B, S, H, width] (zero for
  keys j >= n) instead of P @ V, for the output projection folded into the values (``fold_values``).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _scores(q, K, kbase, sks, cols, d, n, scale_log2, log2m):
    """[BM, BN] scores (log2 units) of q [BM, D] against keys ``cols`` (those >= n: -inf)."""
    cmask = cols < n
    kt = tl.load(K + kbase + cols[None, :] * sks + d[:, None], mask=cmask[None, :], other=0.0)
    s = tl.dot(q, kt) * scale_log2
    s += tl.where(cols == n - 1, log2m, 0.0)[None, :]
    return tl.where(cmask[None, :], s, float("-inf"))


@triton.jit
def _attend(q, K, V, kbase, vbase, sks, svs, d, n, scale_log2, log2m, BM: tl.constexpr, D: tl.constexpr,
            BN: tl.constexpr):
    """Online softmax of q [BM, D] over the first n keys -> P @ V [BM, D], fp32."""
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    start = 0
    while start < n:  # a runtime bound (a while loop: Triton's interpreter takes no loaded range bounds)
        cols = start + tl.arange(0, BN)
        s = _scores(q, K, kbase, sks, cols, d, n, scale_log2, log2m)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = tl.load(V + vbase + cols[:, None] * svs + d[None, :], mask=(cols < n)[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
        m_i = m_new
        start += BN
    return acc / l_i[:, None]


@triton.jit
def _query_block(NK, b, pid_m, S, L, BM: tl.constexpr, D: tl.constexpr):
    """Sample b's key count n, the log2 weight of its last key, and query block pid_m's rows, channels and row
    mask."""
    n = tl.load(NK + b)
    log2m = tl.log2((L - n + 1).to(tl.float32))
    rows = pid_m * BM + tl.arange(0, BM)
    return n, log2m, rows, tl.arange(0, D), rows < S


@triton.jit
def _rstd(qp, rmask, H, C, eps, D: tl.constexpr, BM: tl.constexpr):
    """1 / RMS over all H heads' channels of the raw q rows at qp ([BM, D] offsets of head 0), fp32 [BM]."""
    ss = tl.zeros([BM], tl.float32)
    h = 0
    while h < H:  # while loops: the interpreter cannot index range() with a runtime int (numpy >= 2)
        x = tl.load(qp + h * D, mask=rmask[:, None], other=0.0).to(tl.float32)
        ss += tl.sum(x * x, 1)
        h += 1
    return tl.rsqrt(ss / C + eps)


@triton.jit
def _normed_head(qp, W, h, rstd, rmask, d, D: tl.constexpr):
    """Head h of the normalized q [BM, D] in W's dtype, rounded as PyTorch's ``rms_norm(x).to(w.dtype) * w``
    (and ``rms_rope``): after the norm and after the weight."""
    x = tl.load(qp + h * D, mask=rmask[:, None], other=0.0).to(tl.float32)  # again: mostly from L2
    w = tl.load(W + h * D + d).to(tl.float32)
    dt = W.dtype.element_ty
    return ((x * rstd[:, None]).to(dt).to(tl.float32) * w[None, :]).to(dt)


@triton.jit
def text_attn_normq(Q, W, K, V, OUT, NK, sqb, sqs, skb, sks, skh, svb, svs, svh, sob, sos, soh, S, L, H, C, eps,
                    scale_log2, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    # program (query block, b): the rows' RMS over all heads, then per head the normalized q and the attention
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    n, log2m, rows, d, rmask = _query_block(NK, b, pid_m, S, L, BM, D)
    qp = Q + b * sqb + rows[:, None] * sqs + d[None, :]
    rstd = _rstd(qp, rmask, H, C, eps, D, BM)
    h = 0
    while h < H:
        q = _normed_head(qp, W, h, rstd, rmask, d, D)
        out = _attend(q, K, V, b * skb + h * skh, b * svb + h * svh, sks, svs, d, n, scale_log2, log2m, BM, D, BN)
        tl.store(OUT + b * sob + h * soh + rows[:, None] * sos + d[None, :], out.to(OUT.dtype.element_ty),
                 mask=rmask[:, None])
        h += 1


@triton.jit
def text_probs_normq(Q, W, K, P, NK, sqb, sqs, skb, sks, skh, spb, sps, sph, S, L, H, C, eps, scale_log2, width,
                     D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    # program (query block, b): as text_attn_normq, but every key fits one tile (n <= width <= BN), so the softmax
    # is exact in one step and its weights are stored (keys n .. width - 1 get 0)
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    n, log2m, rows, d, rmask = _query_block(NK, b, pid_m, S, L, BM, D)
    cols = tl.arange(0, BN)
    smask = rmask[:, None] & (cols < width)[None, :]
    qp = Q + b * sqb + rows[:, None] * sqs + d[None, :]
    rstd = _rstd(qp, rmask, H, C, eps, D, BM)
    h = 0
    while h < H:
        q = _normed_head(qp, W, h, rstd, rmask, d, D)
        s = _scores(q, K, b * skb + h * skh, sks, cols, d, n, scale_log2, log2m)
        p = tl.exp2(s - tl.max(s, 1)[:, None])
        p = p / tl.sum(p, 1)[:, None]
        tl.store(P + b * spb + h * sph + rows[:, None] * sps + cols[None, :], p.to(P.dtype.element_ty), mask=smask)
        h += 1
