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
      "kernel_size": [7, 15, 15],   # per (T, H, W); one int = all three; -1 = the whole dimension
      "stride": 1,                  # 1 <= stride <= kernel_size
      "dilation": 1,                # kernel_size * dilation <= grid size
      "is_causal": false,           # bool or [bool, bool, bool]
      "tile": "auto",               # or [t, h, w]; only affects speed, not the result ("auto": the stride
                                    # when it holds 96-128 tokens, else the fewest-slots tile)
      "block_size": null, "dense_steps": 0, "kernel": "auto", "kernel_options": {}
    }
"""
from __future__ import annotations

import math
from typing import Any

from fastwan.attention.base import AttentionMetadata
from fastwan.attention.layout import TokenLayout
from fastwan.attention.sparse import config as cfg
from fastwan.attention.sparse import masks
from fastwan.attention.sparse.common import SparseVideoBackend
from fastwan.attention.sparse.kernels import BlockPlan

_DIMS = ("T", "H", "W")


class NeighborhoodBackend(SparseVideoBackend):
    name = "NEIGHBORHOOD_ATTN"
    KEYS = ("kernel_size", "stride", "dilation", "is_causal") + SparseVideoBackend.COMMON_KEYS

    def __init__(
        self,
        kernel_size: Any = (7, 15, 15),
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
        cfg.reject_unknown(self.name, unknown, self.KEYS)
        super().__init__(tile=tile, block_size=block_size, dense_steps=dense_steps, kernel=kernel,
                         kernel_options=kernel_options)
        self.kernel_size = cfg.triple(kernel_size, "kernel_size", allow_minus_one=True)
        self.stride = cfg.triple(stride, "stride")
        self.dilation = cfg.triple(dilation, "dilation")
        self.is_causal = cfg.bool_triple(is_causal, "is_causal")
        for i, (k, s) in enumerate(zip(self.kernel_size, self.stride)):
            if k != -1 and s > k:
                raise ValueError(
                    f"stride={list(self.stride)}: stride[{i}] ({_DIMS[i]}) = {s} is larger than "
                    f"kernel_size[{i}] = {k}; NATTEN requires stride <= kernel_size (queries of a stride group "
                    f"share one window). Use stride <= {k}."
                )
        self._specs: dict = {}

    def tile_for(self, grid) -> tuple[int, int, int]:
        """``tile="auto"`` with a stride whose token count fills 3/4 to all of a block: the tile is the stride
        (clamped to the grid), so GNA windows (kernel sizes that are odd multiples of the stride) fall on tile
        boundaries -- block-sparse with full blocks only where the tile divides the grid. Otherwise the
        fewest-slots tile of :func:`~fastwan.attention.layout.choose_tile`."""
        if self.tile == "auto" and any(s > 1 for s in self.stride):
            tile = tuple(min(s, g) for s, g in zip(self.stride, grid))
            if 4 * math.prod(tile) >= 3 * (self.block_size or 128) and math.prod(tile) <= (self.block_size or 128):
                return tile
        return super().tile_for(grid)

    def spec(self, grid) -> masks.NeighborhoodSpec:
        """NATTEN parameters resolved for ``grid`` (``-1`` -> grid size), validated against it."""
        grid = tuple(grid)
        if grid not in self._specs:
            ks = tuple(g if k == -1 else k for k, g in zip(self.kernel_size, grid))
            for i, (k, d, s, g) in enumerate(zip(ks, self.dilation, self.stride, grid)):
                if k * d > g:
                    raise ValueError(
                        f"{self.name}: kernel_size[{i}] * dilation[{i}] = {k} * {d} = {k * d} exceeds the grid "
                        f"size {g} along {_DIMS[i]} (grid {list(grid)}); NATTEN requires "
                        f"kernel_size * dilation <= size. Use kernel_size[{i}] <= {g // d} (or -1 for the whole "
                        "dimension)."
                    )
                if s > k:
                    raise ValueError(
                        f"{self.name}: stride[{i}] = {s} > kernel_size[{i}] = {k} along {_DIMS[i]} for grid "
                        f"{list(grid)}; use stride <= kernel_size."
                    )
            self._specs[grid] = masks.NeighborhoodSpec(grid, ks, self.stride, self.dilation, self.is_causal)
        return self._specs[grid]

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
        return (f"kernel_size={list(self.kernel_size)}, stride={list(self.stride)}, "
                f"dilation={list(self.dilation)}, is_causal={list(self.is_causal)}, " + super().config_repr())
