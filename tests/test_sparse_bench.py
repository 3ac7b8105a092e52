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
        assert row["speedup"] > 0


@pytest.mark.parametrize("grid", [(21, 30, 52)])
def test_sta_window_search_balanced(grid):
    w = sb.sta_window((11, 4, 7))
    assert w == [5, 3, 3]
