"""The Wan block's self-attention (video tokens, 3-D RoPE) and cross-attention (text), each in two builds.

The reference classes follow diffusers' rounding points. The fast ones (subclasses, chosen when the model is
built) run q/k RMSNorm + RoPE as one kernel (``fastwan::rms_rope``) and return the attention output before the
output projection, which the fast block adds into the residual stream itself. Every attention call goes through
:class:`fastwan.attention.AttentionDispatch` in the [B, S, H, D] layout, except the fast cross-attention over
collapsed text padding (:mod:`fastwan.models.wan.cross`).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

import fastwan.kernels.norms  # noqa: F401  (registers fastwan::rms_rope)
import fastwan.kernels.text_cross  # noqa: F401  (registers the fastwan:: text cross-attention ops)
from fastwan.attention import AttentionDispatch, AttentionMetadata
from fastwan.models.wan.cross import CrossInputs, CrossKV
from fastwan.kernels.norms import apply_rope
from fastwan.models.wan.layers import RMSNorm


class _Projections(nn.Module):
    """to_q / to_k / to_v / to_out[0] and the q/k RMSNorms, with Diffusers' parameter names."""

    def __init__(self, dim: int, heads: int, head_dim: int, eps: float):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        inner = heads * head_dim
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])
        self.norm_q = RMSNorm(inner, eps)
        self.norm_k = RMSNorm(inner, eps)

    def heads_of(self, t: torch.Tensor) -> torch.Tensor:
        """[B, S, heads * head_dim] -> [B, S, heads, head_dim]."""
        return t.unflatten(-1, (self.heads, self.head_dim))

    def norm(self, t: torch.Tensor, norm: RMSNorm, rope: torch.Tensor | None) -> torch.Tensor:
        """[B, S, inner] -> RMSNorm over all heads (+ RoPE) -> [B, S, heads, head_dim]."""
        t = self.heads_of(norm(t))
        return t if rope is None else apply_rope(t, rope)


class WanSelfAttention(_Projections):
    def __init__(self, dim: int, heads: int, head_dim: int, eps: float):
        super().__init__(dim, heads, head_dim, eps)
        self.to_gate_compress: nn.Linear | None = None  # VSA checkpoints carry it (WanTransformer.add_gate_compress)

    def attend(self, x, attn: AttentionDispatch, rope, meta: AttentionMetadata | None) -> torch.Tensor:
        """x [B, S, C] -> attention output before ``to_out``, [B, S, heads * head_dim] in x's dtype."""
        q = self.norm(self.to_q(x), self.norm_q, rope)
        k = self.norm(self.to_k(x), self.norm_k, rope)
        v = self.heads_of(self.to_v(x))
        if self.to_gate_compress is not None and meta is not None:
            gate = self.heads_of(self.to_gate_compress(x))
            meta = dataclasses.replace(meta, extra={**meta.extra, "gate_compress": gate})
        return attn.self_attention(q, k, v, meta).flatten(2).type_as(x)

    def forward(self, x, attn: AttentionDispatch, rope, meta: AttentionMetadata | None = None) -> torch.Tensor:
        """x [B, S, C] -> [B, S, C]."""
        return self.to_out[0](self.attend(x, attn, rope, meta))


class WanCrossAttention(_Projections):
    """Attention over the text, and for image-conditioned checkpoints (``image_kv_dim`` set) also over the image
    tokens with their own key/value projections (``add_k_proj``, ``add_v_proj``, ``norm_added_k``); the two
    outputs are added before ``to_out``."""

    def __init__(self, dim: int, heads: int, head_dim: int, eps: float, image_kv_dim: int | None = None):
        super().__init__(dim, heads, head_dim, eps)
        self.add_k_proj = self.add_v_proj = self.norm_added_k = None
        if image_kv_dim is not None:
            self.add_k_proj = nn.Linear(image_kv_dim, heads * head_dim)
            self.add_v_proj = nn.Linear(image_kv_dim, heads * head_dim)
            self.norm_added_k = RMSNorm(heads * head_dim, eps)

    def text_kv(self, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """context [B, L, C] -> keys (after ``norm_k``) and values, each [B, L, heads, head_dim]."""
        return self.norm(self.to_k(context), self.norm_k, None), self.heads_of(self.to_v(context))

    def image_kv(self, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Embedded image tokens [B, N, C] -> keys (after ``norm_added_k``) and values, each [B, N, heads, head_dim]."""
        return self.norm(self.add_k_proj(image), self.norm_added_k, None), self.heads_of(self.add_v_proj(image))

    def attend(self, x, context: CrossInputs, attn: AttentionDispatch) -> torch.Tensor:
        """x [B, S, C] over the text (and image) embeddings -> [B, S, heads * head_dim]."""
        k, v = self.text_kv(context.text)
        q = self.norm(self.to_q(x), self.norm_q, None)
        out = attn.cross_attention(q, k, v).flatten(2).type_as(x)
        if context.image is not None:
            k_img, v_img = self.image_kv(context.image)
            out = out + attn.cross_attention(q, k_img, v_img).flatten(2).type_as(x)
        return out

    def forward(self, x, context: CrossInputs, attn: AttentionDispatch) -> torch.Tensor:
        """x [B, S, C] -> [B, S, C]."""
        return self.to_out[0](self.attend(x, context, attn))


class _FastNorm:
    def norm(self, t: torch.Tensor, norm: RMSNorm, rope: torch.Tensor | None) -> torch.Tensor:
        """One pass of ``fastwan::rms_rope`` (same roundings as the reference); the reference where the norm's
        weight is not in t's dtype."""
        if norm.weight.dtype != t.dtype:
            return super().norm(t, norm, rope)
        return self.heads_of(torch.ops.fastwan.rms_rope(t, norm.weight, rope, norm.eps, self.head_dim))


class FastSelfAttention(_FastNorm, WanSelfAttention):
    pass


class FastCrossAttention(_FastNorm, WanCrossAttention):
    def attend(self, x, ctx: CrossKV, attn: AttentionDispatch) -> torch.Tensor:
        """x [B, S, C] over a prompt's :class:`CrossKV` (not folded) -> [B, S, heads * head_dim]. Collapsed text
        padding (``ctx.keys`` set) runs ``fastwan::text_cross_attention_normq`` (q's RMSNorm inside the
        kernel); otherwise the dispatch's cross-attention backend over all keys."""
        q = self.to_q(x)
        if ctx.keys is not None:
            out = torch.ops.fastwan.text_cross_attention_normq(q, self.norm_q.weight, self.norm_q.eps, ctx.k, ctx.v,
                                                               ctx.keys)
        else:
            out = attn.cross_attention(self.norm(q, self.norm_q, None), ctx.k, ctx.v)
        out = out.flatten(2).type_as(x)
        return out if ctx.k_img is None else out + self.image_attend(q, ctx, attn)

    def image_attend(self, q: torch.Tensor, ctx: CrossKV, attn: AttentionDispatch) -> torch.Tensor:
        """The image tokens' part for the raw query projection q [B, S, C] -> [B, S, heads * head_dim]."""
        return attn.cross_attention(self.norm(q, self.norm_q, None), ctx.k_img, ctx.v_img).flatten(2).type_as(q)

    def probs(self, q: torch.Tensor, ctx: CrossKV) -> torch.Tensor:
        """The attention weights of the raw query projection q [B, S, C] over a folded :class:`CrossKV` (``u``
        set) -> [B, S, heads * width] (``fastwan::text_cross_probs_normq``)."""
        width = ctx.u.shape[1] // self.heads
        return torch.ops.fastwan.text_cross_probs_normq(q, self.norm_q.weight, self.norm_q.eps, ctx.k, ctx.keys,
                                                        width).flatten(2)
