"""The GEMMs of a Wan 14B block at 720p (M = 75,600 tokens) as the model calls them, with 8192^3 for scale.

    python -m benchmarks.probes.gemm_shapes [M]

Each case: 3 interleaved rounds of 10 calls (CUDA events, median), the SM clock and power from nvidia-smi mid-round,
then the cuBLAS kernel names of one call each (torch.profiler). Random bf16 operands; needs a GPU.
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from benchmarks.harness import smi_round

C, FF = 5120, 13824


@torch.no_grad()
def run(m: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02

    h, f, x = rnd(m, C), rnd(m, FF), rnd(m, C)
    w, b, w3, b3 = rnd(C, C), rnd(C), rnd(3 * C, C), rnd(3 * C)
    wu, bu, wd = rnd(FF, C), rnd(FF), rnd(C, FF)
    a8, b8 = rnd(8192, 8192), rnd(8192, 8192)
    cases = {
        "8192^3 mm": (lambda: a8 @ b8, 2 * 8192**3),
        "linear 5120->5120 +b": (lambda: F.linear(h, w, b), 2 * m * C * C),
        "mm 5120->5120 nob": (lambda: h @ w.t(), 2 * m * C * C),
        "linear 5120->15360 +b": (lambda: F.linear(h, w3, b3), 2 * m * C * 3 * C),
        "addmm_ resid 5120->5120": (lambda: x.addmm_(h, w.t()), 2 * m * C * C),
        "gelu-epi 5120->13824": (lambda: torch._addmm_activation(bu, h, wu.t(), use_gelu=True), 2 * m * C * FF),
        "linear 5120->13824 +b": (lambda: F.linear(h, wu, bu), 2 * m * C * FF),
        "addmm_ resid 13824->5120": (lambda: x.addmm_(f, wd.t()), 2 * m * C * FF),
        "mm 13824->5120 nob": (lambda: f @ wd.t(), 2 * m * C * FF),
    }
    for fn, _ in cases.values():
        fn()
    torch.cuda.synchronize()
    per = {k: [] for k in cases}
    for _ in range(3):
        for k, (fn, _) in cases.items():
            per[k].append(smi_round(fn, 10))
    print(f"{'case':<28} {'ms':>8} {'TFLOP/s':>8} {'MHz':>6} {'W':>5}")
    for k, rounds in per.items():
        ms = statistics.median(r[0] for r in rounds)
        print(f"{k:<28} {ms:>8.3f} {cases[k][1] / ms / 1e9:>8.1f} {statistics.median(r[1] for r in rounds):>6.0f} "
              f"{statistics.median(r[2] for r in rounds):>5.0f}")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for fn, _ in cases.values():
            fn()
        torch.cuda.synchronize()
    seen: set[str] = set()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.name not in seen:
            seen.add(e.name)
            print("kernel:", e.name[:150])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.gemm_shapes", description=__doc__.split("\n\n")[0])
    p.add_argument("m", nargs="?", type=int, default=75600, help="GEMM rows, the video tokens (default 75600)")
    run(p.parse_args(argv).m)


if __name__ == "__main__":
    main()
