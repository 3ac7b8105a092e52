"""The Wan DiT (Wan2.1 T2V, Wan2.2 T2V-A14B experts, Wan2.2 TI2V-5B), written for speed and clarity.

Parameter names follow the Diffusers ``WanTransformer3DModel`` state dict, so published checkpoints load with
no conversion. Every attention call goes through :class:`fastwan.attention.AttentionDispatch` in the
[B, S, H, D] layout. Modules that Diffusers keeps in fp32 (time embedder, modulation tables, norms) stay fp32.
"""
from __future__ import annotations

import dataclasses
import math
import weakref
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from fastwan.attention import AttentionDispatch, AttentionMetadata
from fastwan.kernels import text_cross
from fastwan.kernels.text_cross import text_cross_ok, text_keys
from fastwan.errors import InvalidArgument
from fastwan.kernels import norms as fused
from fastwan.models.wan.config import WanConfig

# Parameter-name components kept in fp32 whatever the model dtype (as Diffusers does for Wan).
KEEP_IN_FP32 = ("time_embedder", "scale_shift_table", "norm1", "norm2", "norm3")


def keep_in_fp32(param_name: str) -> bool:
    parts = param_name.split(".")
    return any(p in parts for p in KEEP_IN_FP32)


def fp32_layer_norm(x: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
    """LayerNorm computed in fp32; returns fp32. x: [..., C]."""
    w = None if norm.weight is None else norm.weight.float()
    b = None if norm.bias is None else norm.bias.float()
    return F.layer_norm(x.float(), norm.normalized_shape, w, b, norm.eps)


class RMSNorm(nn.Module):
    """RMS norm over the last dim (all heads together), computed in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., C] -> normalized x (fp32 statistics), times the weight."""
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            # one fused kernel: fp32 statistics, result rounded once to the activation dtype
            return F.rms_norm(x, (x.shape[-1],), eps=self.eps).to(self.weight.dtype) * self.weight
        return (F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps) * self.weight).to(x.dtype)


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding, cos half first. t: [N] -> [N, dim] fp32."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def rope_tables(grid: tuple[int, int, int], head_dim: int, max_len: int, device: torch.device,
                theta: float = 10000.0) -> torch.Tensor:
    """3D RoPE table for a (T, H, W) token grid -> fp32 [1, T*H*W, 1, 2 * head_dim].

    The head dim is split t/h/w as Wan does: h = w = 2*(D//6), t = D - h - w; each interleaved channel pair
    (2i, 2i+1) rotates by the angle of its axis position (angles in fp64, stored fp32). The table holds
    ``cos`` repeated per pair (first D) and ``sin`` signed for the pair swap (-sin, +sin) (last D), so the
    rotation is two contiguous multiply-adds (see :func:`apply_rope`).
    """
    T, H, W = grid
    for name, n in zip("THW", grid):
        if n > max_len:
            raise InvalidArgument(f"token grid {name}={n} exceeds rope_max_seq_len={max_len} of this checkpoint; "
                                  "make the video smaller along that axis.")
    hw = 2 * (head_dim // 6)
    dims = (head_dim - 2 * hw, hw, hw)
    angles = []
    for n, d, shape in zip(grid, dims, ((T, 1, 1), (1, H, 1), (1, 1, W))):
        inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=device)[: d // 2] / d))
        a = torch.outer(torch.arange(n, dtype=torch.float64, device=device), inv)  # [n, d/2]
        angles.append(a.view(*shape, d // 2).expand(T, H, W, d // 2))
    ang = torch.cat(angles, dim=-1).reshape(1, T * H * W, 1, head_dim // 2)
    cos = ang.cos().repeat_interleave(2, dim=-1)
    sin = torch.stack((-ang.sin(), ang.sin()), dim=-1).flatten(-2)
    return torch.cat((cos, sin), dim=-1).float()


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved channel pairs in fp32. x: [B, S, H, D]; table: [1, S, 1, 2D] -> x.dtype.

    out[2i] = x[2i] cos - x[2i+1] sin and out[2i+1] = x[2i] sin + x[2i+1] cos, computed as
    x * cos + swap_pairs(x) * signed_sin with every operand contiguous.
    """
    d = x.shape[-1]
    swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return (x * table[..., :d] + swapped * table[..., d:]).type_as(x)  # bf16 * fp32 computes in fp32


class CrossKV(NamedTuple):
    """One block's cross-attention keys and values, computed from the text once per prompt
    (:meth:`WanTransformer._contexts`): k (after ``norm_k``) and v [B, L, H, D]; ``keys`` int32 [B] where the
    text padding is collapsed into one weighted key (:mod:`fastwan.kernels.text_cross`), else None.

    With the output projection folded into the values (``text_fold``), ``u`` [B, H * width, C] holds
    :func:`fastwan.kernels.text_cross.fold_values` of v and ``to_out``'s weight, and v is None: the block adds
    P @ u (P the attention weights [B, S, H * width]) plus ``to_out``'s bias instead of projecting P @ V."""
    k: torch.Tensor
    v: torch.Tensor | None
    keys: torch.Tensor | None
    u: torch.Tensor | None = None


class WanAttention(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int, eps: float, cross: bool):
        super().__init__()
        self.heads, self.head_dim, self.cross = heads, head_dim, cross
        inner = heads * head_dim
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])
        self.norm_q = RMSNorm(inner, eps)
        self.norm_k = RMSNorm(inner, eps)
        self.to_gate_compress: nn.Linear | None = None  # VSA checkpoints add it (see WanTransformer)
        self.to_qkv: nn.Linear | None = None  # set by fuse_qkv() (self-attention only)
        self.fused_norms = True  # single-pass Triton norms on CUDA (WanTransformer.set_fast_paths)
        # collapsed text attention (keys given): the q RMSNorm inside its kernel on the fused route (an A/B switch)
        self.text_normq = True

    def fuse_qkv(self) -> None:
        """Replace to_q/to_k/to_v by one [3*inner, dim] projection (one GEMM instead of three).

        Self-attention only (cross-attention's k/v read the 512 text tokens, not the video). The separate
        projections are removed, so the weights are held once; the state dict then has ``to_qkv`` instead.
        """
        if self.cross:
            raise ValueError("fuse_qkv() applies to self-attention only (attn1); cross-attention keys and values "
                             "come from the text context.")
        if self.to_qkv is not None:
            return
        lins = (self.to_q, self.to_k, self.to_v)
        fused = nn.Linear(lins[0].in_features, 3 * lins[0].out_features, device="meta")
        fused.weight = nn.Parameter(torch.cat([m.weight.detach() for m in lins]), requires_grad=False)
        fused.bias = nn.Parameter(torch.cat([m.bias.detach() for m in lins]), requires_grad=False)
        self.to_qkv = fused
        del self.to_q, self.to_k, self.to_v

    def _norm(self, t: torch.Tensor, norm: RMSNorm, rope: torch.Tensor | None, fused_ok: bool) -> torch.Tensor:
        """[B, S, inner] -> RMSNorm (+ RoPE) -> [B, S, heads, head_dim]: one pass in the fused kernel where it runs
        (:mod:`fastwan.kernels.norms`, the same roundings as the PyTorch path)."""
        if self.fused_norms and fused_ok and norm.weight.dtype == t.dtype:
            return torch.ops.fastwan.rms_rope(t, norm.weight, rope, norm.eps, self.head_dim).unflatten(
                -1, (self.heads, self.head_dim))
        t = norm(t).unflatten(-1, (self.heads, self.head_dim))
        return t if rope is None else apply_rope(t, rope)

    def text_kv(self, context: torch.Tensor, fused_ok: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-attention keys (normed) and values of context [B, L, C] -> two [B, L, heads, head_dim]."""
        return (self._norm(self.to_k(context), self.norm_k, None, fused_ok),
                self.to_v(context).unflatten(-1, (self.heads, self.head_dim)))

    def text_probs(self, x: torch.Tensor, ctx: CrossKV) -> torch.Tensor:
        """The cross-attention weights of x [B, S, C] over a folded :class:`CrossKV` (``u`` set) ->
        [B, S, heads * width] (``fastwan::text_cross_probs_normq``: q's RMSNorm inside the kernel)."""
        width = ctx.u.shape[1] // self.heads
        return torch.ops.fastwan.text_cross_probs_normq(self.to_q(x), self.norm_q.weight, self.norm_q.eps, ctx.k,
                                                        ctx.keys, width).flatten(2)

    def forward(
        self,
        x: torch.Tensor,
        attn: AttentionDispatch,
        context: torch.Tensor | None = None,
        rope: torch.Tensor | None = None,
        meta: AttentionMetadata | None = None,
        fused_ok: bool = False,
        project: bool = True,
    ) -> torch.Tensor:
        """x: [B, S, C]; context: [B, L, C] for cross-attention -> [B, S, C]. ``fused_ok``: the fused norm
        kernels run for these activations (decided once per forward, outside compiled code). ``project=False``
        returns the attention output before ``to_out`` ([B, S, heads * head_dim]; the block then projects it
        into the residual stream itself). A context given as ``(context, keys)`` (``keys``: int32 [B] from
        :func:`fastwan.kernels.text_cross.text_keys`) attends with the text padding collapsed into one
        weighted key (``fastwan::text_cross_attention``, exact); a :class:`CrossKV` brings the keys and values
        already projected (:meth:`text_kv`), or folded into the output projection (then ``project`` must be
        True)."""
        keys = None
        if isinstance(context, CrossKV) and context.u is not None:  # P @ (V W_o^T) + b_o, one batched GEMM
            if not project:
                raise ValueError("WanAttention: a folded CrossKV (u set) includes the output projection; call with "
                                 "project=True, or add text_probs(x, ctx) @ ctx.u to the residual yourself.")
            p = self.text_probs(x, context)
            bias = self.to_out[0].bias.to(p.dtype).view(1, 1, -1).expand(p.shape[0], p.shape[1], -1)
            return torch.baddbmm(bias, p, context.u.expand(p.shape[0], -1, -1))
        if isinstance(context, CrossKV):  # keys and values computed once per prompt
            q = self.to_q(x)
            k, v, keys, _ = context
        else:
            if isinstance(context, tuple):
                context, keys = context
            if self.to_qkv is not None:
                q, k, v = self.to_qkv(x).chunk(3, dim=-1)  # views of one GEMM output
            else:
                src = x if context is None else context
                q, k, v = self.to_q(x), self.to_k(src), self.to_v(src)
            k = self._norm(k, self.norm_k, rope, fused_ok)
            v = v.unflatten(-1, (self.heads, self.head_dim))
        if keys is not None and self.text_normq and self.fused_norms and fused_ok \
                and self.norm_q.weight.dtype == q.dtype:
            # the collapsed text attention with the q RMSNorm in the same kernel (one pass over q fewer)
            out = torch.ops.fastwan.text_cross_attention_normq(q, self.norm_q.weight, self.norm_q.eps, k, v, keys)
            return self._finish(out, q, project)
        q = self._norm(q, self.norm_q, rope, fused_ok)
        if self.cross:
            if keys is not None:
                out = torch.ops.fastwan.text_cross_attention(q, k, v, keys)
            else:
                out = attn.cross_attention(q, k, v)
        else:
            if self.to_gate_compress is not None and meta is not None:
                gate = self.to_gate_compress(x).unflatten(-1, (self.heads, self.head_dim))
                meta = dataclasses.replace(meta, extra={**meta.extra, "gate_compress": gate})
            out = attn.self_attention(q, k, v, meta)
        return self._finish(out, q, project)

    def _finish(self, out: torch.Tensor, q: torch.Tensor, project: bool) -> torch.Tensor:
        out = out.flatten(2).type_as(q)
        return self.to_out[0](out) if project else out


def linear_gelu_tanh(x: torch.Tensor, lin: nn.Linear, epilogue: bool = True) -> torch.Tensor:
    """GELU(tanh)(x @ W^T + b). x: [..., in] -> [..., out].

    On CUDA with ``epilogue`` the bias and GELU run in the GEMM's epilogue (cuBLASLt, through
    ``torch._addmm_activation``; torch.compile keeps it as one extern kernel), so the [tokens, ffn_dim]
    activation is written once instead of written, read and written again. Elsewhere (and on CPU, where
    ``_addmm_activation`` uses the exact erf GELU) it is the plain linear + GELU(tanh).
    """
    if epilogue and x.is_cuda and lin.bias is not None and x.dtype == lin.weight.dtype:
        out = torch._addmm_activation(lin.bias, x.reshape(-1, x.shape[-1]), lin.weight.t(), use_gelu=True)
        return out.view(*x.shape[:-1], out.shape[-1])
    return F.gelu(lin(x), approximate="tanh")


class FeedForward(nn.Module):
    """Linear -> GELU(tanh) -> Linear, with Diffusers' parameter names (net.0.proj, net.2)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        proj = nn.Module()
        proj.proj = nn.Linear(dim, hidden)
        self.net = nn.ModuleList([proj, nn.Identity(), nn.Linear(hidden, dim)])
        self.gelu_epilogue = True  # see linear_gelu_tanh; a per-model switch (WanTransformer.set_fast_paths)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[2](linear_gelu_tanh(x, self.net[0].proj, self.gelu_epilogue))


class WanBlock(nn.Module):
    def __init__(self, cfg: WanConfig):
        super().__init__()
        dim = cfg.inner_dim
        self.norm1 = nn.LayerNorm(dim, cfg.eps, elementwise_affine=False)
        self.attn1 = WanAttention(dim, cfg.num_attention_heads, cfg.attention_head_dim, cfg.eps, cross=False)
        self.attn2 = WanAttention(dim, cfg.num_attention_heads, cfg.attention_head_dim, cfg.eps, cross=True)
        self.norm2 = nn.LayerNorm(dim, cfg.eps, elementwise_affine=True) if cfg.cross_attn_norm else None
        self.ffn = FeedForward(dim, cfg.ffn_dim)
        self.norm3 = nn.LayerNorm(dim, cfg.eps, elementwise_affine=False)
        self.scale_shift_table = nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)
        self.fused_norms = True  # single-pass Triton norms on CUDA (WanTransformer.set_fast_paths)
        self.gemm_residual = True  # residual adds inside the output GEMMs (WanTransformer.set_fast_paths)

    def modulation(self, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """temb: [B, 6, C] or per-token [B, S, 6, C] -> (shift1, scale1, gate1, shift2, scale2, gate2), fp32
        [B, 1, C] or [B, S, C] views."""
        if temb.dim() == 4:
            return (self.scale_shift_table.unsqueeze(0) + temb.float()).unbind(2)  # 6 x [B, S, C]
        return (self.scale_shift_table + temb.float()).unsqueeze(2).unbind(1)  # 6 x [B, 1, C]

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor,
        temb: torch.Tensor,
        rope: torch.Tensor,
        attn: AttentionDispatch,
        meta: AttentionMetadata | None = None,
        fused_ok: bool = False,
        pending: tuple[torch.Tensor, ...] | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """x: [B, S, C]; context: [B, L, C]; temb: [B, 6, C] or per-token [B, S, 6, C] -> (x, pending).

        The residual stream is x plus ``pending`` (:func:`settle` adds it), a part that the fused paths leave
        for the next norm kernel to add while it reads x anyway (``fused_ok``: the fused norm kernels run for x,
        :func:`fastwan.kernels.norms.usable`, decided by the caller outside compiled code):

        * ``(y, gate)``: the block's last residual ``x + ffn * gate``, added by the next block's first norm
          kernel (``residual_norm_mod``: one pass over the activations fewer);
        * ``(offset,)`` (:meth:`_gemm_residual_ok`): the output projections of self-attention, cross-attention
          and FFN add into x inside their GEMM (``fastwan::residual_linear_``, x updated in place; a gate is
          folded into the weight) and their biases (times the gate) accumulate in an fp32 per-channel offset
          that the norm kernels add (``offset_norm_mod``): each norm reads one tensor and writes one, instead
          of reading two and writing two.

        Otherwise ``pending`` is None and x includes everything. With ``(offset,)`` x is updated in place: the
        caller passes an x it owns (:meth:`WanTransformer.forward` does)."""
        mod = self.modulation(temb)
        x, h, pending = self._video_half(x, mod, rope, attn, meta, fused_ok, pending)
        return self._text_half(x, h, pending, context, mod, attn, fused_ok)

    def _gemm_residual_ok(self, mod, fused_ok: bool) -> bool:
        """Whether the block runs its residual adds in the output GEMMs (pending = (offset,)): the fused norms
        run, the option is on, and the modulation is one [C] vector for the whole batch (``mod`` views of
        [1, 1, C]), so that gates fold into the weights. Per-token or per-sample modulation takes the
        residual_norm_mod path."""
        return bool(self.gemm_residual and self.fused_norms and fused_ok and mod[0].shape[:2] == (1, 1))

    def video_half(self, x, temb, rope, attn, meta=None, fused_ok: bool = False):
        """The part of the block that does not read the text: norm1 + modulation, self-attention, gated residual,
        norm2. x [B, S, C] -> (x, h, pending): the residual stream (x + pending, as in forward) and the
        cross-attention input h [B, S, C].

        Classifier-free guidance runs it once for the conditional and unconditional passes of the first block
        (:meth:`WanTransformer.forward_cfg`): their inputs are equal up to here."""
        return self._video_half(x, self.modulation(temb), rope, attn, meta, fused_ok, None)

    def text_half(self, x, h, pending, context, temb, attn, fused_ok: bool = False):
        """The rest of the block: cross-attention over ``context`` [B, L, C], norm3 + modulation, FFN, gated
        residual. (x, h, pending) from :meth:`video_half`, with the batch of ``context`` -> (x, pending) as
        forward()."""
        return self._text_half(x, h, pending, context, self.modulation(temb), attn, fused_ok)

    @staticmethod
    def _residual_linear(x, a, lin: nn.Linear, gate, offset):
        """x += a @ (W * gate)^T in place (one GEMM); returns offset + b * gate ([1, 1, C] fp32)."""
        w = lin.weight if gate is None else (lin.weight.float() * gate.reshape(-1, 1)).to(lin.weight.dtype)
        torch.ops.fastwan.residual_linear_(x, a, w)
        b = lin.bias.float().view(1, 1, -1)
        b = b if gate is None else b * gate
        return b if offset is None else offset + b

    def _video_half(self, x, mod, rope, attn, meta, fused_ok, pending):
        shift1, scale1, gate1 = mod[:3]
        ops = torch.ops.fastwan
        if (pending is None or len(pending) == 1) and self._gemm_residual_ok(mod, fused_ok):
            offset = None if pending is None else pending[0]
            x = x.contiguous()  # a copy only for the first block's (transposed) patch embedding
            h = ops.offset_norm_mod(x, offset, None, None, scale1, shift1, self.norm1.eps)
            o = self.attn1(h, attn, rope=rope, meta=meta, fused_ok=True, project=False)
            offset = self._residual_linear(x, o, self.attn1.to_out[0], gate1, offset)
            if self.norm2 is None:
                return x, settle(x, (offset,)), (offset,)
            return x, ops.offset_norm_mod(x, offset, self.norm2.weight, self.norm2.bias, None, None,
                                          self.norm2.eps), (offset,)
        if self.fused_norms and fused_ok:  # residual + norm (+ modulation) in single-pass kernels, same roundings
            if pending is not None:  # the previous block's FFN residual, added by the norm kernel
                x, h = ops.residual_norm_mod(x, pending[0], pending[1], None, None, scale1, shift1, self.norm1.eps)
            else:
                h = ops.norm_mod(x, None, None, scale1, shift1, self.norm1.eps)
            y = self.attn1(h, attn, rope=rope, meta=meta, fused_ok=True)
            if self.norm2 is None:
                x = (x.float() + y * gate1).type_as(x)
                return x, x, None
            x, h = ops.residual_norm_mod(x, y, gate1, self.norm2.weight, self.norm2.bias, None, None,
                                         self.norm2.eps)
            return x, h, None
        x = settle(x, pending)
        h = (fp32_layer_norm(x, self.norm1) * (1 + scale1) + shift1).type_as(x)
        x = (x.float() + self.attn1(h, attn, rope=rope, meta=meta) * gate1).type_as(x)
        h = fp32_layer_norm(x, self.norm2).type_as(x) if self.norm2 is not None else x
        return x, h, None

    def _text_half(self, x, h, pending, context, mod, attn, fused_ok):
        shift2, scale2, gate2 = mod[3:]
        if pending is not None and len(pending) == 1:  # the residual adds in the output GEMMs
            ops = torch.ops.fastwan
            if isinstance(context, CrossKV) and context.u is not None:  # x += P @ u; b_o into the offset
                ops.residual_bmm_(x, self.attn2.text_probs(h, context), context.u)
                offset = pending[0] + self.attn2.to_out[0].bias.float().view(1, 1, -1)
            else:
                o = self.attn2(h, attn, context=context, fused_ok=True, project=False)
                offset = self._residual_linear(x, o, self.attn2.to_out[0], None, pending[0])
            h = ops.offset_norm_mod(x, offset, None, None, scale2, shift2, self.norm3.eps)
            f = linear_gelu_tanh(h, self.ffn.net[0].proj, self.ffn.gelu_epilogue)
            return x, (self._residual_linear(x, f, self.ffn.net[2], gate2, offset),)
        if self.fused_norms and fused_ok:
            y = self.attn2(h, attn, context=context, fused_ok=True)
            x, h = torch.ops.fastwan.residual_norm_mod(x, y, None, None, None, scale2, shift2, self.norm3.eps)
            return x, (self.ffn(h), gate2)
        x = x + self.attn2(h, attn, context=context)
        h = (fp32_layer_norm(x, self.norm3) * (1 + scale2) + shift2).type_as(x)
        return (x.float() + self.ffn(h).float() * gate2).type_as(x), None


def settle(x: torch.Tensor, pending: tuple[torch.Tensor, ...] | None) -> torch.Tensor:
    """The residual stream as one tensor: x plus a block's pending part (see :meth:`WanBlock.forward`)."""
    if pending is None:
        return x
    if len(pending) == 1:
        return (x.float() + pending[0]).to(x.dtype)
    return fused.residual_reference(x, *pending)


class TimeTextEmbedding(nn.Module):
    def __init__(self, cfg: WanConfig):
        super().__init__()
        dim = cfg.inner_dim
        self.freq_dim = cfg.freq_dim
        self.time_embedder = nn.Module()
        self.time_embedder.linear_1 = nn.Linear(cfg.freq_dim, dim)
        self.time_embedder.linear_2 = nn.Linear(dim, dim)
        self.time_proj = nn.Linear(dim, dim * 6)
        self.text_embedder = nn.Module()
        self.text_embedder.linear_1 = nn.Linear(cfg.text_dim, dim)
        self.text_embedder.linear_2 = nn.Linear(dim, dim)

    def forward(self, timestep: torch.Tensor, text: torch.Tensor):
        """timestep: [B] or per-token [B, S]; text: [B, L, text_dim].

        Returns temb ([B, C] or [B, S, C]), modulation ([B, 6, C] or [B, S, 6, C]), context [B, L, C].
        """
        temb, mod = self.time(timestep, text.dtype)
        return temb, mod, self.text(text)

    def time(self, timestep: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """timestep [B] or [B, S] -> temb ([B, C] or [B, S, C], in ``dtype``) and modulation ([B, 6, C] or
        [B, S, 6, C])."""
        shape = timestep.shape
        t = timestep_embedding(timestep.flatten(), self.freq_dim).unflatten(0, shape)
        te = self.time_embedder
        t = t.to(te.linear_1.weight.dtype)
        temb = te.linear_2(F.silu(te.linear_1(t))).to(dtype)
        return temb, self.time_proj(F.silu(temb)).unflatten(-1, (6, -1))

    def text(self, text: torch.Tensor) -> torch.Tensor:
        """text [B, L, text_dim] -> context [B, L, C]."""
        tx = self.text_embedder
        return tx.linear_2(F.gelu(tx.linear_1(text), approximate="tanh"))


class WanTransformer(nn.Module):
    """Wan DiT. ``forward(latents [B, C, F, H, W], timestep [B] or [B, S], text [B, L, text_dim])``."""

    def __init__(self, cfg: WanConfig, attention: AttentionDispatch | None = None):
        super().__init__()
        self.config = cfg
        dim = cfg.inner_dim
        self.patch_embedding = nn.Conv3d(cfg.in_channels, dim, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        self.condition_embedder = TimeTextEmbedding(cfg)
        self.blocks = nn.ModuleList([WanBlock(cfg) for _ in range(cfg.num_layers)])
        self.norm_out = nn.LayerNorm(dim, cfg.eps, elementwise_affine=False)
        self.proj_out = nn.Linear(dim, cfg.out_channels * math.prod(cfg.patch_size))
        self.scale_shift_table = nn.Parameter(torch.randn(1, 2, dim) / dim**0.5)
        self.attention = attention
        self._rope_cache: dict = {}
        self._first_halves = None  # compiled (video_half, text_half) of block 0, set by compile_blocks()
        self.text_collapse = True  # cross-attention with the text padding as one weighted key (set_fast_paths)
        self.text_kv_cache = True  # cross-attention keys/values once per prompt (set_fast_paths, _contexts)
        self.text_fold = True  # cross-attention output projection folded into the cached values (set_fast_paths)
        self._keys_cache: dict[int, tuple] = {}  # id(text) -> (weakref, version, keys or None, max keys); _text_keys
        self._kv_cache: dict[tuple, tuple] = {}  # ids of the texts -> (refs, versions, signature, contexts)

    # -- attention ----------------------------------------------------------------------------------------
    def set_attention(self, dispatch: AttentionDispatch) -> None:
        self.attention = dispatch

    def add_gate_compress(self) -> None:
        """Create the VSA ``to_gate_compress`` projections (checkpoints trained for VSA carry their weights)."""
        for blk in self.blocks:
            a = blk.attn1
            a.to_gate_compress = nn.Linear(self.config.inner_dim, self.config.inner_dim)

    def set_fast_paths(self, *, fuse_qkv: bool | None = None, gelu_epilogue: bool | None = None,
                       fused_norms: bool | None = None, gemm_residual: bool | None = None,
                       text_collapse: bool | None = None, text_kv_cache: bool | None = None,
                       text_fold: bool | None = None) -> None:
        """Speed options that keep the math (bf16 rounding aside); None leaves an option as it is.

        fuse_qkv: one QKV GEMM per self-attention (irreversible: the separate projections are dropped).
        gelu_epilogue: FFN bias + GELU(tanh) in the first FFN GEMM's epilogue on CUDA.
        fused_norms: residual + LayerNorm + modulation and q/k RMSNorm + RoPE as single-pass Triton kernels on
        CUDA (:mod:`fastwan.kernels.norms`); the PyTorch path elsewhere.
        gemm_residual: with fused_norms, the residual adds of the output projections inside their GEMMs and the
        biases as a pending fp32 offset (:meth:`WanBlock.forward`), where the modulation is one vector per batch.
        text_collapse: where fastwan's Triton cross-attention kernel runs (CUDA, fp16/bf16), text padding (the
        trailing run of equal rows of the text embeddings) enters the cross-attention as one key weighted by its
        count (:mod:`fastwan.kernels.text_cross`; exact), instead of the dispatch's backend over all tokens.
        text_kv_cache: the text embedding and every block's cross-attention keys and values computed once per
        prompt tensor and reused by later forwards (a denoising loop passes the same embeddings every step; the
        same values, computed outside the compiled blocks). Costs their memory (2 x layers x L x C per prompt).
        text_fold: with text_kv_cache and the collapsed text attention, each block's cross-attention output
        projection folded into its cached values (:func:`fastwan.kernels.text_cross.fold_values`): the
        attention writes its weights P [S, H x width] and one GEMM adds P @ U to the residual stream, instead of
        P @ V and the [S, C] x [C, C] projection. Where the prompts' key count rounded up (``fold_width``) is at
        most half the head dim (short prompts); U replaces V in the cache (H x width x C per block and prompt).
        """
        if text_collapse is not None:
            self.text_collapse = bool(text_collapse)
        if text_fold is not None:
            self.text_fold = bool(text_fold)
        if text_kv_cache is not None:
            self.text_kv_cache = bool(text_kv_cache)
            self._kv_cache = {}
        for blk in self.blocks:
            if fused_norms is not None:
                blk.fused_norms = blk.attn1.fused_norms = bool(fused_norms)
            if fuse_qkv:
                blk.attn1.fuse_qkv()
            elif fuse_qkv is False and blk.attn1.to_qkv is not None:
                raise ValueError("fuse_qkv=False: the QKV projections of this model are already fused; reload it.")
            if gelu_epilogue is not None:
                blk.ffn.gelu_epilogue = bool(gelu_epilogue)
            if gemm_residual is not None:
                blk.gemm_residual = bool(gemm_residual)

    @property
    def dtype(self) -> torch.dtype:
        return self.proj_out.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.proj_out.weight.device

    def _rope(self, grid, device):
        key = (grid, device)
        if key not in self._rope_cache:
            self._rope_cache = {key: rope_tables(grid, self.config.attention_head_dim, self.config.rope_max_seq_len,
                                                 device)}
        return self._rope_cache[key]

    def compile_blocks(self, **kwargs) -> None:
        """Regional torch.compile: each block's forward, and the two halves of the first block that
        :meth:`forward_cfg` calls separately (``kwargs`` go to ``torch.compile``)."""
        for block in self.blocks:
            block.compile(**kwargs)
        first = self.blocks[0]
        self._first_halves = (torch.compile(first.video_half, **kwargs), torch.compile(first.text_half, **kwargs))

    # -- forward ------------------------------------------------------------------------------------------
    def _text_keys(self, text: torch.Tensor) -> torch.Tensor | None:
        """int32 [B] key counts for the collapsed cross-attention (:func:`text_keys`), or None where it does not
        run: ``text_collapse`` off, the kernel unusable for the model's dtype and device, or a sample of ``text``
        with more than ``text_cross.MAX_KEYS`` keys left (unpadded or a long prompt: the backend is as fast).
        Outside compiled code; the answer is cached per text tensor (object and version), so a denoising loop
        that passes the same prompt embeddings waits for the GPU once."""
        if not (self.text_collapse and text_cross_ok(self.proj_out.weight, self.config.attention_head_dim)):
            return None
        hit = self._keys_cache.get(id(text))
        if hit is not None and hit[0]() is text and hit[1] == text._version:
            return hit[2]
        keys = text_keys(text)
        n = int(keys.max())  # one sync per new text tensor
        keys = keys if n < text.shape[1] and n <= text_cross.MAX_KEYS else None
        self._keys_cache = {k: v for k, v in self._keys_cache.items() if v[0]() is not None}
        self._keys_cache[id(text)] = (weakref.ref(text), text._version, keys, n)
        return keys

    def _fold_width(self, texts: tuple[torch.Tensor, ...]) -> int | None:
        """The width of the folded cross-attention for these texts (their keys known to :meth:`_text_keys`), or
        None where the fold is off or does not pay (:func:`fastwan.kernels.text_cross.fold_width`)."""
        if not self.text_fold:
            return None
        hits = [self._keys_cache.get(id(t)) for t in texts]
        if any(h is None or h[0]() is not t or h[2] is None for h, t in zip(hits, texts)):
            return None
        return text_cross.fold_width(max(h[3] for h in hits), self.config.attention_head_dim)

    def _text_params(self):
        yield from self.condition_embedder.text_embedder.parameters()
        for blk in self.blocks:
            a = blk.attn2
            yield from (a.to_k.weight, a.to_k.bias, a.to_v.weight, a.to_v.bias, a.norm_k.weight, a.to_out[0].weight)

    def _folds(self, blk: WanBlock, fused_ok: bool) -> bool:
        """Whether a block's cross-attention runs folded when the prompts allow it: the route of the q RMSNorm
        inside the collapsed text kernel (WanAttention.forward's condition for text_cross_attention_normq)."""
        a = blk.attn2
        return bool(fused_ok and blk.fused_norms and a.fused_norms and a.text_normq
                    and a.norm_q.weight.dtype == self.dtype)

    def _text_context(self, texts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The text embedder on the texts concatenated along the batch -> [sum B_i, L, C]."""
        text = texts[0].to(self.dtype) if len(texts) == 1 else torch.cat([t.to(self.dtype) for t in texts])
        return self.condition_embedder.text(text)

    def _contexts(self, texts: tuple[torch.Tensor, ...], fused_ok: bool, context: torch.Tensor | None = None):
        """What every block's cross-attention reads for the texts (each [B_i, L, text_dim]) concatenated along the
        batch -> a list with one entry per block.

        With ``text_kv_cache`` (and autograd off): a :class:`CrossKV` per block, cached per tuple of text tensors
        (objects and versions), the weights they were computed from (storage and version) and the options that
        change their bits, so a denoising loop computes them at its first step only; with ``text_fold`` (where
        :meth:`_fold_width` and :meth:`_folds` allow) v is folded into the output projection. Otherwise the text
        embedding ``context`` (computed here if not given), or ``(context, keys)`` with the text padding
        collapsed (:meth:`_text_keys`), shared by all blocks."""
        keys = [self._text_keys(t) for t in texts]
        keys = None if any(k is None for k in keys) else (keys[0] if len(keys) == 1 else torch.cat(keys))
        if not self.text_kv_cache or torch.is_grad_enabled():
            context = self._text_context(texts) if context is None else context
            return [context if keys is None else (context, keys)] * len(self.blocks)
        ident = tuple(id(t) for t in texts)
        width = None if keys is None else self._fold_width(texts)
        sig = (fused_ok, self.text_collapse, width,
               tuple((blk.fused_norms, blk.attn2.fused_norms, blk.attn2.text_normq) for blk in self.blocks),
               tuple((p.data_ptr(), p._version) for p in self._text_params()))
        hit = self._kv_cache.get(ident)
        if (hit is not None and all(r() is t for r, t in zip(hit[0], texts))
                and hit[1] == tuple(t._version for t in texts) and hit[2] == sig):
            return hit[3]
        context = self._text_context(texts) if context is None else context
        # the norm the block itself would run: fused only on its fused route
        kvs = []
        for blk in self.blocks:
            k, v = blk.attn2.text_kv(context, fused_ok and blk.fused_norms)
            if width is not None and self._folds(blk, fused_ok):
                u = text_cross.fold_values(v, keys, width, blk.attn2.to_out[0].weight)
                torch._dynamo.maybe_mark_dynamic(u, 1)  # compiled blocks: one graph for every prompt width
                kvs.append(CrossKV(k, None, keys, u))
            else:
                kvs.append(CrossKV(k, v, keys))
        live = {k: v for k, v in self._kv_cache.items() if all(r() is not None for r in v[0]) and k != ident}
        self._kv_cache = dict(list(live.items())[-3:])  # the latest prompts only (each holds 2 x layers x L x C)
        self._kv_cache[ident] = (tuple(weakref.ref(t) for t in texts), tuple(t._version for t in texts), sig, kvs)
        return kvs

    def _embed(self, latents: torch.Tensor, timestep: torch.Tensor):
        """Patch embedding (tile-major token order under a sparse backend), RoPE table and time embeddings ->
        (x [B, S, C], rope, temb, mod, grid, layout)."""
        if self.attention is None:
            raise RuntimeError("WanTransformer has no attention dispatch; call set_attention() first.")
        _, _, Fr, Hh, Ww = latents.shape
        pt, ph, pw = self.config.patch_size
        if Fr % pt or Hh % ph or Ww % pw:
            raise ValueError(
                f"latent grid {Fr}x{Hh}x{Ww} is not divisible by patch_size {self.config.patch_size}; "
                "choose a height/width that is a multiple of the VAE factor times the patch size."
            )
        grid = (Fr // pt, Hh // ph, Ww // pw)
        x = self.patch_embedding(latents.to(self.dtype)).flatten(2).transpose(1, 2)  # [B, S, C]
        rope = self._rope(grid, x.device)
        temb, mod = self.condition_embedder.time(timestep, self.dtype)
        layout = self.attention.layout_for(grid, x.device)
        if layout is not None:  # sparse backend: tile-major token order, once per forward
            x = layout.permute(x, dim=1)
            rope = layout.permute(rope, dim=1)
            if mod.dim() == 4:  # per-token modulation [B, S, 6, C]; temb stays raster (used after unpermute)
                mod = layout.permute(mod, dim=1)
        return x, rope, temb, mod, grid, layout

    def _meta(self, grid, layout, i: int, step_index, num_steps) -> AttentionMetadata | None:
        if not self.attention.sparse:
            return None
        return AttentionMetadata(grid=grid, step_index=step_index, num_steps=num_steps, layer_index=i, layout=layout)

    def _head(self, x: torch.Tensor, pending, temb: torch.Tensor, grid, layout) -> torch.Tensor:
        """[B, S, C] (layout order) and the last block's pending residual -> prediction [B, C_out, F, H, W]."""
        x = settle(x, pending)
        if layout is not None:
            x = layout.unpermute(x, dim=1)
        if temb.dim() == 3:  # per-token: [B, S, C]
            shift, scale = (self.scale_shift_table.unsqueeze(0) + temb.unsqueeze(2)).unbind(2)
        else:
            shift, scale = (self.scale_shift_table + temb.unsqueeze(1)).unsqueeze(2).unbind(1)
        x = (fp32_layer_norm(x, self.norm_out) * (1 + scale) + shift).type_as(x)
        x = self.proj_out(x)  # [B, S, C_out * pt * ph * pw]
        B = x.shape[0]
        T, H, W = grid
        pt, ph, pw = self.config.patch_size
        x = x.view(B, T, H, W, pt, ph, pw, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
        return x.reshape(B, -1, T * pt, H * ph, W * pw)

    def forward(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        text: torch.Tensor,
        *,
        step_index: int | None = None,
        num_steps: int | None = None,
    ) -> torch.Tensor:
        """latents [B, C_in, F, H, W]; timestep [B] (or per-token [B, S]); text [B, L, text_dim]
        -> prediction [B, C_out, F, H, W] in the dtype of the model."""
        x, rope, temb, mod, grid, layout = self._embed(latents, timestep)
        fused_ok = fused.usable(x)  # eager: the compiled blocks only see the resulting bool
        contexts = self._contexts((text,), fused_ok)
        x, pending = self._blocks(0, x, None, contexts, mod, rope, grid, layout, fused_ok, step_index, num_steps)
        return self._head(x, pending, temb, grid, layout)

    def _blocks(self, start: int, x, pending, contexts, mod, rope, grid, layout, fused_ok, step_index, num_steps):
        """Blocks ``start`` .. last on x [B, S, C] (and the previous block's pending residual) -> (x, pending);
        ``contexts``: one cross-attention input per block (:meth:`_contexts`)."""
        for i in range(start, len(self.blocks)):
            meta = self._meta(grid, layout, i, step_index, num_steps)
            x, pending = self.blocks[i](x, contexts[i], mod, rope, self.attention, meta, fused_ok=fused_ok,
                                        pending=pending)
        return x, pending

    def forward_cfg(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        text: torch.Tensor,
        text_uncond: torch.Tensor,
        *,
        batched: bool = True,
        step_index: int | None = None,
        num_steps: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The conditional and unconditional predictions of one CFG step, as ``forward(latents, timestep, text)``
        and ``forward(latents, timestep, text_uncond)`` would give them.

        The two passes see the same latents and timestep, and the text enters a Wan block only at its
        cross-attention, so everything up to the first block's cross-attention (patch and time embeddings, the
        first self-attention with its projections and norms) is computed once, at batch 1. The passes then run
        as one batch of 2 (``batched``) or one after the other (less memory).

        latents [1, C_in, F, H, W]; timestep [1] (or per-token [1, S]); text, text_uncond [1, L, text_dim]
        -> (cond, uncond), each [1, C_out, F, H, W].
        """
        if latents.shape[0] != 1 or text.shape[0] != 1 or text_uncond.shape[0] != 1:
            raise ValueError(
                f"forward_cfg takes one sample: latents batch {latents.shape[0]}, text batch {text.shape[0]}, "
                f"text_uncond batch {text_uncond.shape[0]} (each must be 1); call forward() for batches."
            )
        if text.shape[1:] != text_uncond.shape[1:]:
            raise ValueError(
                f"forward_cfg: text {tuple(text.shape)} and text_uncond {tuple(text_uncond.shape)} must have the same "
                "length and width (the pipeline pads both prompts to the same number of tokens); pad them equally."
            )
        x, rope, temb, mod, grid, layout = self._embed(latents, timestep)
        fused_ok = fused.usable(x)
        video_half, text_half = self._first_halves or (self.blocks[0].video_half, self.blocks[0].text_half)
        attn = self.attention
        x, h, pending = video_half(x, mod, rope, attn, self._meta(grid, layout, 0, step_index, num_steps), fused_ok)

        def rest(x, h, ctx):
            x, p = text_half(x, h, pending, ctx[0], mod, attn, fused_ok)
            x, p = self._blocks(1, x, p, ctx, mod, rope, grid, layout, fused_ok, step_index, num_steps)
            return self._head(x, p, temb, grid, layout)

        if batched:
            return rest(torch.cat([x, x]), torch.cat([h, h]), self._contexts((text, text_uncond), fused_ok)).chunk(2)
        both = None if self.text_kv_cache else self._text_context((text, text_uncond))  # one embedder call
        ctx = [self._contexts((t,), fused_ok, None if both is None else both[i:i + 1])
               for i, t in enumerate((text, text_uncond))]
        # with the residual adds in the GEMMs the passes update x in place: the first gets its own copy
        first_x = x.clone() if pending is not None and len(pending) == 1 else x
        return rest(first_x, h, ctx[0]), rest(x, h, ctx[1])
