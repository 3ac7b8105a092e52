"""FlashAttention-4 (``flash_attn.cute``) block sparsity as the kernel of the sparse backends (sm90/sm100).

The kernel takes a :class:`~fastwan.attention.sparse.plan.BlockPlan`'s compact tables (``block_sparse_tensors=``):
full blocks run unmasked, partial blocks through a CuTe ``mask_mod``. Three partial-block rules:

* ``"prefix"``:    every tile holds its real tokens in its first ``tile_tokens`` slots (grid divisible by the
  tile, slot padding only) -> key n is real iff ``n % block_size < tile_tokens``; no memory reads;
* ``"threshold"``: key n is real iff ``n >= threshold[n]`` (0 at real keys, > P at dummy slots); one read per
  key;
* ``"na"``:        NATTEN neighborhood: per query slot the window bounds (lo, hi) per dim, per key slot its
  (t, h, w) (dummy key slots far outside every window); a key is in the window iff ``lo <= c < hi`` and
  ``(c - lo) % dilation == 0`` in all three dims.

:func:`fa4_mask_reference` evaluates the same rules in PyTorch (tests compare it with the exact token masks).
Kernel inputs and outputs are [B, S, H, D] (layout order).
"""
from __future__ import annotations

import functools
import inspect

import torch

from fastwan.attention.base import Capabilities, reasons_cannot_run
from fastwan.attention.sparse.layout import TokenLayout

CAPABILITIES = Capabilities(
    device_types=("cuda",),
    dtypes=(torch.float16, torch.bfloat16),
    min_compute_capability=(9, 0),
    max_compute_capability=(10, 3),  # sm90, sm100, sm103
    packages=(("flash_attn", "flash_attn.cute, FA4: pip install flash-attn-4"),),
)


def fa4_reasons(device: torch.device | str, dtype: torch.dtype) -> list[str]:
    """Why FA4 block sparsity cannot run here (empty: it can). Cached per (device, dtype)."""
    return list(_fa4_reasons(str(torch.device(device)), dtype))


def head_dim_reason(device: torch.device | str, head_dim: int | None) -> str | None:
    """Why FA4 block sparsity cannot run ``head_dim`` on CUDA ``device`` (None: it can, or unknown): the head-dim
    rule of dense FA4 (:data:`fastwan.attention.backends.flash.VARIANTS`), which flash_attn.cute asserts."""
    dev = torch.device(device)
    if head_dim is None or dev.type != "cuda":
        return None
    from fastwan.attention.backends.flash import VARIANTS

    rules = VARIANTS[4].head_dims
    why = rules.get(torch.cuda.get_device_capability(dev)[0], rules[9]).reason(head_dim)
    return None if why is None else f"FA4 needs a head dim {why}; got {head_dim}"


@functools.lru_cache(maxsize=16)
def _fa4_reasons(device: str, dtype: torch.dtype) -> tuple[str, ...]:
    reasons = reasons_cannot_run(CAPABILITIES, device=device, dtype=dtype, head_dim=None)
    if reasons:
        return tuple(reasons)
    # it could run here: make sure the installed package loads and has block sparsity
    try:
        from flash_attn.cute import flash_attn_func
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch  # noqa: F401
    except Exception as exc:  # ImportError, or a CUDA/cutlass initialisation error
        return (f"flash_attn.cute block sparsity cannot be imported: {type(exc).__name__}: {exc}",)
    if "block_sparse_tensors" not in inspect.signature(flash_attn_func).parameters:
        return ("the installed flash_attn.cute.flash_attn_func has no block_sparse_tensors argument "
                "(upgrade flash-attn-4)",)
    return ()


@functools.cache
def _fa4_mask_mod(kind: str, consts: tuple):
    """The CuTe mask_mod of partial-block rule ``kind`` (see the module docstring), compiled once per rule."""
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute import utils as fa_utils

    def i32(x):
        return fa_utils.scalar_to_ssa(x, cutlass.Int32)

    if kind == "threshold":
        @cute.jit
        def key_valid_mask(batch, head, m_idx, n_idx, seqlen_info, aux_tensors):
            threshold = aux_tensors[0]
            return n_idx >= i32(threshold[n_idx[0]])

        return key_valid_mask
    if kind == "prefix":
        block_size, tile_tokens = consts

        @cute.jit
        def prefix_mask(batch, head, m_idx, n_idx, seqlen_info, aux_tensors):
            return (n_idx % i32(block_size)) < i32(tile_tokens)

        return prefix_mask
    if kind == "na":
        dt, dh, dw = consts

        @cute.jit
        def na_mask(batch, head, m_idx, n_idx, seqlen_info, aux_tensors):
            win, kc = aux_tensors[0], aux_tensors[1]
            m, n = m_idx[0], n_idx[0]
            t, h, w = i32(kc[n, 0]), i32(kc[n, 1]), i32(kc[n, 2])
            lt, lh, lw = i32(win[m, 0]), i32(win[m, 2]), i32(win[m, 4])
            ok = (t >= lt) & (t < i32(win[m, 1])) & (h >= lh) & (h < i32(win[m, 3]))
            ok = ok & (w >= lw) & (w < i32(win[m, 5]))
            ok = ok & (((t - lt) % i32(dt)) == i32(0)) & (((h - lh) % i32(dh)) == i32(0))
            return ok & (((w - lw) % i32(dw)) == i32(0))

        return na_mask
    raise ValueError(f"unknown FA4 mask kind {kind!r}")


def fa4_block_multiple() -> int:
    """The sparse block sizes FA4 runs: multiples of 128 (its sm90 tile), or of 64 where the installed
    flash_attn.cute takes explicit block sizes (``BlockSparseTensorsTorch.block_size``; it then shrinks its tile
    to 64 x 64 for 64-slot blocks)."""
    try:
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
    except ImportError:
        return 128
    return 64 if "block_size" in BlockSparseTensorsTorch._fields else 128


def fa4_mask_reference(tensors: dict, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
    """PyTorch evaluation of the FA4 partial-block rule of ``tensors`` (True = attend), broadcasting."""
    kind, consts, aux = tensors["mask"]
    if kind is None:
        return torch.ones(torch.broadcast_shapes(q_idx.shape, kv_idx.shape), dtype=torch.bool)
    if kind == "threshold":
        return (kv_idx >= aux[0][kv_idx]).expand(torch.broadcast_shapes(q_idx.shape, kv_idx.shape))
    if kind == "prefix":
        return ((kv_idx % consts[0]) < consts[1]).expand(torch.broadcast_shapes(q_idx.shape, kv_idx.shape))
    win, kc = aux
    ok = torch.ones(torch.broadcast_shapes(q_idx.shape, kv_idx.shape), dtype=torch.bool)
    for i, d in enumerate(consts):
        c, lo, hi = kc[kv_idx, i], win[q_idx, 2 * i], win[q_idx, 2 * i + 1]
        ok = ok & (c >= lo) & (c < hi) & (torch.remainder(c - lo, d) == 0)
    return ok


def fa4_key_mask(layout: TokenLayout) -> tuple:
    """The (kind, consts, aux) rule for the dummy key slots of ``layout`` (kind None: there are none)."""
    if not layout.has_dummies:
        return (None, (), ())
    if layout.real_prefix_tiles:  # slot padding only: real tokens first in every tile
        return ("prefix", (layout.block_size, layout.tile_tokens), ())
    p = layout.padded_tokens
    return ("threshold", (), (torch.where(layout.key_valid, 0, p + 1).to(torch.int32),))


def run_fa4(q, k, v, tensors: dict, *, scale: float):
    """q, k, v: [B, S, H, D] -> [B, S, H, D] with FA4 block-sparse tensors from ``BlockPlan.fa4_tensors``."""
    from flash_attn.cute import flash_attn_func
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    fields = {
        "mask_block_cnt": tensors["partial_num"],
        "mask_block_idx": tensors["partial_idx"],
        "full_block_cnt": tensors["full_num"],
        "full_block_idx": tensors["full_idx"],
    }
    if "block_size" in BlockSparseTensorsTorch._fields:
        fields["block_size"] = (tensors["block_size"], tensors["block_size"])
    bst = BlockSparseTensorsTorch(**fields)
    kwargs = {"softmax_scale": scale, "block_sparse_tensors": bst}
    kind, consts, aux = tensors["mask"]
    if kind is not None:
        kwargs["mask_mod"] = _fa4_mask_mod(kind, consts)
        if aux:
            kwargs["aux_tensors"] = list(aux)
    out = flash_attn_func(q, k, v, **kwargs)
    return out[0] if isinstance(out, tuple) else out
