"""Row gathers with empty rows, as a ``torch.library`` custom op: ``fastwan::pad_rows``.

A sparse backend's layout pads a video's tokens to whole tiles (:class:`~fastwan.attention.sparse.layout.TokenLayout`):
around every sparse attention call q, k, v and VSA's gate go from the DiT's rows (real tokens only) to the
layout's slots, with zero rows at the dummy slots. The kernel does that in one pass: one program per output row
copies its source row as contiguous vectors (or writes zeros), so every source row is read once and every slot
written once (2.9 TB/s on an H100 for a bf16 [1, 75,600, 5,120] tensor; ``index_copy_`` + ``index_fill_``, which
copy one element per thread, reach 1.1: benchmarks/HISTORY.md).

The op runs its Triton kernel where :func:`fastwan.kernels.triton_runs` holds (CUDA, fp16/bf16/fp32) and no
autograd is involved (the op has no backward), and :func:`pad_rows_reference` elsewhere; :func:`pad_rows_triton`
is the kernel route itself (the tests run it on the CPU under ``TRITON_INTERPRET=1``).
"""
from __future__ import annotations

import functools
import math

import torch

from fastwan.kernels import FLOATS, triton_runs

MAX_BLOCK = 2048  # elements one program copies per step of its row loop


def check_inputs(x: torch.Tensor, src: torch.Tensor) -> None:
    if x.dim() < 2:
        raise ValueError(f"pad_rows: x must be [B, N, ...] (rows along dim 1), got {tuple(x.shape)}")
    if src.dim() != 1 or src.dtype != torch.int64:
        raise ValueError(f"pad_rows: src must be int64 [P] (the row of x each output row copies, -1 for a zero "
                         f"row), got {src.dtype} {tuple(src.shape)}")
    if src.device != x.device:
        raise ValueError(f"pad_rows: src is on {src.device} but x on {x.device}; build src on x's device")


def pad_rows_reference(x: torch.Tensor, src: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """x [B, N, ...], src int64 [P] with values in [-1, N) -> [B, P, ...]: row p is x[:, src[p]], or zeros where
    src[p] == -1; rows along ``dim`` (1 above; any non-negative dim of x). Differentiable."""
    keep = (src >= 0).view(-1, *([1] * (x.dim() - 1 - dim)))
    return torch.where(keep, x.index_select(dim, src.clamp(min=0)), x.new_zeros(()))


def usable(x: torch.Tensor) -> bool:
    """Whether :func:`pad_rows` runs its kernel for ``x``: :func:`~fastwan.kernels.triton_runs` in fp16/bf16/fp32
    and no autograd (the op has no backward: a call that needs gradients keeps the PyTorch route)."""
    grad = torch.is_grad_enabled() and x.requires_grad
    return triton_runs(x, dtypes=FLOATS) and not grad and x.numel() > 0


@torch.library.custom_op("fastwan::pad_rows", mutates_args=())
def pad_rows(x: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """x [B, N, ...] (any strides), src int64 [P] with values in [-1, N) (the caller's guarantee) -> a new
    contiguous [B, P, ...]: row p is x[:, src[p]], zeros where src[p] == -1 (:func:`pad_rows_reference`)."""
    check_inputs(x, src)
    if not usable(x):
        return pad_rows_reference(x, src).contiguous()
    return pad_rows_triton(x, src)


@pad_rows.register_fake
def _(x, src):
    return x.new_empty(x.shape[0], src.shape[0], *x.shape[2:])


def pad_rows_triton(x: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """The kernel route of :func:`pad_rows` (any device under Triton's interpreter)."""
    x = x.contiguous()
    B, N = x.shape[:2]
    P, R = src.shape[0], math.prod(x.shape[2:])
    out = x.new_empty(B, P, *x.shape[2:])
    if out.numel():
        block = min(MAX_BLOCK, 1 << max(4, (R - 1).bit_length()))
        _kernel()[(P, B)](x, src, out, N, P, R, BLOCK=block, STEPS=-(-R // block), num_warps=4)
    return out


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def pad_rows_kernel(x, src, out, N, P, R, BLOCK: tl.constexpr, STEPS: tl.constexpr):
        p = tl.program_id(0)
        b = tl.program_id(1)
        s = tl.load(src + p)
        offs = tl.arange(0, BLOCK)
        dst = out + (b.to(tl.int64) * P + p) * R
        row = x + (b.to(tl.int64) * N + tl.maximum(s, 0)) * R
        filled = tl.where(s >= 0, R, 0)  # elements read from x: none for an empty row
        for i in range(STEPS):
            start = i * BLOCK
            v = tl.load(row + start + offs, mask=start + offs < filled, other=0.0)
            tl.store(dst + start + offs, v, mask=start + offs < R)

    return pad_rows_kernel
