"""Block plans: the block tables of one sparse attention pattern and what each kernel gets from them.

A *block table* is a bool tensor ``[Bm, Hm, nQ, nK]`` over the tiles of a
:class:`~fastwan.attention.sparse.layout.TokenLayout` (one tile = one kernel block of ``block_size`` slots).
Kernels take them compacted: per query tile a count and the indices of its key tiles, full blocks (no token
mask needed) and partial blocks (masked inside) listed separately (:mod:`fastwan.kernels.tables`).
A :class:`BlockPlan` builds, lazily and once each, the ``BlockMask`` of :mod:`~fastwan.attention.sparse.flex`,
the tables and partial-block rule of :mod:`~fastwan.attention.sparse.fa4` and the dense token mask of the sdpa
reference; :class:`PlanCache` keeps the plans a backend reuses.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from fastwan.attention.sparse import fa4, flex, masks
from fastwan.kernels.tables import compact, split_selected


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
            :func:`~fastwan.kernels.tables.split_selected` returns them (int32 [Bm, Hm, nQ] and [Bm, Hm, nQ, k]); they
            become the
            plan's compact tables (VSA's top-k kernel writes them directly).
        token_pred: ``pred(q_idx, kv_idx) -> bool`` exact token rule inside partial blocks (None: the block
            pattern restricted to real keys is exact).
        token_mask: optional callable returning the exact bool [P, P] token mask of ``token_pred`` (faster
            dense construction for the sdpa path).
        fa4_mask: optional callable returning the FA4 partial-block rule ``(kind, consts, aux tensors)`` that
            encodes ``token_pred`` and the dummy keys (see :func:`~fastwan.attention.sparse.fa4.fa4_mask_reference`);
            without it a plan with a ``token_pred`` cannot use FA4.
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
                mask_mod = flex.key_mask_mod(self.layout, self.token_pred, self.name)
            if q_blocks:  # the transposed (q-major) tables need full-width indices
                n = self.layout.num_tiles
                fn, fi = compact(self.full, n)
                pn, pi = compact(self.any & ~self.full, n)
            self._cache[key] = flex.block_mask_from_tables(self.layout, fn, fi, pn, pi, mask_mod, q_blocks)
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
        """Block tables and the partial-block rule for :func:`~fastwan.attention.sparse.fa4.run_fa4` (built once
        per plan)."""
        if "fa4" not in self._cache:
            if self.token_pred is not None and self.fa4_mask is None:
                raise ValueError(
                    "kernel='fa4' has no rule for this plan's token-level pattern; use kernel='flex'."
                )
            fn, fi, pn, pi = self._compact()
            mask = self.fa4_mask() if self.fa4_mask is not None else fa4.fa4_key_mask(self.layout)
            self._cache["fa4"] = {"full_num": fn, "full_idx": fi, "partial_num": pn, "partial_idx": pi,
                                  "mask": mask, "block_size": self.layout.block_size}
        return self._cache["fa4"]


class PlanCache(OrderedDict):
    """The plans of one backend by pattern key, least recently used dropped past ``maxsize``."""

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
