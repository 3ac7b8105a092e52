"""NEIGHBORHOOD_ATTN: 3D neighborhood attention with NATTEN's semantics, on the tile-major layout.

Each query attends to the keys of its (T, H, W) neighborhood: ``kernel_size`` keys per dimension, centered on
the query and shifted at the borders, with NATTEN's ``stride`` (groups of ``stride`` queries share the window
of their center), ``dilation`` (attend every ``dilation``-th token) and ``is_causal`` (a dimension only looks
back) -- see :mod:`fastwan.attention.sparse.masks` for the exact rule. Tokens are permuted once per DiT forward
(not per call as NATTEN does); the pattern becomes a block table over tiles, so with ``stride`` equal to the
tile and kernel sizes that are multiples of it (NATTEN's generalized neighborhood attention) every block is
either empty or full.

Config::

    {
      "kernel_size": [7, 15, 15],   # per (T, H, W); one int = all three; -1 = the whole dimension;
                                    # absent or null: DEFAULT_KERNEL_SIZE fitted to each grid
      "stride": 1,                  # 1 <= stride <= kernel_size
      "dilation": 1,                # kernel_size * dilation <= grid size
      "is_causal": false,           # bool or [bool, bool, bool]
      "tile": "auto",               # or [t, h, w]; only affects speed, not the result ("auto": the stride
                                    # when it holds 96-128 tokens, else the fewest-slots tile)
      "block_size": null, "dense_steps": 0, "kernel": "auto", "kernel_options": {}
    }

Rule for the kernel size: an explicit ``kernel_size`` is used as given and must fit the grid
(``kernel_size * dilation <= size``, else a clear error). The default fits any grid: each entry of
:data:`DEFAULT_KERNEL_SIZE` is clamped to ``size // dilation`` -- with dilation 1 a clamped entry spans the
whole dimension, like ``-1`` (e.g. a 9-frame 768x1280 Wan2.1 video has the DiT grid 3x48x80 and gets the
kernel (3, 15, 15)).
"""
from __future__ import annotations

import math
from typing import Any

from fastwan.attention.base import AttentionMetadata, reject_unknown
from fastwan.attention.sparse.layout import TokenLayout
from fastwan.attention.sparse import config as cfg
from fastwan.attention.sparse import masks
from fastwan.attention.sparse.common import SparseVideoBackend
from fastwan.attention.sparse.plan import BlockPlan
from fastwan.errors import InvalidArgument

_DIMS = ("T", "H", "W")
DEFAULT_KERNEL_SIZE = (7, 15, 15)  # (T, H, W); clamped to each grid (see the module docstring)


class NeighborhoodBackend(SparseVideoBackend):
    name = "NEIGHBORHOOD_ATTN"
    KEYS = ("kernel_size", "stride", "dilation", "is_causal") + SparseVideoBackend.COMMON_KEYS

    def __init__(
        self,
        kernel_size: Any = None,
        stride: Any = 1,
        dilation: Any = 1,
        is_causal: Any = False,
        tile: Any = "auto",
        block_size: int | None = None,
        dense_steps: int = 0,
        kernel: str = "auto",
        kernel_options: dict | None = None,
        **unknown: Any,
    ):
        reject_unknown(self.name, unknown, self.KEYS)
        super().__init__(tile=tile, block_size=block_size, dense_steps=dense_steps, kernel=kernel,
                         kernel_options=kernel_options)
        self.kernel_size_given = kernel_size is not None  # only the default is fitted to the grid
        self.kernel_size = cfg.triple(DEFAULT_KERNEL_SIZE if kernel_size is None else kernel_size, "kernel_size",
                                      allow_minus_one=True)
        self.stride = cfg.triple(stride, "stride")
        self.dilation = cfg.triple(dilation, "dilation")
        self.is_causal = cfg.bool_triple(is_causal, "is_causal")
        for i, (k, s) in enumerate(zip(self.kernel_size, self.stride)):
            if k != -1 and s > k:
                raise InvalidArgument(
                    f"stride={list(self.stride)}: stride[{i}] ({_DIMS[i]}) = {s} is larger than "
                    f"kernel_size[{i}] = {k}; NATTEN requires stride <= kernel_size (queries of a stride group "
                    f"share one window). Use stride <= {k}."
                )
        self._specs: dict = {}

    def tile_for(self, grid) -> tuple[int, int, int]:
        """``tile="auto"`` with a stride whose token count fills 3/4 to all of a block: the tile is the stride
        (clamped to the grid), so GNA windows (kernel sizes that are odd multiples of the stride) fall on tile
        boundaries -- block-sparse with full blocks only where the tile divides the grid. Otherwise the
        fewest-slots tile of :func:`~fastwan.attention.sparse.layout.choose_tile`."""
        if self.tile == "auto" and any(s > 1 for s in self.stride):
            tile = tuple(min(s, g) for s, g in zip(self.stride, grid))
            if 4 * math.prod(tile) >= 3 * (self.block_size or 128) and math.prod(tile) <= (self.block_size or 128):
                return tile
        return super().tile_for(grid)

    def kernel_for(self, grid) -> tuple[int, int, int]:
        """The kernel size used on ``grid``: an explicit one with ``-1`` -> the grid size (checked later by
        :meth:`spec`); the default with each entry clamped to ``size // dilation`` (at least 1)."""
        if self.kernel_size_given:
            return tuple(g if k == -1 else k for k, g in zip(self.kernel_size, grid))
        return tuple(max(1, min(k, g // d)) for k, g, d in zip(self.kernel_size, grid, self.dilation))

    def spec(self, grid) -> masks.NeighborhoodSpec:
        """NATTEN parameters resolved for ``grid`` (:meth:`kernel_for`), validated against it."""
        grid = tuple(grid)
        if grid not in self._specs:
            ks = self.kernel_for(grid)
            for i, (k, d, s, g) in enumerate(zip(ks, self.dilation, self.stride, grid)):
                self._check_dim(i, k, d, s, g, grid)
            self._specs[grid] = masks.NeighborhoodSpec(grid, ks, self.stride, self.dilation, self.is_causal)
        return self._specs[grid]

    def _check_dim(self, i: int, k: int, d: int, s: int, g: int, grid) -> None:
        """NATTEN's rules along dimension ``i`` of ``grid``: dilation <= size, kernel * dilation <= size,
        stride <= kernel."""
        origin = "" if self.kernel_size_given else " (the default kernel_size fitted to the grid)"
        if d > g:
            raise InvalidArgument(
                f"{self.name}: dilation[{i}] = {d} exceeds the grid size {g} along {_DIMS[i]} (grid {list(grid)}); "
                f"NATTEN requires kernel_size * dilation <= size. Use dilation[{i}] <= {g}."
            )
        if k * d > g:
            raise InvalidArgument(
                f"{self.name}: kernel_size[{i}] * dilation[{i}] = {k} * {d} = {k * d} exceeds the grid "
                f"size {g} along {_DIMS[i]} (grid {list(grid)}); NATTEN requires "
                f"kernel_size * dilation <= size. Use kernel_size[{i}] <= {g // d} (or -1 for the whole "
                "dimension), or leave kernel_size unset for a default that fits."
            )
        if s > k:
            raise InvalidArgument(
                f"{self.name}: stride[{i}] = {s} > kernel_size[{i}] = {k}{origin} along {_DIMS[i]} for grid "
                f"{list(grid)}; NATTEN requires stride <= kernel_size. Use stride[{i}] <= {k}."
            )

    def validate_grid(self, layout: TokenLayout) -> None:
        self.spec(layout.grid)

    def plan(self, layout: TokenLayout, meta: AttentionMetadata | None = None, heads: int = 1) -> BlockPlan:
        spec = self.spec(layout.grid)
        key = ("na", str(layout.device), spec.key())

        def make():
            any_, full, aligned = masks.na_tables(layout, spec)
            if aligned:
                return BlockPlan(layout, any_, full, name="keys")
            return BlockPlan(
                layout, any_, full,
                token_pred=spec.token_predicate(layout),
                token_mask=lambda: masks.na_token_mask(layout, spec),
                fa4_mask=lambda: ("na", spec.dilation, masks.na_fa4_aux(layout, spec)),
                name=f"na{spec.key()}",
            )

        return self._plans.get_or(key, make)

    def config_repr(self) -> str:
        ks = list(self.kernel_size) if self.kernel_size_given else f"default {list(self.kernel_size)} fitted to grid"
        return (f"kernel_size={ks}, stride={list(self.stride)}, "
                f"dilation={list(self.dilation)}, is_causal={list(self.is_causal)}, " + super().config_repr())
