"""One dataclass config for the Wan DiT, read from a Diffusers ``transformer/config.json``."""
from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

WAN_CLASS_NAMES = ("WanTransformer3DModel",)


@dataclass(frozen=True)
class WanConfig:
    """Hyper-parameters of ``WanTransformer3DModel`` (the Diffusers names and defaults)."""

    patch_size: tuple[int, int, int] = (1, 2, 2)
    num_attention_heads: int = 40
    attention_head_dim: int = 128
    in_channels: int = 16
    out_channels: int = 16
    text_dim: int = 4096
    freq_dim: int = 256
    ffn_dim: int = 13824
    num_layers: int = 40
    cross_attn_norm: bool = True
    qk_norm: str | None = "rms_norm_across_heads"
    eps: float = 1e-6
    image_dim: int | None = None
    added_kv_proj_dim: int | None = None
    rope_max_seq_len: int = 1024
    pos_embed_seq_len: int | None = None

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config") -> WanConfig:
        name = raw.get("_class_name")
        if name not in WAN_CLASS_NAMES:
            raise ValueError(
                f"{source} describes {name!r}, not a Wan DiT (expected _class_name in {WAN_CLASS_NAMES}). "
                "Point fastwan at a Wan2.1/Wan2.2 checkpoint in the Diffusers layout."
            )
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in raw.items() if k in known}
        if "patch_size" in kwargs:
            kwargs["patch_size"] = tuple(kwargs["patch_size"])
        cfg = cls(**kwargs)
        if cfg.image_dim is not None or cfg.added_kv_proj_dim is not None:
            raise ValueError(
                f"{source} is an image-to-video Wan DiT (image_dim={cfg.image_dim}, "
                f"added_kv_proj_dim={cfg.added_kv_proj_dim}); fastwan runs text-to-video checkpoints "
                "(Wan2.1-T2V, Wan2.2-T2V-A14B, Wan2.2-TI2V-5B in text mode)."
            )
        if cfg.qk_norm not in ("rms_norm_across_heads",):
            raise ValueError(f"{source}: qk_norm={cfg.qk_norm!r} is not supported (Wan uses 'rms_norm_across_heads').")
        if len(cfg.patch_size) != 3:
            raise ValueError(f"{source}: patch_size={cfg.patch_size!r} must have 3 entries (t, h, w).")
        return cfg

    @classmethod
    def from_file(cls, path: str | Path) -> WanConfig:
        from fastwan.models.loading import read_json

        raw = read_json(path, missing="a Diffusers Wan transformer folder needs config.json.")
        return cls.from_dict(raw, source=str(path))
