"""Block-sparse attention kernels over a :class:`~fastwan.attention.sparse.layout.TokenLayout`.

One tile of the layout is one block of the kernel (``block_size`` slots). A :class:`BlockPlan` holds the
block tables of one attention pattern and turns them, lazily and once, into what each kernel needs:

* ``flex``  -- ``torch.nn.attention.flex_attention`` with a ``BlockMask`` built by ``BlockMask.from_kv_blocks``
  (partial blocks -> ``kv_*``, full blocks -> ``full_kv_*``). On CUDA the module-level
  ``torch.compile(flex_attention)`` runs; its ``mask_mod`` is only evaluated inside partial blocks, so it only
  encodes what the block tables cannot (dummy key slots, NA token neighborhoods). On CPU inductor cannot
  compile block-sparse flex (torch 2.13), so the *eager* flex runs; eager flex ignores the block tables and
  evaluates ``mask_mod`` everywhere, so there the ``mask_mod`` encodes the complete pattern (exact mode).
* ``sdpa``  -- reference: dense ``scaled_dot_product_attention`` with the expanded boolean token mask
  (O(S^2) memory; the default on CPU).
* ``fa4``   -- FlashAttention-4 (``flash_attn.cute``) block sparsity (``block_sparse_tensors=``) on sm90/sm100;
  partial blocks are masked by a CuTe ``mask_mod``: dummy key slots (by slot index, or a per-key threshold
  from ``aux_tensors``) or NATTEN neighborhoods (per-slot window bounds and coordinates in ``aux_tensors``).

Kernel inputs are [B, S, H, D] (layout order); outputs too.
"""
from __future__ import annotations

import functools
import inspect
import logging
from collections import OrderedDict
from collections.abc import Callable

import torch
import torch.nn.functional as F

from fastwan.attention.base import package_available
from fastwan.attention.sparse.layout import TokenLayout
from fastwan.attention.sparse import masks

logger = logging.getLogger("fastwan.attention")

_RECOMPILE_LIMIT = 64


# ---------------------------------------------------------------------------------------------- flex
@functools.lru_cache(maxsize=1)
def _flex_module():
    try:
        from torch.nn.attention import flex_attention as fa
    except ImportError as exc:  # torch < 2.5
        raise RuntimeError(
            f"torch {torch.__version__} has no torch.nn.attention.flex_attention (needs torch >= 2.5): {exc}"
        ) from None
    return fa


_COMPILED_FLEX = None


def compiled_flex():
    """``torch.compile(flex_attention, dynamic=False)``, created once per process.

    Each new (grid, batch, heads, kv-index width) is a new static shape; the sparse backends keep those few
    per grid, but a process serving several grids can exceed dynamo's default limit of 8 recompilations
    (after which it would silently run the unfused eager kernel), so the limit is raised to 64 here (logged).
    """
    global _COMPILED_FLEX
    if _COMPILED_FLEX is None:
        import torch._dynamo.config as dcfg

        name = "recompile_limit" if hasattr(dcfg, "recompile_limit") else "cache_size_limit"
        if getattr(dcfg, name) < _RECOMPILE_LIMIT:
            logger.info("sparse attention: raising torch._dynamo.config.%s to %d for compiled flex_attention",
                        name, _RECOMPILE_LIMIT)
            setattr(dcfg, name, _RECOMPILE_LIMIT)
        _COMPILED_FLEX = torch.compile(_flex_module().flex_attention, dynamic=False)
    return _COMPILED_FLEX


def default_kernel_options(block_size: int) -> dict | None:
    """Flex kernel tiles must divide the sparse block: 128-multiples keep the defaults, else smaller tiles."""
    if block_size % 128 == 0:
        return None
    for b in (64, 32, 16):
        if block_size % b == 0:
            return {"BLOCK_M": b, "BLOCK_N": b}
    raise ValueError(f"block_size={block_size} is not a multiple of 16; the Flex kernel cannot tile it.")


def run_flex(q, k, v, block_mask, *, scale: float, compiled: bool, kernel_options: dict | None = None):
    """q, k, v: [B, S, H, D] -> [B, S, H, D] with a FlexAttention BlockMask."""
    fn = compiled_flex() if compiled else _flex_module().flex_attention
    kwargs = {"block_mask": block_mask, "scale": scale}
    if kernel_options:
        kwargs["kernel_options"] = kernel_options
    out = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kwargs)
    return out.transpose(1, 2)


def run_sdpa_masked(q, k, v, mask: torch.Tensor, *, scale: float):
    """Reference: q, k, v [B, S, H, D], mask bool [Bm, Hm, S, S] (True = attend) -> [B, S, H, D]."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale
    )
    return out.transpose(1, 2)


# ---------------------------------------------------------------------------------------------- fa4
def fa4_reasons(device: torch.device | str, dtype: torch.dtype) -> list[str]:
    """Why FA4 block sparsity cannot run here (empty: it can). Cached per (device, dtype)."""
    return list(_fa4_reasons(str(torch.device(device)), dtype))


@functools.lru_cache(maxsize=16)
def _fa4_reasons(device: str, dtype: torch.dtype) -> tuple[str, ...]:
    return tuple(_fa4_check(torch.device(device), dtype))


def _fa4_check(device: torch.device, dtype: torch.dtype) -> list[str]:
    reasons = []
    if not package_available("flash_attn"):
        return ["package 'flash_attn' (flash_attn.cute, FA4) is not installed (pip install flash-attn-4)"]
    try:
        from flash_attn.cute import flash_attn_func
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch  # noqa: F401
    except Exception as exc:  # ImportError, or a CUDA/cutlass initialisation error
        return [f"flash_attn.cute block sparsity cannot be imported: {type(exc).__name__}: {exc}"]
    if "block_sparse_tensors" not in inspect.signature(flash_attn_func).parameters:
        reasons.append("the installed flash_attn.cute.flash_attn_func has no block_sparse_tensors argument "
                       "(upgrade flash-attn-4)")
    if device.type != "cuda" or not torch.cuda.is_available():
        reasons.append(f"FA4 needs a CUDA device (got {device.type})")
    else:
        major = torch.cuda.get_device_capability(device)[0]
        if major not in (9, 10):
            reasons.append(f"FA4 block sparsity needs sm90 or sm100 (got sm{major}x)")
    if dtype not in (torch.float16, torch.bfloat16):
        reasons.append(f"FA4 needs float16/bfloat16 (got {dtype})")
    return reasons


# CuTe mask_mods for the partial blocks of FA4 block sparsity (full blocks skip them). Three rules:
#   "prefix":    every tile holds its real tokens in its first ``tile_tokens`` slots (grid divisible by the tile,
#                slot padding only) -> key n is real iff n % block_size < tile_tokens; no memory reads;
#   "threshold": key n is real iff n >= threshold[n] (0 at real keys, > P at dummy slots); one read per key;
#   "na":        NATTEN neighborhood: per query slot the window bounds (lo, hi) per dim, per key slot its (t, h, w)
#                (dummy key slots far outside every window); key in window iff lo <= c < hi and
#                (c - lo) % dilation == 0 in all three dims.
# fa4_mask_reference() evaluates the same rules in PyTorch (tests compare it with the exact token masks).
@functools.cache
def _fa4_mask_mod(kind: str, consts: tuple):
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


def run_fa4(q, k, v, tensors: dict, *, scale: float):
    """q, k, v: [B, S, H, D] -> [B, S, H, D] with FA4 block-sparse tensors from :meth:`BlockPlan.fa4_tensors`."""
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


def fa4_key_mask(layout: TokenLayout) -> tuple:
    """The (kind, consts, aux) mask for dummy key slots of ``layout`` (kind None: there are none)."""
    if not layout.has_dummies:
        return (None, (), ())
    if layout.real_prefix_tiles:  # slot padding only: real tokens first in every tile
        return ("prefix", (layout.block_size, layout.tile_tokens), ())
    p = layout.padded_tokens
    return ("threshold", (), (torch.where(layout.key_valid, 0, p + 1).to(torch.int32),))


# ---------------------------------------------------------------------------------------------- plan
def compact(table: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bool [..., nK] -> (count int32 [...], indices int32 [..., width]) with the True columns first."""
    num = table.sum(-1, dtype=torch.int32)
    order = torch.sort((~table).to(torch.uint8), dim=-1, stable=True).indices[..., :width]
    return num.contiguous(), order.to(torch.int32).contiguous()


def split_selected(selected: torch.Tensor, tile_full: torch.Tensor, uniform: bool | None = None
                   ) -> tuple[torch.Tensor, ...]:
    """Top-k key tiles [..., k] (long) -> (full_num, full_idx, partial_num, partial_idx), all int32, [.., k].

    Full (no dummy slot) tiles come first in ``full_idx``, partial ones first in ``partial_idx`` (each kind in
    the order of ``selected``).
    """
    k = selected.shape[-1]
    if uniform is not None:  # all tiles partial (True) or all full (False): nothing to partition
        idx = selected.to(torch.int32)
        zeros = torch.zeros(selected.shape[:-1], dtype=torch.int32, device=selected.device)
        counts = torch.full_like(zeros, k)
        return (zeros, idx, counts, idx) if uniform else (counts, idx, zeros, idx)
    # stable partition by scatter (no sort): a full tile goes to its rank among the full ones, a partial tile
    # to its rank among the partial ones, each list continuing with the other kind
    is_partial = ~tile_full[selected]
    rank_p = torch.cumsum(is_partial, dim=-1) - 1
    rank_f = torch.cumsum(~is_partial, dim=-1) - 1
    p = rank_p[..., -1:] + 1
    f = k - p
    sel32 = selected.to(torch.int32)
    full_first = torch.empty_like(sel32).scatter_(-1, torch.where(is_partial, f + rank_p, rank_f), sel32)
    partial_first = torch.empty_like(sel32).scatter_(-1, torch.where(is_partial, rank_p, p + rank_f), sel32)
    return f[..., 0].to(torch.int32), full_first, p[..., 0].to(torch.int32), partial_first


@functools.lru_cache(maxsize=1)
def _from_kv_blocks_params() -> frozenset:
    return frozenset(inspect.signature(_flex_module().BlockMask.from_kv_blocks).parameters)


def _from_kv_blocks(layout: TokenLayout, full_num, full_idx, part_num, part_idx, mask_mod, q_blocks: bool):
    params = _from_kv_blocks_params()
    kwargs = {}
    if "seq_lengths" in params:
        kwargs["seq_lengths"] = (layout.padded_tokens, layout.padded_tokens)
    if "compute_q_blocks" in params:
        kwargs["compute_q_blocks"] = q_blocks
    return _flex_module().BlockMask.from_kv_blocks(
        part_num, part_idx, full_num, full_idx, BLOCK_SIZE=layout.block_size, mask_mod=mask_mod, **kwargs
    )


def key_mask_mod(layout: TokenLayout, token_pred=None, name: str = "keys"):
    """The mask_mod for partial blocks on the compiled path, cached on the layout (one object per layout)."""
    cache = layout.__dict__.setdefault("_mask_mods", {})
    if name not in cache:
        valid = layout.key_valid
        if token_pred is None:
            def mask_mod(b, h, q_idx, kv_idx):
                return valid[kv_idx]
        else:
            def mask_mod(b, h, q_idx, kv_idx):
                return valid[kv_idx] & token_pred(q_idx, kv_idx)
        cache[name] = mask_mod
    return cache[name]


class BlockPlan:
    """One block-sparse pattern on a layout.

    Build it from block tables, or (VSA) from per-query-tile selected key tiles:

    Args:
        layout: the TokenLayout (blocks = tiles, ``layout.block_size`` slots each).
        any_blocks: bool [Bm, Hm, nQ, nK]: tile pairs with at least one attended token pair.
        full_blocks: bool [Bm, Hm, nQ, nK] subset of ``any_blocks`` that needs no token-level mask.
        selected: instead of the tables: long [Bm, Hm, nQ, k], the k key tiles of every query tile (distinct);
            int32 is accepted too (converted where an index must be long).
        tables: with ``selected`` (or alone: ``selected`` is then ``full_idx``): the compact tables of that
            selection already built, ``(full_num, full_idx, partial_num, partial_idx)`` as
            :func:`split_selected` returns them (int32 [Bm, Hm, nQ] and [Bm, Hm, nQ, k]); they become the
            plan's compact tables (VSA's top-k kernel writes them directly).
        token_pred: ``pred(q_idx, kv_idx) -> bool`` exact token rule inside partial blocks (None: the block
            pattern restricted to real keys is exact).
        token_mask: optional callable returning the exact bool [P, P] token mask of ``token_pred`` (faster
            dense construction for the sdpa path).
        fa4_mask: optional callable returning the FA4 partial-block rule ``(kind, consts, aux tensors)`` that
            encodes ``token_pred`` and the dummy keys (see :func:`fa4_mask_reference`); without it a plan with
            a ``token_pred`` cannot use FA4.
        width: kv-index width of the compact tables (>= the largest row count; keep it fixed per grid so
            compiled flex sees one shape).
        name: cache key of the compiled-path mask_mod on the layout.
    """

    def __init__(self, layout, any_blocks=None, full_blocks=None, *, selected=None, tables=None, token_pred=None,
                 token_mask=None, fa4_mask=None, width=None, name="keys"):
        n = layout.num_tiles
        self.layout = layout
        self.token_pred = token_pred
        self.fa4_mask = fa4_mask
        self._token_mask = token_mask
        self.name = name
        self._cache: dict = {}
        if tables is not None:
            fn, fi, pn, pi = tables
            selected = fi if selected is None else selected
            rows = tuple(selected.shape[:-1])
            if (tuple(fi.shape) != tuple(selected.shape) or tuple(pi.shape) != tuple(selected.shape)
                    or tuple(fn.shape) != rows or tuple(pn.shape) != rows):
                raise ValueError(f"compact tables {[tuple(t.shape) for t in tables]} do not match the selection "
                                 f"{tuple(selected.shape)}")
            self._cache["compact"] = (fn, fi, pn, pi)
        self._selected = selected
        if selected is not None:
            if selected.dim() != 4 or selected.shape[2] != n:
                raise ValueError(f"selected tiles shape {tuple(selected.shape)} does not match {layout}")
            self._any = None
            self.width = selected.shape[-1]
            self._shape = tuple(selected.shape[:3]) + (n,)
        else:
            if any_blocks.dim() != 4 or tuple(any_blocks.shape[-2:]) != (n, n):
                raise ValueError(f"block table shape {tuple(any_blocks.shape)} does not match {layout}")
            self._any = any_blocks
            self._full = full_blocks & any_blocks
            max_count = int(any_blocks.sum(-1).max()) if any_blocks.numel() else 1
            self.width = max(1, max_count if width is None else max(width, max_count))
            self._shape = tuple(any_blocks.shape)

    @property
    def any(self) -> torch.Tensor:
        """bool [Bm, Hm, nQ, nK] block table."""
        if self._any is None:
            sel = self._selected.long()
            table = torch.zeros(self._shape, dtype=torch.bool, device=sel.device)
            self._any = table.scatter_(-1, sel, True)
            self._full = self._any & self.layout.tile_full[None, None, None, :]
        return self._any

    @property
    def full(self) -> torch.Tensor:
        self.any  # noqa: B018  (materialises both tables)
        return self._full

    @property
    def batch(self) -> int:
        return self._shape[0]

    @property
    def heads(self) -> int:
        return self._shape[1]

    def density(self) -> float:
        """Fraction of (query tile, key tile) pairs the kernel computes."""
        if self._selected is not None:
            return self.width / self.layout.num_tiles
        return float(self.any.float().mean())

    def _compact(self):
        if "compact" not in self._cache:
            if self._selected is not None:
                self._cache["compact"] = split_selected(self._selected.long(), self.layout.tile_full,
                                                          self.layout.all_tiles_partial)
            else:
                partial = self.any & ~self.full
                self._cache["compact"] = (*compact(self.full, self.width), *compact(partial, self.width))
        return self._cache["compact"]

    def flex_block_mask(self, *, exact: bool, q_blocks: bool = False):
        """BlockMask; ``exact`` puts the whole pattern in mask_mod (needed by eager flex)."""
        key = ("flex", exact, q_blocks)
        if key not in self._cache:
            fn, fi, pn, pi = self._compact()
            if exact:
                mask_mod = self.exact_mask_mod()
            else:
                mask_mod = key_mask_mod(self.layout, self.token_pred, self.name)
            if q_blocks:  # the transposed (q-major) tables need full-width indices
                n = self.layout.num_tiles
                fn, fi = compact(self.full, n)
                pn, pi = compact(self.any & ~self.full, n)
            self._cache[key] = _from_kv_blocks(self.layout, fn, fi, pn, pi, mask_mod, q_blocks)
        return self._cache[key]

    def exact_mask_mod(self) -> Callable:
        layout, table, pred = self.layout, self.any, self.token_pred
        bs, valid = layout.block_size, layout.key_valid
        multi_b, multi_h = table.shape[0] > 1, table.shape[1] > 1

        def mask_mod(b, h, q_idx, kv_idx):
            ok = table[b if multi_b else 0, h if multi_h else 0, q_idx // bs, kv_idx // bs] & valid[kv_idx]
            return ok & pred(q_idx, kv_idx) if pred is not None else ok

        return mask_mod

    def dense_mask(self) -> torch.Tensor:
        """bool [Bm, Hm, P, P]: the exact token-level pattern (True = attend)."""
        m = masks.expand_blocks(self.layout, self.any)
        if self.token_pred is not None:
            if self._token_mask is not None:
                tm = self._token_mask()
            else:
                i = torch.arange(self.layout.padded_tokens, device=self.layout.device)
                tm = self.token_pred(i[:, None], i[None, :])
            m = m & tm
        return m

    def mask_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """bool [Bm, Hm, len(rows), P]: the exact pattern for the query slots ``rows`` (long [r])."""
        layout = self.layout
        kv = torch.arange(layout.padded_tokens, device=rows.device)
        m = self.any[:, :, rows // layout.block_size][:, :, :, kv // layout.block_size]
        m = m & layout.key_valid[None, None, None, :]
        if self.token_pred is not None:
            m = m & self.token_pred(rows[:, None], kv[None, :])
        return m

    def fa4_tensors(self) -> dict:
        """Block tables and the partial-block rule for :func:`run_fa4` (built once per plan)."""
        if "fa4" not in self._cache:
            if self.token_pred is not None and self.fa4_mask is None:
                raise ValueError(
                    "kernel='fa4' has no rule for this plan's token-level pattern; use kernel='flex'."
                )
            fn, fi, pn, pi = self._compact()
            mask = self.fa4_mask() if self.fa4_mask is not None else fa4_key_mask(self.layout)
            self._cache["fa4"] = {"full_num": fn, "full_idx": fi, "partial_num": pn, "partial_idx": pi,
                                  "mask": mask, "block_size": self.layout.block_size}
        return self._cache["fa4"]


class LRU(OrderedDict):
    """A small LRU dict for per-pattern plans."""

    def __init__(self, maxsize: int = 64):
        super().__init__()
        self.maxsize = maxsize

    def get_or(self, key, make):
        if key in self:
            self.move_to_end(key)
            return self[key]
        value = make()
        self[key] = value
        if len(self) > self.maxsize:
            self.popitem(last=False)
        return value


def tflops(batch: int, heads: int, tokens: int, head_dim: int, ms: float, density: float = 1.0) -> float:
    """Attention forward TFLOP/s (4*S^2*D per head) for ``density`` of the S^2 pairs."""
    return 4.0 * batch * heads * tokens * tokens * head_dim * density / (ms * 1e-3) / 1e12


__all__ = [
    "BlockPlan",
    "compact",
    "compiled_flex",
    "default_kernel_options",
    "fa4_reasons",
    "run_fa4",
    "run_flex",
    "run_sdpa_masked",
    "split_selected",
    "tflops",
]
