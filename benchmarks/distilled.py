"""Few-step distilled generation on the GPU: FastWan (DMD + VSA) and a step-distill LoRA, against diffusers.

Random weights at the real shapes (the FLOPs and kernels of the real models; quality is not measured here).

Phases (each appends to the JSON given by --out):
  make            plain random checkpoints (1.3B at --ckpt13, 14B at --ckpt14, one shared UMT5-XXL), their
                  FastWan-layout twins (model_index "WanDMDPipeline", DiT with VSA gates; --fastwan13 / --fastwan14),
                  a random rank-64 14B LoRA in lightx2v's layout (--lora) and a random TAEHV decoder in the published
                  taew2_1 layout (--taehv)
  fastwan13b      FastWan 1.3B with its defaults (DMD 1000/757/522, VSA 0.8, no CFG), compiled: end to end at
                  480x832x81 and at FastWan's 448x832x61, with the text / denoise / decode split
  fastwan13b_tiny fastwan13b with TAEHV's tiny decoder (vae="tiny", vae_path=--taehv) in place of the VAE's; its
                  weights are random, so time only (its frames are no approximation of the full VAE's)
  fastwan14b      FastWan 14B at 720x1280x81 with its defaults (VSA 0.9), compiled: the DiT (denoising) time
  lora14b         Wan2.1 14B at 480x832x81 with the LoRA merged, Euler at 1000/750/500/250 (shift 5), guidance 1
  diffusers13b    diffusers' WanPipeline on the plain 1.3B, 3 steps, guidance 1 (dense: diffusers has no VSA),
                  eager and tuned, at both sizes
  diffusers14b    diffusers on the plain 14B at 480x832x81, 4 steps (FlowMatchEuler, shift 5), guidance 1, eager
                  and tuned: a merged LoRA costs nothing per step, so this is the LoRA job's cost in diffusers
Each job: one untimed warm-up (compilation), then --repeats timed runs; the median is reported.

  python -m benchmarks.distilled --phase make
  python -m benchmarks.distilled --phase fastwan13b,fastwan14b,lora14b,diffusers13b,diffusers14b
  python -m benchmarks.distilled --smoke    # CI: tiny checkpoints on the CPU (FastWan with the VAE and with the
                                            # tiny decoder, LoRA, diffusers eager)

FastWan 1.3B with the tiny decoder against the full VAE, in one run (issue #43: 3 steps at 480p, e2e and decode):

  python -m benchmarks.distilled --phase make,fastwan13b,fastwan13b_tiny --repeats 5 --out distilled_tiny.json
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.checkpoints import derive_fastwan, make_checkpoint, transformer_config, write_lora, write_taehv
from benchmarks.harness import (
    PROMPT, SMOKE_DIR, add_device, add_smoke, bench_dtype, command, device_arg, diffusers_pipeline, log, output,
    parse_args, parse_phases, parse_video, release, sync, versions)

PHASES = ("make", "fastwan13b", "fastwan13b_tiny", "fastwan14b", "lora14b", "diffusers13b", "diffusers14b")
SIZES_13B = {"480x832x81": (480, 832, 81), "448x832x61": (448, 832, 61)}
LORA_JOB = dict(sampler="euler", timesteps=[1000, 750, 500, 250], flow_shift=5.0, guidance_scale=1.0)
LOAD_KEYS = ("lora", "quantization", "vae", "vae_path")  # job_fastwan keywords that go to from_pretrained


def timed(fn, repeats: int, device: torch.device) -> tuple[list[float], object]:
    """Wall seconds of ``repeats`` calls of ``fn`` (the device synchronised) and the last result."""
    runs, out = [], None
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        runs.append(time.perf_counter() - t0)
    return runs, out


def job_fastwan(root: Path, sizes: dict, repeats: int, run: dict, **gen_kw) -> dict:
    """A fastwan generator from ``root`` (``run``: its device and whether compiled; :data:`LOAD_KEYS` in ``gen_kw``
    go to its loading) over ``sizes``, with its defaults unless the rest of ``gen_kw`` sets them."""
    from fastwan import VideoGenerator

    load = {k: gen_kw.pop(k) for k in LOAD_KEYS if k in gen_kw}
    device = run["device"]
    gen = VideoGenerator.from_pretrained(root, device=device, dtype=bench_dtype(device),
                                         enable_torch_compile=run["compile"], **load)
    out = {"attention": gen.attention.describe(device)}
    for label, (h, w, f) in sizes.items():
        kw = dict(height=h, width=w, num_frames=f, seed=0, save_video=False, return_frames=False, **gen_kw)
        t0 = time.perf_counter()
        gen.generate_video(PROMPT, **kw)
        warm = time.perf_counter() - t0
        runs, r = timed(functools.partial(gen.generate_video, PROMPT, **kw), repeats, device)
        split = {k: round(v, 4) for k, v in r.timings.items()}
        out[label] = {"e2e_s": statistics.median(runs), "runs": runs, "warmup_s": warm, "timings": split,
                      "settings": {k: v for k, v in r.settings.items() if k != "cache"},
                      "forwards": r.num_transformer_forwards, "peak_gib": r.peak_memory and r.peak_memory / 2**30}
        log(f"{root.name} {label}: median {out[label]['e2e_s']:.3f} s of {[round(x, 3) for x in runs]}, "
            f"split {split}, peak {out[label]['peak_gib']} GiB")
    gen = None  # freed before the next job loads
    release(run["compile"], device)
    return out


def job_diffusers(root: Path, sizes: dict, steps: int, repeats: int, device: torch.device,
                  shift: float | None = None) -> dict:
    """diffusers' WanPipeline (eager, then tuned: CUDA only) on ``root`` at ``sizes``, ``steps`` steps,
    guidance 1."""
    out = {}
    for tuned in (False, True) if device.type == "cuda" else (False,):
        pipe = diffusers_pipeline(root, tuned, device)
        if shift is not None:
            from diffusers import FlowMatchEulerDiscreteScheduler

            pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
        name = "diffusers_tuned" if tuned else "diffusers"
        for label, (h, w, f) in sizes.items():
            run = functools.partial(pipe, PROMPT, height=h, width=w, num_frames=f, num_inference_steps=steps,
                                    guidance_scale=1.0, generator=torch.Generator(device).manual_seed(0),
                                    output_type="np")
            t0 = time.perf_counter()
            run()
            warm = time.perf_counter() - t0
            runs, _ = timed(run, repeats, device)
            out[f"{name}[{label}]"] = {"e2e_s": statistics.median(runs), "runs": runs, "warmup_s": warm}
            log(f"{name} {root.name} {label}: median {statistics.median(runs):.3f} s of "
                f"{[round(x, 3) for x in runs]}")
        pipe = run = None  # freed before the next peer loads
        release(tuned, device)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.distilled", description=__doc__.split("\n\n")[0])
    p.add_argument("--phase", default="fastwan13b")
    p.add_argument("--ckpt13", default="/tmp/wan13b")
    p.add_argument("--ckpt14", default="/tmp/wan14b")
    p.add_argument("--fastwan13", default="/tmp/fastwan13b")
    p.add_argument("--fastwan14", default="/tmp/fastwan14b")
    p.add_argument("--lora", default="/tmp/lora14b/lightx2v_4step_rank64.safetensors")
    p.add_argument("--taehv", default="/tmp/taehv/taew2_1.safetensors",
                   help="fastwan13b_tiny: the tiny decoder's weight file (make writes a random one)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quantization", choices=("fp8",), default=None,
                   help="fastwan jobs: FP8 DiT weights (their results are stored as '<phase>_fp8')")
    p.add_argument("--out", default="distilled.json")
    p.add_argument("--video", default=None, metavar="HxWxF", help="every job at this size instead of its own")
    add_device(p, compile_default=True)
    files = {"ckpt13": "wan2.1", "ckpt14": "wan2.1", "fastwan13": "fastwan", "fastwan14": "fastwan",
             "lora": "lora.safetensors", "taehv": "taew2_1.safetensors",
             "out": "distilled.json"}  # --smoke: one tiny checkpoint for both sizes
    add_smoke(p, phase="make,fastwan13b,fastwan13b_tiny,lora14b,diffusers14b", repeats=1, video="32x32x5",
              **{name: str(SMOKE_DIR / file) for name, file in files.items()})
    return p


def main(argv=None) -> int:
    p = build_parser()
    a = parse_args(p, argv)
    phases = parse_phases(p, a.phase, PHASES)
    run = {"device": device_arg(p, a.device), "compile": a.compile}
    try:
        video = None if a.video is None else parse_video(a.video)
    except ValueError as exc:
        p.error(str(exc))

    def sizes(own: dict) -> dict:
        return own if video is None else {a.video: video}

    out = output(a.out)
    res = json.loads(out.read_text()) if out.exists() else {}
    res.setdefault("versions", versions())
    res.setdefault("commands", []).append(command(p.prog, argv))
    c13, c14, f13, f14 = (Path(x) for x in (a.ckpt13, a.ckpt14, a.fastwan13, a.fastwan14))

    def key(phase: str) -> str:
        return phase if a.quantization is None else f"{phase}_{a.quantization}"

    for phase in phases:
        if phase == "make":
            make_checkpoint(c13, "tiny" if a.smoke else "1.3b")
            make_checkpoint(c14, "tiny" if a.smoke else "14b", text_encoder_from=c13)
            derive_fastwan(c13, f13)
            derive_fastwan(c14, f14)
            if not Path(a.lora).exists():
                write_lora(Path(a.lora), transformer_config(c14))
            write_taehv(Path(a.taehv), 16)  # taew2_1: Wan2.1's latents
        elif phase == "fastwan13b":
            res[key(phase)] = job_fastwan(f13, sizes(SIZES_13B), a.repeats, run, quantization=a.quantization)
        elif phase == "fastwan13b_tiny":
            res[key(phase)] = job_fastwan(f13, sizes(SIZES_13B), a.repeats, run, quantization=a.quantization,
                                          vae="tiny", vae_path=a.taehv)
        elif phase == "fastwan14b":
            res[key(phase)] = job_fastwan(f14, sizes({"720x1280x81": (720, 1280, 81)}), a.repeats, run,
                                          quantization=a.quantization)
        elif phase == "lora14b":
            res[key(phase)] = job_fastwan(c14, sizes({"480x832x81": (480, 832, 81)}), a.repeats, run, lora=a.lora,
                                          quantization=a.quantization, **LORA_JOB)
        elif phase == "diffusers13b":
            res[phase] = job_diffusers(c13, sizes(SIZES_13B), 3, a.repeats, run["device"])
        elif phase == "diffusers14b":
            res[phase] = job_diffusers(c14, sizes({"480x832x81": (480, 832, 81)}), 4, a.repeats, run["device"],
                                       shift=5.0)
        out.write_text(json.dumps(res, indent=1))
    log("\n| job | size | e2e s (median) | text s | denoise s | decode s |")
    for phase in phases:
        phase = phase if phase.startswith(("make", "diffusers")) else key(phase)
        for label, e in (res.get(phase) or {}).items():
            if isinstance(e, dict) and "e2e_s" in e:
                t = e.get("timings", {})
                log(f"| {phase} | {label} | {e['e2e_s']:.3f} | {t.get('text_encoding', float('nan')):.3f} | "
                    f"{t.get('denoising', float('nan')):.3f} | {t.get('decoding', float('nan')):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
