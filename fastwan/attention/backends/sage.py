"""SAGE_ATTN: SageAttention (INT8-quantized QK^T, smoothed K). Lossy: never picked automatically.

Per release line, what it supports is data (:data:`SAGE_VARIANTS`): 1.x is Triton kernels (INT8 QK, fp16 PV)
checked on sm80/sm86/sm89/sm90 with head dims 64/96/128; 2.x dispatches compiled CUDA kernels per
architecture (sm80, sm86, sm89, sm90, sm120, sm121) and pads head dims up to 128.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fastwan.attention.backends import packages
from fastwan.attention.backends import ops as _ops  # noqa: F401  (registers torch.ops.fastwan.*)
from fastwan.attention.base import (
    AttentionBackend, AttentionMetadata, Capabilities, cuda_capability, reasons_cannot_run,
)

INSTALL = (
    "pip install sageattention==1.0.6 (needs triton), or build SageAttention 2 from github.com/thu-ml/SageAttention"
)


@dataclass(frozen=True)
class SageVariant:
    label: str
    capabilities: Capabilities
    verified_on: tuple[tuple[int, int], ...] = ()  # GPUs on which fastwan's GPU tests and benchmarks ran it


SAGE_VARIANTS: dict[int, SageVariant] = {
    1: SageVariant(
        "Triton INT8 QK, fp16 PV",
        Capabilities(
            device_types=("cuda",),
            dtypes=(torch.float16, torch.bfloat16),
            head_dims=(64, 96, 128),
            compute_capabilities=((8, 0), (8, 6), (8, 9), (9, 0)),
            packages=(("triton", "pip install triton"),),
        ),
        verified_on=((9, 0),),
    ),
    2: SageVariant(
        "CUDA INT8 QK, fp8/fp16 PV",
        Capabilities(
            device_types=("cuda",),
            dtypes=(torch.float16, torch.bfloat16),
            max_head_dim=128,
            compute_capabilities=((8, 0), (8, 6), (8, 9), (9, 0), (12, 0), (12, 1)),
        ),
    ),
}


class SageAttnBackend(AttentionBackend):
    name = "SAGE_ATTN"
    capabilities = Capabilities(
        device_types=("cuda",),
        dtypes=(torch.float16, torch.bfloat16),
        max_head_dim=128,
        packages=(("sageattention", INSTALL),),
    )
    KEYS = ()  # takes no settings

    def reasons(self, *, device, dtype, head_dim, seq_q=None, seq_kv=None) -> list[str]:
        reasons = super().reasons(device=device, dtype=dtype, head_dim=head_dim, seq_q=seq_q, seq_kv=seq_kv)
        major = packages.sage_major()
        if major is None:
            return reasons
        variant = SAGE_VARIANTS.get(major)
        if variant is None:
            return reasons + [f"sageattention {packages.sage_package_version()} is not a supported release (1.x, 2.x)"]
        for r in reasons_cannot_run(variant.capabilities, device=device, dtype=dtype, head_dim=head_dim):
            r = f"sageattention {major}.x: {r}"
            if r not in reasons:
                reasons.append(r)
        if not reasons:  # it could run here: make sure the installed package loads
            err = packages.sage_import_error()
            if err:
                reasons.append(f"sageattention is installed but does not import ({err})")
        return reasons

    def unverified(self, device, head_dim=None) -> str | None:
        device = torch.device(device)
        major = packages.sage_major()
        if device.type != "cuda" or major not in SAGE_VARIANTS:
            return None
        cc = cuda_capability(device)[0]
        if cc is None or cc in SAGE_VARIANTS[major].verified_on:
            return None
        return f"sageattention {major}.x has not been run by fastwan on sm{cc[0]}{cc[1]} (only against CPU fakes)"

    def kernel_name(self, device=None) -> str:
        major = packages.sage_major()
        if major is None:
            return f"{self.name} (sageattention not installed)"
        label = SAGE_VARIANTS[major].label if major in SAGE_VARIANTS else "unknown release"
        return f"sageattention {packages.sage_package_version() or major} sageattn ({label})"

    def version_info(self, device=None) -> str | None:
        return packages.sage_package_version() if packages.sage_installed() else None

    def forward(self, q, k, v, *, scale=None, meta: AttentionMetadata | None = None):
        """q: [B, Sq, H, D], k/v: [B, Skv, H, D] (fp16/bf16, CUDA) -> [B, Sq, H, D]."""
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        return torch.ops.fastwan.sage_attn(q, k, v, scale)
