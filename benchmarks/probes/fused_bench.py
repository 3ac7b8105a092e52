"""The fused norm kernels (fastwan.kernels.norms) against Inductor at the Wan widths, per call (GPU).

    python -m benchmarks.probes.fused_bench [--iters 50]

For each shape (1.3B B=2 at 480p, 14B B=1 at 720p) times, with CUDA events (median of ``--iters`` calls):
q/k RMSNorm + RoPE and LayerNorm + modulation through the ops (the launch fastwan picks), through the RMSNorm +
RoPE kernel at chunks of 512 / 1,024 / 2,048 channels and 2 / 4 / 8 warps, the LayerNorm kernel at 4 / 8 / 16 / 32
warps, and as ``torch.compile`` of the PyTorch references (Inductor). GB/s counts one
read of the input and one write of the output.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from benchmarks.harness import cuda_time
from fastwan.kernels import norms as fused
from fastwan.models.wan.layers import rope_tables

SHAPES = {"1.3B-480p-B2": (2, (21, 30, 52), 1536), "14B-720p-B1": (1, (21, 45, 80), 5120)}


def shape_cases(B, grid, C):
    """{label: fn} for one shape, and the RMSNorm + RoPE reference output."""
    import triton

    ops = torch.ops.fastwan
    S = grid[0] * grid[1] * grid[2]
    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(B, S, C, device="cuda", generator=g).bfloat16()
    w = torch.randn(C, device="cuda", generator=g).bfloat16()
    table = rope_tables(grid, 128, 1024, torch.device("cuda"))
    scale, shift = torch.randn(B, 1, 2, C, device="cuda", generator=g).unbind(2)
    ref_rope = torch.compile(fused.rms_rope_reference)
    ref_norm = torch.compile(fused.norm_mod_reference)
    norm_rows, rms_rope_rows = fused._kernels()
    block = triton.next_power_of_2(C)
    cases = {"rms_rope op": lambda: ops.rms_rope(x, w, table, 1e-6, 128),
             "rms_rope inductor": lambda: ref_rope(x, w, table, 1e-6, 128),
             "norm_mod op": lambda: ops.norm_mod(x, None, None, scale, shift, 1e-6),
             "norm_mod inductor": lambda: ref_norm(x, None, None, scale, shift, 1e-6)}
    for chunk in (512, 1024, 2048):  # the RMSNorm + RoPE kernel at each chunk and warp count (fused.ROPE_*)
        for warps in (2, 4, 8):
            def rope(chunk=chunk, warps=warps):
                out = torch.empty_like(x)
                rms_rope_rows[(B * S,)](x, w, table, out, S, C, 128, 1e-6, ROPE=True, HALF=min(chunk, block) // 2,
                                        num_warps=warps)
                return out
            cases[f"rms_rope, chunk {chunk}, {warps} warps"] = rope
    for warps in (4, 8, 16, 32):  # the LayerNorm kernel at each warp count (fused._launch_cfg)
        def norm(warps=warps):
            h = torch.empty_like(x)
            # the launch of fused._norm_launch for LayerNorm + modulation (no residual, gate, offset or affine)
            norm_rows[(B * S,)](x, x, x, 0, 0, x, 0, 0, x, x, scale, scale.stride(0), 0, shift, shift.stride(0), 0,
                                x, h, S, C, 1e-6, HAS_Y=False, HAS_G=False, HAS_P=False, AFFINE=False, MOD=True,
                                BLOCK=block, num_warps=warps)
            return h
        cases[f"norm_mod, {warps} warps"] = norm
    return cases, fused.rms_rope_reference(x, w, table, 1e-6, 128), 2 * x.numel() * x.element_size() / 1e9


@torch.no_grad()
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.fused_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default="fused_bench.json")
    a = p.parse_args(argv)
    rows = []
    for name, (B, grid, C) in SHAPES.items():
        cases, want, gb = shape_cases(B, grid, C)
        for label, fn in cases.items():
            out = fn()
            err = float((out.float() - want.float()).abs().max()) if label.startswith("rms_rope") else None
            t = cuda_time(fn, warmup=3, iters=a.iters)
            row = {"shape": name, "case": label, "ms": round(t, 4), "gb_s": round(gb / t * 1e3, 1), "max_diff": err}
            rows.append(row)
            print(json.dumps(row), flush=True)
        del cases, want
        torch.cuda.empty_cache()
    Path(a.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    print(f"\n{'shape':<14} {'case':<24} {'ms':>8} {'GB/s':>7}")
    for r in rows:
        print(f"{r['shape']:<14} {r['case']:<24} {r['ms']:>8.3f} {r['gb_s']:>7.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
