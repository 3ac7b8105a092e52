"""3D tile-major token layout for the sparse video attention backends.

The DiT keeps its video tokens in raster order ``t``-major, then ``h``, then ``w`` (``[B, T*H*W, C]``). Sparse
attention wants tokens that are close in 3D to be close in the sequence, so that a block of the attention
kernel (64 or 128 tokens) is a small 3D box. :class:`TokenLayout` reorders the sequence once per DiT forward:

* the grid ``(T, H, W)`` is cut into tiles of ``tile = (tt, th, tw)`` tokens; a grid that the tile does not
  divide is padded at its far end up to ``padded_grid`` (a multiple of the tile);
* tiles are laid out one after the other in raster order of the tile grid; inside a tile tokens are in
  raster order of the tile;
* every tile occupies ``block_size >= tt*th*tw`` consecutive slots, so tile ``i`` is exactly the sequence
  range ``[i*block_size, (i+1)*block_size)`` and maps to one block of the block-sparse kernel. Slots past
  ``tt*th*tw`` ("slot padding") and slots of grid padding are *dummy* slots.

Dummy slots are zero after :meth:`TokenLayout.permute`, are never attended to as keys (``key_valid`` is False
there) and are dropped by :meth:`TokenLayout.unpermute`. Every tile holds at least one real token, because
the padding of each dimension is smaller than the tile.

``permute`` is one scatter into a zero buffer (``index_copy``; a plain ``index_select`` when there are no
dummy slots) and ``unpermute`` is one ``index_select``; both index tensors are precomputed.

The DiT keeps its stream in the *compact* layout order instead: the slots' order without the dummy slots
(:meth:`TokenLayout.permute_compact`), so its projections, norms and FFN run on real tokens only (a 4x4x4 tile
pads the 21 x 30 x 52 grid of 480p to 1.22x its tokens). Around each sparse attention call the dispatch pads
q, k, v to the slots (:meth:`TokenLayout.pad_slots`) and drops the dummy rows of the output
(:meth:`TokenLayout.drop_slots`).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import product

import torch

from fastwan.kernels.rows import pad_rows_reference  # also registers fastwan::pad_rows
from fastwan.errors import InvalidArgument

Triple = tuple[int, int, int]

# Tiles ``choose_tile`` considers: at most this many frames, and h/w between these bounds (tokens).
_AUTO_MAX_T = 4
_AUTO_MIN_HW, _AUTO_MAX_HW = 4, 16


def _as_triple(value, name: str, *, allow_scalar: bool = True) -> Triple:
    """Validate ``value`` as three positive ints (a scalar is repeated when ``allow_scalar``)."""
    if allow_scalar and isinstance(value, int) and not isinstance(value, bool):
        value = (value, value, value)
    if (
        not isinstance(value, Sequence)
        or isinstance(value, str)
        or len(value) != 3
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in value)
    ):
        raise InvalidArgument(
            f"{name}={value!r} must be three integers (T, H, W)"
            + (" or one integer for all three" if allow_scalar else "")
            + "; e.g. [2, 8, 8]."
        )
    if any(x < 1 for x in value):
        raise InvalidArgument(f"{name}={list(value)!r}: every entry must be >= 1.")
    return (int(value[0]), int(value[1]), int(value[2]))


def default_block_size(tile: Triple) -> int:
    """Slots per tile when none is given: the tile's token count rounded up to a multiple of 64."""
    return max(64, -(-math.prod(tile) // 64) * 64)


def choose_tile(grid: Sequence[int], block_size: int = 128) -> Triple:
    """The tile for ``tile="auto"``: fewest total slots for ``grid`` with ``block_size`` slots per tile.

    Candidates have at most ``block_size`` tokens (and at least 3/4 of it), ``t <= 4`` frames and
    ``4 <= h, w <= 16`` tokens, each clamped to the grid. Ties prefer more real tokens per tile, then the
    most cube-like tile. Example: grid (21, 30, 52) -> (3, 10, 4) (1.067x slots), (21, 45, 80) -> (1, 8, 16) (1.067x).
    """
    grid = _as_triple(tuple(grid), "grid", allow_scalar=False)
    best = None
    for t, h, w in product(range(1, _AUTO_MAX_T + 1), range(_AUTO_MIN_HW, _AUTO_MAX_HW + 1),
                           range(_AUTO_MIN_HW, _AUTO_MAX_HW + 1)):
        tile = (min(t, grid[0]), min(h, grid[1]), min(w, grid[2]))
        n = math.prod(tile)
        if n > block_size or (4 * n < 3 * block_size and tile == (t, h, w)):
            continue
        tiles = math.prod(-(-g // s) for g, s in zip(grid, tile))
        key = (tiles * block_size, -n, max(tile) / min(tile), tile)
        if best is None or key < best:
            best = key
    if best is None:  # unreachable for block_size >= 16; keep the error explicit anyway
        raise InvalidArgument(f"no tile of at most {block_size} tokens fits grid {grid}; give tile= explicitly.")
    return best[3]


class TokenLayout:
    """Raster <-> 3D tile-major token order for one grid.

    Attributes (all tensors live on ``device``):
        grid: (T, H, W) token grid; tile: (tt, th, tw); block_size: slots per tile.
        padded_grid: grid rounded up to a multiple of the tile; tile_grid: tiles per dimension.
        num_tiles, tile_tokens (tt*th*tw), num_tokens (T*H*W), padded_tokens (num_tiles*block_size).
        key_valid: bool [padded_tokens], True at real tokens.
        slot_of_token: long [num_tokens], slot of raster token i (the unpermute gather index).
        token_of_slot: long [padded_tokens], raster index of each slot, -1 at dummy slots.
        real_slots: long [num_tokens], the slots of real tokens, ascending: row r of the compact order is slot
            ``real_slots[r]``; row_of_slot: long [padded_tokens], its inverse (-1 at dummy slots).
        token_of_row / row_of_token: long [num_tokens], raster token of compact row r / compact row of raster
            token i.
        coords: long [padded_tokens, 3], (t, h, w) of each slot; dummy slots get the nearest real coordinate
            inside their own tile (grid padding is clamped to the last index, slot padding gets the tile
            origin), so a dummy query row has a well-defined, non-empty neighborhood.
        tile_valid_counts: long [num_tiles], real tokens per tile (>= 1).
        tile_full: bool [num_tiles], True where a tile has no dummy slot.
        real_prefix_tiles: True when the tile divides the grid, so every tile's real tokens are its first
            ``tile_tokens`` slots; all_tiles_partial: True / False / None (every / no / some tile has dummies).
    """

    def __init__(
        self,
        grid: Sequence[int],
        tile: Sequence[int] | int,
        block_size: int | None = None,
        device: torch.device | str = "cpu",
    ):
        self.grid: Triple = _as_triple(tuple(grid), "grid", allow_scalar=False)
        self.tile: Triple = _as_triple(tile if isinstance(tile, int) else tuple(tile), "tile")
        self.tile_tokens = math.prod(self.tile)
        if block_size is None:
            block_size = default_block_size(self.tile)
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < self.tile_tokens:
            raise InvalidArgument(
                f"block_size={block_size!r} must be an integer >= the tile's token count "
                f"{self.tile_tokens} (tile {list(self.tile)}); leave it unset for the default "
                f"{default_block_size(self.tile)}."
            )
        self.block_size = int(block_size)
        self.device = torch.device(device)
        self.tile_grid: Triple = tuple(-(-g // t) for g, t in zip(self.grid, self.tile))  # type: ignore
        self.padded_grid: Triple = tuple(n * t for n, t in zip(self.tile_grid, self.tile))  # type: ignore
        self.num_tiles = math.prod(self.tile_grid)
        self.num_tokens = math.prod(self.grid)
        self.padded_tokens = self.num_tiles * self.block_size
        self._build()

    def _build(self) -> None:
        T, H, W = self.grid
        tt, th, tw = self.tile
        nt, nh, nw = self.tile_grid
        slot = torch.arange(self.padded_tokens, dtype=torch.long)
        tile_id, local = slot // self.block_size, slot % self.block_size
        in_tile = local < self.tile_tokens
        local = torch.where(in_tile, local, torch.zeros_like(local))  # slot padding -> tile origin
        a, b, c = tile_id // (nh * nw), (tile_id // nw) % nh, tile_id % nw
        it, ih, iw = local // (th * tw), (local // tw) % th, local % tw
        t, h, w = a * tt + it, b * th + ih, c * tw + iw
        valid = in_tile & (t < T) & (h < H) & (w < W)
        raster = (t * H + h) * W + w
        token_of_slot = torch.where(valid, raster, torch.full_like(raster, -1))
        slot_of_token = torch.empty(self.num_tokens, dtype=torch.long)
        slot_of_token[token_of_slot[valid]] = slot[valid]
        coords = torch.stack([t.clamp(max=T - 1), h.clamp(max=H - 1), w.clamp(max=W - 1)], dim=1)
        counts = valid.view(self.num_tiles, self.block_size).sum(1)
        dev = self.device
        self.key_valid = valid.to(dev)
        self.token_of_slot = token_of_slot.to(dev)
        self.slot_of_token = slot_of_token.to(dev)
        self.coords = coords.to(dev)
        real = valid.nonzero().squeeze(1)  # the compact order: real slots in slot order
        row_of_token = torch.empty(self.num_tokens, dtype=torch.long)
        row_of_token[token_of_slot[real]] = torch.arange(self.num_tokens)
        row_of_slot = torch.full((self.padded_tokens,), -1, dtype=torch.long)
        row_of_slot[real] = torch.arange(self.num_tokens)
        self.real_slots = real.to(dev)
        self.row_of_slot = row_of_slot.to(dev)
        self.token_of_row = token_of_slot[real].to(dev)
        self.row_of_token = row_of_token.to(dev)
        self.tile_valid_counts = counts.to(dev)
        self.tile_full = (counts == self.block_size).to(dev)
        self.has_dummies = self.padded_tokens != self.num_tokens
        # every tile holds its real tokens in its first tile_tokens slots (the tile divides the grid)
        self.real_prefix_tiles = self.padded_grid == self.grid
        n_full = int((counts == self.block_size).sum())
        # True: every tile has a dummy slot; False: none has; None: mixed
        self.all_tiles_partial = True if n_full == 0 else (False if n_full == self.num_tiles else None)

    # ------------------------------------------------------------------ reorder
    def _check(self, x: torch.Tensor, dim: int, expected: int, what: str, hint: str) -> int:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{what} takes a torch.Tensor, got {type(x).__name__}")
        d = dim % x.dim() if x.dim() else 0
        if x.dim() == 0 or x.shape[d] != expected:
            raise ValueError(
                f"{what}: dim {dim} of shape {tuple(x.shape)} must have {expected} tokens for grid "
                f"{list(self.grid)} (tile {list(self.tile)}, {self.num_tokens} tokens in {self.padded_tokens} "
                f"slots); {hint}."
            )
        if x.device != self.device:
            raise ValueError(
                f"{what}: tensor is on {x.device} but this layout was built for {self.device}; "
                "build the layout on the tensor's device (backend.layout(grid, x.device))."
            )
        return d

    def permute(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Raster order -> tile-major layout order along ``dim``: [..., num_tokens, ...] -> [..., padded_tokens, ...].

        Dummy slots are zero. Works for activations [B, S, C], RoPE tables [1, S, 1, D], per-token
        embeddings, etc.
        """
        d = self._check(x, dim, self.num_tokens, "permute", "permute raster-order tokens")
        if not self.has_dummies:
            return x.index_select(d, self.token_of_slot)
        shape = list(x.shape)
        shape[d] = self.padded_tokens
        return x.new_zeros(shape).index_copy(d, self.slot_of_token, x)

    def unpermute(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Layout order -> raster order along ``dim``: [..., padded_tokens, ...] -> [..., num_tokens, ...]."""
        d = self._check(x, dim, self.padded_tokens, "unpermute", "unpermute layout-order tokens")
        return x.index_select(d, self.slot_of_token)

    def permute_compact(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Raster order -> compact layout order (the slots' order, dummy slots left out) along ``dim``; the
        length stays ``num_tokens``. Equals ``drop_slots(permute(x))``."""
        d = self._check(x, dim, self.num_tokens, "permute_compact", "permute raster-order tokens")
        return x.index_select(d, self.token_of_row)

    def unpermute_compact(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Compact layout order -> raster order along ``dim`` (the inverse of :meth:`permute_compact`)."""
        d = self._check(x, dim, self.num_tokens, "unpermute_compact", "unpermute compact-order tokens")
        return x.index_select(d, self.row_of_token)

    def pad_slots(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Compact order -> layout order along ``dim``: [..., num_tokens, ...] -> [..., padded_tokens, ...], the
        dummy slots zero (``x`` itself when there are none)."""
        d = self._check(x, dim, self.num_tokens, "pad_slots", "pad compact-order tokens")
        if not self.has_dummies:
            return x
        if d == 1 and not (torch.is_grad_enabled() and x.requires_grad):  # one pass of fastwan::pad_rows
            return torch.ops.fastwan.pad_rows(x, self.row_of_slot)
        return pad_rows_reference(x, self.row_of_slot, d)  # other dims, and autograd (the op has no backward)

    def drop_slots(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Layout order -> compact order along ``dim``: the rows of the real slots (``x`` itself when there are no
        dummy slots)."""
        d = self._check(x, dim, self.padded_tokens, "drop_slots", "drop the dummy slots of layout-order tokens")
        return x if not self.has_dummies else x.index_select(d, self.real_slots)

    # ------------------------------------------------------------------ helpers
    def tile_coords(self) -> torch.Tensor:
        """long [num_tiles, 3]: tile-grid coordinate of every tile (raster order of the tile grid)."""
        i = torch.arange(self.num_tiles, device=self.device)
        nt, nh, nw = self.tile_grid
        return torch.stack([i // (nh * nw), (i // nw) % nh, i % nw], dim=1)

    def describe(self) -> str:
        return (
            f"grid {list(self.grid)} tile {list(self.tile)} ({self.tile_tokens} tokens, {self.block_size} slots) "
            f"-> {list(self.tile_grid)} tiles, {self.padded_tokens} slots "
            f"({self.padded_tokens / self.num_tokens:.3f}x tokens)"
        )

    def __repr__(self) -> str:
        return f"TokenLayout({self.describe()}, device={self.device})"
