"""Run a test script in a subprocess under Triton's interpreter (``TRITON_INTERPRET=1`` must be set before Triton
is imported, so the kernels run on CPU tensors), from the repository root so that ``tests.*`` imports."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def worst_error(script: str) -> float:
    """Run ``script`` (it prints ``WORST <float>``) and return that float; a failing script fails the test."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    return float(out.stdout.split("WORST")[-1].split()[0])
