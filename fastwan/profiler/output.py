"""The profiler's output: a rich table on the console, and the JSON report."""
from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import torch

from fastwan.envinfo import device_info
from fastwan.profiler.problem import Problem
from fastwan.profiler.runner import Result, fastest


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
