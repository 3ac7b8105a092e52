"""Attention patterns of the sparse backends, at token level and at tile (block) level.

Conventions: a *block table* is a bool tensor ``[Bm, Hm, nQ, nK]`` over the tiles of a
:class:`~fastwan.attention.sparse.layout.TokenLayout` (``Bm``/``Hm`` are 1 when the pattern is shared across batch /
heads); ``any`` marks tile pairs with at least one attended (query, key) pair, ``full`` the subset in which
every real query attends every key slot (so the kernel needs no token-level mask there: such key tiles have
no dummy slot).

Neighborhood attention follows NATTEN's definition, per dimension of length ``L`` with kernel size ``k``,
stride ``s``, dilation ``d`` and a causal flag. For a query at ``x`` and a key at ``y``:

* dilation splits the axis into ``d`` interleaved groups; ``x`` and ``y`` must be in the same group
  (``x % d == y % d``) and are then indexed inside it as ``xi = x // d``, ``yi = y // d``; the group holds
  ``Lg = ceil((L - x % d) / d)`` positions;
* ``left = k // 2`` and ``right = k - 1 - left`` (an even ``k`` has one more on the left);
* non-causal: the stride groups queries ``xi // s``; the group's leader is
  ``c = min((xi // s) * s + s // 2, Lg - 1)``; the window is ``[start, start + k)`` with
  ``start = max(c - left, 0)``, shifted to ``Lg - k`` when ``c + right >= Lg`` (windows stay inside the axis
  and always hold ``k`` keys);
* causal: ``c = min((xi // s) * s + s - 1, Lg - 1)``; the window is ``[max(c - k + 1, 0), min(xi + 1, Lg))``.

The 3D neighborhood is the product of the three 1D ones. The sliding tile attention (STA) pattern is the same
rule applied to *tile* coordinates with stride 1, dilation 1 and ``k = min(window, tiles in that dim)``.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from fastwan.attention.sparse.layout import TokenLayout


def na_neighbor_1d(
    x: torch.Tensor, y: torch.Tensor, length: int, kernel_size: int, stride: int, dilation: int, causal: bool
) -> torch.Tensor:
    """NATTEN's 1D neighborhood predicate: is key coordinate ``y`` in the window of query ``x``?

    ``x`` and ``y`` are long tensors of any broadcastable shapes (0-d inside a FlexAttention ``mask_mod``);
    ``x`` must be a real coordinate (``0 <= x < length``). Returns a bool tensor of the broadcast shape.
    """
    d = dilation
    gq, gk = x % d, y % d
    start, end = _na_group_window(x // d, (length - gq + (d - 1)) // d, kernel_size, stride, causal)
    yi = y // d
    return (gq == gk) & (yi >= start) & (yi < end)


def _na_group_window(xi, lg, k: int, s: int, causal: bool):
    """Window [start, end) of a query at index ``xi`` of its dilation group (``lg`` positions)."""
    if causal:
        leader = torch.minimum((xi // s) * s + (s - 1), lg - 1)
        return (leader - (k - 1)).clamp(min=0), torch.minimum(xi + 1, lg)
    left = k // 2
    right = k - 1 - left
    leader = torch.minimum((xi // s) * s + s // 2, lg - 1)
    shift = torch.where(leader + right >= lg, lg - right - leader - 1, torch.zeros_like(leader))
    start = (leader - left).clamp(min=0) + shift
    return start, start + k


def na_window_1d(x: torch.Tensor, length: int, kernel_size: int, stride: int, dilation: int, causal: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Absolute key bounds of the window of query coordinates ``x`` (long): ``(lo, hi)``.

    Key ``y`` is in the window iff ``lo <= y < hi`` and ``(y - lo) % dilation == 0`` (same as
    :func:`na_neighbor_1d`).
    """
    d = dilation
    g = x % d
    start, end = _na_group_window(x // d, (length - g + (d - 1)) // d, kernel_size, stride, causal)
    return start * d + g, (end - 1) * d + g + 1


def na_mask_1d(length: int, kernel_size: int, stride: int = 1, dilation: int = 1, causal: bool = False,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """bool [length, length]: row = query coordinate, column = key coordinate."""
    i = torch.arange(length, device=device)
    return na_neighbor_1d(i[:, None], i[None, :], length, kernel_size, stride, dilation, causal)


def _outer3(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """[n0, n0], [n1, n1], [n2, n2] -> [n0*n1*n2, n0*n1*n2] with (i0, i1, i2) raster order on both axes."""
    n0, n1, n2 = a.shape[0], b.shape[0], c.shape[0]
    out = a[:, None, None, :, None, None] & b[None, :, None, None, :, None] & c[None, None, :, None, None, :]
    return out.reshape(n0 * n1 * n2, n0 * n1 * n2)


def full_tables(layout: TokenLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense pattern over real keys: any = all ones, full = key tiles without dummy slots. [1, 1, n, n]."""
    n = layout.num_tiles
    any_ = torch.ones(1, 1, n, n, dtype=torch.bool, device=layout.device)
    return any_, any_ & layout.tile_full[None, None, None, :]


# ---------------------------------------------------------------------------------------------- STA
def sta_tile_table(tile_grid: Sequence[int], window: Sequence[int], device: torch.device | str = "cpu"
                   ) -> torch.Tensor:
    """bool [nQ, nK] over tiles: key tile within the (border-shifted) ``window`` of the query tile."""
    parts = [na_mask_1d(n, min(w, n), device=device) for n, w in zip(tile_grid, window)]
    return _outer3(*parts)


def sta_tables(layout: TokenLayout, windows: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """STA block tables for one window per head (or one shared window): any/full [1, len(windows), n, n]."""
    cache: dict[tuple, torch.Tensor] = {}
    tabs = []
    for w in windows:
        key = tuple(min(x, n) for x, n in zip(w, layout.tile_grid))
        if key not in cache:
            cache[key] = sta_tile_table(layout.tile_grid, key, layout.device)
        tabs.append(cache[key])
    any_ = torch.stack(tabs)[None]
    return any_, any_ & layout.tile_full[None, None, None, :]


def sta_max_blocks(layout: TokenLayout, windows: Sequence[Sequence[int]]) -> int:
    """Largest number of key tiles one query tile attends to under any of ``windows``."""
    best = 1
    for w in windows:
        n = 1
        for x, g in zip(w, layout.tile_grid):
            n *= min(x, g)
        best = max(best, n)
    return best


# ---------------------------------------------------------------------------------------------- NA
class NeighborhoodSpec:
    """Resolved NATTEN parameters for one grid: kernel_size/stride/dilation/is_causal per (T, H, W)."""

    def __init__(self, grid, kernel_size, stride, dilation, is_causal):
        self.grid = tuple(grid)
        self.kernel_size = tuple(kernel_size)
        self.stride = tuple(stride)
        self.dilation = tuple(dilation)
        self.is_causal = tuple(is_causal)

    def key(self) -> tuple:
        return (self.grid, self.kernel_size, self.stride, self.dilation, self.is_causal)

    def masks_1d(self, device) -> list[torch.Tensor]:
        return [
            na_mask_1d(n, k, s, d, c, device)
            for n, k, s, d, c in zip(self.grid, self.kernel_size, self.stride, self.dilation, self.is_causal)
        ]

    def token_predicate(self, layout: TokenLayout):
        """``pred(q_idx, kv_idx) -> bool``: NATTEN neighborhood between layout slots (vmap/broadcast safe).

        Dummy query slots use their clamped coordinates (a real coordinate in the same tile); dummy key
        slots must be excluded separately with ``layout.key_valid``.
        """
        ct, ch, cw = (layout.coords[:, i].contiguous() for i in range(3))
        params = list(zip(self.grid, self.kernel_size, self.stride, self.dilation, self.is_causal))

        def pred(q_idx, kv_idx):
            ok = na_neighbor_1d(ct[q_idx], ct[kv_idx], *params[0])
            ok = ok & na_neighbor_1d(ch[q_idx], ch[kv_idx], *params[1])
            return ok & na_neighbor_1d(cw[q_idx], cw[kv_idx], *params[2])

        return pred


def na_fa4_aux(layout: TokenLayout, spec: NeighborhoodSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-slot data for the FA4 neighborhood ``mask_mod``: (windows int32 [P, 6], key coords int32 [P, 3]).

    windows[q] = (lo_t, hi_t, lo_h, hi_h, lo_w, hi_w) of query slot q (dummy query slots use their clamped
    coordinates); coords[k] = (t, h, w) of key slot k, and a large negative value at dummy key slots so no
    window contains them.
    """
    c = layout.coords
    bounds = []
    for i, params in enumerate(zip(spec.grid, spec.kernel_size, spec.stride, spec.dilation, spec.is_causal)):
        lo, hi = na_window_1d(c[:, i], *params)
        bounds += [lo, hi]
    windows = torch.stack(bounds, dim=1).to(torch.int32).contiguous()
    coords = torch.where(layout.key_valid[:, None], c, torch.full_like(c, -(1 << 20)))
    return windows, coords.to(torch.int32).contiguous()


def na_tables(layout: TokenLayout, spec: NeighborhoodSpec) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """NA block tables [1, 1, n, n] (any, full) and whether the pattern is tile-aligned.

    Tile-aligned means every ``any`` tile pair is attended completely (apart from dummy key slots), so the
    kernel needs only the key-padding mask -- e.g. stride equal to the tile and windows that are multiples
    of it (generalized neighborhood attention).
    """
    anys, alls = [], []
    for m, length, t, n in zip(spec.masks_1d(layout.device), layout.grid, layout.tile, layout.tile_grid):
        padded = n * t
        q = torch.arange(padded, device=layout.device)
        qc = q.clamp(max=length - 1)
        real_k = q < length
        ext = m[qc][:, qc] & real_k[None, :]  # [padded, padded]; padded query rows = clamped rows
        blocks = ext.view(n, t, n, t)
        anys.append(blocks.any(dim=3).any(dim=1))
        # "all" over real queries and real keys only (dummy keys are handled by tile_full / key_valid)
        neutral = ext | ~(real_k[:, None] & real_k[None, :])
        alls.append(neutral.view(n, t, n, t).all(dim=3).all(dim=1))
    any_ = _outer3(*anys)
    all_ = _outer3(*alls) & any_
    aligned = bool(torch.equal(any_, all_))
    full = all_ & layout.tile_full[None, :]
    return any_[None, None], full[None, None], aligned


def na_token_mask(layout: TokenLayout, spec: NeighborhoodSpec) -> torch.Tensor:
    """bool [P, P] over layout slots: NATTEN neighborhood (clamped query coords) and real keys."""
    m = spec.masks_1d(layout.device)
    c = layout.coords
    out = layout.key_valid[None, :].expand(layout.padded_tokens, -1).clone()
    for i in range(3):
        out &= m[i][c[:, i][:, None], c[:, i][None, :]]
    return out


# ---------------------------------------------------------------------------------------------- expansion
def expand_blocks(layout: TokenLayout, any_blocks: torch.Tensor) -> torch.Tensor:
    """Block table [Bm, Hm, nQ, nK] -> token mask [Bm, Hm, P, P] (block pattern & real keys)."""
    tile = torch.arange(layout.padded_tokens, device=layout.device) // layout.block_size
    m = any_blocks[:, :, tile][:, :, :, tile]
    return m & layout.key_valid[None, None, None, :]
