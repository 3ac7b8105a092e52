"""Sparse video attention vs dense FA4 at Wan shapes (bf16, CUDA, B=1, D=128).

    python -m benchmarks.sparse_bench --out sparse_bench.json [--iters 20] [--budget-s 225] [--variants sta,vsa]

Grids: 21x30x52 with 12 heads (Wan2.1 1.3B 480p, 32,760 tokens) and 21x45x80 with 40 heads (14B 720p,
75,600 tokens). For each grid the dense reference is ``flash_attn.cute.flash_attn_func`` (FA4; SDPA cudnn,
then SDPA flash, when it is missing) on the raster-order tokens, timed in the same process. Each sparse variant
(:mod:`benchmarks.sparse_configs`, ~85% sparsity) is timed through its backend exactly as the DiT calls it (q/k/v
already permuted into the layout, block masks built beforehand and cached):

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
(``--out``) holds the environment and every row; a short table is printed last. ``--dry-run`` (CI, no GPU): the
arguments checked and the queue of (grid, variant) jobs listed, each variant's backend built from its config.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.harness import add_dry_run, cuda_time, kernel_groups, print_plan
from benchmarks.sparse_configs import GRIDS, variants
from fastwan.attention.base import AttentionMetadata
from fastwan.attention.registry import create_backend
from fastwan.attention.sparse.fa4 import fa4_reasons
from fastwan.attention.sparse.plan import BlockPlan
from fastwan.attention.sparse.vsa import topk_count
from fastwan.kernels import vsa as vsa_kernels
from fastwan.profiler import span_time


# ---------------------------------------------------------------------------------------------- timing
def call_ms(fn, iters: int) -> float:
    """Median ms of ``iters`` synchronised calls (CUDA events), after two warm-up calls."""
    return cuda_time(fn, warmup=2, iters=iters)


def stream_ms(fn, calls: int) -> float:
    """ms per call of ``calls`` back-to-back calls timed as one span (CUDA events, one sync at the end)."""
    return span_time(fn, calls=calls, device=torch.device("cuda"))


def wall(fn):
    """(fn(), seconds), the device synchronised before and after."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t


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
    """GPU kernel time of one call (ms), summed over all kernels (torch.profiler, ``calls`` calls): what the
    call costs on a GPU whose host runs ahead (as inside the DiT), without the gaps a back-to-back loop of
    small calls can leave when the host is slower than the device."""
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


@dataclass(frozen=True)
class Timers:
    """How :func:`run_variant` times a call: ``call_ms(fn, iters)`` (median ms of synchronised calls),
    ``stream_ms(fn, calls)`` (ms per call of back-to-back calls), ``wall(fn) -> (out, seconds)``. The defaults
    time on the GPU."""
    call_ms: Callable = call_ms
    stream_ms: Callable = stream_ms
    wall: Callable = wall


@dataclass(frozen=True)
class Extras:
    """The optional figures: ``rounds`` > 1 alternates sparse and dense timings (both need the dense kernel);
    ``graph``: CUDA-graph replay times; ``kernel_time``: torch.profiler kernel time; ``host_dir``: host time per
    call and cProfile dumps written there."""
    rounds: int = 1
    graph: bool = False
    kernel_time: bool = False
    host_dir: Path | None = None


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
def run_variant(label, name, conf, grid, heads, qkv_raster, iters, dense_ms, *, dense=None,
                timers: Timers = Timers(), extras: Extras = Extras()):
    """One row: the variant's layout, masks, error and times; ``dense(q, k, v)`` (raster order) is the reference
    kernel for ``extras``' alternating rounds and paired figures, ``dense_ms`` its time when not re-timed."""
    row = {"grid": list(grid), "heads": heads, "variant": label, "backend": name, "config": conf}
    if dense is None and (extras.rounds > 1 or extras.graph or extras.kernel_time or extras.host_dir):
        raise ValueError("run_variant: rounds > 1, graph, kernel_time and host_dir time the dense kernel too; "
                         "pass dense=")
    dev = qkv_raster[0].device
    backend = create_backend(name, conf)
    layout, t_layout = timers.wall(lambda: backend.layout(grid, dev))
    row.update(layout=layout.describe(), tile=list(layout.tile), block=layout.block_size,
               layout_ms=round(t_layout * 1e3, 2))
    q, k, v = (layout.permute(t, dim=1) for t in qkv_raster)
    scale = q.shape[-1] ** -0.5
    meta = AttentionMetadata(grid=tuple(grid), step_index=None, num_steps=None, layer_index=0, layout=layout)
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
        plan, t_mask = timers.wall(select)
    else:
        plan, t_mask = timers.wall(lambda: backend.plan(layout, meta, heads))
        _, t_bm = timers.wall(lambda: plan.fa4_tensors() if kind == "fa4" else plan.flex_block_mask(exact=False))
        t_mask += t_bm
    row.update(kernel=backend.kernel_name(dev), mask_ms=round(t_mask * 1e3, 2),
               block_density=round(plan.density(), 4),
               work=round(float(plan.any.sum(-1).double().mean()) * layout.num_tiles * layout.block_size ** 2
                          / layout.num_tokens ** 2, 4),
               attended=round(attended_fraction(plan, backend, layout), 4))

    def call():
        return backend(q, k, v, meta=meta)

    def call_dense():
        return dense(*qkv_raster)

    out, t_first = timers.wall(call)
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
    if extras.rounds > 1:  # interleaved with the dense call, so both see the same clocks
        sparse_t, dense_t, sparse_s, dense_s = [], [], [], []
        for _ in range(extras.rounds):
            sparse_t.append(timers.call_ms(call, iters))
            dense_t.append(timers.call_ms(call_dense, iters))
            sparse_s.append(timers.stream_ms(call, iters))
            dense_s.append(timers.stream_ms(call_dense, iters))
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
        row["ms"] = round(timers.call_ms(call, iters), 3)
    if name == "VIDEO_SPARSE_ATTN":
        row["fine_ms"] = round(timers.call_ms(lambda: backend.run_plan(plan, q, k, v, scale), iters), 3)
        row["select_ms"] = round(timers.call_ms(select, iters), 3)  # pooling + coarse scores + top-k + tables
        pooled = [t.transpose(1, 2) for t in vsa_kernels.pool_tiles(q, k, None, layout)]
        scores = torch.matmul(pooled[0], pooled[1].transpose(-1, -2))
        kk = topk_count(backend.sparsity, layout.num_tiles)

        def tables():  # top-k + block tables alone, from given tile scores (the backend's kernel or torch path)
            p2 = backend.plan_from_scores(scores, layout, kk)
            return p2.fa4_tensors() if kind == "fa4" else p2.flex_block_mask(exact=False)

        row["tables_ms"] = round(timers.call_ms(tables, iters), 4)
    row["dense_ms"] = round(dense_ms, 3)
    row["speedup"] = round(dense_ms / row["ms"], 2)
    if extras.graph:
        try:
            row["graph_ms"] = round(graph_ms(call), 3)
            row["dense_graph_ms"] = round(graph_ms(call_dense), 3)
            row["graph_speedup"] = round(row["dense_graph_ms"] / row["graph_ms"], 2)
        except Exception as exc:  # a kernel that cannot be captured: say so, keep the other figures
            row["graph_error"] = f"{type(exc).__name__}: {exc}"
    if extras.kernel_time:
        row["kernel_ms"] = round(kernel_ms(call), 3)
        row["dense_kernel_ms"] = round(kernel_ms(call_dense), 3)
        row["kernel_speedup"] = round(row["dense_kernel_ms"] / row["kernel_ms"], 2)
    if extras.host_dir:
        row["host_us"] = round(host_us(call), 1)
        row["dense_host_us"] = round(host_us(call_dense), 1)
        tag = f"{'x'.join(map(str, grid))}-{label}"
        text = host_profile(call, Path(extras.host_dir) / f"host-{tag}.prof")
        (Path(extras.host_dir) / f"host-{tag}.txt").write_text(text)
        if name == "VIDEO_SPARSE_ATTN":
            row["select_host_us"] = round(host_us(select), 1)
            row["fine_host_us"] = round(host_us(lambda: backend.run_plan(plan, q, k, v, scale)), 1)
    return row


def row_line(row: dict) -> str:
    """One variant's figures as a progress line."""
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
    return (f"  {row['variant']}: {row['ms']:.2f} ms vs dense {row['dense_ms']:.2f} -> {row['speedup']:.2f}x{extra} "
            f"(attended {row['attended']:.3f}, work {row['work']:.3f}, mask {row['mask_ms']:.1f} ms, "
            f"err {row['max_err']:.2e})")


def print_table(results: list[dict]) -> None:
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sparse_bench", description=__doc__.split("\n\n")[0])
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
    add_dry_run(p)
    return p


def parse_grids(text: str) -> list[tuple[tuple[int, int, int], int]]:
    """'21x30x52:12,21x45x80:40' -> [(grid, heads), ...]; ValueError for another form."""
    try:
        grids = [(tuple(int(x) for x in g.split(":")[0].split("x")), int(g.split(":")[1])) for g in text.split(",")]
    except (ValueError, IndexError):
        grids = []
    if not grids or any(len(g) != 3 or min(g) <= 0 or heads <= 0 for g, heads in grids):
        raise ValueError(f"--grids {text!r}: use TxHxW:HEADS[,...], e.g. 21x30x52:12")
    return grids


def job_queue(grids, wanted: list[str]) -> list[tuple]:
    """(core variants of every grid first, then the extras) as (grid, heads, (label, backend name, config))."""
    queue = []
    for gi, (grid, heads) in enumerate(grids):
        vs = [v for v in variants(grid) if not wanted or any(w in v[0] for w in wanted)]
        queue += [(not v[3], i, gi, grid, heads, v[:3]) for i, v in enumerate(vs)]
    queue.sort(key=lambda x: x[:3])
    return [q[3:] for q in queue]


def main(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    try:
        grids = parse_grids(args.grids) if args.grids else GRIDS
    except ValueError as exc:
        p.error(str(exc))
    wanted = [w for w in args.variants.split(",") if w]
    queue = job_queue(grids, wanted)
    if args.dry_run:
        return print_plan(p.prog, [f"{'x'.join(map(str, grid))}, {heads} heads: {label} = "
                                   f"{create_backend(name, conf).name} {conf}" for grid, heads, (label, name, conf)
                                   in queue])
    extras = Extras(rounds=max(1, args.rounds), graph=args.graph, kernel_time=args.kernel_time,
                    host_dir=Path(args.host_time) if args.host_time else None)
    if extras.host_dir:
        extras.host_dir.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        sys.exit("sparse_bench needs a CUDA device.")
    t0 = time.perf_counter()
    dev = torch.device("cuda")
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(dev),
           "capability": list(torch.cuda.get_device_capability(dev))}
    try:
        import flash_attn

        env["flash_attn"] = getattr(flash_attn, "__version__", "?")
    except Exception as exc:
        env["flash_attn"] = f"unavailable: {exc}"
    env["fa4_block_sparse"] = fa4_reasons(dev, torch.bfloat16) or "ok"
    print(json.dumps(env), flush=True)
    dense_name, dense_fn = dense_kernel()

    per_grid = {}
    results, skipped = [], []
    for grid, heads, (label, name, conf) in queue:
        if time.perf_counter() - t0 > args.budget_s:
            skipped.append(f"{'x'.join(map(str, grid))}/{label}")
            continue
        if grid not in per_grid:
            n = math.prod(grid)
            gen = torch.Generator(device=dev).manual_seed(0)
            qkv = [torch.randn(1, n, heads, 128, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(3)]
            try:
                dense_ms = round(call_ms(lambda q=qkv: dense_fn(*q), args.iters), 3)
            except Exception as exc:
                print(f"dense {dense_name} failed: {exc}; using SDPA", flush=True)
                dense_ms = round(call_ms(lambda q=qkv: F.scaled_dot_product_attention(
                    *(t.transpose(1, 2) for t in q)), args.iters), 3)
            per_grid[grid] = (qkv, dense_ms)
            print(f"grid {grid} heads {heads}: dense {dense_name} {dense_ms:.2f} ms "
                  f"({4 * heads * n * n * 128 / dense_ms / 1e9:.0f} TFLOP/s)", flush=True)
        qkv, dense_ms = per_grid[grid]
        t_v = time.perf_counter()
        try:
            row = run_variant(label, name, conf, grid, heads, qkv, args.iters, dense_ms, dense=dense_fn,
                              extras=extras)
        except Exception as exc:
            print(f"  {label}: FAILED {type(exc).__name__}: {exc}", flush=True)
            traceback.print_exc(limit=3)
            row = {"grid": list(grid), "heads": heads, "variant": label, "backend": name, "config": conf,
                   "error": f"{type(exc).__name__}: {exc}"}
        row["wall_s"] = round(time.perf_counter() - t_v, 1)
        row["dense_kernel"] = dense_name
        results.append(row)
        if "error" not in row:
            print(row_line(row), flush=True)
        torch.cuda.empty_cache()

    Path(args.out).write_text(json.dumps({"env": env, "dense_kernel": dense_name, "results": results,
                                          "skipped_for_budget": skipped}, indent=1))
    print(f"\nwrote {args.out} ({time.perf_counter() - t0:.0f} s); skipped for budget: {skipped or 'none'}")
    print_table(results)


if __name__ == "__main__":
    main()
