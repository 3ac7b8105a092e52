"""Cross-attention over padded text with the padding collapsed into one weighted key (exact).

Wan's text encoder output is padded to 512 tokens with zero rows (diffusers' ``WanPipeline`` and the original Wan
code), and the DiT's cross-attention attends to all 512 without a mask. Every padding row goes through the same
row-wise maps (text embedder, ``to_k`` + RMSNorm, ``to_v``), so all of them give the same key and value. With
``n`` the number of keys up to and including the first padding row, attention over the 512 keys equals attention
over the first ``n`` keys where key ``n - 1`` counts ``512 - n + 1`` times: its score gets ``+ log(512 - n + 1)``.
A prompt of 20 tokens thus attends to 21 keys instead of 512.

* :func:`text_keys` finds ``n`` per sample from the text embeddings (rows equal to the last row form the trailing
  run; a tensor, so nothing waits for the GPU and torch.compile does not specialise on prompt lengths);
* ``fastwan::text_cross_attention(q, k, v, keys)`` attends with that rule: a Triton kernel on CUDA that loops over
  the first ``n`` keys only; elsewhere a masked dense attention with the same weights (the reference);
* ``fastwan::text_cross_attention_normq(q, weight, eps, k, v, keys)`` is the same attention with the query's
  RMSNorm (over all heads, with ``weight``; the rounding of ``rms_rope``) fused in: it takes the raw projection
  q [B, S, C], so the normalized q is never written (the kernel normalizes each query block on the fly).

:class:`fastwan.models.wan.WanTransformer` uses it for its cross-attention when ``text_collapse`` is on (default)
and :func:`text_cross_ok` holds; otherwise the attention dispatch's cross-attention backend runs over all keys.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from fastwan.attention.kernels import triton_ok

MAX_KEYS = 128  # the model collapses up to this many keys; at ~150 the kernel only ties FA4 over 512 (RESULTS 12)
HEAD_DIMS = (16, 32, 64, 128, 256)  # the kernel's head sizes (tl.arange needs a power of two)
DTYPES = (torch.float16, torch.bfloat16)


def _kernel_device(x: torch.Tensor) -> bool:
    """Whether x lives where the Triton kernel runs (CUDA; the interpreter tests widen this)."""
    return x.is_cuda


def text_keys(text: torch.Tensor) -> torch.Tensor:
    """text [B, L, D] -> int32 [B]: per sample, the number of leading rows that differ from the trailing run of
    rows equal to the last row, plus one (the run's representative). L when the last row is unique (no padding);
    1 when all rows are equal."""
    if text.dim() != 3 or text.shape[1] == 0:
        raise ValueError(f"text_keys: text must be [B, L, D] with L >= 1, got {tuple(text.shape)}")
    L = text.shape[1]
    same = (text == text[:, -1:]).all(dim=-1)  # [B, L]; the last row is always True (NaN rows: never equal)
    idx = torch.arange(L, device=text.device)
    last_other = torch.where(same, -1, idx).amax(dim=-1)  # the last row that differs from the last row, or -1
    return (last_other + 2).clamp(max=L).to(torch.int32)


def text_cross_ok(x: torch.Tensor, head_dim: int) -> bool:
    """Whether the Triton kernel runs for attention heads of ``head_dim`` on tensors like x: CUDA, fp16/bf16,
    head_dim a power of two in 16..256, Triton importable."""
    return _kernel_device(x) and x.dtype in DTYPES and head_dim in HEAD_DIMS and triton_ok()


def text_cross_reference(q, k, v, keys) -> torch.Tensor:
    """Masked dense attention with the collapsed weights (fp32 softmax): keys j >= n get no weight, key n - 1
    gets log(L - n + 1) added to its score. q [B, S, H, D], k/v [B, L, H, D], keys int32 [B] -> [B, S, H, D]."""
    L = k.shape[1]
    n = keys.to(torch.int64).view(-1, 1)
    j = torch.arange(L, device=k.device).view(1, -1)
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    bias = torch.where(j == n - 1, torch.log((L - n + 1).double()), 0.0)
    bias = torch.where(j < n, bias, -math.inf).to(dt)
    out = F.scaled_dot_product_attention(q.transpose(1, 2).to(dt), k.transpose(1, 2).to(dt),
                                         v.transpose(1, 2).to(dt), attn_mask=bias.view(-1, 1, 1, L))
    return out.transpose(1, 2).to(q.dtype)


def check_inputs(q, k, v, keys) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape or k.shape[0] != q.shape[0] or k.shape[2:] != q.shape[2:]:
        raise ValueError(f"text_cross_attention: q [B, S, H, D] and k, v [B, L, H, D] expected, got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if keys.shape != (q.shape[0],) or keys.dtype != torch.int32:
        raise ValueError(f"text_cross_attention: keys must be int32 [{q.shape[0]}] (text_keys), got "
                         f"{keys.dtype} {tuple(keys.shape)}")
    if keys.device != q.device:
        raise ValueError(f"text_cross_attention: keys are on {keys.device} but q on {q.device}; move keys to "
                         "q's device (text_keys of the text on that device)")


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def text_attn(Q, K, V, OUT, NK, sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh, S, L, H, scale_log2,
                  D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        # program (query block, b * H + h): online softmax over the first n keys of sample b; key n - 1 counts
        # L - n + 1 times (log2 weight added to its score, which is in log2 units here)
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        n = tl.load(NK + b)
        log2m = tl.log2((L - n + 1).to(tl.float32))
        rows = pid_m * BM + tl.arange(0, BM)
        d = tl.arange(0, D)
        rmask = rows < S
        q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + d[None, :], mask=rmask[:, None], other=0.0)
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, D], tl.float32)
        start = 0
        while start < n:  # a runtime bound (a while loop: Triton's interpreter takes no loaded range bounds)
            cols = start + tl.arange(0, BN)
            cmask = cols < n
            kt = tl.load(K + b * skb + h * skh + cols[None, :] * sks + d[:, None], mask=cmask[None, :], other=0.0)
            s = tl.dot(q, kt) * scale_log2
            s += tl.where(cols == n - 1, log2m, 0.0)[None, :]
            s = tl.where(cmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            vt = tl.load(V + b * svb + h * svh + cols[:, None] * svs + d[None, :], mask=cmask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
            m_i = m_new
            start += BN
        out = acc / l_i[:, None]
        tl.store(OUT + b * sob + h * soh + rows[:, None] * sos + d[None, :], out.to(OUT.dtype.element_ty),
                 mask=rmask[:, None])

    return text_attn


@torch.library.custom_op("fastwan::text_cross_attention", mutates_args=())
def text_cross_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Attention of q [B, S, H, D] over the first ``keys[b]`` keys of k, v [B, L, H, D], key ``keys[b] - 1``
    counting ``L - keys[b] + 1`` times (see the module docstring) -> [B, S, H, D] in q's dtype."""
    check_inputs(q, k, v, keys)
    if not (text_cross_ok(q, q.shape[-1]) and k.dtype == v.dtype == q.dtype):
        return text_cross_reference(q, k, v, keys)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    B, S, H, D = q.shape
    out = torch.empty(B, S, H, D, device=q.device, dtype=q.dtype)
    bm = 128 if D <= 128 else 64
    grid = (-(-S // bm), B * H)
    _kernel()[grid](q, k, v, out, keys, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
                    S, k.shape[1], H, D ** -0.5 * math.log2(math.e), D=D, BM=bm, BN=64,
                    num_warps=8 if D >= 128 else 4, num_stages=2)
    return out


@text_cross_attention.register_fake
def _(q, k, v, keys):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def normq_reference(q, weight, eps: float, k, v, keys) -> torch.Tensor:
    """The PyTorch route: RMSNorm of q [B, S, C] over C with weight [C] (rms_rope's formula), then
    :func:`text_cross_reference` over k, v [B, L, H, D] -> [B, S, H, D] in q's dtype."""
    qn = F.rms_norm(q, (q.shape[-1],), eps=eps).to(weight.dtype) * weight
    return text_cross_reference(qn.unflatten(-1, k.shape[2:]), k, v, keys).to(q.dtype)


def check_inputs_normq(q, weight, k, v, keys) -> None:
    name = "text_cross_attention_normq"
    if q.dim() != 3:
        raise ValueError(f"{name}: q must be the raw projection [B, S, C] (not split into heads), got "
                         f"{tuple(q.shape)}")
    B, S, C = q.shape
    if weight.shape != (C,):
        raise ValueError(f"{name}: weight must be [{C}] (the q norm's weight over all heads), got "
                         f"{tuple(weight.shape)}")
    if k.dim() != 4 or v.shape != k.shape or k.shape[0] != B or k.shape[2] * k.shape[3] != C:
        raise ValueError(f"{name}: k, v [B, L, H, D] with B = {B} and H * D = C = {C} (q's channels) expected, "
                         f"got k {tuple(k.shape)}, v {tuple(v.shape)}")
    check_inputs(q.unflatten(-1, k.shape[2:]), k, v, keys)  # keys: int32 [B] on q's device


def normq_block(D: int) -> int:
    """Query rows per program of the fused kernel: 64 up to D = 128 (more programs than SMs at B = 1), else 32."""
    return 64 if D <= 128 else 32


@functools.cache
def _normq_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def text_attn_normq(Q, W, K, V, OUT, NK, sqb, sqs, skb, sks, skh, svb, svs, svh, sob, sos, soh, S, L, H, C,
                        eps, scale_log2, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        # program (query block, b): pass 1 sums x^2 over all H heads' channels; pass 2, per head, normalizes the
        # q chunk (rms_rope_rows' roundings) and runs text_attn's online softmax over the first n keys
        pid_m = tl.program_id(0)
        b = tl.program_id(1)
        n = tl.load(NK + b)
        log2m = tl.log2((L - n + 1).to(tl.float32))
        rows = pid_m * BM + tl.arange(0, BM)
        d = tl.arange(0, D)
        rmask = rows < S
        qp = Q + b * sqb + rows[:, None] * sqs + d[None, :]
        ss = tl.zeros([BM], tl.float32)
        h = 0
        while h < H:  # while loops: the interpreter cannot index range() with a runtime int (numpy >= 2)
            x = tl.load(qp + h * D, mask=rmask[:, None], other=0.0).to(tl.float32)
            ss += tl.sum(x * x, 1)
            h += 1
        rstd = tl.rsqrt(ss / C + eps)
        h = 0
        while h < H:
            x = tl.load(qp + h * D, mask=rmask[:, None], other=0.0).to(tl.float32)  # again: mostly from L2
            w = tl.load(W + h * D + d).to(tl.float32)
            # rounded as PyTorch's rms_norm(x).to(w.dtype) * w (and rms_rope_rows): twice
            q = ((x * rstd[:, None]).to(OUT.dtype.element_ty).to(tl.float32) * w[None, :]).to(OUT.dtype.element_ty)
            m_i = tl.full([BM], float("-inf"), tl.float32)
            l_i = tl.zeros([BM], tl.float32)
            acc = tl.zeros([BM, D], tl.float32)
            start = 0
            while start < n:
                cols = start + tl.arange(0, BN)
                cmask = cols < n
                kt = tl.load(K + b * skb + h * skh + cols[None, :] * sks + d[:, None], mask=cmask[None, :],
                             other=0.0)
                s = tl.dot(q, kt) * scale_log2
                s += tl.where(cols == n - 1, log2m, 0.0)[None, :]
                s = tl.where(cmask[None, :], s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                p = tl.exp2(s - m_new[:, None])
                alpha = tl.exp2(m_i - m_new)
                l_i = l_i * alpha + tl.sum(p, 1)
                vt = tl.load(V + b * svb + h * svh + cols[:, None] * svs + d[None, :], mask=cmask[:, None],
                             other=0.0)
                acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
                m_i = m_new
                start += BN
            out = acc / l_i[:, None]
            tl.store(OUT + b * sob + h * soh + rows[:, None] * sos + d[None, :], out.to(OUT.dtype.element_ty),
                     mask=rmask[:, None])
            h += 1

    return text_attn_normq


@torch.library.custom_op("fastwan::text_cross_attention_normq", mutates_args=())
def text_cross_attention_normq(q: torch.Tensor, weight: torch.Tensor, eps: float, k: torch.Tensor,
                               v: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``text_cross_attention(rms_norm(q) * weight, k, v, keys)`` in one kernel: q [B, S, C] the raw projection
    (any row stride), weight [C], k, v [B, L, H, D] with H * D = C, keys int32 [B] -> [B, S, H, D] in q's dtype.
    The normalized q rounds as ``rms_rope_reference`` (fp32 statistics, rounded after the norm and after the
    weight)."""
    check_inputs_normq(q, weight, k, v, keys)
    H, D = k.shape[2:]
    if not (text_cross_ok(q, D) and weight.dtype == k.dtype == v.dtype == q.dtype):
        return normq_reference(q, weight, eps, k, v, keys)
    q, weight, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, weight, k, v))
    B, S, C = q.shape
    out = torch.empty(B, S, H, D, device=q.device, dtype=q.dtype)
    if out.numel():
        bm = normq_block(D)
        _normq_kernel()[(-(-S // bm), B)](
            q, weight, k, v, out, keys, *q.stride()[:2], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
            S, k.shape[1], H, C, eps, D ** -0.5 * math.log2(math.e), D=D, BM=bm, BN=64,
            num_warps=8 if D >= 128 else 4, num_stages=2)
    return out


@text_cross_attention_normq.register_fake
def _(q, weight, eps, k, v, keys):
    return torch.empty(*q.shape[:2], *k.shape[2:], dtype=q.dtype, device=q.device)
