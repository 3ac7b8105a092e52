"""Several GPUs (issue #22): the same video on 1, 2, 4 ... processes, measured back to back on one machine.

Each layout is its own ParallelGenerator (``from_pretrained(num_gpus=N, cfg_parallel=...)``: N worker processes,
one GPU each): an untimed 1-step warm-up video (compilation), then --repeats timed videos of --steps steps. Reported:
s/step (denoising time / steps), the end-to-end time of a --full-steps video (measured text + decode + --full-steps
x s/step), the speedup over the 1-process layout, and the frames of the last video against the 1-process frames
(PSNR, max abs difference). The split of a step into communication and compute comes from one more --steps video
under torch.profiler on rank 0: communication is the time its GPU spends in NCCL kernels (the all-to-alls, the
CFG all-gather, and the waits for the other ranks inside them), divided by the steps; compute is the rest of s/step.

  python -m benchmarks.parallel_bench --ckpt /tmp/wan14b --layouts 1,sp2,cfg2,sp4,cfg2xsp2
  python -m benchmarks.parallel_bench --ckpt tiny --device cpu --video 48x80x9 --layouts 1,sp2,cfg2xsp2  # gloo
  python -m benchmarks.parallel_bench --smoke      # CI: a tiny checkpoint on the CPU, one process and two (gloo)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import numpy as np
import torch

from benchmarks.checkpoints import tiny_checkpoint
from benchmarks.harness import (
    PROMPT, SMOKE_DIR, add_device, add_smoke, bench_dtype, command, device_arg, log, output, parse_args, parse_video,
    psnr, versions)


def layout(text: str) -> tuple[int, bool]:
    """"1", "spN", "cfg2" or "cfg2xspN" -> (num_gpus, cfg_parallel)."""
    cfg = text.startswith("cfg2")
    rest = text[len("cfg2"):].lstrip("x") if cfg else text
    sp = 1 if rest in ("", "1") else int(rest.removeprefix("sp"))
    return sp * (2 if cfg else 1), cfg


class Profiled:
    """A VideoGenerator (one rank's) with :meth:`profile_video`; everything else is the wrapped generator's."""

    def __init__(self, gen):
        self.gen = gen

    def __getattr__(self, name):
        return getattr(self.gen, name)

    def profile_video(self, prompt: str, **kwargs) -> dict:
        """generate_video under torch.profiler -> {"nccl_s": seconds of NCCL kernels, "gpu_s": seconds of all
        kernels, "denoising_s": the video's denoising time} (this rank's GPU)."""
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            out = self.gen.generate_video(prompt, **kwargs)
        kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
        nccl = sum(e.time_range.elapsed_us() for e in kernels if "nccl" in e.name.lower())
        return {"nccl_s": nccl / 1e6, "gpu_s": sum(e.time_range.elapsed_us() for e in kernels) / 1e6,
                "denoising_s": out.timings["denoising"]}


def profiled_loader(model, **kwargs) -> Profiled:
    """``VideoGenerator.from_pretrained`` wrapped in :class:`Profiled` (a worker's loader; picklable by reference)."""
    from fastwan import VideoGenerator

    return Profiled(VideoGenerator.from_pretrained(model, **kwargs))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.parallel_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", default="/tmp/wan14b")
    p.add_argument("--video", default="720x1280x81")
    p.add_argument("--layouts", default="1,sp2,cfg2,sp4,cfg2xsp2")
    add_device(p, compile_default=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--full-steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default="parallel.json")
    add_smoke(p, ckpt=str(SMOKE_DIR / "wan2.1"), video="32x32x5", layouts="1,sp2", steps=2, full_steps=4, repeats=1,
              out=str(SMOKE_DIR / "parallel.json"))
    return p


def main(argv=None) -> int:
    p = build_parser()
    a = parse_args(p, argv)
    from fastwan.parallel.workers import ParallelGenerator

    device = device_arg(p, a.device)
    try:
        h, w, f = parse_video(a.video)
        layouts = {name: layout(name) for name in a.layouts.split(",")}
    except ValueError as exc:
        p.error(str(exc))
    if a.smoke:
        tiny_checkpoint(a.ckpt)
    cuda = device.type == "cuda"
    load = dict(device=a.device, dtype=bench_dtype(device), enable_torch_compile=a.compile,
                attention_backend="FLASH_ATTN" if cuda else None)
    job = dict(height=h, width=w, num_frames=f, guidance_scale=5.0, seed=0, save_video=False)
    timed = {**job, "num_inference_steps": a.steps}
    rows, ref = [], None
    for name, (n, cfg) in layouts.items():
        # the workers are the ones from_pretrained(num_gpus=n) starts, each generator wrapped in Profiled
        gen = (profiled_loader(a.ckpt, **load) if n == 1 else
               ParallelGenerator(profiled_loader, a.ckpt, {**load, "num_gpus": n, "cfg_parallel": cfg}, n,
                                 torch.device(a.device)))
        try:
            gen.generate_video(PROMPT, **job, num_inference_steps=1, return_frames=False)
            runs = [gen.generate_video(PROMPT, **timed) for _ in range(a.repeats)]
            # one process has nothing to communicate: its split is all compute
            prof = (gen._call("profile_video", (PROMPT,), {**timed, "return_frames": False}) if cuda and n > 1
                    else None)
        finally:
            if isinstance(gen, ParallelGenerator):  # layout "1" is one process: nothing to end
                gen.close()
        step = statistics.median(r.timings["denoising"] / a.steps for r in runs)
        fixed = statistics.median(r.timings["total"] - r.timings["denoising"] for r in runs)
        frames = runs[-1].frames
        ref = frames if ref is None else ref
        row = {"layout": name, "num_gpus": n, "cfg_parallel": cfg, "step_s": step, "fixed_s": fixed,
               "e2e_full_s": fixed + a.full_steps * step, "psnr_vs_first": psnr(frames, ref),
               "max_diff_vs_first": int(np.abs(frames.astype(int) - ref.astype(int)).max()),
               "comm_s_per_step": (prof["nccl_s"] / a.steps if prof else 0.0 if cuda else None), "profile_rank0": prof}
        rows.append(row)
        log(row)
    base = rows[0]["e2e_full_s"]
    res = {"video": a.video, "steps": a.steps, "full_steps": a.full_steps, "rows": rows,
           "versions": versions() if cuda else {"torch": torch.__version__},
           "command": command(p.prog, argv)}
    with open(output(a.out), "w") as fh:
        json.dump(res, fh, indent=1)
    first = rows[0]['layout']
    print(f"\n| layout | GPUs | s/step | comm / compute s/step | {a.full_steps}-step e2e s | speedup | "
          f"PSNR / max diff vs {first} |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        c = r["comm_s_per_step"]
        split = "-" if c is None else f"{c:.3f} / {r['step_s'] - c:.3f}"
        print(f"| {r['layout']} | {r['num_gpus']} | {r['step_s']:.3f} | {split} | {r['e2e_full_s']:.1f} | "
              f"{base / r['e2e_full_s']:.2f}x | {r['psnr_vs_first']:.1f} dB / {r['max_diff_vs_first']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
