"""fastwan's own kernels, each a ``torch.library`` custom op with a fake (so ``torch.compile(fullgraph=True)``
traces through it) and a PyTorch reference with the same math.

An op runs its Triton kernel where :func:`triton_runs` says the kernel can run for its inputs, and its reference
everywhere else. Two context managers switch that, for tests: :func:`reference_kernels` forces the references, and
:func:`interpreted_kernels` runs the kernels on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``
set before Triton is imported).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator

import torch

HALF = (torch.float16, torch.bfloat16)
FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_FORCE_REFERENCE = contextvars.ContextVar("fastwan_force_reference_kernels", default=False)
_INTERPRETED = contextvars.ContextVar("fastwan_interpreted_kernels", default=False)


@functools.cache
def triton_importable() -> bool:
    """Whether Triton imports (every kernel here needs it; each op has its PyTorch reference otherwise)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True


def triton_runs_on(device: torch.device | str, dtype: torch.dtype, dtypes: tuple[torch.dtype, ...] = HALF) -> bool:
    """The one rule of whether a Triton kernel runs for data of ``dtype`` on ``device``: CUDA and a dtype in
    ``dtypes``, Triton importable, and not inside :func:`reference_kernels`. Inside :func:`interpreted_kernels`
    any device and any of fp16/bf16/fp32 qualifies."""
    if _FORCE_REFERENCE.get() or not triton_importable():
        return False
    if _INTERPRETED.get():
        return dtype in FLOATS
    return torch.device(device).type == "cuda" and dtype in dtypes


def triton_runs(*tensors: torch.Tensor | None, dtypes: tuple[torch.dtype, ...] = HALF,
                max_last_dim: int | None = None) -> bool:
    """:func:`triton_runs_on` for every given tensor (None: skipped), each with a last dim of at most
    ``max_last_dim``."""
    if _FORCE_REFERENCE.get() or not triton_importable():
        return False
    for t in tensors:
        if t is None:
            continue
        if not triton_runs_on(t.device, t.dtype, dtypes):
            return False
        if max_last_dim is not None and t.dim() and t.shape[-1] > max_last_dim:
            return False
    return True


@contextlib.contextmanager
def reference_kernels() -> Iterator[None]:
    """Inside the block every op of this package runs its PyTorch reference."""
    token = _FORCE_REFERENCE.set(True)
    try:
        yield
    finally:
        _FORCE_REFERENCE.reset(token)


@contextlib.contextmanager
def interpreted_kernels() -> Iterator[None]:
    """Inside the block the Triton kernels also take CPU tensors and fp32 (Triton's interpreter runs them; the
    process must have ``TRITON_INTERPRET=1`` set before Triton is imported)."""
    token = _INTERPRETED.set(True)
    try:
        yield
    finally:
        _INTERPRETED.reset(token)
