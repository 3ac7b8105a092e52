"""The Wan block in two builds, chosen when the model is built (:class:`fastwan.options.DiTOptions`).

Both compute norm1 + modulation -> self-attention -> gated residual -> norm2 -> cross-attention -> residual ->
norm3 + modulation -> FFN -> gated residual, in two halves: :meth:`WanBlock.video_half` (everything before the
text enters) and :meth:`WanBlock.text_half`, so classifier-free guidance can run the first half once for both
passes. The residual stream between blocks is a :class:`Residual`.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

import fastwan.kernels.norms  # noqa: F401  (registers the fastwan:: norm and residual ops)
from fastwan.attention import AttentionDispatch, AttentionMetadata
from fastwan.models.wan.attention import (
    FastCrossAttention,
    FastSelfAttention,
    WanCrossAttention,
    WanSelfAttention,
)
from fastwan.models.wan.config import WanConfig
from fastwan.models.wan.cross import CrossKV
from fastwan.models.wan.layers import FeedForward, fp32_layer_norm, linear_gelu_tanh


class Residual(NamedTuple):
    """The residual stream: ``x`` [B, S, C] plus what the fast block leaves for the next norm kernel to add
    while it reads x anyway: an fp32 per-channel ``offset`` [1, 1, C] (the output projections' biases, times
    their gates), or a branch output ``y`` [B, S, C] times ``gate`` (None: 1). At most one of the two is set."""
    x: torch.Tensor
    offset: torch.Tensor | None = None
    y: torch.Tensor | None = None
    gate: torch.Tensor | None = None


def settle(r: Residual) -> torch.Tensor:
    """The stream as one tensor in x's dtype."""
    x = r.x
    if r.offset is not None:
        return (x.float() + r.offset).to(x.dtype)
    if r.y is not None:
        y = r.y.float() if r.gate is None else r.y.float() * r.gate
        return (x.float() + y).to(x.dtype)
    return x


class WanBlock(nn.Module):
    """The reference build: PyTorch ops with diffusers' rounding points (fp32 norms and gated adds)."""

    def __init__(self, cfg: WanConfig, self_attn: type = WanSelfAttention, cross_attn: type = WanCrossAttention):
        super().__init__()
        dim, heads, hd = cfg.inner_dim, cfg.num_attention_heads, cfg.attention_head_dim
        self.norm1 = nn.LayerNorm(dim, cfg.eps, elementwise_affine=False)
        self.attn1 = self_attn(dim, heads, hd, cfg.eps)
        self.attn2 = cross_attn(dim, heads, hd, cfg.eps, cfg.added_kv_proj_dim)
        self.norm2 = nn.LayerNorm(dim, cfg.eps, elementwise_affine=True) if cfg.cross_attn_norm else None
        self.ffn = FeedForward(dim, cfg.ffn_dim)
        self.norm3 = nn.LayerNorm(dim, cfg.eps, elementwise_affine=False)
        self.scale_shift_table = nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)

    def modulation(self, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """temb [B, 6, C] or per-token [B, S, 6, C] -> (shift1, scale1, gate1, shift2, scale2, gate2), fp32
        [B, 1, C] or [B, S, C] views."""
        if temb.dim() == 4:
            return (self.scale_shift_table.unsqueeze(0) + temb.float()).unbind(2)
        return (self.scale_shift_table + temb.float()).unsqueeze(2).unbind(1)

    def forward(self, r: Residual, context, temb: torch.Tensor, rope: torch.Tensor, attn: AttentionDispatch,
                meta: AttentionMetadata | None = None) -> Residual:
        """r: the stream [B, S, C]; context: the text embedding [B, L, C] (reference) or this block's
        :class:`CrossKV` (fast); temb: [B, 6, C] or per-token [B, S, 6, C]; rope: [1, S, 1, 2 * head_dim]."""
        mod = self.modulation(temb)
        r, h = self._video(r, mod, rope, attn, meta)
        return self._text(r, h, context, mod, attn)

    def video_half(self, r: Residual, temb, rope, attn, meta=None) -> tuple[Residual, torch.Tensor]:
        """norm1 + modulation, self-attention, gated residual, norm2 -> (stream, cross-attention input h)."""
        return self._video(r, self.modulation(temb), rope, attn, meta)

    def text_half(self, r: Residual, h: torch.Tensor, context, temb, attn) -> Residual:
        """Cross-attention, residual, norm3 + modulation, FFN, gated residual."""
        return self._text(r, h, context, self.modulation(temb), attn)

    def _video(self, r: Residual, mod, rope, attn, meta) -> tuple[Residual, torch.Tensor]:
        shift1, scale1, gate1 = mod[:3]
        x = settle(r)
        h = (fp32_layer_norm(x, self.norm1) * (1 + scale1) + shift1).type_as(x)
        x = (x.float() + self.attn1(h, attn, rope, meta) * gate1).type_as(x)
        h = fp32_layer_norm(x, self.norm2).type_as(x) if self.norm2 is not None else x
        return Residual(x), h

    def _text(self, r: Residual, h: torch.Tensor, context, mod, attn) -> Residual:
        shift2, scale2, gate2 = mod[3:]
        x = r.x + self.attn2(h, context, attn)
        h = (fp32_layer_norm(x, self.norm3) * (1 + scale2) + shift2).type_as(x)
        return Residual((x.float() + self.ffn(h).float() * gate2).type_as(x))


def _no_bias(lin: nn.Module, a: torch.Tensor) -> torch.Tensor:
    """lin(a) without lin's bias (an nn.Linear or an Fp8Linear)."""
    return F.linear(a, lin.weight) if isinstance(lin, nn.Linear) else lin(a, with_bias=False)


class FastWanBlock(WanBlock):
    """The fast build: every norm is one pass of a ``fastwan::*norm_mod`` kernel that also adds what the stream
    has pending; where the modulation is one [C] vector for the batch, each output projection adds into x in place
    inside its GEMM (the gate folded into the weight, ``fastwan::residual_linear_``) and its bias joins the fp32
    offset; otherwise the projection's output is left pending for the next norm kernel. The FFN's bias + GELU run
    in its first GEMM's epilogue. x is updated in place: the caller passes a stream it owns."""

    def __init__(self, cfg: WanConfig):
        super().__init__(cfg, FastSelfAttention, FastCrossAttention)

    @staticmethod
    def _norm(r: Residual, norm: nn.LayerNorm | None, scale, shift) -> tuple[Residual, torch.Tensor]:
        """The stream with its pending part added, and the norm (+ modulation) of it, in one kernel."""
        ops = torch.ops.fastwan
        w, b = (None, None) if norm is None or norm.weight is None else (norm.weight, norm.bias)
        if norm is None:  # no norm before the cross-attention: h is the settled stream
            h = settle(r)
            return (r if r.y is None else Residual(h)), h
        if r.y is not None:
            x, h = ops.residual_norm_mod(r.x, r.y, r.gate, w, b, scale, shift, norm.eps)
            return Residual(x), h
        return r, ops.offset_norm_mod(r.x, r.offset, w, b, scale, shift, norm.eps)

    @staticmethod
    def _add(r: Residual, a: torch.Tensor, lin: nn.Module, gate, in_gemm: bool, bias: bool = True) -> Residual:
        """r + lin(a) [* gate] (gate: fp32 [1, 1, C] when ``in_gemm``, else any modulation view, or None; without
        lin's bias if not ``bias``); a pending output ``y`` of r is added to, otherwise r has none. ``lin``: an
        nn.Linear, or an Fp8Linear, whose output is always left pending."""
        if not in_gemm or not isinstance(lin, nn.Linear):  # an FP8 layer's GEMM cannot add into x
            y = lin(a) if bias else _no_bias(lin, a)
            return Residual(r.x, y=y if r.y is None else r.y + y, gate=gate)
        w = lin.weight if gate is None else (lin.weight.float() * gate.reshape(-1, 1)).to(lin.weight.dtype)
        torch.ops.fastwan.residual_linear_(r.x, a, w)
        if not bias:
            return r
        b = lin.bias.float().view(1, 1, -1)
        b = b if gate is None else b * gate
        return Residual(r.x, offset=b if r.offset is None else r.offset + b)

    def _video(self, r: Residual, mod, rope, attn, meta) -> tuple[Residual, torch.Tensor]:
        shift1, scale1, gate1 = mod[:3]
        in_gemm = shift1.shape[:2] == (1, 1)  # one modulation vector for the batch: gates fold into weights
        r, h = self._norm(r, self.norm1, scale1, shift1)
        r = self._add(r, self.attn1.attend(h, attn, rope, meta), self.attn1.to_out[0], gate1, in_gemm)
        return self._norm(r, self.norm2, None, None)

    def _text(self, r: Residual, h: torch.Tensor, context: CrossKV, mod, attn) -> Residual:
        shift2, scale2, gate2 = mod[3:]
        in_gemm = shift2.shape[:2] == (1, 1)
        out = self.attn2.to_out[0]
        if context.u is None:
            r = self._add(r, self.attn2.attend(h, context, attn), out, None, in_gemm)
        else:  # folded: P @ u in one batched GEMM, plus to_out's bias
            q = self.attn2.to_q(h)
            p = self.attn2.probs(q, context)
            if in_gemm and isinstance(out, nn.Linear):  # x += P @ u in place, the bias into the offset
                torch.ops.fastwan.residual_bmm_(r.x, p, context.u)
                bias = out.bias.float().view(1, 1, -1)
                r = Residual(r.x, offset=bias if r.offset is None else r.offset + bias)
            else:
                bias = out.bias.to(p.dtype).view(1, 1, -1).expand(p.shape[0], p.shape[1], -1)
                r = Residual(r.x, y=torch.baddbmm(bias, p, context.u.expand(p.shape[0], -1, -1)))
            if context.k_img is not None:  # the image tokens' part, projected without a second bias
                r = self._add(r, self.attn2.image_attend(q, context, attn), out, None, in_gemm, bias=False)
        r, h = self._norm(r, self.norm3, scale2, shift2)
        return self._add(r, linear_gelu_tanh(h, self.ffn.net[0].proj), self.ffn.net[2], gate2, in_gemm)
