"""The one seam between the DiT and the attention backends.

A DiT holds one :class:`AttentionDispatch`. Self-attention goes to ``self_backend`` (dense or sparse);
cross-attention (video queries vs. text keys) always goes to a dense backend. A sparse backend also supplies
the :class:`~fastwan.attention.sparse.layout.TokenLayout` that the DiT applies once per forward (its compact
order: the DiT's stream holds no dummy slots, and the dispatch pads q, k, v to the slots around each call).
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from typing import Any

import torch

from fastwan.attention.base import TOKEN_EXTRAS, AttentionBackend, AttentionMetadata, check_qkv
from fastwan.attention.registry import auto_backend, resolve_backend
from fastwan.errors import InvalidArgument, InvalidArgumentType


class AttentionDispatch:
    def __init__(self, self_backend: AttentionBackend, cross_backend: AttentionBackend | None = None):
        # backends are duck-typed here: an object without these attributes is a plain dense backend
        if cross_backend is None and getattr(self_backend, "self_attention_only", False):
            raise InvalidArgument(f"{self_backend.name} serves self-attention only; pass a dense backend (e.g. "
                                  "create_backend('TORCH_SDPA')) as cross_backend, or build the dispatch with "
                                  "AttentionDispatch.resolve.")
        if cross_backend is None:
            cross_backend = self_backend
        if cross_backend.sparse:
            raise InvalidArgument(f"cross-attention needs a dense backend, got sparse {cross_backend.name}; pass a "
                                  "dense one (e.g. create_backend('TORCH_SDPA')) as cross_backend.")
        self.self_backend = self_backend
        self.cross_backend = cross_backend
        # a hybrid schedule: the first / last steps' self-attention runs on the cross backend (step_meta)
        steps = getattr(self_backend, "lossless_steps", None)
        self.lossless_steps = steps() if steps is not None else (0, 0)
        # A sparse backend's call runs outside torch.compile graphs (one graph break per block): its block tables
        # are cached per (grid, config, step, layer) in Python objects and VSA builds its table from a top-k on
        # every call; none of that traces as a static graph. The work around the call (norms, RoPE, projections,
        # FFN) is still compiled, and the kernels are the ones eager mode runs. torch.compiler.disable imports
        # dynamo, so it is applied here, when a sparse dispatch is built, never at ``import fastwan``.
        self._sparse_call = torch.compiler.disable(_call_with_meta) if self_backend.sparse else None

    @classmethod
    def resolve(
        cls,
        requested: AttentionBackend | str | None,
        *,
        device: torch.device | str,
        dtype: torch.dtype,
        head_dim: int,
        config: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        model: Any = None,
        source: str | None = None,
    ) -> AttentionDispatch:
        """The backends for a DiT; ``model`` (its transformer config: ``num_attention_heads``, ``num_layers``), when
        given, lets a sparse backend check its per-head and per-layer settings against the DiT now; ``source``: as
        in :func:`resolve_backend`."""
        backend = resolve_backend(requested, device=device, dtype=dtype, head_dim=head_dim, config=config, env=env,
                                  source=source)
        if backend.sparse and model is not None:
            backend.check_model(model.num_attention_heads, model.num_layers)
        cross = None
        if backend.sparse or backend.self_attention_only:
            # sparse (and self-attention-only) backends serve self-attention; text cross-attention, and a hybrid
            # schedule's lossless steps, pick the best dense kernel
            cross = auto_backend(device=device, dtype=dtype, head_dim=head_dim)
        return cls(backend, cross)

    @property
    def sparse(self) -> bool:
        return self.self_backend.sparse

    def describe(self, device: torch.device | str | None = None) -> str:
        """Human-readable name of the kernels that run, e.g. 'FLASH_ATTN (flash_attn.cute FA4 sm90)'."""
        s = f"{self.self_backend.name} ({self.self_backend.kernel_name(device)})"
        if self.cross_backend is not self.self_backend:
            hybrid = " and the lossless steps" if any(self.lossless_steps) else ""
            s += f"; cross-attention{hybrid} {self.cross_backend.name} ({self.cross_backend.kernel_name(device)})"
        return s

    def step_meta(self, step_index: int | None, num_steps: int | None) -> AttentionMetadata | None:
        """A dense dispatch's metadata for denoising step ``step_index`` of ``num_steps`` (computed by the DiT outside
        compiled code): None without a hybrid schedule; else whether the step is one of its lossless steps, the
        first ``first`` or the last ``last`` of :attr:`lossless_steps` (outside a loop, step_index None: no)."""
        first, last = self.lossless_steps
        if self.sparse or not (first or last):
            return None
        lossless = step_index is not None and (
            step_index < first or (num_steps is not None and step_index >= num_steps - last))
        return AttentionMetadata(lossless=lossless)

    def layout_for(self, grid: tuple[int, int, int], device: torch.device):
        """TokenLayout for a sparse backend (built once per grid, cached by the backend), else None."""
        if not self.sparse:
            return None
        return self.self_backend.layout(grid, device)

    def self_attention(self, q, k, v, meta: AttentionMetadata | None = None) -> torch.Tensor:
        """q, k, v: [B, S, H, D] -> [B, S, H, D]; for a sparse backend in the order ``meta`` says (the layout's
        slots, or its compact order with ``meta.compact``)."""
        if self._sparse_call is not None:
            return self._sparse_call(self.self_backend, q, k, v, meta)
        if meta is not None and meta.lossless:  # a hybrid schedule's lossless step
            return self.cross_backend(q, k, v)
        return self.self_backend(q, k, v, meta=None)

    def cross_attention(self, q, k, v) -> torch.Tensor:
        """q: [B, S, H, D]; k, v: [B, L, H, D] -> [B, S, H, D]."""
        return self.cross_backend(q, k, v)


def _call_with_meta(backend, q, k, v, meta):
    """``backend(q, k, v, meta=meta)``; compact tokens (``meta.compact``) padded to the layout's slots first and
    the output's dummy rows dropped."""
    if meta is None or not meta.compact:
        return backend(q, k, v, meta=meta)
    layout = meta.layout
    if layout is None:
        raise ValueError("AttentionMetadata(compact=True) needs its layout: the compact order is the layout's")
    q, k, v = (layout.pad_slots(t, 1) for t in (q, k, v))
    extra = {name: layout.pad_slots(t, 1) if name in TOKEN_EXTRAS else t for name, t in meta.extra.items()}
    meta = dataclasses.replace(meta, extra=extra, compact=False)
    return layout.drop_slots(backend(q, k, v, meta=meta), 1)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    backend: AttentionBackend | str | None = None,
    scale: float | None = None,
    config: Mapping[str, Any] | None = None,
) -> torch.Tensor:
    """Standalone attention: q [B, Sq, H, D], k/v [B, Skv, H, D] -> [B, Sq, H, D].

    ``backend`` (name or instance) > ``attention_backend()`` context > env var > automatic.
    """
    check_qkv(q, k, v)
    scale = _check_scale(scale)
    b = resolve_backend(
        backend, device=q.device, dtype=q.dtype, head_dim=q.shape[-1], config=config,
        seq_q=q.shape[1], seq_kv=k.shape[1],
    )
    if b.sparse:
        raise InvalidArgument(
            f"{b.name} is a sparse video backend: call it inside the DiT (it needs a token layout), "
            "or build its layout and call backend(q, k, v, meta=...) directly."
        )
    return b(q, k, v, scale=scale)


def _check_scale(scale) -> float | None:
    """``scale`` as a float (None: the backend's default 1/sqrt(head_dim)); raised on before any work."""
    if scale is None:
        return None
    if isinstance(scale, torch.Tensor) and scale.numel() == 1 and not scale.dtype.is_complex:
        scale = scale.item()
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise InvalidArgumentType(
            f"scale={scale!r} must be a real number (the softmax scale of q @ k^T), or None for 1/sqrt(head_dim).")
    if not math.isfinite(scale):
        raise InvalidArgument(f"scale={scale!r} must be finite; pass e.g. 1/sqrt(head_dim), or None for that default.")
    return float(scale)
