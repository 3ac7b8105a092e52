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

:class:`fastwan.models.wan.transformer.WanTransformer` uses it for its cross-attention when ``text_collapse`` is on (default)
and :func:`text_cross_ok` holds; otherwise the attention dispatch's cross-attention backend runs over all keys.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from fastwan.kernels import triton_importable

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
    return _kernel_device(x) and x.dtype in DTYPES and head_dim in HEAD_DIMS and triton_importable()


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
def _kernels():
    from fastwan.kernels import text_cross_triton as text_cross_kernels  # imports Triton

    return text_cross_kernels


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
    _kernels().text_attn[grid](q, k, v, out, keys, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
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
        _kernels().text_attn_normq[(-(-S // bm), B)](
            q, weight, k, v, out, keys, *q.stride()[:2], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
            S, k.shape[1], H, C, eps, D ** -0.5 * math.log2(math.e), D=D, BM=bm, BN=64,
            num_warps=8 if D >= 128 else 4, num_stages=2)
    return out


@text_cross_attention_normq.register_fake
def _(q, weight, eps, k, v, keys):
    return torch.empty(*q.shape[:2], *k.shape[2:], dtype=q.dtype, device=q.device)


# ------------------------------------------------------------------------------------------------------------
# The cross-attention's output projection folded into the values
#
# With the weights P [S, H, n] of a head h over the text keys, the block adds (sum_j P[:, h, j] v[j, h]) W_o,h^T
# over the heads: the same as P [S, H * n] @ U with U [H * n, C] holding v[j, h] @ W_o,h^T per (head, key). U
# depends on the prompt only, so it is computed once per prompt (:func:`fold_values`); each forward then writes P
# (``text_cross_probs_normq``) and runs one GEMM with K = H * width instead of the attention's P @ V and the
# [S, C] x [C, C] output projection. Exact in real arithmetic (the product reassociated).

FOLD_ALIGN = 8  # width rounds the key count up to this (P's rows stay 16-byte aligned for cuBLAS in fp16/bf16)
FOLD_MAX_WIDTH = 0.5  # fold where width <= this fraction of the head dim: the GEMM's K at most half the projection's


def fold_width(max_keys: int, head_dim: int) -> int | None:
    """The width of P and U for prompts of at most ``max_keys`` keys (rounded up to FOLD_ALIGN), or None where the
    fold does not pay (width above FOLD_MAX_WIDTH of the head dim)."""
    if max_keys < 1:
        raise ValueError(f"fold_width: max_keys must be >= 1, got {max_keys}")
    width = -(-max_keys // FOLD_ALIGN) * FOLD_ALIGN
    return width if width <= FOLD_MAX_WIDTH * head_dim else None


def fold_values(v: torch.Tensor, keys: torch.Tensor, width: int, weight: torch.Tensor) -> torch.Tensor:
    """U for the folded output projection: v [B, L, H, D], keys int32 [B], weight [N, H * D] (``to_out``'s,
    without bias) -> [B, H * width, N] in v's dtype, U[b, h * width + j] = v[b, j, h] @ weight[:, h*D:(h+1)*D]^T
    for j < keys[b] and 0 for the rest (computed in fp32, or fp64 for fp64 inputs)."""
    B, L, H, D = v.shape
    if weight.dim() != 2 or weight.shape[1] != H * D:
        raise ValueError(f"fold_values: weight must be [N, H * D = {H * D}], got {tuple(weight.shape)}")
    if keys.shape != (B,):
        raise ValueError(f"fold_values: keys must be [{B}], got {tuple(keys.shape)}")
    dt = torch.float64 if v.dtype == torch.float64 else torch.float32
    vv = v[:, :width].to(dt)
    if vv.shape[1] < width:  # a text shorter than the width: the missing keys get no weight (U rows 0)
        vv = F.pad(vv, (0, 0, 0, 0, 0, width - vv.shape[1]))
    vv = vv * (torch.arange(width, device=v.device).view(1, -1) < keys.view(-1, 1)).to(dt).view(B, width, 1, 1)
    u = torch.einsum("bjhd,nhd->bhjn", vv, weight.to(dt).view(-1, H, D))
    return u.reshape(B, H * width, -1).to(v.dtype)


def probs_reference(q, weight, eps: float, k, keys, width: int) -> torch.Tensor:
    """The PyTorch route of ``text_cross_probs_normq``: the weights of :func:`normq_reference`'s softmax over
    the first ``width`` keys (fp32, or fp64 for fp64 inputs) -> [B, S, H, width] in q's dtype."""
    B, L, H, D = k.shape
    if int(keys.max()) > width:
        raise ValueError(f"text_cross_probs_normq: a sample has {int(keys.max())} keys, more than width={width}; "
                         "width must be at least keys.max() (fold_width)")
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    qn = (F.rms_norm(q, (q.shape[-1],), eps=eps).to(weight.dtype) * weight).unflatten(-1, (H, D))
    s = torch.einsum("bshd,blhd->bhsl", qn.to(dt), k.to(dt)) * D ** -0.5
    n = keys.to(torch.int64).view(-1, 1)
    j = torch.arange(L, device=k.device).view(1, -1)
    bias = torch.where(j == n - 1, torch.log((L - n + 1).to(dt)), 0.0)
    bias = torch.where(j < n, bias, -math.inf).to(dt)
    p = (s + bias.view(B, 1, 1, L)).softmax(-1).permute(0, 2, 1, 3)[..., :width]  # [B, S, H, min(L, width)]
    return F.pad(p, (0, width - p.shape[-1])).to(q.dtype).contiguous()


@torch.library.custom_op("fastwan::text_cross_probs_normq", mutates_args=())
def text_cross_probs_normq(q: torch.Tensor, weight: torch.Tensor, eps: float, k: torch.Tensor, keys: torch.Tensor,
                           width: int) -> torch.Tensor:
    """The attention weights of ``text_cross_attention_normq``: q [B, S, C] the raw projection (any row stride),
    weight [C], k [B, L, H, D] with H * D = C, keys int32 [B] with every keys[b] <= ``width`` (the caller's
    guarantee; :func:`fold_width` of the largest) -> P [B, S, H, width] in q's dtype: P[b, s, h, j] is the weight
    of key j (key keys[b] - 1 with its padding count), 0 for j >= keys[b]."""
    check_inputs_normq(q, weight, k, k, keys)
    H, D = k.shape[2:]
    if not 1 <= width <= MAX_KEYS:
        raise ValueError(f"text_cross_probs_normq: width={width} must be in 1..{MAX_KEYS} (one key tile)")
    if not (text_cross_ok(q, D) and weight.dtype == k.dtype == q.dtype):
        return probs_reference(q, weight, eps, k, keys, width)
    q, weight, k = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, weight, k))
    B, S, C = q.shape
    p = torch.empty(B, S, H, width, device=q.device, dtype=q.dtype)
    if p.numel():
        bm = normq_block(D)
        _kernels().text_probs_normq[(-(-S // bm), B)](
            q, weight, k, p, keys, *q.stride()[:2], *k.stride()[:3], *p.stride()[:3], S, k.shape[1], H, C, eps,
            D ** -0.5 * math.log2(math.e), width, D=D, BM=bm, BN=max(16, triton_next_pow2(width)),
            num_warps=8 if D >= 128 else 4, num_stages=2)
    return p


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@text_cross_probs_normq.register_fake
def _(q, weight, eps, k, keys, width):
    return q.new_empty(*q.shape[:2], *k.shape[2:3], width)
