"""Attention profiler: which backends can run a Wan self-attention problem, how fast, and which is fastest.

A problem is ``B`` videos x ``H`` heads x head dim ``D`` over a (T, H, W) token grid (S = T*H*W tokens), given
directly (``-i T H W``) or derived from a model preset and a resolution. Dense backends run
``backend(q, k, v)`` on [B, S, H, D]; sparse backends get their :class:`TokenLayout` for the grid, the
inputs permuted once (not timed, as in the DiT), and ``meta=AttentionMetadata(grid, layout, step_index)``.
TFLOP/s is always dense-equivalent: ``4 * B * H * S * S * D / time`` with the unpadded S.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from fastwan.attention.base import AttentionMetadata
from fastwan.attention.synthetic import wan_like_qkv
from fastwan.attention.variants import BackendSpec, backend_specs
from fastwan.envinfo import default_device, device_info, parse_dtype


@dataclass(frozen=True)
class ModelPreset:
    heads: int
    head_dim: int
    vae_stride: int  # pixels per latent (spatial)
    patch: int  # latent patches per token (spatial)
    default_size: tuple[int, int, int]  # height, width, frames

    @property
    def pixels_per_token(self) -> int:
        return self.vae_stride * self.patch


MODELS: dict[str, ModelPreset] = {
    "wan2.1-1.3b": ModelPreset(12, 128, 8, 2, (480, 832, 81)),
    "wan2.1-14b": ModelPreset(40, 128, 8, 2, (720, 1280, 81)),
    "wan2.2-a14b": ModelPreset(40, 128, 8, 2, (720, 1280, 81)),
    "wan2.2-ti2v-5b": ModelPreset(24, 128, 16, 2, (704, 1280, 121)),
}
TEMPORAL_STRIDE = 4


def model_grid(model: str, height: int, width: int, num_frames: int) -> tuple[int, int, int]:
    """Token grid (T, H, W) of a Wan model at a resolution: T = (F-1)//4 + 1, H = height // (vae*patch)."""
    preset = MODELS[model]
    px = preset.pixels_per_token
    for what, value in (("height", height), ("width", width)):
        if value <= 0 or value % px:
            raise ValueError(f"{what}={value} must be a positive multiple of {px} for {model} ({px} pixels per token).")
    if num_frames < 1 or (num_frames - 1) % TEMPORAL_STRIDE:
        raise ValueError(f"num_frames={num_frames} must be 4k+1 (e.g. 81, 121) for Wan's temporal VAE stride 4.")
    return ((num_frames - 1) // TEMPORAL_STRIDE + 1, height // px, width // px)


@dataclass(frozen=True)
class Problem:
    batch: int
    heads: int
    head_dim: int
    grid: tuple[int, int, int]
    dtype: torch.dtype
    device: torch.device

    @property
    def tokens(self) -> int:
        t, h, w = self.grid
        return t * h * w

    @property
    def flops(self) -> float:
        """Dense attention FLOPs: QK^T and PV, 2 multiply-adds each: 4 * B * H * S^2 * D."""
        return 4.0 * self.batch * self.heads * self.tokens**2 * self.head_dim

    def as_dict(self) -> dict[str, Any]:
        return {
            "batch": self.batch, "heads": self.heads, "head_dim": self.head_dim, "grid": list(self.grid),
            "tokens": self.tokens, "dtype": str(self.dtype).replace("torch.", ""), "device": str(self.device),
            "gflop": self.flops / 1e9,
        }


@dataclass
class Result:
    label: str
    backend: str
    config: dict[str, Any]
    runnable: bool
    reasons: list[str]
    kernel: str | None = None
    sparse: bool = False
    approximate: bool = False
    median_ms: float | None = None
    times_ms: list[float] = field(default_factory=list)
    tflops: float | None = None
    speedup: float | None = None
    max_abs_err: float | None = None  # vs the TORCH_SDPA[auto] output (sparse: after layout.unpermute)
    error: str | None = None


BASELINE = "TORCH_SDPA[auto]"


# ---- timing ----------------------------------------------------------------------------------------------

def time_fn(fn: Callable[[], Any], *, warmup: int, iters: int, device: torch.device) -> list[float]:
    """Milliseconds per call for ``iters`` calls after ``warmup``: CUDA events on a GPU, perf_counter on CPU."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def span_time(fn: Callable[[], Any], *, calls: int, device: torch.device) -> float:
    """Milliseconds per call of ``calls`` back-to-back calls timed as one span, after one warm-up call: on a GPU
    two CUDA events and one synchronisation at the end (the host queues ahead, as in a denoising loop, so launch
    latency is hidden), perf_counter on CPU."""
    fn()
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) * 1e3 / calls
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


# ---- planning --------------------------------------------------------------------------------------------

def _free_bytes(device: torch.device) -> int | None:
    try:
        if device.type == "cuda":
            return torch.cuda.mem_get_info(device)[0]
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, RuntimeError, AttributeError):
        return None


def _memory_reason(spec: BackendSpec, p: Problem) -> str | None:
    """The math kernel materializes the B x H x S x S scores (and softmax): refuse when it cannot fit."""
    if spec.config.get("kernel") != "math":
        return None
    need = p.batch * p.heads * p.tokens**2 * (2 * p.dtype.itemsize + 4)
    free = _free_bytes(p.device)
    if free is not None and need > free:
        return f"the math kernel materializes B*H*S*S scores: ~{need / 2**30:.1f} GiB > {free / 2**30:.1f} GiB free"
    return None


def plan(problem: Problem, specs: Sequence[BackendSpec]) -> tuple[list[Result], dict[str, Any]]:
    """Which specs can run ``problem`` and why the others cannot. Returns (results, created backends)."""
    results, backends = [], {}
    s, d = problem.tokens, problem.head_dim
    for spec in specs:
        r = Result(spec.label, spec.name, dict(spec.config), False, [], approximate=spec.approximate)
        try:
            backend = spec.create()
        except Exception as exc:
            r.reasons = [f"cannot create: {type(exc).__name__}: {exc}"]
            results.append(r)
            continue
        r.sparse = bool(getattr(backend, "sparse", False))
        r.approximate = r.approximate or r.sparse
        try:
            r.kernel = backend.kernel_name(problem.device)
            r.reasons = list(backend.reasons(device=problem.device, dtype=problem.dtype, head_dim=d, seq_q=s, seq_kv=s))
        except Exception as exc:
            r.reasons = [f"reasons() failed: {type(exc).__name__}: {exc}"]
        mem = _memory_reason(spec, problem)
        if mem:
            r.reasons.append(mem)
        if r.sparse and not r.reasons:
            if not callable(getattr(backend, "layout", None)):
                r.reasons.append("sparse backend has no layout(grid, device) method")
            else:
                try:  # grid-dependent limits (tile sizes, kernel windows) surface here
                    backend.layout(problem.grid, problem.device)
                except Exception as exc:
                    r.reasons.append(f"layout for grid {problem.grid}: {type(exc).__name__}: {exc}")
        r.runnable = not r.reasons
        if r.runnable:
            backends[spec.label] = backend
        results.append(r)
    return results, backends


# ---- running ---------------------------------------------------------------------------------------------

def _callable(backend, q, k, v, problem: Problem, step_index: int, num_steps: int):
    """(fn() -> output in the backend's token order, fn's output -> [B, S, H, D] in grid order or None)."""
    if not getattr(backend, "sparse", False):
        return (lambda: backend(q, k, v)), (lambda out: out)
    layout = backend.layout(problem.grid, problem.device)
    qp, kp, vp = (layout.permute(x, dim=1) for x in (q, k, v))
    meta = AttentionMetadata(grid=problem.grid, layout=layout, step_index=step_index, num_steps=num_steps)
    unpermute = getattr(layout, "unpermute", None)
    return (lambda: backend(qp, kp, vp, meta=meta)), (lambda out: unpermute(out, dim=1) if unpermute else None)


def run(
    problem: Problem,
    specs: Sequence[BackendSpec],
    *,
    warmup: int,
    iters: int,
    step_index: int = 49,
    num_steps: int = 50,
    seed: int = 0,
) -> list[Result]:
    """Time every runnable spec (the TORCH_SDPA[auto] baseline is added when missing)."""
    if not any(s.label == BASELINE for s in specs):
        specs = [BackendSpec("TORCH_SDPA", {"kernel": "auto"}, "auto"), *specs]
    results, backends = plan(problem, specs)
    q, k, v = wan_like_qkv(
        problem.grid, problem.heads, problem.head_dim, batch=problem.batch, dtype=problem.dtype,
        device=problem.device, seed=seed,
    )
    ref = None
    for r in results:
        if not r.runnable:
            continue
        try:
            with torch.inference_mode():
                fn, to_grid = _callable(backends[r.label], q, k, v, problem, step_index, num_steps)
                out = to_grid(fn())
                if ref is None and r.label == BASELINE:
                    ref = out.float()
                if ref is not None and out is not None:
                    r.max_abs_err = float((out.float() - ref).abs().max())
                del out
                r.times_ms = time_fn(fn, warmup=warmup, iters=iters, device=problem.device)
            r.median_ms = statistics.median(r.times_ms)
            r.tflops = problem.flops / (r.median_ms * 1e-3) / 1e12
        except Exception as exc:  # a failing kernel is reported, the others still run
            r.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            if problem.device.type == "cuda":
                torch.cuda.empty_cache()
    base = next((r for r in results if r.label == BASELINE and r.median_ms), None)
    for r in results:
        if base and r.median_ms:
            r.speedup = base.median_ms / r.median_ms
    return results


def fastest(results: Sequence[Result], *, exact_only: bool = False) -> Result | None:
    timed = [r for r in results if r.median_ms and not (exact_only and r.approximate)]
    return min(timed, key=lambda r: r.median_ms) if timed else None


# ---- output ----------------------------------------------------------------------------------------------

def report(problem: Problem, results: Sequence[Result], *, mode: str) -> dict[str, Any]:
    best, best_exact = fastest(results), fastest(results, exact_only=True)
    return {
        "mode": mode,
        "problem": problem.as_dict(),
        "device": device_info(problem.device),
        "torch": torch.__version__,
        "results": [asdict(r) for r in results],
        "fastest": best.label if best else None,
        "fastest_exact": best_exact.label if best_exact else None,
    }


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def render(problem: Problem, results: Sequence[Result], *, mode: str, console=None) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    console = console or Console(width=None if sys.stdout.isatty() else 160)
    p = problem
    title = (
        f"B={p.batch} H={p.heads} D={p.head_dim} grid={p.grid} S={p.tokens} "
        f"{str(p.dtype).replace('torch.', '')} on {p.device}"
    )
    table = Table(title=escape(title))
    if mode == "dry-run":
        cols = ("backend", "kernel", "runnable", "why not")
    else:
        cols = ("backend", "kernel", "median ms", "TFLOP/s", "vs SDPA", "max|err|", "status")
    for c in cols:
        table.add_column(c, overflow="fold", justify="right" if c in ("median ms", "TFLOP/s", "vs SDPA") else "left")
    for r in results:
        why = "\n".join(r.reasons) or "-"
        if mode == "dry-run":
            ok = Text("yes", style="green") if r.runnable else Text("no", style="red")
            table.add_row(Text(r.label), Text(r.kernel or "-"), ok, Text(why))
        else:
            status = r.error or ("ok" + (" (sparse, dense-equiv. TFLOP/s)" if r.sparse else "") if r.runnable else why)
            table.add_row(
                Text(r.label), Text(r.kernel or "-"), _fmt(r.median_ms, ".3f"), _fmt(r.tflops, ".2f"),
                _fmt(r.speedup, ".2f") + ("x" if r.speedup else ""), _fmt(r.max_abs_err, ".2e"), Text(status),
            )
    console.print(table)
    if mode != "dry-run":
        best, exact = fastest(results), fastest(results, exact_only=True)
        if best:
            timing = f"{best.median_ms:.3f} ms, {best.tflops:.2f} TFLOP/s"
            console.print(f"[bold]fastest[/]: {escape(best.label)} ({timing})")
        if exact and exact is not best:
            console.print(f"[bold]fastest exact[/]: {escape(exact.label)} ({exact.median_ms:.3f} ms)")
        if not best:
            console.print("[red]no backend could be timed[/]")


# ---- command line ----------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m fastwan.profiler",
        description="Time attention backends on Wan self-attention problems (NATTEN-style profiler).",
    )
    src = ap.add_mutually_exclusive_group()
    src.add_argument("-i", "--input-size", nargs=3, type=int, metavar=("T", "H", "W"), help="token grid")
    src.add_argument("--model", choices=sorted(MODELS), help="derive heads, head dim and grid from a Wan model")
    ap.add_argument("--height", type=int, help="video height in pixels (with --model)")
    ap.add_argument("--width", type=int, help="video width in pixels (with --model)")
    ap.add_argument("--num-frames", type=int, help="video frames, 4k+1 (with --model)")
    ap.add_argument("-b", "--batch", type=int, default=1)
    ap.add_argument("-n", "--heads", type=int, help="attention heads (default: model's, else 12)")
    ap.add_argument("-d", "--head-dim", type=int, help="head dim (default: model's, else 128)")
    ap.add_argument("--dtype", default="bf16", help="bf16 | fp16 | fp32")
    ap.add_argument("--device", help="default: cuda if available, else cpu")
    ap.add_argument("--backend", action="append", help="backend name (repeatable) or 'all' (default: all)")
    ap.add_argument("--warmup", type=int, help="warmup calls (default 3 on GPU, 1 on CPU)")
    ap.add_argument("--iters", type=int, help="timed calls (default 10 on GPU, 3 on CPU)")
    ap.add_argument("--dry-run", action="store_true", help="only say which backends can run and why not")
    ap.add_argument("--optimize", action="store_true", help="also try every kernel variant; report the fastest")
    ap.add_argument("--step-index", type=int, default=49, help="denoising step passed to sparse backends")
    ap.add_argument("--num-steps", type=int, default=50, help="denoising steps passed to sparse backends")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--config", action="append", default=[], metavar="NAME=JSON",
                    help="settings for one backend, e.g. 'SLIDING_TILE_ATTN={\"window\": [5, 3, 3]}' "
                         "(repeatable; a JSON object, or a path to a JSON file)")
    return ap


def problem_from_args(args: argparse.Namespace) -> Problem:
    device = torch.device(args.device) if args.device else default_device()
    dtype = parse_dtype(args.dtype)
    if args.model:
        preset = MODELS[args.model]
        h, w, f = preset.default_size
        grid = model_grid(args.model, args.height or h, args.width or w, args.num_frames or f)
        heads, head_dim = args.heads or preset.heads, args.head_dim or preset.head_dim
    else:
        if any(x is not None for x in (args.height, args.width, args.num_frames)):
            raise ValueError("--height/--width/--num-frames need --model (or give the token grid with -i T H W).")
        if args.input_size is None:
            raise ValueError("give a token grid with -i T H W, or a model preset with --model.")
        grid = tuple(args.input_size)
        heads, head_dim = args.heads or 12, args.head_dim or 128
    for name, value in (("grid", min(grid)), ("batch", args.batch), ("heads", heads), ("head dim", head_dim)):
        if value < 1:
            raise ValueError(f"{name} must be positive, got {value}.")
    return Problem(args.batch, heads, head_dim, grid, dtype, device)


def parse_configs(items: Sequence[str]) -> dict[str, dict]:
    """['NAME=JSON or path', ...] -> {NAME: config}; bad names or JSON raise ValueError."""
    from fastwan.attention.registry import BACKENDS
    from fastwan.attention.sparse import load_attention_config

    out: dict[str, dict] = {}
    for item in items:
        name, sep, value = item.partition("=")
        name = name.strip().upper()
        if not sep or name not in BACKENDS:
            raise ValueError(f"--config {item!r} must be NAME=JSON with NAME one of {', '.join(BACKENDS)}.")
        out[name] = load_attention_config(value)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        problem = problem_from_args(args)
        specs = backend_specs(args.backend, variants=args.optimize)
        configs = parse_configs(args.config)
        specs = [BackendSpec(sp.name, {**configs[sp.name], **sp.config}, sp.suffix) if sp.name in configs else sp
                 for sp in specs]
    except ValueError as exc:
        ap.error(str(exc))
    on_gpu = problem.device.type == "cuda"
    warmup = args.warmup if args.warmup is not None else (3 if on_gpu else 1)
    iters = args.iters if args.iters is not None else (10 if on_gpu else 3)
    if warmup < 0 or iters < 1:
        ap.error(f"--warmup must be >= 0 and --iters >= 1 (got {warmup}, {iters}).")
    if args.dry_run:
        mode, results = "dry-run", plan(problem, specs)[0]
    else:
        mode = "optimize" if args.optimize else "time"
        results = run(problem, specs, warmup=warmup, iters=iters, step_index=args.step_index,
                      num_steps=args.num_steps, seed=args.seed)
    render(problem, results, mode=mode)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report(problem, results, mode=mode), f, indent=2, default=str)
    if mode != "dry-run" and not any(r.median_ms for r in results):
        return 1
    return 0


__all__ = ["MODELS", "Problem", "Result", "fastest", "main", "model_grid", "plan", "render", "report", "run", "time_fn"]
