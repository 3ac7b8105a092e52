"""One ring rank's attention compute on one GPU: where its time goes, against one dense call of the same FLOPs, and
which way of merging the ring's steps pays.

A single process simulates rank 0 of a ring (no torch.distributed): its queries are the first chunk of a Wan-like
sequence (:func:`fastwan.attention.synthetic.wan_like_qkv`), the key/value chunks of the ring's steps are slices
of the whole sequence. The rank's own message is stacked in each timed call, as ``ring_attention`` does; the
received ones are built beforehand (their transfer is not simulated).

Shapes (per rank, bf16, D = 128): 1.3b-ring4 (q 8190 x 12 heads over 32760 keys in 4 chunks), 1.3b-u2r2 (16380 x 6
over 32760 in 2), 14b-ring3 (25200 x 40 over 75600 in 3), 1.3b-u4 (32760 x 3 over 32760: a Ulysses-4 rank, one call;
the FLOPs of 1.3b-ring4). Variants:
  dense                FA4 over every key in one call (``_flash_attn_fwd``, the kernel of the ring's steps): the floor
  dense-backend        the FLASH_ATTN backend (FA4 with fastwan's sm90 tile plan): what a Ulysses rank runs
  ring                 what ``fastwan.parallel.ring`` runs per step: ``KERNELS["fa4"]``, then ``merge`` into fp32,
                       and the final cast to bf16
  ring-combine         each step's FA4 output written into one bf16 buffer [R, B, S, H, D] (``out=``) and its
                       log-sum-exp into [R, B, H, S] (``lse=``, FA4's layout), then FA4's combine kernel once
  ring-compiled-merge  ``ring`` with ``merge`` under torch.compile(fullgraph=True, dynamic=False)
Per shape and variant: the median of --iters timed calls (CUDA events, after a first call and --warmup calls), one
torch.profiler pass's kernel time by group (attention, combine, merge: elementwise and fused kernels, copy: stack,
casts; gaps = median - kernel time), and the relative L2 of the output against "dense" (fp32). A variant that fails
prints its reason and the run goes on (exit status 1). The table is printed last; --out holds the JSON.

  python -m benchmarks.ring_bench --out ring_bench.json
  python -m benchmarks.ring_bench --smoke    # CI: tiny shapes on the CPU, "ring" against fp32 torch attention
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict

import torch

from benchmarks.harness import (
    SMOKE_DIR, add_device, add_smoke, bench_dtype, classify, command, device_arg, kernel_times, log, output,
    parse_args, raise_recompile_limit, sync, versions)
from fastwan.attention.synthetic import wan_like_qkv
from fastwan.parallel.ring import merge
from fastwan.parallel.ring_kernels import KERNELS, attention_lse
from fastwan.profiler import time_fn

SHAPES = {  # name -> the whole sequence's (T, H, W) grid, this rank's heads, the ring's chunks
    "1.3b-ring4": ((21, 30, 52), 12, 4),
    "1.3b-u2r2": ((21, 30, 52), 6, 2),
    "14b-ring3": ((21, 45, 80), 40, 3),
    "1.3b-u4": ((21, 30, 52), 3, 1),
    "tiny-ring4": ((2, 4, 8), 2, 4),  # --smoke
}
VARIANTS = ("dense", "dense-backend", "ring", "ring-combine", "ring-compiled-merge")
CPU_VARIANTS = ("dense", "ring")  # dense: fp32 torch attention (attention_lse); ring: the "exact" step kernel
GROUPS = ("attention", "combine", "merge", "copy")
HEAD_DIM = 128


def kernel_group(name: str) -> str:
    """A kernel's group in the breakdown (:data:`GROUPS`)."""
    n = name.lower()
    if "combine" in n:
        return "combine"
    if classify(name) == "attention":
        return "attention"
    return "copy" if "copy" in n else "merge"


def dense(q, k, v, scale):
    """Every key in one call: FA4 on CUDA, fp32 torch attention elsewhere."""
    if not q.is_cuda:
        return attention_lse(q, k, v, scale)[0]
    from flash_attn.cute.interface import _flash_attn_fwd

    return _flash_attn_fwd(q, k, v, softmax_scale=scale, causal=False)[0]


def own_message(k, v, chunks: int):
    """This rank's message, [2, B, S/chunks, H, D], built as ``ring_attention`` builds it."""
    n = k.shape[1] // chunks
    return torch.stack((k[:, :n], v[:, :n])).contiguous()


def received(k, v, chunks: int) -> list:
    """The messages of the other ranks' chunks, as they arrive (built before timing: no transfer here)."""
    n = k.shape[1] // chunks
    return [torch.stack((k[:, i * n:(i + 1) * n], v[:, i * n:(i + 1) * n])).contiguous() for i in range(1, chunks)]


def ring(q, k, v, others, scale, kernel: str, merge_fn):
    """The ring's per-step compute: each message's attention (``KERNELS[kernel]``), merged by ``merge_fn``."""
    step = KERNELS[kernel]
    out = lse = None
    for kv in (own_message(k, v, len(others) + 1), *others):
        out, lse = merge_fn(out, lse, *step(q, kv[0], kv[1], scale))
    return out.to(q.dtype)


def ring_combine(q, k, v, others, scale):
    """Each step's FA4 output and log-sum-exp into one buffer, then FA4's combine kernel."""
    from flash_attn.cute.interface import _flash_attn_fwd, _flash_attn_fwd_combine

    from fastwan.attention.backends.packages import fa4_lock

    B, S, H, D = q.shape
    R = len(others) + 1
    part = q.new_empty((R, B, S, H, D))
    lse = torch.empty((R, B, H, S), dtype=torch.float32, device=q.device)  # the kernel reads it seqlen-innermost
    out = torch.empty_like(q)
    with fa4_lock():
        for r, kv in enumerate((own_message(k, v, R), *others)):
            _flash_attn_fwd(q, kv[0], kv[1], softmax_scale=scale, causal=False, return_lse=True, out=part[r],
                            lse=lse[r])
        _flash_attn_fwd_combine(part, lse.transpose(-1, -2), out)
    return out


def variant_fn(name: str, q, k, v, chunks: int, compiled_merge):
    """(the call of variant ``name``, None) or (None, why it is skipped)."""
    scale = q.shape[-1] ** -0.5
    if not q.is_cuda and name not in CPU_VARIANTS:
        return None, "runs FA4: CUDA only"
    if name.startswith("ring") and chunks == 1:
        return None, "one chunk: no ring"
    others = received(k, v, chunks) if name.startswith("ring") else []
    kernel = "fa4" if q.is_cuda else "exact"
    if name == "dense":
        return (lambda: dense(q, k, v, scale)), None
    if name == "dense-backend":
        from fastwan.attention import create_backend

        backend = create_backend("FLASH_ATTN", {"version": 4})
        why = backend.reasons(device=q.device, dtype=q.dtype, head_dim=q.shape[-1], seq_q=q.shape[1],
                              seq_kv=k.shape[1])
        return (None, "; ".join(why)) if why else ((lambda: backend(q, k, v)), None)
    if name == "ring":
        return (lambda: ring(q, k, v, others, scale, kernel, merge)), None
    if name == "ring-combine":
        return (lambda: ring_combine(q, k, v, others, scale)), None
    return (lambda: ring(q, k, v, others, scale, kernel, compiled_merge)), None


def measure(fn, ref, args, device) -> dict:
    """Timing, kernel breakdown (CUDA) and the error against ``ref`` of one variant's call."""
    t0 = time.perf_counter()
    out = fn()  # FA4's JIT compile, torch.compile
    sync(device)
    row = {"first_call_s": time.perf_counter() - t0,
           "rel_l2": float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))}
    del out
    row["times_ms"] = time_fn(fn, warmup=args.warmup, iters=args.iters, device=device)
    row["median_ms"] = statistics.median(row["times_ms"])
    if device.type == "cuda":
        ms, launches = defaultdict(float), defaultdict(float)
        row["kernels"] = kernel_times(fn, warmup=False)  # name -> (ms, launches) per call
        for name, (t, n) in row["kernels"].items():
            ms[kernel_group(name)] += t
            launches[kernel_group(name)] += n
        row["kernel_ms"] = {g: ms[g] for g in GROUPS}
        row["launches"] = {g: launches[g] for g in GROUPS}
        row["gaps_ms"] = row["median_ms"] - sum(ms.values())
    return row


def run_shape(name: str, variants: list, args, device, compiled_merge) -> list:
    grid, heads, chunks = SHAPES[name]
    q, k, v = wan_like_qkv(grid, heads, HEAD_DIM, dtype=bench_dtype(device), device=device, seed=0)
    q = q[:, :q.shape[1] // chunks].contiguous()
    log(f"== {name}: q {list(q.shape)} over k/v {list(k.shape)} in {chunks} chunk(s), {q.dtype}")
    with torch.no_grad():
        ref = dense(q, k, v, q.shape[-1] ** -0.5).float()
        rows = []
        for label in variants:
            row = {"shape": name, "variant": label, "q": list(q.shape), "kv": list(k.shape), "chunks": chunks}
            fn, row["skipped"] = variant_fn(label, q, k, v, chunks, compiled_merge)
            if fn is not None:
                try:
                    row.update(measure(fn, ref, args, device))
                except Exception as exc:  # report and go on
                    row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            rows.append(row)
            status = row.get("skipped") or row.get("error") or \
                f"{row['median_ms']:.3f} ms, rel L2 {row['rel_l2']:.2e} ({row['first_call_s']:.1f} s first call)"
            log(f"  {label:20s} {'skipped: ' if row.get('skipped') else ''}{status}")
    del q, k, v, ref
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def table(rows: list) -> None:
    print("| shape | variant | ms | x dense | attention | combine | merge | copy | gaps | launches | rel L2 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    floor = {r["shape"]: r["median_ms"] for r in rows if r["variant"] == "dense" and "median_ms" in r}
    for r in rows:
        if "median_ms" not in r:
            print(f"| {r['shape']} | {r['variant']} | {r.get('skipped') or r.get('error')} |")
            continue
        ratio = f"{r['median_ms'] / floor[r['shape']]:.2f}" if r["shape"] in floor else "-"
        ks = [f"{r['kernel_ms'][g]:.3f}" for g in GROUPS] if "kernel_ms" in r else ["-"] * len(GROUPS)
        gaps = f"{r['gaps_ms']:.3f}" if "gaps_ms" in r else "-"
        n = f"{sum(r['launches'].values()):.0f}" if "launches" in r else "-"
        print(f"| {r['shape']} | {r['variant']} | {r['median_ms']:.3f} | {ratio} | {' | '.join(ks)} | {gaps} | {n} | "
              f"{r['rel_l2']:.2e} |")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ring_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="1.3b-ring4,1.3b-u2r2,14b-ring3,1.3b-u4",
                   help=f"comma-separated: {', '.join(SHAPES)}")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated: {', '.join(VARIANTS)}")
    p.add_argument("--iters", type=int, default=20, help="timed calls per variant (the median is reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls after the first one")
    p.add_argument("--out", default="ring_bench.json", help="results JSON")
    add_device(p)
    add_smoke(p, shapes="tiny-ring4", iters=1, warmup=1, out=str(SMOKE_DIR / "ring_bench.json"))
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_args(parser, argv)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for given, known, flag in ((shapes, SHAPES, "--shapes"), (variants, VARIANTS, "--variants")):
        unknown = [x for x in given if x not in known]
        if unknown or not given:
            parser.error(f"{flag} {','.join(unknown) or '(empty)'}: use one or more of {', '.join(known)}")
    if args.iters < 1 or args.warmup < 0:
        parser.error(f"--iters {args.iters} / --warmup {args.warmup}: need --iters >= 1 and --warmup >= 0")
    device = device_arg(parser, args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device here; use --smoke (or --device cpu)")
    compiled_merge = None
    if device.type == "cuda" and "ring-compiled-merge" in variants:
        raise_recompile_limit()
        compiled_merge = torch.compile(merge, fullgraph=True, dynamic=False)
    record = {"command": command("benchmarks.ring_bench", argv), "versions": versions(), "results": []}
    for name in shapes:
        record["results"] += run_shape(name, variants, args, device, compiled_merge)
    out = output(args.out)
    out.write_text(json.dumps(record, indent=1, default=str))
    log(f"wrote {out}")
    table(record["results"])
    return 1 if any("error" in r for r in record["results"]) else 0


if __name__ == "__main__":
    sys.exit(main())
