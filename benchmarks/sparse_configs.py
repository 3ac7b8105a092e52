"""Sparse attention configurations at ~85% sparsity for a token grid: the variants that ``benchmarks.sparse_bench``
times and ``benchmarks.e2e --phase sparse`` runs end to end.

A variant is (label, backend name, config, core?): core variants run first on every grid. STA windows and
neighborhood kernel sizes are searched for a density near :data:`TARGET`; within 25% of it the most balanced
shape (per-dimension fractions closest to each other) wins, else the closest density.
"""
from __future__ import annotations

import itertools
import math

from fastwan.attention.registry import create_backend
from fastwan.attention.sparse.layout import choose_tile

GRIDS = ((21, 30, 52), 12), ((21, 45, 80), 40)  # (token grid, heads): Wan2.1 1.3B 480p, 14B 720p
TARGET = 0.15  # attended fraction (85% sparsity)


def _pick(candidates, target):
    """(density, fractions, value): within 25% of ``target`` the most balanced shape wins, else the closest."""
    def balance(c):
        return max(c[1]) - min(c[1])

    near = [c for c in candidates if abs(math.log(c[0] / target)) <= math.log(1.25)]
    if near:
        return min(near, key=lambda c: (balance(c), abs(math.log(c[0] / target))))[2]
    return min(candidates, key=lambda c: abs(math.log(c[0] / target)))[2]


def sta_window(tile_grid, target=TARGET, closest=False):
    """Odd window (tiles), w <= tiles per dim, with tile density prod(w) / prod(n) near ``target``.

    ``closest``: the density nearest to ``target`` (else a balanced shape within 25% of it wins)."""
    cands = []
    for w in itertools.product(*[range(1, n + 1, 2) for n in tile_grid]):
        fr = [a / n for a, n in zip(w, tile_grid)]
        cands.append((math.prod(fr), fr, list(w)))
    if closest:
        return min(cands, key=lambda c: (abs(math.log(c[0] / target)), max(c[1]) - min(c[1])))[2]
    return _pick(cands, target)


def na_kernel(grid, stride=(1, 1, 1), target=TARGET, closest=False):
    """kernel_size with prod(k / L) near ``target``; with stride > 1 only odd multiples of the stride.

    ``closest``: the density nearest to ``target`` (else a balanced shape within 25% of it wins)."""
    opts = []
    for L, s in zip(grid, stride):
        ks = [k for k in range(1, L + 1) if s == 1 or (k % s == 0 and (k // s) % 2 == 1)]
        opts.append(ks or [L])
    cands = []
    for k in itertools.product(*opts):
        fr = [a / L for a, L in zip(k, grid)]
        cands.append((math.prod(fr), fr, list(k)))
    if closest:
        return min(cands, key=lambda c: (abs(math.log(c[0] / target)), max(c[1]) - min(c[1])))[2]
    return _pick(cands, target)


def variants(grid):
    """(label, backend name, config, core?) in priority order; core variants run first on every grid."""
    def sta(tile, kernel, core, options=None, closest=False):
        probe = create_backend("SLIDING_TILE_ATTN", {"tile": tile}).layout(grid, "cpu")
        tag = ("x".join(map(str, tile)) if tile != "auto" else "auto") + ("85" if closest else "")
        conf = {"tile": tile, "window": sta_window(probe.tile_grid, closest=closest), "kernel": kernel}
        if options:
            conf["kernel_options"] = options
        return (f"sta-{tag}-{kernel}" + ("-bn128" if options else ""), "SLIDING_TILE_ATTN", conf, core)

    vsa = {"sparsity": 1 - TARGET}
    auto = list(choose_tile(grid))  # the tile "auto" picks (fewest slots)
    return [
        sta("auto", "fa4", True),
        sta("auto", "fa4", True, closest=True),  # the window whose density is nearest to 15%
        sta([2, 8, 8], "fa4", True),
        ("vsa-auto-fa4", "VIDEO_SPARSE_ATTN", {"tile": "auto", **vsa, "kernel": "fa4"}, True),
        ("gna-auto-fa4", "NEIGHBORHOOD_ATTN",  # stride = the auto tile: GNA windows on tile boundaries
         {"kernel_size": na_kernel(grid, auto), "stride": auto, "tile": "auto", "kernel": "fa4"}, True),
        ("gna-auto85-fa4", "NEIGHBORHOOD_ATTN",  # the same, kernel_size with the density closest to 15%
         {"kernel_size": na_kernel(grid, auto, closest=True), "stride": auto, "tile": "auto", "kernel": "fa4"}, True),
        ("gna-2x8x8-fa4", "NEIGHBORHOOD_ATTN",
         {"kernel_size": na_kernel(grid, (2, 8, 8)), "stride": [2, 8, 8], "tile": [2, 8, 8], "kernel": "fa4"}, True),
        ("na-auto-fa4", "NEIGHBORHOOD_ATTN", {"kernel_size": na_kernel(grid), "tile": "auto", "kernel": "fa4"},
         True),
        sta([2, 8, 8], "flex", False),
        sta("auto", "flex", False),
        ("vsa-4x4x4-flex", "VIDEO_SPARSE_ATTN", {"tile": [4, 4, 4], **vsa, "kernel": "flex"}, False),
        ("vsa-auto-flex", "VIDEO_SPARSE_ATTN", {"tile": "auto", **vsa, "kernel": "flex"}, False),
        ("na-auto-flex", "NEIGHBORHOOD_ATTN", {"kernel_size": na_kernel(grid), "tile": "auto", "kernel": "flex"},
         False),
        ("gna-2x8x8-flex", "NEIGHBORHOOD_ATTN",
         {"kernel_size": na_kernel(grid, (2, 8, 8)), "stride": [2, 8, 8], "tile": [2, 8, 8], "kernel": "flex"},
         False),
        ("vsa-2x8x8-fa4", "VIDEO_SPARSE_ATTN", {"tile": [2, 8, 8], **vsa, "kernel": "fa4"}, False),
    ]
