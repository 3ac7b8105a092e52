"""Image-to-video benchmark: fastwan vs diffusers' WanImageToVideoPipeline on the same random weights (GPU).

Jobs (--job): ``i2v-14b`` Wan2.1-I2V-14B, 480x832, 81 frames, 40 steps, CFG 5 (CLIP image tokens, 36 input
channels); ``i2v-a14b`` Wan2.2-I2V-A14B, 720x1280, 81 frames, 40 steps, guidance 3.5/3.5 (two experts, no CLIP).
Phases (each appends to the JSON given by --out, so they can run in separate processes):
  make             write a random checkpoint of the job at the real shapes to --ckpt (A14B: transformer_2 is a link
                   to transformer; the two experts load as separate tensors, so time and memory are the real ones)
  diffusers        WanImageToVideoPipeline end to end (bf16 DiT, fp32 CLIP and VAE as diffusers' examples load
                   them), per-step times from its step callback, frames saved for the comparison
  diffusers_tuned  the same with compile_repeated_blocks(fullgraph=True) and the _native_cudnn attention backend
  fastwan          VideoGenerator end to end with --steps (fewer steps measure the whole job's peak memory, as the
                   peak does not depend on the count once both experts have run), frames compared with diffusers'
Random weights have the FLOPs and kernels of the real model; video quality is not measured here.

  python -m benchmarks.i2v --job i2v-14b --phase make,diffusers,diffusers_tuned,fastwan --ckpt /tmp/i2v14b
  python -m benchmarks.i2v --smoke [--job i2v-a14b]    # CI: the job's tiny checkpoint on the CPU, 2 steps
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from benchmarks.checkpoints import make_checkpoint
from benchmarks.harness import (
    NEG, PEERS, PROMPT, SMOKE_DIR, add_device, add_smoke, bench_dtype, command, compare, device_arg, frames_path, log,
    output, parse_args, parse_phases, parse_video, peak_gib, release, reset_peak, sync, tune_diffusers, versions)

class Job(NamedTuple):
    task: str  # the checkpoint's task (benchmarks.harness.TASKS)
    height: int
    width: int
    frames: int
    steps: int
    guidance: float
    guidance_2: float | None


JOBS = {
    "i2v-14b": Job("i2v", 480, 832, 81, 40, 5.0, None),
    "i2v-a14b": Job("i2v-a14b", 720, 1280, 81, 40, 3.5, 3.5),
}
PHASES = ("make", "diffusers", "diffusers_tuned", "fastwan")


def bench_image(height: int, width: int) -> np.ndarray:
    """A deterministic uint8 RGB image [height, width, 3]: colour gradients with a checker pattern (edges and
    smooth areas, like a photo's content for the encoders' purposes)."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    checker = ((y // 32 + x // 32) % 2) * 40.0
    r = 255 * x / max(width - 1, 1)
    g = 255 * y / max(height - 1, 1)
    b = 127 + 100 * np.sin(x / 37.0) * np.cos(y / 23.0)
    return np.clip(np.stack([r, g, b], -1) * 0.8 + checker[..., None], 0, 255).astype(np.uint8)


def compare_runs(res: dict, out: Path, job: str) -> None:
    """Every run of ``job`` against diffusers eager's frames, once both are saved (the phases may run in any order
    and in separate processes)."""
    ref = frames_path(out, f"{job}:diffusers")
    for key, entry in res.items():
        if key.startswith(f"{job}:") and key != f"{job}:diffusers" and entry.get("vs_diffusers") is None:
            mine = frames_path(out, key)
            if mine.exists():
                entry["vs_diffusers"] = compare(np.load(mine), ref)


class StepClock:
    """diffusers' ``callback_on_step_end``: the host time at the end of every step (after a device sync)."""

    def __init__(self, device: torch.device):
        self.device, self.marks = device, []

    def __call__(self, pipe, i, t, kwargs):
        sync(self.device)
        self.marks.append(time.perf_counter())
        return {}

    def step_seconds(self) -> list[float]:
        """Seconds of steps 2..N (the first step's start is not marked)."""
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


def diffusers_i2v(root: Path, tuned: bool, device: torch.device, pipeline: str = "WanImageToVideoPipeline"):
    """diffusers' ``pipeline`` (WanImageToVideoPipeline, or another Wan pipeline class) from ``root``: bf16 DiT
    (fp32 off CUDA), fp32 VAE and CLIP where it has one (diffusers' examples)."""
    import diffusers
    from diffusers import AutoencoderKLWan

    extra = {"vae": AutoencoderKLWan.from_pretrained(root / "vae", torch_dtype=torch.float32)}
    if (root / "image_encoder").is_dir():
        from transformers import CLIPVisionModel

        extra["image_encoder"] = CLIPVisionModel.from_pretrained(root / "image_encoder", torch_dtype=torch.float32)
    pipe = getattr(diffusers, pipeline).from_pretrained(root, torch_dtype=bench_dtype(device), **extra).to(device)
    pipe.set_progress_bar_config(disable=True)
    if tuned:
        for t in (pipe.transformer, getattr(pipe, "transformer_2", None)):
            if t is not None:
                tune_diffusers(t)
    return pipe


def phase_diffusers(root: Path, job: str, video: tuple[int, int, int], steps: int, res: dict, out: Path,
                    tuned: bool, device: torch.device) -> None:
    """diffusers end to end: one untimed warm-up (2 steps when tuned, to compile), one timed run."""
    from PIL import Image

    h, w, f = video
    gs, gs2 = JOBS[job].guidance, JOBS[job].guidance_2
    pipe = diffusers_i2v(root, tuned, device)
    image = Image.fromarray(bench_image(h, w))
    kw = dict(image=image, prompt=PROMPT, negative_prompt=NEG, height=h, width=w, num_frames=f, guidance_scale=gs)
    if gs2 is not None:
        kw["guidance_scale_2"] = gs2
    key = f"{job}:diffusers_tuned" if tuned else f"{job}:diffusers"
    res[key] = timed_diffusers(pipe, kw, steps, tuned, device, frames_path(out, key))
    res[key]["setup"] = PEERS["diffusers_tuned" if tuned else "diffusers"] + ", fp32 CLIP"
    log(f"{key}: {res[key]['seconds']:.2f} s, {res[key]['s_per_step_median']} s/step, peak {res[key]['peak_gib']} "
        "GiB")
    del pipe
    release(tuned, device)


def timed_diffusers(pipe, kw: dict, steps: int, tuned: bool, device: torch.device, frames_to: Path) -> dict:
    """diffusers' ``pipe(**kw)`` end to end: one untimed warm-up (2 steps when tuned, to compile; latents out),
    one timed run of ``steps`` (seed 0) whose uint8 frames are saved to ``frames_to`` -> its figures: seconds,
    steps, warm-up seconds, peak GiB, the median and spread of steps 2..N."""
    t0 = time.perf_counter()
    pipe(**kw, num_inference_steps=2 if tuned else 1, output_type="latent")
    warmup = time.perf_counter() - t0
    clock = StepClock(device)
    reset_peak(device)
    sync(device)
    t0 = time.perf_counter()
    out_np = pipe(**kw, num_inference_steps=steps, generator=torch.Generator(device).manual_seed(0),
                  output_type="np", callback_on_step_end=clock).frames[0]
    sync(device)
    e2e = time.perf_counter() - t0
    np.save(frames_to, (out_np * 255).round().astype(np.uint8))
    per_step = clock.step_seconds()
    return {"seconds": e2e, "steps": steps, "warmup_s": warmup, "peak_gib": peak_gib(device),
            "s_per_step_median": statistics.median(per_step) if per_step else None,
            "s_per_step_spread": [min(per_step), max(per_step)] if per_step else None}


def phase_fastwan(root: Path, job: str, video: tuple[int, int, int], steps: int, res: dict, out: Path,
                  compile_: bool, cfg_mode: str, device: torch.device) -> None:
    """fastwan end to end: one untimed 2-step warm-up (compilation, kernel JIT), one timed run."""
    from fastwan import VideoGenerator

    h, w, f = video
    gs, gs2 = JOBS[job].guidance, JOBS[job].guidance_2
    gen = VideoGenerator.from_pretrained(root, device=device, dtype=bench_dtype(device), cfg_mode=cfg_mode,
                                         enable_torch_compile=compile_)
    kw = dict(image=bench_image(h, w), negative_prompt=NEG, height=h, width=w, num_frames=f, guidance_scale=gs,
              guidance_scale_2=gs2)
    key = f"{job}:fastwan[{cfg_mode}{',compiled' if compile_ else ''},{steps} steps]"
    res[key] = {**timed_fastwan(gen, kw, steps, device, frames_path(out, key)), "experts": expert_steps(gen, steps)}
    log(f"{key}: {res[key]['seconds']:.2f} s ({res[key]['s_per_step']:.3f} s/step), peak {res[key]['peak_gib']} "
        f"GiB, timings {res[key]['timings']}")
    del gen
    release(compile_, device)


def timed_fastwan(gen, kw: dict, steps: int, device: torch.device, frames_to: Path) -> dict:
    """fastwan's ``gen.generate_video(PROMPT, **kw)`` end to end (seed 0): one untimed 2-step warm-up (compilation,
    kernel JIT), one timed run of ``steps`` whose frames are saved to ``frames_to`` -> its figures: seconds, steps,
    s/step (denoising time / steps), the generator's timings, warm-up seconds, attention backend, peak GiB."""
    kw = dict(kw, seed=0, save_video=False)
    t0 = time.perf_counter()
    gen.generate_video(PROMPT, **kw, num_inference_steps=2)
    warmup = time.perf_counter() - t0
    sync(device)
    t0 = time.perf_counter()
    r = gen.generate_video(PROMPT, **kw, num_inference_steps=steps)
    sync(device)
    e2e = time.perf_counter() - t0
    np.save(frames_to, r.frames)
    return {"seconds": e2e, "steps": steps, "s_per_step": r.timings["denoising"] / steps, "timings": r.timings,
            "warmup_s": warmup, "attention": r.attention_backend,
            "peak_gib": None if r.peak_memory is None else r.peak_memory / 2**30}


def expert_steps(gen, steps: int) -> list[int]:
    """How many of ``steps`` steps each expert runs (one entry without a boundary)."""
    sched = type(gen.scheduler).from_config(gen.scheduler.config)
    sched.set_timesteps(steps)
    ratio = gen.checkpoint.boundary_ratio
    if ratio is None:
        return [steps]
    high = sum(1 for t in sched.timesteps.tolist() if t >= ratio * sched.config.num_train_timesteps)
    return [high, steps - high]


def summary(res: dict, job: str) -> None:
    """This job's figures: each fastwan run against both diffusers peers (e2e and s/step)."""
    peers = {p: res[f"{job}:{p}"] for p in ("diffusers", "diffusers_tuned") if f"{job}:{p}" in res}
    log(f"\n| {job} | e2e s | s/step | peak GiB | " + " | ".join(f"vs {p} (e2e, step)" for p in peers) + " |")
    for name, p in peers.items():
        log(f"| {name} | {p['seconds']:.2f} | {p['s_per_step_median']:.3f} | {p['peak_gib']} | |")
    for k, v in res.items():
        if k.startswith(f"{job}:fastwan[") and isinstance(v, dict):
            ratios = [f"{p['seconds'] / v['seconds']:.3f}x, {p['s_per_step_median'] / v['s_per_step']:.3f}x"
                      for p in peers.values() if p["steps"] == v["steps"]]
            log(f"| {k} | {v['seconds']:.2f} | {v['s_per_step']:.3f} | {v['peak_gib']} | " + " | ".join(ratios)
                + " |")
    for k, v in res.items():
        if k.startswith(f"{job}:") and v.get("vs_diffusers"):
            log(f"{k} vs diffusers eager: " + ", ".join(f"{m} {x:.4g}" for m, x in v["vs_diffusers"].items()))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.i2v", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    add_job_arguments(p, tuple(JOBS), "/tmp/wan-i2v-random", "i2v.json", compile_default=False)
    return p


def add_job_arguments(p, jobs: tuple[str, ...], ckpt: str, out: str, compile_default: bool,
                      video_help: str = "height x width x frames (default: the job's)") -> None:
    """The arguments :func:`run_phases` reads: --job (one of ``jobs``, the first by default), --phase, --ckpt,
    --steps, --cfg-mode, --device, --compile, --video, --out (``out``; --smoke's in the smoke folder) and --smoke."""
    p.add_argument("--job", default=jobs[0], choices=jobs)
    p.add_argument("--phase", default="make,diffusers,diffusers_tuned,fastwan", help="comma-separated, in order")
    p.add_argument("--ckpt", default=ckpt)
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: the job's)")
    p.add_argument("--cfg-mode", default="auto", choices=("auto", "batched", "sequential"))
    add_device(p, compile_default=compile_default)
    p.add_argument("--video", default=None, metavar="HxWxF", help=video_help)
    p.add_argument("--out", default=out)
    add_smoke(p, ckpt=None, phase="make,diffusers,fastwan", video="32x32x5", steps=2, out=str(SMOKE_DIR / out))


def main(argv=None) -> int:
    p = build_parser()
    a = parse_args(p, argv)
    job = JOBS[a.job]

    def make(root: Path, device: torch.device) -> None:
        make_checkpoint(root, "tiny" if a.smoke else "14b", task=job.task, device=device)

    return run_phases(p, a, argv, job.steps, (job.height, job.width, job.frames), make, phase_diffusers,
                      phase_fastwan)


def run_phases(p, a, argv, steps: int, video: tuple[int, int, int], make, diffusers, fastwan) -> int:
    """Run the phases of a command line ``a`` parsed by ``p`` (--job, --phase, --device, --steps, --video, --ckpt,
    --out, --compile, --cfg-mode, --smoke) in order, appending the results to --out after each (frames compared
    once both are saved), then print the job's summary; 0. ``steps`` and ``video``: the job's defaults;
    ``make(root, device)`` writes the checkpoint; ``diffusers`` and ``fastwan`` are called as
    :func:`phase_diffusers` and :func:`phase_fastwan` are. Bad arguments: the parser's error, before any work."""
    phases = parse_phases(p, a.phase, PHASES)
    device = device_arg(p, a.device, *(f"--phase {ph}" for ph in phases if ph == "diffusers_tuned"))
    steps = a.steps if a.steps is not None else steps
    if steps < 2:
        p.error(f"--steps {steps}: must be at least 2 (the per-step times need two step ends)")
    if a.video is not None:
        try:
            video = parse_video(a.video)
        except ValueError as exc:
            p.error(str(exc))
    root = SMOKE_DIR / a.job if a.ckpt is None else Path(a.ckpt)  # --smoke: each job's tiny checkpoint
    out = output(a.out)
    res = json.loads(out.read_text()) if out.exists() else {}
    res.setdefault("versions", versions())
    res.setdefault("commands", []).append(command(p.prog, argv))
    for ph in phases:
        if ph == "make":
            make(root, device)
        elif ph in ("diffusers", "diffusers_tuned"):
            diffusers(root, a.job, video, steps, res, out, ph == "diffusers_tuned", device)
        else:
            fastwan(root, a.job, video, steps, res, out, a.compile, a.cfg_mode, device)
        compare_runs(res, out, a.job)
        out.write_text(json.dumps(res, indent=1))
    summary(res, a.job)
    return 0


if __name__ == "__main__":
    sys.exit(main())
