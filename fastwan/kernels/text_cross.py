"""Cross-attention over padded text with the padding collapsed into one weighted key (exact).

Wan pads the text to 512 tokens with equal rows, and every padding row gives the same key and value. With ``n``
keys up to and including the first padding row (:func:`fastwan.models.wan.cross.text_keys`), attention over
all L keys equals attention over the first ``n`` keys where key ``n - 1`` counts ``L - n + 1`` times: its score
gets ``+ log(L - n + 1)``.

* ``fastwan::text_cross_attention_normq(q, weight, eps, k, v, keys)``: that attention with the query's RMSNorm
  (over all heads, the rounding of ``rms_rope``) inside the kernel, from the raw projection q [B, S, C];
* ``fastwan::text_cross_probs_normq(q, weight, eps, k, keys, width)``: its attention weights P, for the output
  projection folded into the values (:func:`fastwan.models.wan.cross.fold_values`: P @ U replaces P @ V and the
  [S, C] x [C, C] projection; exact in real arithmetic).

Both run a Triton kernel that loops over the first ``n`` keys where :func:`fastwan.kernels.triton_runs` allows
and the head dim is in ``HEAD_DIMS``; elsewhere a masked dense attention with the same weights (the reference).
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from fastwan.kernels import HALF, triton_runs

MAX_WIDTH = 128  # the probs kernel holds one tile of this many keys
HEAD_DIMS = (16, 32, 64, 128, 256)  # the kernel's head sizes (tl.arange needs a power of two)


def kernel_runs(q: torch.Tensor, *others: torch.Tensor, head_dim: int) -> bool:
    """Whether the Triton kernel runs: :func:`fastwan.kernels.triton_runs` for q and the other float inputs, all
    of one dtype, and ``head_dim`` in HEAD_DIMS."""
    return head_dim in HEAD_DIMS and all(t.dtype == q.dtype for t in others) and triton_runs(q, *others, dtypes=HALF)


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
        raise ValueError(f"text cross-attention: q [B, S, H, D] and k, v [B, L, H, D] expected, got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if keys.shape != (q.shape[0],) or keys.dtype != torch.int32:
        raise ValueError(f"text cross-attention: keys must be int32 [{q.shape[0]}] (text_keys), got "
                         f"{keys.dtype} {tuple(keys.shape)}")
    if keys.device != q.device:
        raise ValueError(f"text cross-attention: keys are on {keys.device} but q on {q.device}; move keys to "
                         "q's device (text_keys of the text on that device)")


@functools.cache
def _kernels():
    from fastwan.kernels import text_cross_triton as text_cross_kernels  # imports Triton

    return text_cross_kernels


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
    """Attention of ``rms_norm(q) * weight`` over the collapsed keys (:func:`text_cross_reference`), one kernel:
    q [B, S, C] the raw projection (any row stride), weight [C], k, v [B, L, H, D] with H * D = C, keys int32
    [B] -> [B, S, H, D] in q's dtype. The normalized q rounds as ``rms_rope_reference`` (fp32 statistics,
    rounded after the norm and after the weight)."""
    check_inputs_normq(q, weight, k, v, keys)
    H, D = k.shape[2:]
    if not kernel_runs(q, weight, k, v, head_dim=D):
        return normq_reference(q, weight, eps, k, v, keys).contiguous()  # SDPA may return a transposed layout
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


def probs_reference(q, weight, eps: float, k, keys, width: int) -> torch.Tensor:
    """The PyTorch route of ``text_cross_probs_normq``: the weights of :func:`normq_reference`'s softmax over
    the first ``width`` keys (fp32, or fp64 for fp64 inputs) -> [B, S, H, width] in q's dtype."""
    B, L, H, D = k.shape
    if int(keys.max()) > width:
        raise ValueError(f"text_cross_probs_normq: a sample has {int(keys.max())} keys, more than width={width}; "
                         "width must be at least keys.max() (fastwan.models.wan.cross.fold_width)")
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
    guarantee) -> P [B, S, H, width] in q's dtype: P[b, s, h, j] is the weight of key j (key keys[b] - 1 with
    its padding count), 0 for j >= keys[b]."""
    check_inputs_normq(q, weight, k, k, keys)
    H, D = k.shape[2:]
    if not 1 <= width <= MAX_WIDTH:
        raise ValueError(f"text_cross_probs_normq: width={width} must be in 1..{MAX_WIDTH} (one key tile)")
    if not kernel_runs(q, weight, k, head_dim=D):
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
