"""The GPU benchmark's logic on CPU: configs hit ~85% sparsity, every variant family runs and checks itself."""
import math
import time

import pytest
import torch

from benchmarks import sparse_bench, sparse_configs
from fastwan.attention.registry import create_backend


def fixed_ms(ms):
    """A timer that makes the calls and reports ``ms`` per call (figures that do not depend on the CPU's load)."""
    def timer(fn, calls):
        for _ in range(calls):
            fn()
        return ms
    return timer


def cpu_wall(fn):
    t = time.perf_counter()
    return fn(), time.perf_counter() - t


CPU = sparse_bench.Timers(call_ms=fixed_ms(2.0), stream_ms=fixed_ms(3.0), wall=cpu_wall)
GRID, HEADS = (5, 7, 9), 2
CASES = [
    ("sta", "SLIDING_TILE_ATTN", {"tile": [2, 3, 4], "window": [3, 1, 3]}),
    ("vsa", "VIDEO_SPARSE_ATTN", {"tile": [2, 3, 4], "sparsity": 0.6}),
    ("na", "NEIGHBORHOOD_ATTN", {"tile": "auto", "kernel_size": [3, 5, 5]}),
    ("gna", "NEIGHBORHOOD_ATTN", {"tile": [2, 3, 4], "kernel_size": [2, 3, 4], "stride": [2, 3, 4]}),
]


@pytest.fixture(scope="module")
def qkv():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, math.prod(GRID), HEADS, 16, generator=g) for _ in range(3)]


def test_configs_target_85_percent():
    grid = (21, 30, 52)
    for label, name, conf, _ in sparse_configs.variants(grid):
        if name == "SLIDING_TILE_ATTN":
            n = create_backend(name, {"tile": conf["tile"]}).layout(grid, "cpu").tile_grid
            d = math.prod(min(w, t) for w, t in zip(conf["window"], n)) / math.prod(n)
        elif name == "NEIGHBORHOOD_ATTN":
            d = math.prod(k / g for k, g in zip(conf["kernel_size"], grid))
        else:
            d = 1 - conf["sparsity"]
        assert 0.11 <= d <= 0.19, (label, d)


@pytest.mark.parametrize("label,name,conf", CASES, ids=[c[0] for c in CASES])
def test_run_variant_on_cpu(label, name, conf, qkv):
    row = sparse_bench.run_variant(label, name, {**conf, "kernel": "sdpa"}, GRID, HEADS, qkv, 1, dense_ms=1.0,
                                   timers=CPU)
    assert row["max_err"] < 1e-4, row
    assert 0 < row["attended"] <= row["work"] + 1e-9 and row["block_density"] <= 1
    assert row["ms"] == 2.0 and row["dense_ms"] == 1.0 and row["speedup"] == 0.5


def test_rounds_alternate_with_the_dense_kernel(qkv):
    """rounds=3: the variant and the dense reference alternate, and the speedup uses the adjacent dense times."""
    dense_calls = []

    def dense(q, k, v):
        dense_calls.append(1)
        return q * 1.0

    extras = sparse_bench.Extras(rounds=3)
    row = sparse_bench.run_variant("sta", "SLIDING_TILE_ATTN", {**CASES[0][2], "kernel": "sdpa"}, GRID, HEADS, qkv,
                                   1, dense_ms=1e6, dense=dense, timers=CPU, extras=extras)
    assert len(row["ms_rounds"]) == len(row["dense_ms_rounds"]) == 3
    assert row["stream_rounds"] == row["dense_stream_rounds"] == [3.0] * 3 and row["stream_speedup"] == 1.0
    assert row["dense_ms"] == 2.0 and row["speedup"] == 1.0  # the dense times of the rounds, not dense_ms=1e6
    assert len(dense_calls) == 6  # one call per round from call_ms and one from stream_ms (iters=1)
    with pytest.raises(ValueError, match="pass dense="):
        sparse_bench.run_variant("sta", "SLIDING_TILE_ATTN", {**CASES[0][2], "kernel": "sdpa"}, GRID, HEADS, qkv, 1,
                                 dense_ms=1.0, timers=CPU, extras=extras)


def test_sta_window_search_balanced():
    assert sparse_configs.sta_window((11, 4, 7)) == [5, 3, 3]


def test_sta_window_closest_to_target():
    """closest=True: the odd window whose tile density is nearest to 15% (7x3x13 tiles: 39/273 = 14.3%)."""
    tiles = (7, 3, 13)
    w = sparse_configs.sta_window(tiles, closest=True)
    best = min(abs(math.log(a * b * c / math.prod(tiles) / 0.15)) for a in range(1, 8, 2) for b in range(1, 4, 2)
               for c in range(1, 14, 2))
    assert abs(math.log(math.prod(w) / math.prod(tiles) / 0.15)) == best
    assert math.prod(w) == 39
