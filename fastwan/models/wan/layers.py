"""The Wan DiT's small parts: fp32 norms, RoPE, timestep embedding, the FFN and the time/text embedder.

Parameter names follow the Diffusers ``WanTransformer3DModel`` state dict. Modules that Diffusers keeps in fp32
(time embedder, modulation tables, norms) stay fp32 (:func:`keep_in_fp32`).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from fastwan.errors import InvalidArgument
from fastwan.models.wan.config import WanConfig

# Parameter-name components kept in fp32 whatever the model dtype (as Diffusers does for Wan).
KEEP_IN_FP32 = ("time_embedder", "scale_shift_table", "norm1", "norm2", "norm3", "motion_synthesis_weight")


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
                theta: float = 10000.0, start: int = 0) -> torch.Tensor:
    """3D RoPE table for a (T, H, W) token grid -> fp32 [1, T*H*W, 1, 2 * head_dim]; ``start``: the first frame's
    position (a causal stream's chunk at frame ``start``; positions past ``max_len`` follow the same formula, so a
    stream has no length limit, while one grid's own sizes stay within ``max_len``).

    The head dim is split t/h/w as Wan does: h = w = 2*(D//6), t = D - h - w; each interleaved channel pair
    (2i, 2i+1) rotates by the angle of its axis position (angles in fp64, stored fp32). The table holds
    ``cos`` repeated per pair (first D) and ``sin`` signed for the pair swap (-sin, +sin) (last D), so the
    rotation is two contiguous multiply-adds (see :func:`fastwan.kernels.norms.apply_rope`).
    """
    T, H, W = grid
    for name, n in zip("THW", grid):
        if n > max_len:
            raise InvalidArgument(f"token grid {name}={n} exceeds rope_max_seq_len={max_len} of this checkpoint; "
                                  "make the video smaller along that axis.")
    hw = 2 * (head_dim // 6)
    dims = (head_dim - 2 * hw, hw, hw)
    angles = []
    for axis, (n, d, shape) in enumerate(zip(grid, dims, ((T, 1, 1), (1, H, 1), (1, 1, W)))):
        inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=device)[: d // 2] / d))
        first = start if axis == 0 else 0
        a = torch.outer(torch.arange(first, first + n, dtype=torch.float64, device=device), inv)  # [n, d/2]
        angles.append(a.view(*shape, d // 2).expand(T, H, W, d // 2))
    ang = torch.cat(angles, dim=-1).reshape(1, T * H * W, 1, head_dim // 2)
    cos = ang.cos().repeat_interleave(2, dim=-1)
    sin = torch.stack((-ang.sin(), ang.sin()), dim=-1).flatten(-2)
    return torch.cat((cos, sin), dim=-1).float()


def linear_gelu_tanh(x: torch.Tensor, lin: nn.Linear) -> torch.Tensor:
    """GELU(tanh)(x @ W^T + b), x: [..., in] -> [..., out], with the bias and GELU in the GEMM's epilogue on CUDA
    (cuBLASLt through ``torch._addmm_activation``, kept as one extern kernel by torch.compile), so the
    [tokens, ffn_dim] activation is written once. Elsewhere (``_addmm_activation`` uses the erf GELU on CPU; an
    FP8 layer's GEMM has no GELU epilogue) the layer + GELU(tanh)."""
    if x.is_cuda and isinstance(lin, nn.Linear) and lin.bias is not None and x.dtype == lin.weight.dtype:
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[2](F.gelu(self.net[0].proj(x), approximate="tanh"))


class ImageEmbedding(nn.Module):
    """CLIP image tokens -> the DiT's width: fp32 LayerNorm, Linear -> GELU (erf) -> Linear, fp32 LayerNorm, with
    Diffusers' names (norm1, ff.net.0.proj, ff.net.2, norm2, pos_embed). With ``pos_embed`` (first-last-frame
    checkpoints) the two images' tokens, stacked on the batch, are joined into one sequence first."""

    def __init__(self, in_dim: int, dim: int, pos_embed_seq_len: int | None):
        super().__init__()
        self.norm1 = nn.LayerNorm(in_dim)
        proj = nn.Module()
        proj.proj = nn.Linear(in_dim, in_dim)
        self.ff = nn.Module()
        self.ff.net = nn.ModuleList([proj, nn.Identity(), nn.Linear(in_dim, dim)])
        self.norm2 = nn.LayerNorm(dim)
        self.pos_embed = None if pos_embed_seq_len is None else nn.Parameter(torch.zeros(1, pos_embed_seq_len, in_dim))

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        """image [B, N, image_dim] (with pos_embed: [2B, N, image_dim]) -> [B, N or 2N, C] in image's dtype."""
        if self.pos_embed is not None:
            image = image.reshape(-1, 2 * image.shape[1], image.shape[2]) + self.pos_embed
        h = fp32_layer_norm(image, self.norm1).to(image.dtype)
        h = self.ff.net[2](F.gelu(self.ff.net[0].proj(h)))
        return fp32_layer_norm(h, self.norm2).to(image.dtype)


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
        self.image_embedder = None if cfg.image_dim is None else ImageEmbedding(cfg.image_dim, dim,
                                                                              cfg.pos_embed_seq_len)

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
