"""TORCH_SDPA: PyTorch's scaled_dot_product_attention, with an optional pinned kernel."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fastwan import envs
from fastwan.attention.base import AttentionBackend, AttentionMetadata, Capabilities

_KERNELS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


class TorchSDPABackend(AttentionBackend):
    name = "TORCH_SDPA"
    capabilities = Capabilities()

    def __init__(self, kernel: str | None = None):
        kernel = (kernel or envs.sdpa_kernel()).lower()
        if kernel not in envs.SDPA_KERNELS:
            raise ValueError(f"SDPA kernel {kernel!r} is unknown; use one of {', '.join(envs.SDPA_KERNELS)}.")
        self.kernel = kernel

    def reasons(self, *, device, dtype, head_dim, seq_q=None, seq_kv=None):
        reasons = super().reasons(device=device, dtype=dtype, head_dim=head_dim, seq_q=seq_q, seq_kv=seq_kv)
        device = torch.device(device)
        if self.kernel in ("flash", "cudnn") and device.type != "cuda":
            reasons.append(f"SDPA kernel '{self.kernel}' needs a CUDA device (got {device.type})")
        if self.kernel in ("flash", "cudnn") and dtype not in (torch.float16, torch.bfloat16):
            reasons.append(f"SDPA kernel '{self.kernel}' needs float16/bfloat16 (got {dtype})")
        return reasons

    def kernel_name(self, device=None) -> str:
        return f"torch.sdpa[{self.kernel}]"

    def forward(self, q, k, v, *, scale=None, meta: AttentionMetadata | None = None):
        # SDPA wants [B, H, S, D]; transposes are views, SDPA handles the strides.
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.kernel == "auto":
            out = F.scaled_dot_product_attention(qt, kt, vt, scale=scale)
        else:
            with sdpa_kernel(_KERNELS[self.kernel]):
                out = F.scaled_dot_product_attention(qt, kt, vt, scale=scale)
        return out.transpose(1, 2)
