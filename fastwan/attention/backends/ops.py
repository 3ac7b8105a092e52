"""External attention kernels as ``torch.library`` custom ops, so ``torch.compile(fullgraph=True)`` treats
each one as a single opaque node (no graph break) and can still infer shapes through its fake impl.

All ops take ``q [B, Sq, H, D]``, ``k, v [B, Skv, H, D]`` and return a new contiguous ``[B, Sq, H, D]`` tensor
with q's dtype (for NVFP4, q is the bf16 input; quantization happens inside the op). Importing this module
registers the ops but imports no external package: the kernels are loaded lazily via
:mod:`fastwan.attention.backends.packages` on the first real call.
"""
from __future__ import annotations

import torch

from fastwan.attention.backends import fa4_plan
from fastwan.attention.backends import packages as kernels


def _contiguous_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _finish(out, q: torch.Tensor) -> torch.Tensor:
    if isinstance(out, (tuple, list)):  # some releases return (out, lse, ...)
        out = out[0]
    if out.shape != q.shape:
        raise RuntimeError(f"attention kernel returned shape {tuple(out.shape)}, expected {tuple(q.shape)}")
    return out.contiguous()


def _fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args) -> torch.Tensor:
    return q.new_empty(q.shape)  # contiguous, q's dtype and device


@torch.library.custom_op("fastwan::flash_attn", mutates_args=())
def flash_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, version: int,
               tile_m: int = 0, split: int = 0, tail_tile_m: int = 0) -> torch.Tensor:
    """FlashAttention ``version`` (2: flash_attn, 3: flash_attn_interface, 4: flash_attn.cute). ``tile_m``: FA4's
    sm90 query tile (:data:`fastwan.attention.backends.fa4_plan.FA4_SM90_TILES`); 0 = the kernel's own choice.

    ``split`` > 0 (FA4 with explicit tiles only): two launches writing into one output, query rows ``[0, split)``
    with ``tile_m`` and ``[split, Sq)`` with ``tail_tile_m``, one after the other (the tail on a second stream
    measured no faster on an H100). ``split`` = -1: FA4 on sm90, head dim 128; the launches are planned here,
    from the shapes and the device's SM count (:func:`fastwan.attention.backends.fa4_plan.fa4_sm90_plan`), ``tile_m``
    being the one-launch tile."""
    fn = kernels.flash_kernel(version)
    q, k, v = _contiguous_last(q), _contiguous_last(k), _contiguous_last(v)
    if split == -1:
        tm, split, tail_tile_m = fa4_plan.fa4_sm90_plan(q.shape[0], q.shape[1], k.shape[1], q.shape[2],
                                                        _sm_count(q.device))
        if not split:
            tile_m = 0 if tm == 128 else tm  # 128 is FA4's own default: its public entry point
        else:
            tile_m = tm
    if not split:
        return _finish(fn(q, k, v, scale, tile_m) if tile_m else fn(q, k, v, scale), q)
    if version != 4 or not (0 < split < q.shape[1]) or tile_m not in fa4_plan.FA4_SM90_TILES \
            or tail_tile_m not in fa4_plan.FA4_SM90_TILES:
        raise ValueError(f"flash_attn split={split} needs FA4 (version={version}), 0 < split < Sq={q.shape[1]} and "
                         f"tiles from {sorted(fa4_plan.FA4_SM90_TILES)} (tile_m={tile_m}, tail_tile_m={tail_tile_m}).")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)

    def run(rows: slice, tm: int) -> None:
        dst = out[:, rows]
        got = fn(q[:, rows], k, v, scale, tm, dst)
        got = got[0] if isinstance(got, (tuple, list)) else got
        if got.data_ptr() != dst.data_ptr():  # a kernel that ignored ``out``
            dst.copy_(got)

    run(slice(0, split), tile_m)
    run(slice(split, None), tail_tile_m)
    return out


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (the planning input of ``split=-1``)."""
    if device.type != "cuda":
        raise ValueError(f"flash_attn split=-1 plans FA4 launches on a CUDA device, got {device}; pass split=0.")
    return torch.cuda.get_device_properties(device).multi_processor_count


@torch.library.custom_op("fastwan::nvfp4_flash_attn", mutates_args=())
def nvfp4_flash_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """FA4 with Q, K quantized to NVFP4 inside the op and V in bf16 (sm100/sm103 builds only)."""
    fn = kernels.nvfp4_flash_kernel()
    return _finish(fn(q.contiguous(), k.contiguous(), _contiguous_last(v), scale), q).to(q.dtype)


@torch.library.custom_op("fastwan::sage_attn", mutates_args=())
def sage_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """SageAttention (INT8 QK^T): ``sageattn(..., tensor_layout="NHD", sm_scale=scale)``."""
    fn = kernels.sage_kernel()
    return _finish(fn(_contiguous_last(q), _contiguous_last(k), _contiguous_last(v), scale), q)


for _op in (flash_attn, nvfp4_flash_attn, sage_attn):
    _op.register_fake(_fake)
