"""FP8 DiT weights on the GPU: GEMM speed and error at the Wan shapes, and 1.3B end to end against bf16.

Phases (each adds to the JSON given by --out):
  gemm     every block linear shape of Wan2.1 1.3B at 480x832x81 (32,760 tokens) and 14B at 720x1280x81 (75,600):
           bf16 F.linear, the FP8 layer as compiled (per-token activation quantization fused by inductor +
           torch._scaled_mm with row-wise scales) and torch._scaled_mm alone on pre-quantized activations; TFLOP/s
           and the relative error of both against an fp32 product of the bf16 operands
  e2e13b   the 1.3B random checkpoint at --ckpt (made by ``python -m benchmarks.e2e --phase make``), 480x832x81,
           --steps steps, CFG 5, compiled, FLASH_ATTN: bf16 and quantization="fp8" generators in interleaved runs
           (median of --repeats after a warm-up each), peak memory, PSNR / SSIM of the FP8 frames against bf16's
The 14B forward: ``python -m benchmarks.forward_14b --compile --variants auto,fp8``.

  python -m benchmarks.fp8_bench --phase gemm,e2e13b
  python -m benchmarks.fp8_bench --smoke     # CI: tiny GEMMs (the "dequant" route) and a tiny checkpoint on the CPU
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.checkpoints import tiny_checkpoint
from benchmarks.harness import (
    PROMPT, SMOKE_DIR, add_device, add_smoke, bench_dtype, command, cuda_time, device_arg, gib, log, output, parse_args,
    parse_phases, parse_video, psnr, release, ssim, versions)

PHASES = ("gemm", "e2e13b")
SHAPES = {  # model -> (tokens, [(in_features, out_features), ...]) of its block linears
    "1.3B 480p": (32760, [(1536, 1536), (1536, 8960), (8960, 1536)]),
    "14B 720p": (75600, [(5120, 5120), (5120, 13824), (13824, 5120)]),
    "tiny": (64, [(32, 64), (64, 32)]),  # --smoke
}


def gemm_row(model: str, m: int, i: int, o: int, iters: int, device: torch.device, compile_: bool) -> dict:
    """One [m, i] x [i, o] shape: time and error of bf16, the FP8 layer (compiled with ``compile_``; its
    "scaled_mm" route where that runs, else "dequant") and scaled_mm alone (where it runs)."""
    from fastwan.kernels.fp8 import Fp8Linear, quantize_activation, route_reasons

    g = torch.Generator(device).manual_seed(0)
    x = torch.randn(m, i, device=device, generator=g, dtype=torch.bfloat16)
    lin = torch.nn.Linear(i, o, device=device, dtype=torch.bfloat16)
    why = route_reasons("scaled_mm", device=device, dtype=torch.bfloat16, in_features=i, out_features=o)
    fp8 = Fp8Linear.from_linear(lin, route="dequant" if why else "scaled_mm")
    layer = torch.compile(fp8, fullgraph=True) if compile_ else fp8
    x8, xs = quantize_activation(x)
    w8t, ws = fp8.weight.t(), fp8.weight_scale.view(1, -1)
    runs = {
        "bf16": lambda: F.linear(x, lin.weight, lin.bias),
        "fp8 layer": lambda: layer(x),
        "scaled_mm only": lambda: torch._scaled_mm(x8, w8t, scale_a=xs, scale_b=ws, bias=fp8.bias,
                                                   out_dtype=torch.bfloat16),
    }
    row = {"model": model, "M": m, "K": i, "N": o, "fp8_route": fp8.route}
    rows = slice(0, 2048)  # the error on a slice of tokens, against fp32 operands
    want = x[rows].float() @ lin.weight.float().t() + lin.bias.float()
    for name, fn in runs.items():
        if name == "scaled_mm only" and why:
            row[name] = {"error": "; ".join(why)}
            continue
        ms = cuda_time(fn, warmup=3, iters=iters, device=device)
        got = fn()[rows].float()
        err = ((got - want).norm() / want.norm()).item()
        row[name] = {"ms": ms, "tflops": 2 * m * i * o / ms / 1e9, "rel_err": err}
    log(f"{model} {m}x{i}x{o}: " + ", ".join(row_cell(k, row[k]) for k in runs))
    return row


def row_cell(name: str, cell: dict) -> str:
    """One kernel's figures in a row, or why it did not run."""
    if "error" in cell:
        return f"{name} not run ({cell['error']})"
    return f"{name} {cell['tflops']:.0f} TFLOP/s err {cell['rel_err']:.3g}"


def phase_gemm(res: dict, iters: int, models: list[str], device: torch.device, compile_: bool) -> None:
    res["gemm"] = []
    for model in models:
        m, shapes = SHAPES[model]
        for i, o in shapes:
            res["gemm"].append(gemm_row(model, m, i, o, iters, device, compile_))
            release(False, device)


def phase_e2e13b(res: dict, a, device: torch.device, outdir: Path) -> None:
    from fastwan import VideoGenerator

    h, w, f = parse_video(a.video)
    steps = a.steps
    job = dict(height=h, width=w, num_frames=f, num_inference_steps=steps, guidance_scale=5.0, seed=0,
               save_video=False)
    gens = {q or "bf16": VideoGenerator.from_pretrained(a.ckpt, attention_backend=a.backend, device=device,
                                                        dtype=bench_dtype(device), enable_torch_compile=a.compile,
                                                        quantization=q)
            for q in (None, "fp8")}
    frames, runs, peaks = {}, {k: [] for k in gens}, {}
    for name, gen in gens.items():  # warm-up: compilation
        t0 = time.perf_counter()
        gen.generate_video(PROMPT, **{**job, "num_inference_steps": 2})
        log(f"{name}: warm-up {time.perf_counter() - t0:.1f} s")
    for r in range(a.repeats):
        for name, gen in gens.items():
            out = gen.generate_video(PROMPT, **job)
            runs[name].append(out.timings["total"])
            peaks[name] = out.peak_memory and out.peak_memory / 2**30
            frames[name] = out.frames
            log(f"round {r} {name}: {out.timings['total']:.2f} s (denoise {out.timings['denoising']:.2f})")
    e = res["e2e13b"] = {"job": job, "runs_s": runs, "peak_gib": peaks,
                         "median_s": {k: statistics.median(v) for k, v in runs.items()}}
    e["speedup_fp8"] = e["median_s"]["bf16"] / e["median_s"]["fp8"]
    e["psnr_db"], e["ssim"] = psnr(frames["fp8"], frames["bf16"]), ssim(frames["fp8"], frames["bf16"])
    import numpy as np

    np.save(outdir / "frames_bf16.npy", frames["bf16"][::10])
    del gens
    release(a.compile, device)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fp8_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--phase", default="gemm,e2e13b")
    p.add_argument("--ckpt", default="/tmp/wan13b-random")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--shapes", default="1.3B 480p,14B 720p", help=f"gemm: models of {', '.join(SHAPES)}")
    p.add_argument("--video", default="480x832x81", metavar="HxWxF", help="e2e13b: height x width x frames")
    p.add_argument("--backend", default="FLASH_ATTN", help="e2e13b: the attention backend")
    p.add_argument("--out", default="fp8.json")
    add_device(p, compile_default=True)
    add_smoke(p, ckpt=str(SMOKE_DIR / "wan2.1"), steps=2, repeats=1, iters=1, shapes="tiny", video="32x32x5",
              backend="TORCH_SDPA", out=str(SMOKE_DIR / "fp8.json"))
    return p


def main(argv=None) -> int:
    p = build_parser()
    a = parse_args(p, argv)
    phases = parse_phases(p, a.phase, PHASES)
    device = device_arg(p, a.device)
    models = a.shapes.split(",")
    try:
        parse_video(a.video)
        unknown = [m for m in models if m not in SHAPES]
        if unknown:
            raise ValueError(f"--shapes: unknown model(s) {unknown}; use {', '.join(SHAPES)}")
    except ValueError as exc:
        p.error(str(exc))
    if a.smoke and "e2e13b" in phases:
        tiny_checkpoint(a.ckpt)
    out = output(a.out)
    res = json.loads(out.read_text()) if out.exists() else {}
    res["versions"] = versions()
    res["command"] = command(p.prog, argv)
    for ph in phases:
        if ph == "gemm":
            with torch.no_grad():
                phase_gemm(res, a.iters, models, device, a.compile)
        else:
            phase_e2e13b(res, a, device, out.parent)
        out.write_text(json.dumps(res, indent=1))
    for row in res.get("gemm", []):
        print(f"{row['model']:9s} {row['M']}x{row['K']}x{row['N']}: " + ", ".join(
            row_cell(k, row[k]) for k in ("bf16", "fp8 layer", "scaled_mm only")))
    if "e2e13b" in res:
        e = res["e2e13b"]
        print(f"e2e: bf16 {e['median_s']['bf16']:.2f} s ({gib(e['peak_gib']['bf16'])} GiB), fp8 "
              f"{e['median_s']['fp8']:.2f} s ({gib(e['peak_gib']['fp8'])} GiB), {e['speedup_fp8']:.3f}x; "
              f"PSNR {e['psnr_db']:.1f} dB, SSIM {e['ssim']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
