"""Per-kernel breakdown of one DiT forward (fastwan vs diffusers) with torch.profiler, on the GPU.

Groups CUDA kernel time into attention / GEMM / other, prints the top kernels, and compares with the FLOP
floor at the bf16 GEMM rate measured in the same run.

  python benchmarks/profile_forward.py --ckpt /tmp/wan13b-random --backend FLASH_ATTN [--compile]
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from e2e import cuda_time, forward_inputs  # noqa: E402


def classify(name: str) -> str:
    n = name.lower()
    if n.startswith("triton_"):  # inductor's fused kernels are named after the ops they fuse
        return "norms" if "norm" in n else "elementwise/other"
    if any(s in n for s in ("flash", "fmha", "attention", "sage", "attn", "cudnn_generated")):
        return "attention"
    if any(s in n for s in ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas", "matmul", "wgmma")):
        return "gemm"
    if any(s in n for s in ("norm", "welford", "rms")):  # incl. fastwan.kernels.norms (norm_rows, rms_rope_rows)
        return "norms"
    return "elementwise/other"


def kernel_groups(fn, calls: int = 1) -> dict[str, float]:
    """CUDA kernel time per call of ``fn`` (ms) by :func:`classify` group, from torch.profiler over ``calls``
    calls after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    groups: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            groups[classify(e.name)] += e.device_time / 1e3 / calls
    return dict(groups)


def gemm_rate() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = cuda_time(lambda: a @ b, warmup=3, iters=20)
    return 2 * 8192**3 / (ms * 1e-3) / 1e12


def breakdown(fn, label: str, out: dict, top_n: int = 15) -> None:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    groups: dict[str, float] = defaultdict(float)
    per_kernel: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            t = evt.device_time if hasattr(evt, "device_time") else evt.cuda_time
            groups[classify(evt.name)] += t / 1e3
            per_kernel[evt.name[:120]] += t / 1e3
            counts[evt.name[:120]] += 1
    total = sum(groups.values())
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top_n]
    out[label] = {"groups_ms": dict(groups), "kernel_total_ms": total,
                  "top": [(k, v, counts[k]) for k, v in top]}
    print(f"--- {label}: kernel time {total:.1f} ms")
    for g, v in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"   {g:20s} {v:8.1f} ms")
    for k, v, c in out[label]["top"]:
        print(f"      {v:8.2f} ms  x{c:<4d} {classify(k):18s} {k}")


@torch.no_grad()
def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", default="/tmp/wan13b-random")
    p.add_argument("--backend", default="FLASH_ATTN")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--diffusers", action="store_true")
    p.add_argument("--out", default="profile.json")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--top", type=int, default=15, help="how many kernels to list, by total time")
    a = p.parse_args()
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
    model = load_transformer(Path(a.ckpt) / "transformer", dtype=torch.bfloat16, device="cuda", attention=att)
    if a.compile:
        for blk in model.blocks:
            blk.compile(fullgraph=True)
        model(*args)
    breakdown(lambda: model(*args), f"fastwan[{a.backend}{',compiled' if a.compile else ''}]", res, a.top)
    ms = cuda_time(lambda: model(*args), iters=5)
    res["forward_ms"] = ms
    print(f"fastwan forward B={a.batch}: {ms:.1f} ms")
    Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
