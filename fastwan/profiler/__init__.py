"""Attention profiler: ``python -m fastwan.profiler -i T H W`` or ``--model wan2.1-1.3b`` (see core)."""
from fastwan.profiler.core import MODELS, Problem, Result, fastest, main, model_grid, plan, report, run, time_fn

__all__ = ["MODELS", "Problem", "Result", "fastest", "main", "model_grid", "plan", "report", "run", "time_fn"]
