"""Compiled modules that several threads run at once (the server's workers: one model per GPU, one thread each).

Rule: one thread's compilation must not fail or change another thread's compiled call. torch.compile's AOT
stage traces with torch.fx, and the flag torch.fx sets while it traces is a process-wide global; a compiled
function entered by another thread meanwhile sees it and raises "Detected that you are using FX to symbolically
trace a dynamo-optimized function" (its own thread traces nothing). :func:`share_across_threads` sets, once,
when a model's blocks are compiled, the dynamo setting under which that call runs as usual: compiled
(``force_compile_during_fx_trace``) where torch has it, else eagerly for that call alone
(``error_on_nested_fx_trace=False``), which gives the same result.
"""
from __future__ import annotations

import torch


def share_across_threads() -> None:
    """Let compiled calls on one thread run while another thread's compilation traces (see the module's rule)."""
    config = torch._dynamo.config
    if hasattr(config, "force_compile_during_fx_trace"):
        config.force_compile_during_fx_trace = True
    else:
        config.error_on_nested_fx_trace = False
