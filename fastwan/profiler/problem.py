"""The profiler's problem: ``B`` videos x ``H`` heads x head dim ``D`` over a (T, H, W) token grid, given directly
or derived from a Wan model preset and a video resolution."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from fastwan.errors import CheckpointError, InvalidArgument, InvalidArgumentType


@dataclass(frozen=True)
class ModelPreset:
    heads: int
    head_dim: int
    vae_stride: int  # pixels per latent (spatial)
    patch: int  # latent patches per token (spatial)
    default_size: tuple[int, int, int]  # height, width, frames
    vae_temporal: int = 4  # frames per latent frame after the first (4 for every Wan VAE)
    patch_t: int = 1  # latent frames per token
    max_grid: int | None = None  # tokens per axis the DiT's RoPE covers (None: not checked)

    @property
    def pixels_per_token(self) -> int:
        return self.vae_stride * self.patch


MODELS = MappingProxyType({
    "wan2.1-1.3b": ModelPreset(12, 128, 8, 2, (480, 832, 81)),
    "wan2.1-14b": ModelPreset(40, 128, 8, 2, (720, 1280, 81)),
    "wan2.2-a14b": ModelPreset(40, 128, 8, 2, (720, 1280, 81)),
    "wan2.2-ti2v-5b": ModelPreset(24, 128, 16, 2, (704, 1280, 121)),
})


def model_preset(model: str) -> ModelPreset:
    """A preset name (:data:`MODELS`, nothing read), else what ``fastwan generate --model`` takes that is on this
    machine: a tiny model name or a Diffusers-format folder, read from its configs (no weights load). Anything
    else raises a user error naming the choices."""
    if not isinstance(model, str):
        raise InvalidArgumentType(f"model={model!r} must be a string (a preset, tiny model name or folder).")
    if model in MODELS:
        return MODELS[model]
    from fastwan.checkpoint.tiny import TINY_IDS

    if model in TINY_IDS or (model.strip() and Path(model).expanduser().exists()):
        return _checkpoint_preset(model)
    from fastwan.checkpoint.safetensors import HUB_MODEL_ID

    hub = " Hub ids are not downloaded here: download the checkpoint and pass its folder." if HUB_MODEL_ID.match(
        model) else ""
    raise InvalidArgument(
        f"--model {model!r} is not a preset ({', '.join(MODELS)}), not a tiny model ({', '.join(TINY_IDS)}) and "
        f"not a folder that exists.{hub} Pass one of those, or give the token grid with -i T H W."
    )


def _checkpoint_preset(model: str) -> ModelPreset:
    """The attention problem of a checkpoint ``fastwan.checkpoint.resolver.resolve`` accepts, at its preset size."""
    from fastwan.checkpoint.safetensors import read_json
    from fastwan.checkpoint.resolver import resolve
    from fastwan.vae.decode import scale_factors

    ckpt = resolve(model)
    cfg = ckpt.transformer_config
    vt, vs = scale_factors(read_json(ckpt.folder("vae") / "config.json", missing="the vae component needs it."))
    pt, ph, pw = cfg.patch_size
    if ph != pw:
        raise CheckpointError(f"{model}: patch_size {list(cfg.patch_size)} has different height and width patches; "
                              "the profiler takes square patches (give the token grid with -i T H W instead).")
    size = (ckpt.preset.height, ckpt.preset.width, ckpt.preset.num_frames)
    return ModelPreset(cfg.num_attention_heads, cfg.attention_head_dim, vs, ph, size, vt, pt, cfg.rope_max_seq_len)


def model_grid(model: str | ModelPreset, height: int, width: int, num_frames: int, *,
               name: str | None = None) -> tuple[int, int, int]:
    """Token grid (T, H, W) of a Wan model at a resolution, as the DiT sees it: T = ((F-1)//4 + 1) // time patch,
    H = height // (vae*patch); the sizes must meet ``fastwan generate``'s rules
    (:func:`fastwan.pipelines.inputs.check_video_size`)."""
    from fastwan.pipelines.inputs import check_video_size

    preset = model_preset(model) if isinstance(model, str) else model
    try:
        return check_video_size(height, width, num_frames, vae_factors=(preset.vae_temporal, preset.vae_stride),
                                patch=(preset.patch_t, preset.patch, preset.patch), max_grid=preset.max_grid)
    except (InvalidArgument, InvalidArgumentType) as exc:  # name the model the rule came from
        name = name or (model if isinstance(model, str) else "this model")
        raise type(exc)(f"{name}: {exc}") from None


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
