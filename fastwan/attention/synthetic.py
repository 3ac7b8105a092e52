"""Synthetic Wan-like attention inputs for tests, the profiler and benchmarks.

Video tokens are spatially correlated: neighbouring latent patches carry similar features. Random iid q/k/v
make attention unrealistically flat and its output unrealistically small, which exaggerates every kernel's
relative error. Here a smooth random field over the (T, H, W) token grid plus per-token noise is projected to
q, k, v; q and k are RMS-normalised per head like Wan's qk-norm and scaled by a norm weight with a few
outlier channels (the case block-scaled FP4/INT8 quantizers find hardest).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def grid_tokens(grid: tuple[int, int, int]) -> int:
    t, h, w = grid
    return t * h * w


def wan_like_qkv(
    grid: tuple[int, int, int],
    heads: int,
    head_dim: int,
    *,
    batch: int = 1,
    kv_len: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    outliers: int = 2,
    outlier_gain: float = 4.0,
    noise: float = 0.5,
    channels: int = 64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [B, S, H, D] and k, v [B, S or kv_len, H, D] with S = T*H*W tokens in Wan's (t, h, w) order.

    ``kv_len`` (cross-attention) draws k/v from iid "text" features of that length instead of the grid.
    The data is generated in fp32 on ``device`` (deterministic for a seed) and cast to ``dtype``.
    """
    g = torch.Generator(device="cpu").manual_seed(seed)
    t, h, w = grid

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device)

    low = rand(batch, channels, max(t // 2, 1), max(h // 4, 1), max(w // 4, 1))
    field = F.interpolate(low, size=(t, h, w), mode="trilinear", align_corners=False)
    x = field.flatten(2).transpose(1, 2)  # [B, S, C]
    x = x / x.std().clamp_min(1e-6)
    x = x + noise * rand(*x.shape)
    text = rand(batch, kv_len, channels) if kv_len is not None else x

    def project(src: torch.Tensor, normed: bool) -> torch.Tensor:
        wmat = rand(channels, heads * head_dim) / math.sqrt(channels)
        y = (src @ wmat).unflatten(-1, (heads, head_dim))
        if normed:
            y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)
            gamma = 1 + 0.1 * rand(heads, head_dim)
            if outliers:
                idx = torch.randint(0, head_dim, (heads, outliers), generator=g).to(device)
                gamma.scatter_(1, idx, outlier_gain)
            y = y * gamma
        return y

    q, k, v = project(x, True), project(text, True), project(text, False)
    return q.to(dtype).contiguous(), k.to(dtype).contiguous(), v.to(dtype).contiguous()


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None):
    """Plain softmax(q k^T * scale) v in float64 (on q's device): [B, Sq, H, D] -> [B, Sq, H, D] float64."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    qd, kd, vd = (x.double().transpose(1, 2) for x in (q, k, v))
    p = torch.softmax((qd @ kd.transpose(-1, -2)) * scale, dim=-1)
    return (p @ vd).transpose(1, 2)
