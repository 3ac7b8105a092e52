"""The Wan DiT (Wan2.1 T2V, Wan2.2 T2V-A14B experts, Wan2.2 TI2V-5B) with Diffusers' parameter names."""
from fastwan.models.wan.config import WanConfig
from fastwan.models.wan.loading import load_transformer
from fastwan.models.wan.transformer import WanTransformer, keep_in_fp32

__all__ = ["WanConfig", "WanTransformer", "keep_in_fp32", "load_transformer"]
