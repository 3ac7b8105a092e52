"""Attention kernel benchmark at Wan shapes (bf16, CUDA): TFLOP/s of every kernel through fastwan's
backends, plus flash_attn.cute and sageattn called directly (to see the dispatch overhead).

    python -m benchmarks.attention_bench --out attention_bench.json [--iters 10] [--warmup 3]

Shapes: Wan2.1 1.3B 480p (B=1, S=32760, H=12, D=128) and 14B 720p (B=1, S=75600, H=40, D=128).
Timing: CUDA events around each call, median of ``--iters`` calls after ``--warmup`` calls (the first FA4
call JIT-compiles its kernel and is part of the warmup). TFLOP/s = 4*B*H*S*S*D / time. A case that cannot run
or fails prints its reason and the script goes on. The JSON holds device, versions, and per shape and case:
kernel, median/all times, TFLOP/s, max abs difference vs SDPA flash. A short table is printed last. ``--dry-run``
(CI, no GPU): the arguments checked and the (shape, case) jobs listed.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.harness import add_dry_run, print_plan
from fastwan.attention import create_backend
from fastwan.attention.synthetic import wan_like_qkv
from fastwan.envinfo import device_info, software_versions
from fastwan.profiler import time_fn

SHAPES = {
    "wan2.1-1.3b-480p": {"grid": (21, 30, 52), "heads": 12},  # S = 32760
    "wan2.1-14b-720p": {"grid": (21, 45, 80), "heads": 40},  # S = 75600
}
# label -> (backend name, config); None = a direct call defined in direct_cases()
CASES = {
    "SDPA flash (FA2)": ("TORCH_SDPA", {"kernel": "flash"}),
    "SDPA cudnn": ("TORCH_SDPA", {"kernel": "cudnn"}),
    "SDPA efficient": ("TORCH_SDPA", {"kernel": "efficient"}),
    "FLASH_ATTN (auto)": ("FLASH_ATTN", {}),
    "FLASH_ATTN FA4": ("FLASH_ATTN", {"version": 4}),
    "SAGE_ATTN": ("SAGE_ATTN", {}),
    "flash_attn.cute direct": None,
    "sageattn direct": None,
}
REFERENCE = "SDPA flash (FA2)"


def direct_case(label, q, k, v):
    """(fn, kernel description) for the standalone calls; raises ImportError when the package is missing."""
    scale = q.shape[-1] ** -0.5
    if label == "flash_attn.cute direct":
        from flash_attn.cute import flash_attn_func

        def fn():
            out = flash_attn_func(q, k, v, softmax_scale=scale, causal=False)
            return out[0] if isinstance(out, tuple) else out

        return fn, "flash_attn.cute.flash_attn_func"
    if label == "sageattn direct":
        from sageattention import sageattn

        k_own = k.clone()  # sageattention 1.x smooths K in place: keep the shared k intact
        return (lambda: sageattn(q, k_own, v, tensor_layout="NHD", is_causal=False, sm_scale=scale)), "sageattn"
    raise KeyError(label)


def bench_case(label, spec, q, k, v, *, warmup, iters):
    row = {"case": label, "kernel": None, "median_ms": None, "times_ms": [], "tflops": None, "error": None}
    try:
        if spec is None:
            fn, row["kernel"] = direct_case(label, q, k, v)
        else:
            backend = create_backend(*spec)
            why = backend.reasons(device=q.device, dtype=q.dtype, head_dim=q.shape[-1],
                                  seq_q=q.shape[1], seq_kv=k.shape[1])
            if why:
                row["error"] = "cannot run: " + "; ".join(why)
                return row, None
            row["kernel"] = backend.kernel_name(q.device)

            def fn():
                return backend(q, k, v)

        with torch.inference_mode():
            t0 = time.perf_counter()
            out = fn()  # first call (JIT compile for FA4 / Triton) timed separately
            torch.cuda.synchronize()
            row["first_call_s"] = time.perf_counter() - t0
            row["times_ms"] = time_fn(fn, warmup=warmup, iters=iters, device=q.device)
        row["median_ms"] = statistics.median(row["times_ms"])
        b, s, h, d = q.shape
        row["tflops"] = 4 * b * h * s * s * d / (row["median_ms"] * 1e-3) / 1e12
        return row, out
    except Exception as exc:  # report and go on
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        torch.cuda.empty_cache()
        return row, None


def plan(shapes: list[str], cases: list[str], args) -> list[str]:
    """The (shape, case) jobs, each case's backend built from its config (a bad config raises here)."""
    jobs = []
    for name in shapes:
        shape = f"B=1, S={math.prod(SHAPES[name]['grid'])}, H={SHAPES[name]['heads']}, D=128"
        for label in cases:
            how = "a direct call" if CASES[label] is None else f"{create_backend(*CASES[label]).name} {CASES[label][1]}"
            jobs.append(f"{name} ({shape}): {label} = {how}; {args.warmup} warm-up + {args.iters} timed calls")
    return jobs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.attention_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated subset of {', '.join(SHAPES)}")
    ap.add_argument("--cases", default=None, help="comma-separated subset of the case labels")
    add_dry_run(ap)
    args = ap.parse_args(argv)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    cases = [c.strip() for c in args.cases.split(",")] if args.cases else list(CASES)
    for name in shapes:
        if name not in SHAPES:
            ap.error(f"unknown shape {name!r}; choose from {', '.join(SHAPES)}")
    for c in cases:
        if c not in CASES:
            ap.error(f"unknown case {c!r}; choose from {', '.join(CASES)}")
    if args.dry_run:
        return print_plan(ap.prog, plan(shapes, cases, args))
    if not torch.cuda.is_available():
        print("attention_bench needs a CUDA device", file=sys.stderr)
        return 2

    report = {"device": device_info(), "software": software_versions(), "iters": args.iters,
              "warmup": args.warmup, "dtype": "bfloat16", "results": {}}
    t_start = time.perf_counter()
    for name in shapes:
        grid, heads = SHAPES[name]["grid"], SHAPES[name]["heads"]
        q, k, v = wan_like_qkv(grid, heads, 128, dtype=torch.bfloat16, device="cuda", seed=0)
        print(f"== {name}: B=1 S={q.shape[1]} H={heads} D=128 bf16", flush=True)
        rows, ref = [], None
        for label in cases:
            row, out = bench_case(label, CASES[label], q, k, v, warmup=args.warmup, iters=args.iters)
            if out is not None:
                if label == REFERENCE:
                    ref = out.float()
                if ref is not None:
                    row["max_abs_diff_vs_sdpa_flash"] = float((out.float() - ref).abs().max())
                del out
            rows.append(row)
            status = row["error"] or f"{row['median_ms']:.3f} ms  {row['tflops']:.1f} TFLOP/s  ({row['kernel']})"
            print(f"  {label:24s} {status}", flush=True)
        report["results"][name] = {"tokens": q.shape[1], "heads": heads, "cases": rows}
        del q, k, v, ref
        torch.cuda.empty_cache()
    report["wall_s"] = time.perf_counter() - t_start
    Path(args.out).write_text(json.dumps(report, indent=2, default=str))

    print(f"\n{report['device'].get('name')} | torch {torch.__version__} | wrote {args.out}")
    header = f"{'case':24s}" + "".join(f"{n:>22s}" for n in shapes)
    print(header + "\n" + "-" * len(header))
    for label in cases:
        cells = []
        for n in shapes:
            r = next(r for r in report["results"][n]["cases"] if r["case"] == label)
            cells.append(f"{r['tflops']:.1f} TFLOP/s" if r["tflops"] else "n/a")
        print(f"{label:24s}" + "".join(f"{c:>22s}" for c in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
