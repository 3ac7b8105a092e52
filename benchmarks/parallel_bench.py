"""Several GPUs (issues #22, #46): the same video on 1, 2, 4 ... processes, measured back to back on one machine.

Each layout is its own ParallelGenerator (``from_pretrained(num_gpus=N, cfg_parallel=..., ring_degree=...)``: N
worker processes, one GPU each): an untimed 1-step warm-up video (compilation), then --repeats timed videos of
--steps steps. Reported: s/step (denoising time / steps), the end-to-end time of a --full-steps video (measured text
+ decode + --full-steps x s/step), the speedup over the first layout, and the frames of the last video against the
first layout's frames (PSNR, max abs difference; or against --ref-frames, a .npy another run saved with
--save-frames). The split of a step into communication and compute comes from one more --steps video under
torch.profiler on rank 0: communication is the time its GPU spends in NCCL kernels (all-to-alls, ring key/value
passes, the CFG all-gather, CHORDS's latents, and the waits for the other ranks inside them), divided by the steps;
compute is the rest of s/step.

Layouts: "1"; "spN" (N sequence-parallel processes, split Ulysses x Ring automatically); "spNrR" (ring degree R
pinned); "cfg2" and "cfg2xspN[rR]" (CFG parallelism, times N); "chordsK" (CHORDS step-parallel sampling, K cores on
K processes), "chordsKxspS" (each core on S processes), "chordsK@s0-s1-..." (the cores' start steps). A CHORDS
video is not extrapolated: with a chords layout --steps must equal --full-steps (its rounds are fewer than its
steps), and every layout samples with --sampler (default euler then, the sampler CHORDS needs) so that the first
layout is the sequential video CHORDS approximates.

  python -m benchmarks.parallel_bench --ckpt /tmp/wan14b --layouts 1,sp2,cfg2,sp4,cfg2xsp2
  python -m benchmarks.parallel_bench --ckpt /tmp/wan14b --layouts sp3 --ref-frames one.npy   # 3 GPUs: USP
  python -m benchmarks.parallel_bench --ckpt /tmp/wan13b --video 480x832x81 --layouts 1,sp4r2,chords4@0-12-20-28 \
      --steps 50 --full-steps 50
  python -m benchmarks.parallel_bench --ckpt tiny --device cpu --video 48x80x9 --layouts 1,sp2,cfg2xsp2  # gloo
  python -m benchmarks.parallel_bench --smoke      # CI: a tiny checkpoint on the CPU: one process, Ring 2, CHORDS 2
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from dataclasses import dataclass

import numpy as np
import torch

from benchmarks.checkpoints import tiny_checkpoint
from benchmarks.harness import (
    PROMPT, SMOKE_DIR, add_device, add_smoke, bench_dtype, command, device_arg, log, output, parse_args, parse_video,
    psnr, versions)


@dataclass(frozen=True)
class Layout:
    """One layout of --layouts: ``num_gpus`` processes, CFG parallelism, a pinned ring degree (None: automatic),
    CHORDS's cores (None: sequential sampling) and their start steps (None: the default schedule)."""
    num_gpus: int
    cfg: bool = False
    ring: int | None = None
    cores: int | None = None
    init: tuple[int, ...] | None = None

    def load(self) -> dict:
        return {"num_gpus": self.num_gpus, "cfg_parallel": self.cfg, "ring_degree": self.ring}

    def request(self) -> dict:
        if self.cores is None:
            return {}
        return {"chords_cores": self.cores, **({} if self.init is None else {"chords_init": list(self.init)})}


_SEQUENCE = re.compile(r"(?:(?P<cfg>cfg2)(?:xsp)?|sp)(?P<sp>\d*)(?:r(?P<ring>\d+))?")
_CHORDS = re.compile(r"chords(?P<cores>\d+)(?:xsp(?P<sp>\d+))?(?:@(?P<init>\d+(?:-\d+)*))?")


def layout(text: str) -> Layout:
    """"1", "spN[rR]", "cfg2", "cfg2xspN[rR]", "chordsK[xspS][@s0-s1-...]" -> :class:`Layout`."""
    if text == "1":
        return Layout(1)
    if m := _CHORDS.fullmatch(text):
        cores = int(m["cores"])
        init = None if m["init"] is None else tuple(int(v) for v in m["init"].split("-"))
        if init is not None and len(init) != cores:
            raise ValueError(f"--layouts entry {text!r}: {len(init)} start steps for {cores} CHORDS cores; give one "
                             "per core")
        return Layout(cores * int(m["sp"] or 1), cores=cores, init=init)
    m = _SEQUENCE.fullmatch(text)
    # "cfg2" alone has no sequence degree; "spN" and "cfg2xspN" need theirs
    if m is None or (m["sp"] == "") != (text == "cfg2"):
        raise ValueError(f"--layouts entry {text!r} is not one of 1, spN, spNrR, cfg2, cfg2xspN[rR], "
                         "chordsK[xspS][@s0-s1-...] (e.g. 1,sp3,sp4r2,cfg2xsp2,chords4@0-12-20-28)")
    sp = int(m["sp"] or 1)
    return Layout(sp * (2 if m["cfg"] else 1), cfg=bool(m["cfg"]), ring=None if m["ring"] is None else int(m["ring"]))


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
    p.add_argument("--sampler", default=None,
                   help="every layout's sampler (default: euler with a chords layout, else the checkpoint's)")
    p.add_argument("--save-frames", default=None, help="write the first layout's frames here (.npy)")
    p.add_argument("--ref-frames", default=None,
                   help="compare every layout's frames with this .npy (a --save-frames of another run)")
    p.add_argument("--out", default="parallel.json")
    add_smoke(p, ckpt=str(SMOKE_DIR / "wan2.1"), video="32x32x5", layouts="1,sp2r2,chords2", steps=3, full_steps=3,
              repeats=1, out=str(SMOKE_DIR / "parallel.json"))
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
    chords = [name for name, lay in layouts.items() if lay.cores is not None]
    if chords and a.steps != a.full_steps:
        p.error(f"--layouts {','.join(chords)}: a CHORDS video is timed whole, not extrapolated from s/step; pass "
                f"--steps equal to --full-steps (now {a.steps} and {a.full_steps})")
    sampler = a.sampler or ("euler" if chords else None)
    if a.smoke:
        tiny_checkpoint(a.ckpt)
    cuda = device.type == "cuda"
    load = dict(device=a.device, dtype=bench_dtype(device), enable_torch_compile=a.compile,
                attention_backend="FLASH_ATTN" if cuda else None)
    job = dict(height=h, width=w, num_frames=f, guidance_scale=5.0, seed=0, save_video=False,
               **({} if sampler is None else {"sampler": sampler}))
    rows, ref = [], None if a.ref_frames is None else np.load(a.ref_frames)
    for name, lay in layouts.items():
        n, run = lay.num_gpus, {**job, **lay.request()}
        # the workers are the ones from_pretrained(num_gpus=n) starts, each generator wrapped in Profiled
        gen = (profiled_loader(a.ckpt, **load) if n == 1 else
               ParallelGenerator(profiled_loader, a.ckpt, {**load, **lay.load()}, n,
                                 torch.device(a.device)))
        try:
            # CHORDS needs a step per core: its warm-up runs as many steps as it has cores
            gen.generate_video(PROMPT, **run, num_inference_steps=lay.cores or 1, return_frames=False)
            runs = [gen.generate_video(PROMPT, **run, num_inference_steps=a.steps) for _ in range(a.repeats)]
            # one process has nothing to communicate: its split is all compute
            prof = (gen._call("profile_video", (PROMPT,), {**run, "num_inference_steps": a.steps,
                                                             "return_frames": False}) if cuda and n > 1
                    else None)
        finally:
            if isinstance(gen, ParallelGenerator):  # layout "1" is one process: nothing to end
                gen.close()
        step = statistics.median(r.timings["denoising"] / a.steps for r in runs)
        fixed = statistics.median(r.timings["total"] - r.timings["denoising"] for r in runs)
        frames = runs[-1].frames
        if ref is None:
            ref = frames
            if a.save_frames:
                np.save(output(a.save_frames), frames)
        row = {"layout": name, "num_gpus": n, "cfg_parallel": lay.cfg, "ring_degree": lay.ring,
               "chords_cores": lay.cores, "chords_init": lay.init, "sampler": sampler, "step_s": step, "fixed_s": fixed,
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
    first = rows[0]['layout'] if a.ref_frames is None else a.ref_frames
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
