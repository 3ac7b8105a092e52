"""Several GPUs (issue #22): the same video on 1, 2, 4 ... processes, measured back to back on one machine.

Each layout is its own ParallelGenerator (``from_pretrained(num_gpus=N, cfg_parallel=...)``: N worker processes,
one GPU each): an untimed 1-step warm-up video (compilation), then --repeats timed videos of --steps steps. Reported:
s/step (denoising time / steps), the end-to-end time of a --full-steps video (measured text + decode + --full-steps
x s/step), the speedup over the 1-process layout, and the frames of the last video against the 1-process frames
(PSNR, max abs difference).

  python -m benchmarks.parallel_bench --ckpt /tmp/wan14b --layouts 1,sp2,cfg2,sp4,cfg2xsp2
  python -m benchmarks.parallel_bench --ckpt tiny --device cpu --video 48x80x9 --layouts 1,sp2,cfg2xsp2  # gloo
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import numpy as np
import torch

from benchmarks.harness import PROMPT, log, parse_video, psnr, versions


def layout(text: str) -> tuple[int, bool]:
    """"1", "spN", "cfg2" or "cfg2xspN" -> (num_gpus, cfg_parallel)."""
    cfg = text.startswith("cfg2")
    rest = text[len("cfg2"):].lstrip("x") if cfg else text
    sp = 1 if rest in ("", "1") else int(rest.removeprefix("sp"))
    return sp * (2 if cfg else 1), cfg


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.parallel_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", default="/tmp/wan14b")
    p.add_argument("--video", default="720x1280x81")
    p.add_argument("--layouts", default="1,sp2,cfg2,sp4,cfg2xsp2")
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--full-steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default="parallel.json")
    a = p.parse_args(argv)
    from fastwan import VideoGenerator
    from fastwan.parallel.workers import ParallelGenerator

    h, w, f = parse_video(a.video)
    cuda = a.device == "cuda"
    load = dict(device=a.device, dtype=torch.bfloat16 if cuda else torch.float32, enable_torch_compile=cuda,
                attention_backend="FLASH_ATTN" if cuda else None)
    job = dict(height=h, width=w, num_frames=f, guidance_scale=5.0, seed=0, save_video=False)
    rows, ref = [], None
    for name in a.layouts.split(","):
        n, cfg = layout(name)
        gen = VideoGenerator.from_pretrained(a.ckpt, num_gpus=n, cfg_parallel=cfg, **load)
        try:
            gen.generate_video(PROMPT, **job, num_inference_steps=1, return_frames=False)
            runs = [gen.generate_video(PROMPT, **job, num_inference_steps=a.steps) for _ in range(a.repeats)]
        finally:
            if isinstance(gen, ParallelGenerator):  # layout "1" is one process: nothing to end
                gen.close()
        step = statistics.median(r.timings["denoising"] / a.steps for r in runs)
        fixed = statistics.median(r.timings["total"] - r.timings["denoising"] for r in runs)
        frames = runs[-1].frames
        ref = frames if ref is None else ref
        row = {"layout": name, "num_gpus": n, "cfg_parallel": cfg, "step_s": step, "fixed_s": fixed,
               "e2e_full_s": fixed + a.full_steps * step, "psnr_vs_first": psnr(frames, ref),
               "max_diff_vs_first": int(np.abs(frames.astype(int) - ref.astype(int)).max())}
        rows.append(row)
        log(row)
    base = rows[0]["e2e_full_s"]
    res = {"video": a.video, "steps": a.steps, "full_steps": a.full_steps, "rows": rows,
           "versions": versions() if cuda else {"torch": torch.__version__},
           "command": " ".join(["python -m benchmarks.parallel_bench"] + (argv or sys.argv[1:]))}
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1)
    first = rows[0]['layout']
    print(f"\n| layout | GPUs | s/step | {a.full_steps}-step e2e s | speedup | PSNR / max diff vs {first} |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layout']} | {r['num_gpus']} | {r['step_s']:.3f} | {r['e2e_full_s']:.1f} | "
              f"{base / r['e2e_full_s']:.2f}x | {r['psnr_vs_first']:.1f} dB / {r['max_diff_vs_first']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
