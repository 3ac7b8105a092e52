"""Attention profiler: ``python -m fastwan.profiler -i T H W`` or ``--model wan2.1-1.3b``.

:mod:`~fastwan.profiler.problem` defines the problem (grid, heads, presets); :mod:`~fastwan.profiler.runner`
plans and times it (``time_fn`` and ``span_time`` are also the benchmarks' timers); :mod:`~fastwan.profiler.output`
prints the table and builds the JSON report; :mod:`~fastwan.profiler.cli` parses the command line.
"""
from fastwan.profiler.cli import main
from fastwan.profiler.problem import MODELS, ModelPreset, Problem, model_grid
from fastwan.profiler.output import render, report
from fastwan.profiler.runner import Result, fastest, plan, run, span_time, time_fn

__all__ = ["MODELS", "ModelPreset", "Problem", "Result", "fastest", "main", "model_grid", "plan", "render", "report",
           "run", "span_time", "time_fn"]
