"""The kernel routes of fastwan.kernels.norms (``*_triton``) on the CPU under Triton's interpreter
(TRITON_INTERPRET=1): their indexing (strided per-batch / per-token modulation, RoPE channel pairs, rows wider
than a power of two) against the PyTorch references, in fp32 so no bf16 rounding hides a wrong index. Roundings
are checked on the GPU (tests/gpu/test_gpu_fastpath.py); the interpreter does not round bf16 like the hardware."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs the triton package")

SCRIPT = r"""
import torch
from fastwan.kernels import norms as fused
from fastwan.models.wan.layers import rope_tables

worst = 0.0
for C, D, grid, per_token in [(24, 12, (1, 2, 3), False), (40, 8, (2, 3, 2), True), (48, 16, (1, 2, 2), False),
                              (1536, 128, (1, 1, 3), True)]:
    S, B = grid[0] * grid[1] * grid[2], 2
    g = torch.Generator().manual_seed(C)
    x, y = torch.randn(B, S, C, generator=g), torch.randn(B, S, C, generator=g)
    mods = torch.randn(B, S if per_token else 1, 4, C, generator=g)
    gate, scale, shift, _ = mods.unbind(2)  # strided views, as the block passes them
    w, b = torch.randn(C, generator=g), torch.randn(C, generator=g)
    table = rope_tables(grid, D, 64, torch.device("cpu"))
    pairs = [
        (fused.norm_mod_triton(x, None, None, scale, shift, 1e-6),
         fused.norm_mod_reference(x, None, None, scale, shift, 1e-6)),
        (fused.norm_mod_triton(x, w, b, None, None, 1e-6), fused.norm_mod_reference(x, w, b, None, None, 1e-6)),
        (fused.rms_rope_triton(x, w, table, 1e-6, D), fused.rms_rope_reference(x, w, table, 1e-6, D)),
        (fused.rms_rope_triton(x, w, None, 1e-6, D), fused.rms_rope_reference(x, w, None, 1e-6, D)),
    ]
    offset = torch.randn(1, 1, C, generator=g)  # the gemm-residual route's pending biases (fp32, broadcast)
    pairs += [
        (fused.offset_norm_mod_triton(x, offset, None, None, scale, shift, 1e-6),
         fused.offset_norm_mod_reference(x, offset, None, None, scale, shift, 1e-6)),
        (fused.offset_norm_mod_triton(x, offset.expand(B, 1, C), w, b, None, None, 1e-6),
         fused.offset_norm_mod_reference(x, offset, w, b, None, None, 1e-6)),
    ]
    for gt, sc in ((gate, None), (None, scale)):
        r, h = fused.residual_norm_mod_triton(x, y, gt, w if sc is None else None, b if sc is None else None, sc,
                                               shift if sc is not None else None, 1e-6)
        r_ref = fused.residual_reference(x, y, gt)
        pairs += [(r, r_ref), (h, fused.norm_mod_reference(r_ref, w if sc is None else None, b if sc is None else None,
                                                           sc, shift if sc is not None else None, 1e-6))]
    for got, want in pairs:
        assert got.shape == want.shape
        worst = max(worst, float(((got - want).abs() / (want.abs() + 1)).max()))
x, w = torch.randn(2, 3, 37), torch.randn(37)  # no rotation: any width, head_dim need not divide it
got, want = fused.rms_rope_triton(x, w, None, 1e-6, 8), fused.rms_rope_reference(x, w, None, 1e-6, 8)
worst = max(worst, float(((got - want).abs() / (want.abs() + 1)).max()))
print(f"WORST {worst:.3e}")
"""


def test_kernels_match_references_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    worst = float(out.stdout.split("WORST")[-1])
    assert worst <= 1e-5, out.stdout
