"""Wan DiT written for fastwan, loading Diffusers-format checkpoints directly."""
from fastwan.models.wan import WanConfig, WanTransformer, keep_in_fp32, load_transformer

__all__ = ["WanConfig", "WanTransformer", "keep_in_fp32", "load_transformer"]
