"""The profiler's problem: ``B`` videos x ``H`` heads x head dim ``D`` over a (T, H, W) token grid, given directly
or derived from a Wan model preset and a video resolution."""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch


@dataclass(frozen=True)
class ModelPreset:
    heads: int
    head_dim: int
    vae_stride: int  # pixels per latent (spatial)
    patch: int  # latent patches per token (spatial)
    default_size: tuple[int, int, int]  # height, width, frames

    @property
    def pixels_per_token(self) -> int:
        return self.vae_stride * self.patch


MODELS = MappingProxyType({
    "wan2.1-1.3b": ModelPreset(12, 128, 8, 2, (480, 832, 81)),
    "wan2.1-14b": ModelPreset(40, 128, 8, 2, (720, 1280, 81)),
    "wan2.2-a14b": ModelPreset(40, 128, 8, 2, (720, 1280, 81)),
    "wan2.2-ti2v-5b": ModelPreset(24, 128, 16, 2, (704, 1280, 121)),
})
TEMPORAL_STRIDE = 4


def model_grid(model: str, height: int, width: int, num_frames: int) -> tuple[int, int, int]:
    """Token grid (T, H, W) of a Wan model at a resolution: T = (F-1)//4 + 1, H = height // (vae*patch)."""
    preset = MODELS[model]
    px = preset.pixels_per_token
    for what, value in (("height", height), ("width", width)):
        if value <= 0 or value % px:
            raise ValueError(f"{what}={value} must be a positive multiple of {px} for {model} ({px} pixels per token).")
    if num_frames < 1 or (num_frames - 1) % TEMPORAL_STRIDE:
        raise ValueError(f"num_frames={num_frames} must be 4k+1 (e.g. 81, 121) for Wan's temporal VAE stride 4.")
    return ((num_frames - 1) // TEMPORAL_STRIDE + 1, height // px, width // px)


@dataclass(frozen=True)
class Problem:
    batch: int
    heads: int
    head_dim: int
    grid: tuple[int, int, int]
    dtype: torch.dtype
    device: torch.device

    @property
    def tokens(self) -> int:
        t, h, w = self.grid
        return t * h * w

    @property
    def flops(self) -> float:
        """Dense attention FLOPs: QK^T and PV, 2 multiply-adds each: 4 * B * H * S^2 * D."""
        return 4.0 * self.batch * self.heads * self.tokens**2 * self.head_dim

    def as_dict(self) -> dict[str, Any]:
        return {
            "batch": self.batch, "heads": self.heads, "head_dim": self.head_dim, "grid": list(self.grid),
            "tokens": self.tokens, "dtype": str(self.dtype).replace("torch.", ""), "device": str(self.device),
            "gflop": self.flops / 1e9,
        }
