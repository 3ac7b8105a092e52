"""Probe: read bandwidth from L2 and from HBM, the bound on attention whose query tiles share no key tiles.

    python -m benchmarks.l2_probe [--sizes-mb 4,16,32,48,4096] [--out l2.json]

A Triton kernel reads a bf16 buffer of each size over and over (every program walks its own strided sequence of
16 KB blocks, accumulating in registers so no load is dead), long enough to move about 40 GB; a buffer that fits in
L2 is served from L2 after the first pass. Median of 5 CUDA-event timings; the figure is bytes read / time.

Why: a 64-row query tile (one VSA cube) that shares no key cube with another tile reads 32 KB of K and V per 64-key
block for 2.1 MFLOP, 64 FLOP per byte; its attention runs at most 64 x (L2 read bandwidth) FLOP/s. ``--dry-run``
(CI, no GPU): the arguments checked and the buffers listed.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from benchmarks.harness import add_dry_run, print_plan

TOTAL_BYTES = 40e9  # read per buffer size

def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def read_blocks(x, out, n_blocks, iters, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        offs = tl.arange(0, BLOCK)
        for i in range(iters):
            b = (pid + i * nprog) % n_blocks
            acc += tl.load(x + b * BLOCK + offs).to(tl.float32)
        tl.store(out + pid * BLOCK + offs, acc)

    return read_blocks


def bandwidth(size_bytes: int, total_bytes: float = TOTAL_BYTES, block: int = 8192, programs_per_sm: int = 8) -> float:
    """Bytes per second read from a buffer of ``size_bytes`` (bf16), median of 5 timed launches."""
    kernel = _kernel()
    n_blocks = max(size_bytes // (2 * block), 1)
    x = torch.randn(n_blocks * block, device="cuda", dtype=torch.bfloat16)
    programs = torch.cuda.get_device_properties(0).multi_processor_count * programs_per_sm
    out = torch.empty(programs * block, device="cuda", dtype=torch.float32)
    iters = max(int(total_bytes / (programs * block * 2)), 1)
    moved = programs * iters * block * 2
    kernel[(programs,)](x, out, n_blocks, iters, BLOCK=block, num_warps=8)  # compile and warm L2
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        kernel[(programs,)](x, out, n_blocks, iters, BLOCK=block, num_warps=8)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return moved / statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.l2_probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mb", default="4,16,32,48,4096")
    p.add_argument("--out", default=None)
    add_dry_run(p)
    a = p.parse_args(argv)
    try:
        sizes = [int(s) for s in a.sizes_mb.split(",")]
    except ValueError:
        sizes = [0]
    if min(sizes) <= 0:
        p.error(f"--sizes-mb {a.sizes_mb!r}: use positive integers (MB), comma-separated, e.g. 4,16,4096")
    if a.dry_run:
        return print_plan(p.prog, [f"a {mb} MB bf16 buffer read until {TOTAL_BYTES / 1e9:.0f} GB have moved, median of "
                                   "5 launches" for mb in sizes])
    rows = []
    for mb in sizes:
        tbs = bandwidth(mb << 20) / 1e12
        rows.append({"buffer_mb": mb, "read_tb_s": round(tbs, 2), "attention_bound_tflops_64row": round(64 * tbs, 0)})
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows}, f, indent=1)
    print(f"{'buffer MB':>10} {'read TB/s':>10} {'64 FLOP/B bound TFLOP/s':>24}")
    for r in rows:
        print(f"{r['buffer_mb']:>10} {r['read_tb_s']:>10} {r['attention_bound_tflops_64row']:>24}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
