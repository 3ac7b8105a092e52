"""A GPU memory budget on the GPU: one generator per process, the budget enforced with
``torch.cuda.set_per_process_memory_fraction`` and checked by the peak allocated memory.

The job: --video at --steps steps, CFG 5, compiled, --backend (FLASH_ATTN), on a random checkpoint
(benchmarks.distilled --phase make, or harness.derive_a14b for Wan2.2-A14B). One untimed warm-up video of 1 step
(compilation, the first host-to-device copies), then --repeats timed videos. A job of --full-steps steps is reported
as measured text + decode time plus --full-steps times the measured seconds per step; with --steps equal to
--full-steps that is the measured video (benchmarks/budget_suite.sh runs such jobs in a detached process, since a
40-step 720p video of a 14B model outlasts one device call).

  python -m benchmarks.budget_bench --ckpt /tmp/wan14b --video 720x1280x81 --budget 24GiB [--quantization fp8]
  python -m benchmarks.budget_bench --smoke      # CI: a tiny checkpoint on the CPU, no budget (a GPU's alone)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch

from benchmarks.checkpoints import tiny_checkpoint
from benchmarks.harness import (
    PROMPT, SMOKE_DIR, add_device, add_smoke, bench_dtype, command, device_arg, gib, log, output, parse_args,
    parse_video, peak_gib, reset_peak, versions)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.budget_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", default="/tmp/wan14b")
    p.add_argument("--video", default="720x1280x81")
    p.add_argument("--budget", default=None, help="max_gpu_memory, e.g. 24GiB (None: no budget)")
    p.add_argument("--quantization", default=None, choices=("fp8",))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--full-steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--backend", default="FLASH_ATTN", help="attention backend (default FLASH_ATTN)")
    p.add_argument("--sparsity", type=float, default=0.9, help="VIDEO_SPARSE_ATTN's sparsity (default 0.9)")
    p.add_argument("--frames-out", default=None, help="save the last timed video's uint8 frames here (.npy)")
    p.add_argument("--label", default=None)
    p.add_argument("--out", default="budget.jsonl")
    add_device(p, compile_default=True)
    add_smoke(p, ckpt=str(SMOKE_DIR / "wan2.1"), video="32x32x5", steps=2, full_steps=4, repeats=1,
              backend="TORCH_SDPA", out=str(SMOKE_DIR / "budget.jsonl"))
    return p


def main(argv=None) -> int:
    p = build_parser()
    a = parse_args(p, argv)
    from fastwan import VideoGenerator
    from fastwan.errors import InvalidArgument
    from fastwan.offload import parse_memory

    device = device_arg(p, a.device, *(["--budget"] if a.budget is not None else []))
    try:
        h, w, f = parse_video(a.video)
    except ValueError as exc:
        p.error(str(exc))
    try:
        budget = parse_memory(a.budget, name="--budget")
    except InvalidArgument as exc:
        p.error(str(exc))
    if a.smoke:
        tiny_checkpoint(a.ckpt)
    if budget is not None:
        torch.cuda.set_per_process_memory_fraction(budget / torch.cuda.get_device_properties(device).total_memory)
    t0 = time.perf_counter()
    gen = VideoGenerator.from_pretrained(a.ckpt, attention_backend=a.backend,
                                         attention_config={"sparsity": a.sparsity} if "SPARSE" in a.backend else None,
                                         device=device, dtype=bench_dtype(device), enable_torch_compile=a.compile,
                                         quantization=a.quantization, max_gpu_memory=budget)
    load_s = time.perf_counter() - t0
    plan = None if gen.memory_plan is None else gen.memory_plan.describe()
    if plan:
        log(plan)
    job = dict(height=h, width=w, num_frames=f, guidance_scale=5.0, seed=0, save_video=False, return_frames=False)
    t0 = time.perf_counter()
    gen.generate_video(PROMPT, **job, num_inference_steps=1)
    warm = time.perf_counter() - t0
    runs = []
    for i in range(a.repeats):
        reset_peak(device)
        keep = a.frames_out is not None and i == a.repeats - 1
        r = gen.generate_video(PROMPT, **{**job, "return_frames": keep}, num_inference_steps=a.steps)
        if keep:
            np.save(a.frames_out, np.asarray(r.frames))
        t = r.timings
        runs.append({"timings": t, "peak_gib": peak_gib(device), "step_s": t["denoising"] / a.steps})
        log(f"{a.label}: {t} peak {gib(runs[-1]['peak_gib'])} GiB")
    plan = None if gen.memory_plan is None else gen.memory_plan.describe()  # the plan of this size (may be new)
    step = statistics.median(x["step_s"] for x in runs)
    fixed = statistics.median(x["timings"]["total"] - x["timings"]["denoising"] for x in runs)
    res = {"label": a.label or f"budget={a.budget} q={a.quantization}", "video": a.video, "budget": a.budget,
           "quantization": a.quantization, "plan": plan, "load_s": load_s, "warmup_s": warm, "runs": runs,
           "step_s": step, "fixed_s": fixed, "e2e_full_s": fixed + a.full_steps * step, "full_steps": a.full_steps,
           "peak_gib": None if device.type != "cuda" else max(x["peak_gib"] for x in runs), "versions": versions(),
           "command": command(p.prog, argv)}
    with open(output(a.out), "a") as fh:
        fh.write(json.dumps(res) + "\n")
    print(f"{res['label']}: {step:.3f} s/step, fixed {fixed:.2f} s, {a.full_steps}-step e2e {res['e2e_full_s']:.1f} s, "
          f"peak {gib(res['peak_gib'])} GiB, load {load_s:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
