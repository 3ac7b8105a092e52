"""TORCH_SDPA: PyTorch's scaled_dot_product_attention, with an optional pinned kernel.

``kernel=`` (or ``FASTWAN_SDPA_KERNEL``) is auto | flash | cudnn | efficient | math. A pinned kernel runs
only that kernel (PyTorch raises rather than falls back), so :meth:`TorchSDPABackend.reasons` says up front
why it cannot run: the per-kernel limits below are data, and on a CUDA device PyTorch's own
``torch.backends.cuda.can_use_*`` checks are asked too (their explanation becomes the reason).
On CPU only 'flash' (PyTorch's CPU flash kernel) and 'math' exist.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fastwan.errors import InvalidArgument
from fastwan import envs
from fastwan.attention.base import AttentionBackend, AttentionMetadata, Capabilities, reasons_cannot_run

_KERNELS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}

_HALF = (torch.float16, torch.bfloat16)
_ALL = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# Limits of each pinned kernel, per device type (no entry: the kernel does not exist there).
KERNEL_CAPABILITIES: dict[str, dict[str, Capabilities]] = {
    "auto": {"cpu": Capabilities(dtypes=_ALL), "cuda": Capabilities(dtypes=_ALL)},
    "math": {"cpu": Capabilities(dtypes=_ALL), "cuda": Capabilities(dtypes=_ALL)},
    "flash": {
        "cpu": Capabilities(dtypes=_ALL),
        "cuda": Capabilities(dtypes=_HALF, max_head_dim=256, head_dim_multiple=8, min_compute_capability=(8, 0)),
    },
    "cudnn": {"cuda": Capabilities(dtypes=_HALF, max_head_dim=256, head_dim_multiple=8, min_compute_capability=(8, 0))},
    "efficient": {"cuda": Capabilities(dtypes=(*_HALF, torch.float32), min_compute_capability=(5, 0))},
}

_PROBES = {
    "flash": "can_use_flash_attention",
    "cudnn": "can_use_cudnn_attention",
    "efficient": "can_use_efficient_attention",
}


def _probe(kernel: str, device: torch.device, dtype: torch.dtype, head_dim: int, seq_q, seq_kv) -> str | None:
    """Ask PyTorch whether ``kernel`` accepts this problem on a CUDA device; its warning text is the reason."""
    fn = getattr(torch.backends.cuda, _PROBES[kernel], None)
    params_cls = getattr(torch.backends.cuda, "SDPAParams", None)
    if fn is None or params_cls is None:
        return None
    sq, skv = min(seq_q or 128, 128), min(seq_kv or seq_q or 128, 128)  # limits do not depend on length
    try:
        q = torch.empty(1, 1, sq, head_dim, device=device, dtype=dtype)
        kv = torch.empty(1, 1, skv, head_dim, device=device, dtype=dtype)
        try:
            params = params_cls(q, kv, kv, None, 0.0, False, False)
        except TypeError:  # older signature without enable_gqa
            params = params_cls(q, kv, kv, None, 0.0, False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ok = fn(params, debug=True)
    except RuntimeError as exc:  # the probe itself failed: the declared limits above still apply
        return f"could not ask PyTorch whether SDPA kernel '{kernel}' runs here: {exc}"
    if ok:
        return None
    detail = "; ".join(str(w.message).strip() for w in caught) or "no detail given"
    return f"PyTorch says SDPA kernel '{kernel}' cannot run this problem: {detail}"


class TorchSDPABackend(AttentionBackend):
    name = "TORCH_SDPA"
    capabilities = Capabilities(dtypes=_ALL)
    KEYS = ("kernel",)

    def __init__(self, kernel: str | None = None):
        shown = kernel
        kernel = envs.sdpa_kernel() if kernel is None else kernel  # None: FASTWAN_SDPA_KERNEL, else auto
        if not isinstance(kernel, str) or kernel.strip().lower() not in envs.SDPA_KERNELS:
            raise InvalidArgument(f"SDPA kernel {shown!r} is unknown; use one of {', '.join(envs.SDPA_KERNELS)} "
                                  "(or leave it unset for FASTWAN_SDPA_KERNEL, default auto).")
        self.kernel = kernel.strip().lower()

    def reasons(self, *, device, dtype, head_dim, seq_q=None, seq_kv=None):
        device = torch.device(device)
        reasons = super().reasons(device=device, dtype=dtype, head_dim=head_dim, seq_q=seq_q, seq_kv=seq_kv)
        per_device = KERNEL_CAPABILITIES[self.kernel]
        caps = per_device.get(device.type)
        if caps is None:
            where = " or ".join(per_device)
            reasons.append(f"SDPA kernel '{self.kernel}' does not exist on {device.type} (only on {where})")
            return reasons
        for r in reasons_cannot_run(caps, device=device, dtype=dtype, head_dim=head_dim):
            r = f"SDPA kernel '{self.kernel}': {r}"
            if r not in reasons:
                reasons.append(r)
        if not reasons and device.type == "cuda" and self.kernel in _PROBES:
            why = _probe(self.kernel, device, dtype, head_dim, seq_q, seq_kv)
            if why:
                reasons.append(why)
        return reasons

    def kernel_name(self, device=None) -> str:
        return f"torch.sdpa[{self.kernel}]"

    def version_info(self, device=None) -> str | None:
        return f"torch {torch.__version__}"

    def forward(self, q, k, v, *, scale=None, meta: AttentionMetadata | None = None):
        """q: [B, Sq, H, D], k/v: [B, Skv, H, D] -> [B, Sq, H, D]."""
        # SDPA wants [B, H, S, D]; transposes are views, SDPA handles the strides.
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.kernel == "auto":
            out = F.scaled_dot_product_attention(qt, kt, vt, scale=scale)
        else:
            with sdpa_kernel(_KERNELS[self.kernel]):
                out = F.scaled_dot_product_attention(qt, kt, vt, scale=scale)
        return out.transpose(1, 2)
