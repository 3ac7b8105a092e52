"""Sparse video attention vs dense FA4 at Wan shapes (bf16, CUDA, B=1, D=128).

    python benchmarks/sparse_bench.py --out sparse_bench.json [--iters 20] [--budget-s 225] [--variants sta,vsa]

Grids: 21x30x52 with 12 heads (Wan2.1 1.3B 480p, 32,760 tokens) and 21x45x80 with 40 heads (14B 720p,
75,600 tokens). For each grid the dense reference is ``flash_attn.cute.flash_attn_func`` (FA4; SDPA cudnn,
then SDPA flash, when it is missing) on the raster-order tokens, timed in the same process. Each sparse variant
is configured for ~85% sparsity and timed through its backend exactly as the DiT calls it (q/k/v already
permuted into the layout, block masks built beforehand and cached):

* ``mask_ms``     building the layout-dependent block mask once (fresh backend, empty caches);
* ``compile_s``   the first call (torch.compile / FA4 JIT);
* ``ms``          median of ``--iters`` calls, CUDA events; ``speedup`` = dense ms / ms (with ``--rounds R``:
                  sparse and dense timed alternately R times, medians of the per-round medians);
* ``stream_ms``   (with ``--rounds R``) ms per call of ``--iters`` back-to-back calls between two events, one
                  synchronisation at the end: the host queues ahead as in the DiT, so the per-call launch
                  latency that ``ms`` (one synchronised call at a time) includes is hidden; dense alike;
* ``graph_ms``    (``--graph``) ms per call of 10 calls replayed from one CUDA graph, and the same for dense;
* ``attended``    fraction of the N^2 real (query, key) pairs the pattern attends (1 - sparsity);
* ``work``        fraction of N^2 that the kernel computes (listed blocks x block^2, padding included);
* ``max_err``     max |out - reference| over 256 random real query rows (fp32 masked attention reference).

VSA's top-k selection is per call; its ``ms`` includes pooling, coarse attention, top-k and block-mask
construction (``select_ms``: all of these, as ``VideoSparseBackend.select`` runs them; ``tables_ms``: top-k and
block tables from given tile scores), and ``fine_ms`` is the block-sparse kernel alone. A variant that fails
prints its error and the run goes on; variants left when ``--budget-s`` is spent are skipped (listed). The JSON
(``--out``) holds the environment and every row; a short table is printed last.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastwan.attention.base import AttentionMetadata  # noqa: E402
from fastwan.attention.sparse.layout import choose_tile  # noqa: E402
from fastwan.attention.registry import create_backend  # noqa: E402
from fastwan.attention.sparse import kernels as sk  # noqa: E402
from fastwan.kernels import vsa as vsa_kernels  # noqa: E402
from fastwan.attention.sparse.kernels import BlockPlan  # noqa: E402
from fastwan.attention.sparse.vsa import topk_count  # noqa: E402
from fastwan.profiler.core import span_time, time_fn  # noqa: E402

GRIDS = [((21, 30, 52), 12), ((21, 45, 80), 40)]
KERNEL_TIME = False  # --kernel-time
GRAPH = False  # --graph
ROUNDS = 1  # --rounds
HOST_TIME = ""  # --host-time: directory for cProfile dumps ("" = off)
DENSE: list = []  # the dense reference fn, set in main
TARGET = 0.15  # attended fraction (85% sparsity)


# ---------------------------------------------------------------------------------------------- configs
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


# ---------------------------------------------------------------------------------------------- timing
def cuda_time(fn, iters, warmup=2):
    """Median ms of ``iters`` calls (CUDA events), after ``warmup`` calls."""
    return statistics.median(time_fn(fn, warmup=warmup, iters=iters, device=torch.device("cuda")))


def stream_ms(fn, calls: int) -> float:
    """ms per call of ``calls`` back-to-back calls timed as one span (CUDA events, one sync at the end)."""
    return span_time(fn, calls=calls, device=torch.device("cuda"))


def graph_ms(fn, calls=10, replays=5) -> float:
    """ms per call of ``calls`` calls captured in one CUDA graph (median of ``replays`` replays, CUDA events):
    the device time of back-to-back calls with no launch gaps from the host."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (allocator, JIT)
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(replays + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return statistics.median(times[1:])


def kernel_ms(fn, calls=5) -> float:
    """GPU kernel time of one call (ms), summed over all kernels (torch.profiler, ``calls`` calls) -- what the
    call costs on a GPU whose host runs ahead (as inside the DiT), without the gaps a back-to-back loop of
    small calls can leave when the host is slower than the device."""
    from profile_forward import kernel_groups

    return sum(kernel_groups(fn, calls).values())


@contextlib.contextmanager
def gpu_kept_busy():
    """A block whose CUDA launches never wait for the device: a ~2 s sleep kernel is queued ahead of them."""
    torch.cuda.synchronize()
    torch.cuda._sleep(int(4e9))
    yield
    torch.cuda.synchronize()


def host_us(fn, calls=20) -> float:
    """Host (CPU) time per call in microseconds, with the GPU kept busy: what the call costs the host,
    whatever the GPU does."""
    with gpu_kept_busy():
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        dt = time.perf_counter() - t
    return dt / calls * 1e6


def host_profile(fn, path: Path, calls=20, top=25) -> str:
    """cProfile of ``calls`` calls (GPU kept busy as in :func:`host_us`); the top functions by own time."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    with gpu_kept_busy():
        prof.enable()
        for _ in range(calls):
            fn()
        prof.disable()
    prof.dump_stats(str(path))
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats("tottime").print_stats(top)
    st.sort_stats("cumulative").print_stats(top)
    return buf.getvalue()


def wall(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t


def dense_kernel():
    """(name, fn(q, k, v) -> out) for the dense reference: FA4, else SDPA cudnn, else SDPA flash."""
    try:
        from flash_attn.cute import flash_attn_func

        def fa4(q, k, v):
            out = flash_attn_func(q, k, v)
            return out[0] if isinstance(out, tuple) else out

        return "flash_attn.cute (FA4)", fa4
    except Exception as exc:  # not installed / cannot initialise
        print(f"FA4 unavailable ({type(exc).__name__}: {exc}); dense reference = SDPA", flush=True)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(q, k, v):
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            return out.transpose(1, 2)

    return "sdpa (cudnn, else flash)", sdpa


# ---------------------------------------------------------------------------------------------- checks
def attended_fraction(plan: BlockPlan, backend, layout) -> float:
    """Real (q, k) pairs attended / N^2, averaged over batch and heads."""
    n = layout.num_tokens
    if backend.name == "NEIGHBORHOOD_ATTN":
        spec = backend.spec(layout.grid)
        return math.prod(float(m.sum()) for m in spec.masks_1d("cpu")) / n / n
    cnt = layout.tile_valid_counts.double()
    pairs = torch.einsum("bhqk,q,k->bh", plan.any.double(), cnt, cnt)
    return float(pairs.mean()) / n / n


def reference_rows(q, k, v, plan: BlockPlan, rows, scale):
    """fp32 masked attention for query slots ``rows``: [B, r, H, D]."""
    m = plan.mask_rows(rows)  # [Bm, Hm, r, P]
    s = torch.einsum("brhd,bkhd->bhrk", q[:, rows].float(), k.float()) * scale
    s = s.masked_fill(~m, float("-inf"))
    return torch.einsum("bhrk,bkhd->brhd", torch.softmax(s, dim=-1), v.float())


# ---------------------------------------------------------------------------------------------- run
def run_variant(label, name, conf, grid, heads, qkv_raster, iters, dense_ms):
    row = {"grid": list(grid), "heads": heads, "variant": label, "backend": name, "config": conf}
    dev = qkv_raster[0].device
    meta_grid = tuple(grid)
    backend = create_backend(name, conf)
    layout, t_layout = wall(lambda: backend.layout(grid, dev))
    row.update(layout=layout.describe(), tile=list(layout.tile), block=layout.block_size,
               layout_ms=round(t_layout * 1e3, 2))
    q, k, v = (layout.permute(t, dim=1) for t in qkv_raster)
    scale = q.shape[-1] ** -0.5
    meta = AttentionMetadata(grid=meta_grid, step_index=None, num_steps=None, layer_index=0, layout=layout)
    kind = backend.resolve_kernel(dev, q.dtype)
    if name == "VIDEO_SPARSE_ATTN":
        def select():  # exactly what the backend's call does before its fine kernel (no gate: no coarse output)
            plan, _ = backend.select(q, k, v, layout, scale, backend.sparsity, with_output=False)
            if kind == "fa4":
                plan.fa4_tensors()
            else:
                plan.flex_block_mask(exact=False)
            return plan

        select()  # warm the pooling/top-k kernels
        plan, t_mask = wall(select)
    else:
        plan, t_mask = wall(lambda: backend.plan(layout, meta, heads))
        _, t_bm = wall(lambda: plan.fa4_tensors() if kind == "fa4" else plan.flex_block_mask(exact=False))
        t_mask += t_bm
    row.update(kernel=backend.kernel_name(dev), mask_ms=round(t_mask * 1e3, 2),
               block_density=round(plan.density(), 4),
               work=round(float(plan.any.sum(-1).double().mean()) * layout.num_tiles * layout.block_size ** 2
                          / layout.num_tokens ** 2, 4),
               attended=round(attended_fraction(plan, backend, layout), 4))

    def call():
        return backend(q, k, v, meta=meta)

    out, t_first = wall(call)
    row["compile_s"] = round(t_first, 2)
    g = torch.Generator(device="cpu").manual_seed(0)
    real = torch.nonzero(layout.key_valid.cpu()).flatten()
    rows = real[torch.randperm(real.numel(), generator=g)[:256]].to(dev)
    if name == "VIDEO_SPARSE_ATTN":  # the same selection as the call (deterministic on the same inputs)
        check_plan, _ = backend.select(q, k, v, layout, scale, backend.sparsity)
    else:
        check_plan = plan
    ref = reference_rows(q, k, v, check_plan, rows, scale)
    row["max_err"] = float((out[:, rows].float() - ref).abs().max())
    dense = DENSE[0] if DENSE else None
    if ROUNDS > 1:  # interleaved with the dense call, so both see the same clocks
        sparse_t, dense_t, sparse_s, dense_s = [], [], [], []
        for _ in range(ROUNDS):
            sparse_t.append(cuda_time(call, iters))
            dense_t.append(cuda_time(lambda: dense(*qkv_raster), iters))
            sparse_s.append(stream_ms(call, iters))
            dense_s.append(stream_ms(lambda: dense(*qkv_raster), iters))
        row["stream_ms"] = round(statistics.median(sparse_s), 3)
        row["dense_stream_ms"] = round(statistics.median(dense_s), 3)
        row["stream_speedup"] = round(row["dense_stream_ms"] / row["stream_ms"], 2)
        row["stream_rounds"] = [round(t, 3) for t in sparse_s]
        row["dense_stream_rounds"] = [round(t, 3) for t in dense_s]
        row["ms"] = round(statistics.median(sparse_t), 3)
        row["ms_rounds"] = [round(t, 3) for t in sparse_t]
        row["dense_ms_rounds"] = [round(t, 3) for t in dense_t]
        dense_ms = statistics.median(dense_t)
    else:
        row["ms"] = round(cuda_time(call, iters), 3)
    if name == "VIDEO_SPARSE_ATTN":
        row["fine_ms"] = round(cuda_time(lambda: backend.run_plan(plan, q, k, v, scale), iters), 3)
        row["select_ms"] = round(cuda_time(select, iters), 3)  # pooling + coarse scores + top-k + tables
        pooled = [t.transpose(1, 2) for t in vsa_kernels.pool_tiles(q, k, None, layout)]
        scores = torch.matmul(pooled[0], pooled[1].transpose(-1, -2))
        kk = topk_count(backend.sparsity, layout.num_tiles)

        def tables():  # top-k + block tables alone, from given tile scores (the backend's kernel or torch path)
            p2 = backend.plan_from_scores(scores, layout, kk)
            return p2.fa4_tensors() if kind == "fa4" else p2.flex_block_mask(exact=False)

        row["tables_ms"] = round(cuda_time(tables, iters), 4)
    row["dense_ms"] = round(dense_ms, 3)
    row["speedup"] = round(dense_ms / row["ms"], 2)
    if GRAPH:
        try:
            row["graph_ms"] = round(graph_ms(call), 3)
            row["dense_graph_ms"] = round(graph_ms(lambda: dense(*qkv_raster)), 3)
            row["graph_speedup"] = round(row["dense_graph_ms"] / row["graph_ms"], 2)
        except Exception as exc:  # a kernel that cannot be captured: say so, keep the other figures
            row["graph_error"] = f"{type(exc).__name__}: {exc}"
    if KERNEL_TIME:
        row["kernel_ms"] = round(kernel_ms(call), 3)
        row["dense_kernel_ms"] = round(kernel_ms(lambda: dense(*qkv_raster)), 3)
        row["kernel_speedup"] = round(row["dense_kernel_ms"] / row["kernel_ms"], 2)
    if HOST_TIME:
        row["host_us"] = round(host_us(call), 1)
        row["dense_host_us"] = round(host_us(lambda: dense(*qkv_raster)), 1)
        tag = f"{'x'.join(map(str, grid))}-{label}"
        text = host_profile(call, Path(HOST_TIME) / f"host-{tag}.prof")
        (Path(HOST_TIME) / f"host-{tag}.txt").write_text(text)
        if name == "VIDEO_SPARSE_ATTN":
            row["select_host_us"] = round(host_us(select), 1)
            row["fine_host_us"] = round(host_us(lambda: backend.run_plan(plan, q, k, v, scale)), 1)
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="sparse_bench.json")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--budget-s", type=float, default=225.0, help="skip variants once this much time is spent")
    p.add_argument("--variants", default="", help="comma-separated substrings; only matching variants run")
    p.add_argument("--grids", default="", help="e.g. 21x30x52:12,21x45x80:40 (default: both Wan grids)")
    p.add_argument("--kernel-time", action="store_true",
                   help="also report GPU kernel time per call (torch.profiler) for each variant and FA4 dense")
    p.add_argument("--host-time", default="", metavar="DIR",
                   help="also report host (CPU) time per call, GPU kept busy, and write cProfile dumps to DIR")
    p.add_argument("--graph", action="store_true",
                   help="also time 10 calls captured in a CUDA graph, for each variant and FA4 dense")
    p.add_argument("--rounds", type=int, default=1,
                   help="time each variant and FA4 dense alternately this many times (medians); 1: dense once "
                        "per grid")
    args = p.parse_args(argv)
    global KERNEL_TIME, HOST_TIME, GRAPH, ROUNDS
    KERNEL_TIME = args.kernel_time
    GRAPH = args.graph
    ROUNDS = max(1, args.rounds)
    HOST_TIME = args.host_time
    if HOST_TIME:
        Path(HOST_TIME).mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        sys.exit("sparse_bench needs a CUDA device.")
    t0 = time.perf_counter()
    dev = torch.device("cuda")
    grids = GRIDS
    if args.grids:
        grids = [(tuple(int(x) for x in g.split(":")[0].split("x")), int(g.split(":")[1]))
                 for g in args.grids.split(",")]
    wanted = [w for w in args.variants.split(",") if w]
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(dev),
           "capability": list(torch.cuda.get_device_capability(dev))}
    try:
        import flash_attn

        env["flash_attn"] = getattr(flash_attn, "__version__", "?")
    except Exception as exc:
        env["flash_attn"] = f"unavailable: {exc}"
    env["fa4_block_sparse"] = sk.fa4_reasons(dev, torch.bfloat16) or "ok"
    print(json.dumps(env), flush=True)
    dense_name, dense_fn = dense_kernel()
    DENSE[:] = [dense_fn]

    # queue: core variants of every grid first, then the extras
    per_grid = {}
    queue = []
    for gi, (grid, heads) in enumerate(grids):
        vs = [v for v in variants(grid) if not wanted or any(w in v[0] for w in wanted)]
        queue += [(not v[3], i, gi, grid, heads, v[:3]) for i, v in enumerate(vs)]
    queue.sort(key=lambda x: x[:3])

    results, skipped = [], []
    for *_, grid, heads, (label, name, conf) in queue:
        if time.perf_counter() - t0 > args.budget_s:
            skipped.append(f"{'x'.join(map(str, grid))}/{label}")
            continue
        if grid not in per_grid:
            n = math.prod(grid)
            gen = torch.Generator(device=dev).manual_seed(0)
            qkv = [torch.randn(1, n, heads, 128, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(3)]
            try:
                dense_ms = round(cuda_time(lambda q=qkv: dense_fn(*q), args.iters), 3)
            except Exception as exc:
                print(f"dense {dense_name} failed: {exc}; using SDPA", flush=True)
                dense_ms = round(cuda_time(lambda q=qkv: F.scaled_dot_product_attention(
                    *(t.transpose(1, 2) for t in q)), args.iters), 3)
            per_grid[grid] = (qkv, dense_ms)
            print(f"grid {grid} heads {heads}: dense {dense_name} {dense_ms:.2f} ms "
                  f"({sk.tflops(1, heads, n, 128, dense_ms):.0f} TFLOP/s)", flush=True)
        qkv, dense_ms = per_grid[grid]
        t_v = time.perf_counter()
        try:
            row = run_variant(label, name, conf, grid, heads, qkv, args.iters, dense_ms)
        except Exception as exc:
            print(f"  {label}: FAILED {type(exc).__name__}: {exc}", flush=True)
            traceback.print_exc(limit=3)
            row = {"grid": list(grid), "heads": heads, "variant": label, "backend": name, "config": conf,
                   "error": f"{type(exc).__name__}: {exc}"}
        row["wall_s"] = round(time.perf_counter() - t_v, 1)
        row["dense_kernel"] = dense_name
        results.append(row)
        if "error" not in row:
            extra = ""
            if "tables_ms" in row:
                extra = f", select {row['select_ms']:.3f} ms, tables {row['tables_ms']:.4f} ms"
            if "stream_ms" in row:
                extra += (f"; back-to-back {row['stream_ms']:.3f} vs dense {row['dense_stream_ms']:.3f} ms "
                          f"-> {row['stream_speedup']:.2f}x")
            if "kernel_ms" in row:
                extra += (f"; GPU kernel time {row['kernel_ms']:.3f} vs dense {row['dense_kernel_ms']:.3f} ms "
                          f"-> {row['kernel_speedup']:.2f}x")
            if "graph_ms" in row:
                extra += f"; CUDA graph {row['graph_ms']:.3f} vs dense {row['dense_graph_ms']:.3f} ms " \
                         f"-> {row['graph_speedup']:.2f}x"
            if "host_us" in row:
                extra += f"; host {row['host_us']:.0f} us/call (dense {row['dense_host_us']:.0f} us)"
                if "select_host_us" in row:
                    extra += f" = select {row['select_host_us']:.0f} + fine {row['fine_host_us']:.0f} us"
            print(f"  {label}: {row['ms']:.2f} ms vs dense {row['dense_ms']:.2f} -> {row['speedup']:.2f}x{extra} "
                  f"(attended {row['attended']:.3f}, work {row['work']:.3f}, mask {row['mask_ms']:.1f} ms, "
                  f"err {row['max_err']:.2e})", flush=True)
        torch.cuda.empty_cache()

    Path(args.out).write_text(json.dumps({"env": env, "dense_kernel": dense_name, "results": results,
                                          "skipped_for_budget": skipped}, indent=1))
    print(f"\nwrote {args.out} ({time.perf_counter() - t0:.0f} s); skipped for budget: {skipped or 'none'}")
    hdr = f"{'grid':<10} {'variant':<16} {'tile':<10} {'att%':>5} {'work%':>6} {'mask ms':>8} {'ms':>8} " \
          f"{'dense':>7} {'speedup':>7} {'err':>8}"
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        g = "x".join(map(str, r["grid"]))
        if "error" in r:
            print(f"{g:<10} {r['variant']:<16} ERROR {r['error'][:70]}")
            continue
        tile = "x".join(map(str, r["tile"]))
        print(f"{g:<10} {r['variant']:<16} {tile:<10} {100 * r['attended']:>5.1f} {100 * r['work']:>6.1f} "
              f"{r['mask_ms']:>8.1f} {r['ms']:>8.2f} {r['dense_ms']:>7.2f} {r['speedup']:>6.2f}x {r['max_err']:>8.1e}")


if __name__ == "__main__":
    main()
