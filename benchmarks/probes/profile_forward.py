"""Per-kernel breakdown of one DiT forward (fastwan vs diffusers) with torch.profiler, on the GPU.

Groups CUDA kernel time into attention / GEMM / norms / other (:func:`benchmarks.harness.classify`), prints the
top kernels, and measures the bf16 GEMM rate in the same run (the FLOP floor's rate). ``--dit-variant`` builds
fastwan's DiT with DiTOptions overrides (:func:`benchmarks.harness.option_variants`).

  python -m benchmarks.probes.profile_forward --ckpt /tmp/wan13b-random --backend FLASH_ATTN [--compile]
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.harness import classify, cuda_time, dit_options, forward_inputs, kernel_times, option_overrides


def gemm_rate() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = cuda_time(lambda: a @ b, warmup=3, iters=20)
    return 2 * 8192**3 / (ms * 1e-3) / 1e12


def breakdown(fn, label: str, out: dict, top_n: int = 15) -> None:
    """Kernel time of one call of ``fn`` by group and its ``top_n`` kernels, printed and stored in ``out``."""
    per_kernel = kernel_times(fn)
    groups: dict[str, float] = defaultdict(float)
    for name, (ms, _) in per_kernel.items():
        groups[classify(name)] += ms
    total = sum(groups.values())
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:top_n]
    out[label] = {"groups_ms": dict(groups), "kernel_total_ms": total,
                  "top": [(k[:120], ms, int(n)) for k, (ms, n) in top]}
    print(f"--- {label}: kernel time {total:.1f} ms")
    for g, v in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"   {g:20s} {v:8.1f} ms")
    for k, v, c in out[label]["top"]:
        print(f"      {v:8.2f} ms  x{c:<4d} {classify(k):18s} {k}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.profile_forward",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", default="/tmp/wan13b-random")
    p.add_argument("--backend", default="FLASH_ATTN")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--diffusers", action="store_true", help="also profile diffusers' model")
    p.add_argument("--dit-variant", default="defaults", help="defaults, reference, fast")
    p.add_argument("--out", default="profile.json")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--top", type=int, default=15, help="how many kernels to list, by total time")
    return p


@torch.no_grad()
def main(argv=None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    try:
        overrides = option_overrides(a.dit_variant)
    except ValueError as exc:
        p.error(str(exc))
    from fastwan.attention import AttentionDispatch
    from fastwan.models import load_transformer

    res = {"gemm_tflops": gemm_rate()}
    print(f"bf16 GEMM 8192^3: {res['gemm_tflops']:.0f} TFLOP/s")
    args = forward_inputs(a.batch)
    if a.diffusers:
        from diffusers import WanTransformer3DModel
        ref = WanTransformer3DModel.from_pretrained(Path(a.ckpt) / "transformer", torch_dtype=torch.bfloat16).cuda()
        breakdown(lambda: ref(*args, return_dict=False), "diffusers", res, a.top)
        del ref
        torch.cuda.empty_cache()
    att = AttentionDispatch.resolve(a.backend, device="cuda", dtype=torch.bfloat16, head_dim=128)
    model = load_transformer(Path(a.ckpt) / "transformer", dtype=torch.bfloat16, device="cuda", attention=att,
                             options=dit_options(overrides))
    if a.compile:
        model.compile_blocks(fullgraph=True)
        model(*args)
    label = f"fastwan[{a.backend}{',' + a.dit_variant if overrides else ''}{',compiled' if a.compile else ''}]"
    breakdown(lambda: model(*args), label, res, a.top)
    ms = cuda_time(lambda: model(*args), iters=5)
    res["forward_ms"] = ms
    print(f"fastwan forward B={a.batch}: {ms:.1f} ms")
    Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
