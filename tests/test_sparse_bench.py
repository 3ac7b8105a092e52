"""The GPU benchmark's logic on CPU: configs hit ~85% sparsity, every variant family runs and checks itself."""
import importlib.util
import math
import time
from pathlib import Path

import pytest
import torch

spec = importlib.util.spec_from_file_location(
    "sparse_bench", Path(__file__).resolve().parents[1] / "benchmarks" / "sparse_bench.py")
sb = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sb)


def test_configs_target_85_percent():
    grid = (21, 30, 52)
    for label, name, conf, _ in sb.variants(grid):
        if name == "SLIDING_TILE_ATTN":
            n = sb.create_backend(name, {"tile": conf["tile"]}).layout(grid, "cpu").tile_grid
            d = math.prod(min(w, t) for w, t in zip(conf["window"], n)) / math.prod(n)
        elif name == "NEIGHBORHOOD_ATTN":
            d = math.prod(k / g for k, g in zip(conf["kernel_size"], grid))
        else:
            d = 1 - conf["sparsity"]
        assert 0.11 <= d <= 0.19, (label, d)


def test_run_variant_on_cpu(monkeypatch):
    def cpu_time(fn, iters, warmup=0):
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    def cpu_wall(fn):
        t = time.perf_counter()
        return fn(), time.perf_counter() - t

    monkeypatch.setattr(sb, "cuda_time", cpu_time)
    monkeypatch.setattr(sb, "stream_ms", lambda fn, calls: cpu_time(fn, calls) + 1.0)  # > 0 after rounding
    monkeypatch.setattr(sb, "wall", cpu_wall)
    grid, heads = (5, 7, 9), 2
    g = torch.Generator().manual_seed(0)
    qkv = [torch.randn(1, math.prod(grid), heads, 16, generator=g) for _ in range(3)]
    cases = [
        ("sta", "SLIDING_TILE_ATTN", {"tile": [2, 3, 4], "window": [3, 1, 3]}),
        ("vsa", "VIDEO_SPARSE_ATTN", {"tile": [2, 3, 4], "sparsity": 0.6}),
        ("na", "NEIGHBORHOOD_ATTN", {"tile": "auto", "kernel_size": [3, 5, 5]}),
        ("gna", "NEIGHBORHOOD_ATTN", {"tile": [2, 3, 4], "kernel_size": [2, 3, 4], "stride": [2, 3, 4]}),
    ]
    for label, name, conf in cases:
        row = sb.run_variant(label, name, {**conf, "kernel": "sdpa"}, grid, heads, qkv, 1, dense_ms=1.0)
        assert row["max_err"] < 1e-4, row
        assert 0 < row["attended"] <= row["work"] + 1e-9 and row["block_density"] <= 1
        assert row["speedup"] > 0 and row["dense_ms"] == 1.0
    # --rounds 3: the variant and the dense reference alternate, and the speedup uses the adjacent dense times
    monkeypatch.setattr(sb, "ROUNDS", 3)
    monkeypatch.setattr(sb, "DENSE", [lambda q, k, v: q * 1.0])
    row = sb.run_variant("sta", "SLIDING_TILE_ATTN", {**cases[0][2], "kernel": "sdpa"}, grid, heads, qkv, 1,
                         dense_ms=1e6)
    assert len(row["ms_rounds"]) == len(row["dense_ms_rounds"]) == 3
    assert len(row["stream_rounds"]) == len(row["dense_stream_rounds"]) == 3 and row["stream_speedup"] > 0
    assert row["dense_ms"] < 1e6 and row["speedup"] == round(row["dense_ms"] / row["ms"], 2)


@pytest.mark.parametrize("grid", [(21, 30, 52)])
def test_sta_window_search_balanced(grid):
    w = sb.sta_window((11, 4, 7))
    assert w == [5, 3, 3]


def test_sta_window_closest_to_target():
    """closest=True: the odd window whose tile density is nearest to 15% (7x3x13 tiles: 39/273 = 14.3%)."""
    tiles = (7, 3, 13)
    w = sb.sta_window(tiles, closest=True)
    best = min(abs(math.log(a * b * c / math.prod(tiles) / 0.15)) for a in range(1, 8, 2) for b in range(1, 4, 2)
               for c in range(1, 14, 2))
    assert abs(math.log(math.prod(w) / math.prod(tiles) / 0.15)) == best
    assert math.prod(w) == 39
