"""The Triton kernels of :mod:`fastwan.kernels.attn8` (imported only where Triton is; the op launches them).

One program: ``BLOCK_M`` query rows of one (sample, head) against every key, ``BLOCK_N`` keys a step (the
quantization blocks of :func:`fastwan.kernels.attn8.quantize`): INT8 Q·K^T with an int32 accumulator, the online
softmax in fp32, e4m3 P·V with an fp32 accumulator; full key blocks run unmasked, the tail block masked.

Version 1 (:func:`attn8_fwd`) reads q8 / k8 / v8 through their strides, K as a [D, BLOCK_N] tile. Version 2
(:func:`attn8_v2_fwd`) reads the fused quantizer's padded head-major planes (:func:`row_plane`,
:func:`token_plane`): Q once as [BLOCK_M, D], K as [BLOCK_N, D] tiles transposed for Q·K^T (D contiguous: the
K-major operand 8-bit tensor cores take), V^T as [D, BLOCK_N] (tokens contiguous) transposed for P·V, optionally
through TMA descriptors; it converts the int32 scores exactly without a conversion instruction and can compute
part of the exponentials by a polynomial (:func:`exp2_poly`). Same arithmetic as version 1 and the reference.

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


def launch(t, out: torch.Tensor, block_m: int, block_n: int, p_scale: float, num_warps: int = 8,
           num_stages: int = 3) -> None:
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
        num_warps=num_warps, num_stages=num_stages)


@triton.jit
def exp2_poly(x, DEGREE: tl.constexpr):
    """2^x for x <= 0 on the FMA units (Cody-Waite): x = j + f with j = round(x) (ties to even) and f in [-1/2, 1/2];
    2^f by a polynomial with p(0) = 1 fitted for relative error (degree 3, 4 or 5; the bounds are in
    tests/kernels/test_attn8_v2.py), 2^j added to its exponent bits. x is clamped to -126 (a normal 2^-126)."""
    x = tl.maximum(x, -126.0)
    t = x + 12582912.0  # 1.5 * 2^23: t's low mantissa bits hold round(x)
    f = x - (t - 12582912.0)
    if DEGREE == 3:
        p = f * 0.0550089068710804 + 0.2422109842300415
        p = p * f + 0.693282961845398
    elif DEGREE == 4:
        p = f * 0.009582851082086563 + 0.05590642988681793
        p = p * f + 0.24024099111557007
        p = p * f + 0.6931241750717163
    else:
        p = f * 0.0013264723820611835 + 0.009671512991189957
        p = p * f + 0.05550733581185341
        p = p * f + 0.24022242426872253
        p = p * f + 0.6931470036506653
    p = p * f + 1.0
    bits = p.to(tl.uint32, bitcast=True) + (t.to(tl.uint32, bitcast=True) << 23)  # t's bits << 23 = j << 23
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _int_to_float(x, CVT: tl.constexpr):
    """int32 |x| < 2^22 -> fp32, exactly: by the conversion instruction (``CVT``), else x added to the bits of
    1.5 * 2^23 minus 1.5 * 2^23 (an integer add and an fp32 add)."""
    if CVT:
        return x.to(tl.float32)
    return (x + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0


@triton.jit
def _step_v2(acc, m_i, l_i, q8, qs, K8, V8, kp, vp, ksp, k_row, v_row, start, Skv, H, D: tl.constexpr,
             BLOCK_N: tl.constexpr, P_SCALE: tl.constexpr, ROUND_BY_BITS: tl.constexpr, DESC: tl.constexpr,
             MASKED: tl.constexpr, POLY: tl.constexpr, POLY_DEGREE: tl.constexpr, FOLD: tl.constexpr,
             CVT: tl.constexpr, FFMA: tl.constexpr):
    """One key block at token ``start`` (version 2): K [BLOCK_N, D] transposed for Q·K^T, V^T [D, BLOCK_N] (tokens
    contiguous) transposed for P·V; the online-softmax update of (acc, m_i, l_i). An unmasked block takes its row
    maxima on the integer scores (x -> x * c is monotonic for c > 0: the same maxima). ``FOLD``: p is computed as
    exp2(s - m + log2(P_SCALE)) (l then sums P_SCALE p) instead of P_SCALE * exp2(s - m). ``FFMA``: the exponent
    of an unmasked block in one FMA of the biased integer scores (the bias's product rounded once per row: p moves
    by about 1e-5 relative)."""
    if DESC:
        k = K8.load([k_row + start, 0])
        vt = V8.load([v_row, start])
    else:
        k = tl.load(kp + start * D)
        vt = tl.load(vp + start)
    c = qs * tl.load(ksp + (start // BLOCK_N) * H)
    si = tl.dot(q8, tl.trans(k))
    if MASKED:
        s = tl.where((start + tl.arange(0, BLOCK_N) < Skv)[None, :], _int_to_float(si, CVT) * c, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
    else:
        m_new = tl.maximum(m_i, _int_to_float(tl.max(si, 1), CVT) * c)
    shift = m_new - 8.807354922057604 if FOLD else m_new  # log2(448)
    if FFMA and not MASKED:  # (si + 1.5 * 2^23) as fp32 bits, times c, minus (1.5 * 2^23 c + shift): one FMA
        x = tl.fma((si + 0x4B400000).to(tl.float32, bitcast=True), c, -(12582912.0 * c + shift)[:, None])
    elif MASKED:
        x = s - shift[:, None]
    else:
        x = _int_to_float(si, CVT) * c - shift[:, None]
    if POLY:
        p = exp2_poly(x, POLY_DEGREE)
    else:
        p = tl.exp2(x)
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if not FOLD:
        p = p * P_SCALE
    if ROUND_BY_BITS:
        p = _e4m3_round(p)
    acc = tl.dot(p.to(tl.float8e4nv), tl.trans(vt), acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["Sq", "Skv"])
def attn8_v2_fwd(Q8, QS, K8, KS, V8, VS, OUT, sob, sos, soh, Sq, Skv, H, n_m, n_n, D: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, P_SCALE: tl.constexpr, ROUND_BY_BITS: tl.constexpr,
                 DESC: tl.constexpr, WARP_SPEC: tl.constexpr, POLY_GROUP: tl.constexpr, POLY_DEGREE: tl.constexpr,
                 FOLD: tl.constexpr, CVT: tl.constexpr, FFMA: tl.constexpr):
    """Program (query block, b * H + h), version 2. Q8 / K8: int8 planes [B * H * n * BLOCK, D] (head-major, each
    head's rows padded to whole blocks), V8: e4m3 [B * H * D, n_n * BLOCK_N] (tokens contiguous); with ``DESC`` these
    three are TMA tensor descriptors of those planes. QS [B, n_m, H], KS [B, n_n, H], VS [B, H, D] fp32 dense; OUT
    [B, Sq, H, D] with strides (``sob``, ``sos``, ``soh``, 1). Full key blocks run unmasked; the last one, when
    partial, masks its scores. ``POLY_GROUP`` g > 0: the last key block of every g takes :func:`exp2_poly`;
    ``FOLD`` / ``FFMA`` / ``CVT``: :func:`_step_v2`, :func:`_int_to_float`."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    d = tl.arange(0, D)
    rn = tl.arange(0, BLOCK_N)
    q_row = (bh * n_m + pid_m) * BLOCK_M
    k_row = bh * n_n * BLOCK_N
    v_row = bh * D
    if DESC:
        q8 = Q8.load([q_row, 0])
        kp = K8
        vp = V8
    else:
        q8 = tl.load(Q8 + (q_row + tl.arange(0, BLOCK_M))[:, None].to(tl.int64) * D + d[None, :])
        kp = K8 + (k_row + rn)[:, None].to(tl.int64) * D + d[None, :]
        vp = V8 + (v_row + d)[:, None].to(tl.int64) * (n_n * BLOCK_N) + rn[None, :]
    qs = tl.load(QS + (b * n_m + pid_m) * H + h)
    ksp = KS + b * n_n * H + h
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    full = Skv // BLOCK_N
    plain = 0
    if POLY_GROUP > 0:
        plain = (full // POLY_GROUP) * POLY_GROUP
        for g in range(0, plain, POLY_GROUP):
            for u in tl.static_range(POLY_GROUP):
                acc, m_i, l_i = _step_v2(acc, m_i, l_i, q8, qs, K8, V8, kp, vp, ksp, k_row, v_row, (g + u) * BLOCK_N,
                                         Skv, H, D, BLOCK_N, P_SCALE, ROUND_BY_BITS, DESC, False,
                                         u == POLY_GROUP - 1, POLY_DEGREE, FOLD, CVT, FFMA)
    for j in tl.range(plain, full, warp_specialize=WARP_SPEC):
        acc, m_i, l_i = _step_v2(acc, m_i, l_i, q8, qs, K8, V8, kp, vp, ksp, k_row, v_row, j * BLOCK_N, Skv, H, D,
                                 BLOCK_N, P_SCALE, ROUND_BY_BITS, DESC, False, False, POLY_DEGREE, FOLD, CVT, FFMA)
    if full < n_n:
        acc, m_i, l_i = _step_v2(acc, m_i, l_i, q8, qs, K8, V8, kp, vp, ksp, k_row, v_row, full * BLOCK_N, Skv, H, D,
                                 BLOCK_N, P_SCALE, ROUND_BY_BITS, DESC, True, False, POLY_DEGREE, FOLD, CVT, FFMA)
    vs = tl.load(VS + bh * D + d)
    if FOLD:
        vs = vs * P_SCALE
    out = (acc / l_i[:, None]) * vs[None, :]
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    optr = OUT + b.to(tl.int64) * sob + h.to(tl.int64) * soh + rows[:, None].to(tl.int64) * sos + d[None, :]
    tl.store(optr, out.to(OUT.dtype.element_ty), mask=(rows < Sq)[:, None])


def row_plane(x: torch.Tensor, block: int) -> tuple[torch.Tensor, int]:
    """int8 x [B, S, H, D] -> (its head-major plane [B * H * n * block, D], n = ceil(S / block)): the buffer under x
    where x is a view of one ([B, H, n * block, D], zero-padded: the fused quantizer's), else a zero-padded copy."""
    B, S, H, D = x.shape
    n = triton.cdiv(S, block)
    rows = x.stride(2) // D if D else 0
    if (x.stride(3) == 1 and x.stride(1) == D and x.stride(2) == rows * D and rows == n * block
            and x.stride(0) == H * rows * D and x.storage_offset() == 0
            and x.untyped_storage().nbytes() >= B * H * rows * D * x.element_size()):
        return x.as_strided((B * H * rows, D), (D, 1)), n
    buf = x.new_zeros(B, H, n * block, D)
    buf[:, :, :S] = x.transpose(1, 2)
    return buf.view(B * H * n * block, D), n


def token_plane(v: torch.Tensor, block: int) -> torch.Tensor:
    """e4m3 v [B, S, H, D] -> its token-fastest plane [B * H * D, n * block], n = ceil(S / block): the buffer under v
    where v is a view of one ([B, H, D, n * block], zero-padded), else a zero-padded copy."""
    B, S, H, D = v.shape
    cols = triton.cdiv(S, block) * block
    if (v.stride(1) == 1 and v.stride(3) == cols and v.stride(2) == D * cols and v.stride(0) == H * D * cols
            and v.storage_offset() == 0 and v.untyped_storage().nbytes() >= B * H * D * cols * v.element_size()):
        return v.as_strided((B * H * D, cols), (cols, 1))
    buf = torch.zeros(B, H, D, cols, device=v.device, dtype=v.dtype)
    buf[..., :S] = v.permute(0, 2, 3, 1)
    return buf.view(B * H * D, cols)


def launch_v2(t, out: torch.Tensor, cfg, p_scale: float) -> None:
    """Run :func:`attn8_v2_fwd` with configuration ``cfg`` (:class:`fastwan.kernels.attn8_configs.Attn8Config`) on
    ``t`` (:class:`fastwan.kernels.attn8.Quantized` in ``cfg``'s blocks) into ``out`` [B, Sq, H, D] (channel stride
    1); P is stored as e4m3(``p_scale`` p)."""
    B, Sq, H, D = t.q8.shape
    Skv = t.k8.shape[1]
    q8, n_m = row_plane(t.q8, cfg.block_m)
    k8, n_n = row_plane(t.k8, cfg.block_n)
    v8 = token_plane(t.v8, cfg.block_n)
    if cfg.descriptors:
        from triton.tools.tensor_descriptor import TensorDescriptor

        q8 = TensorDescriptor.from_tensor(q8, [cfg.block_m, D])
        k8 = TensorDescriptor.from_tensor(k8, [cfg.block_n, D])
        v8 = TensorDescriptor.from_tensor(v8, [D, cfg.block_n])
    attn8_v2_fwd[(n_m, B * H)](
        q8, t.qs.contiguous(), k8, t.ks.contiguous(), v8, t.vs.contiguous(), out, out.stride(0), out.stride(1),
        out.stride(2), Sq, Skv, H, n_m, n_n, D=D, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, P_SCALE=p_scale,
        ROUND_BY_BITS=out.device.type != "cuda", DESC=cfg.descriptors, WARP_SPEC=cfg.warp_specialize,
        POLY_GROUP=cfg.poly_group, POLY_DEGREE=cfg.poly_degree, FOLD=cfg.fold, CVT=cfg.cvt, FFMA=cfg.ffma,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
