"""Planning and timing: which backends can run a :class:`Problem` (and why the others cannot), and how fast.

Dense backends run ``backend(q, k, v)`` on [B, S, H, D]; sparse backends get their :class:`TokenLayout` for the
grid, the inputs permuted once (not timed, as in the DiT), and ``meta=AttentionMetadata(grid, layout,
step_index)``. TFLOP/s is always dense-equivalent: ``4 * B * H * S * S * D / time`` with the unpadded S.
"""
from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fastwan.attention.base import AttentionMetadata
from fastwan.attention.synthetic import wan_like_qkv
from fastwan.attention.variants import BackendSpec
from fastwan.profiler.problem import Problem

BASELINE = "TORCH_SDPA[auto]"


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
        # NVFP4 Q/K comes from the config or from FASTVIDEO_NVFP4_FA4: the built backend says which
        r.approximate = r.approximate or r.sparse or getattr(backend, "nvfp4", False) is True
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
    if not backends:
        return results
    q, k, v = wan_like_qkv(
        problem.grid, problem.heads, problem.head_dim, batch=problem.batch, dtype=problem.dtype,
        device=problem.device, seed=seed,
    )
    ref = None
    # the baseline runs first: its output is the reference every other backend's max|err| is measured against
    for r in sorted(results, key=lambda r: r.label != BASELINE):
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
