"""End-to-end and DiT-forward benchmark: fastwan vs diffusers on the same random weights (GPU).

Phases (run them in one process or separately; each appends to the JSON given by --out):
  make       write a random checkpoint at the real Wan2.1 shapes (--size; DiT, UMT5-XXL, Wan VAE) to --ckpt
  forward    DiT forward ms at batch 1 and 2: diffusers (SDPA default) and fastwan per --backends, each its own model
  diffusers  WanPipeline end to end (--steps, CFG --guidance), frames saved for the comparison
  diffusers_tuned  the same with compile_repeated_blocks(fullgraph=True) and the _native_cudnn attention backend
  fastwan    VideoGenerator end to end (--backend, each --cfg-modes value), frames compared with the diffusers run
  sparse     VideoGenerator end to end with each --sparse-variants config (benchmarks.sparse_configs)
  cfgab      same-run A/B of --ab variants (a cfg_mode, optionally with DiT options): one generator per variant,
             timed in interleaved runs
Random weights have the FLOPs and kernels of the real model; image quality is not measured here.

  python -m benchmarks.e2e --phase make,forward,diffusers,diffusers_tuned,fastwan --compile --out results.json
  python -m benchmarks.e2e --smoke      # CI: make, diffusers, fastwan with a tiny checkpoint on the CPU, 2 steps
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.checkpoints import make_checkpoint
from benchmarks.harness import (
    NEG, PEERS, PROMPT, SMOKE_DIR, F, H, W, add_device, add_smoke, bench_dtype, command, compare, cuda_time, device_arg,
    diffusers_pipeline, forward_inputs, frames_path, gib, kernel_groups, log, option_overrides, output, parse_args,
    parse_phases, parse_video, peak_gib, raise_recompile_limit, release, reset_peak, sync, versions)

PHASES = ("make", "forward", "diffusers", "diffusers_tuned", "fastwan", "sparse", "cfgab")
GPU_PHASES = ("forward", "diffusers_tuned", "sparse")  # CUDA kernels, CUDA-event timing, FA4 at the real grid
DENSE = "fastwan_dense"  # fastwan's eager dense run: the reference of compiled and sparse runs (frames_path)


def parse_backend(label: str) -> tuple[str, dict | None]:
    """'TORCH_SDPA[cudnn]' -> ('TORCH_SDPA', {'kernel': 'cudnn'}); 'FLASH_ATTN[4]' -> version 4."""
    if "[" not in label:
        return label, None
    name, arg = label[:-1].split("[")
    return name, ({"version": int(arg)} if name == "FLASH_ATTN" else {"kernel": arg})


def parse_ab(label: str) -> tuple[str, dict]:
    """'sequential' or 'batched/reference' -> (cfg_mode, DiTOptions overrides)."""
    mode, _, variant = label.partition("/")
    if mode not in ("batched", "sequential", "auto"):
        raise ValueError(f"A/B variant {label!r}: the cfg_mode must be batched, sequential or auto")
    return mode, option_overrides(variant or "defaults")


@torch.no_grad()
def phase_forward(root: Path, backends: list[str], res: dict, iters: int, compile_: bool = False) -> None:
    from diffusers import WanTransformer3DModel

    from fastwan.attention import AttentionDispatch
    from fastwan.models import load_transformer

    out = res.setdefault("forward_ms", {})
    ref = WanTransformer3DModel.from_pretrained(root / "transformer", torch_dtype=torch.bfloat16).cuda().eval()
    for b in (1, 2):
        args = forward_inputs(b)
        out[f"diffusers_b{b}"] = cuda_time(lambda args=args: ref(*args, return_dict=False), iters=iters)
        log(f"diffusers forward B={b}: {out[f'diffusers_b{b}']:.1f} ms")
    x, t, text = forward_inputs(1)
    want = ref(x, t, text, return_dict=False)[0].float()
    heads, layers = ref.config.num_attention_heads, ref.config.num_layers
    ref = None
    torch.cuda.empty_cache()
    tokens = x.shape[2] * (x.shape[3] // 2) * (x.shape[4] // 2)
    attn_flops = 4 * heads * tokens**2 * 128 * layers  # per batch element
    for label in backends:
        key = label + (" compiled" if compile_ else "")
        model = None
        try:
            name, conf = parse_backend(label)
            att = AttentionDispatch.resolve(name, device="cuda", dtype=torch.bfloat16, head_dim=128, config=conf)
            model = load_transformer(root / "transformer", dtype=torch.bfloat16, device="cuda", attention=att)
            if compile_:
                model.compile_blocks(fullgraph=True)
            got = model(x, t, text).float()
            rel = ((got - want).norm() / want.norm()).item()
            out[f"{key}_kernel"] = att.describe("cuda")
            out[f"{key}_rel_err_vs_diffusers"] = rel
            ams = kernel_groups(lambda m=model: m(x, t, text)).get("attention", 0.0)
            out[f"{key}_attention_ms_b1"] = ams
            out[f"{key}_attention_tflops_in_model"] = attn_flops / (ams * 1e-3) / 1e12
            for b in (1, 2):
                args = forward_inputs(b)
                out[f"{key}_b{b}"] = cuda_time(lambda args=args, m=model: m(*args), iters=iters)
            log(f"fastwan[{key}] forward B=1 {out[f'{key}_b1']:.1f} ms, B=2 {out[f'{key}_b2']:.1f} ms, attention "
                f"in model {ams:.1f} ms = {out[f'{key}_attention_tflops_in_model']:.0f} TFLOP/s, rel err {rel:.2e}")
        except Exception as exc:  # keep going: report the failure
            out[f"{key}_error"] = f"{type(exc).__name__}: {exc}"
            log(f"fastwan[{key}] FAILED: {exc}")
        del model
        release(compile_)


class Job:
    """What every end-to-end phase of one run shares: the checkpoint, the video, the steps and guidance, the
    device, and where the results and frames go."""

    def __init__(self, a, root: Path, out: Path, device: torch.device):
        self.root, self.out, self.device, self.steps, self.guidance = root, out, device, a.steps, a.guidance
        self.video = parse_video(a.video)

    def kwargs(self) -> dict:
        h, w, f = self.video
        return dict(negative_prompt=NEG, height=h, width=w, num_frames=f, num_inference_steps=self.steps,
                    guidance_scale=self.guidance, seed=0, save_video=False)

    def frames(self, run: str) -> Path:
        return frames_path(self.out, run)


def phase_diffusers(job: Job, res: dict, tuned: bool = False) -> None:
    """diffusers' WanPipeline end to end (fp32 VAE): the eager peer or the tuned one."""
    pipe = diffusers_pipeline(job.root, tuned, job.device)
    h, w, f = job.video
    kw = dict(negative_prompt=NEG, height=h, width=w, num_frames=f, guidance_scale=job.guidance)
    t0 = time.perf_counter()
    pipe(PROMPT, **kw, num_inference_steps=2 if tuned else 1, output_type="latent")  # warm-up, not timed
    warmup = time.perf_counter() - t0
    reset_peak(job.device)
    sync(job.device)
    t0 = time.perf_counter()
    out = pipe(PROMPT, **kw, num_inference_steps=job.steps, generator=torch.Generator(job.device).manual_seed(0),
               output_type="np").frames[0]
    sync(job.device)
    e2e = time.perf_counter() - t0
    frames = (out * 255).round().astype(np.uint8)
    key = "diffusers_tuned_e2e" if tuned else "diffusers_e2e"
    res[key] = {"seconds": e2e, "steps": job.steps, "s_per_step": e2e / job.steps, "warmup_s": warmup,
                "peak_gib": peak_gib(job.device), "setup": PEERS["diffusers_tuned" if tuned else "diffusers"]}
    if tuned:
        res[key]["vs_diffusers"] = compare(frames, job.frames("diffusers"))
    else:
        np.save(job.frames("diffusers"), frames)
    log(f"{key} {e2e:.2f}s, peak {gib(res[key]['peak_gib'])} GiB")
    del pipe
    release(tuned, job.device)


def generator(job: Job, backend: str, cfg_mode: str, compile_: bool, attention_config: dict | None = None,
              overrides: dict | None = None):
    from fastwan import VideoGenerator
    from fastwan.options import DiTOptions

    return VideoGenerator.from_pretrained(job.root, device=job.device, dtype=bench_dtype(job.device),
                                          attention_backend=backend, attention_config=attention_config,
                                          cfg_mode=cfg_mode, enable_torch_compile=compile_,
                                          dit_options=DiTOptions(**(overrides or {})))


def phase_fastwan(job: Job, backend: str, cfg_mode: str, compile_: bool, res: dict,
                  attention_config: dict | None = None, tag: str | None = None) -> None:
    gen = generator(job, backend, cfg_mode, compile_, attention_config)
    tag = tag or backend
    key = f"fastwan_e2e[{tag},{cfg_mode}{',compiled' if compile_ else ''}]"
    kw = job.kwargs()
    t0 = time.perf_counter()  # warm-up: kernel JIT (FA4) and, with --compile, compilation; not timed
    gen.generate_video(PROMPT, **{**kw, "num_inference_steps": 2})
    res[key + "_warmup_s"] = time.perf_counter() - t0
    sync(job.device)
    t0 = time.perf_counter()
    r = gen.generate_video(PROMPT, **kw)
    sync(job.device)
    e2e = time.perf_counter() - t0
    entry = {"seconds": e2e, "steps": job.steps, "s_per_step": r.timings["denoising"] / job.steps,
             "timings": r.timings, "peak_gib": r.peak_memory and r.peak_memory / 2**30,
             "attention": r.attention_backend, "config": attention_config,
             "vs_diffusers": compare(r.frames, job.frames("diffusers"))}
    if attention_config is None and not compile_:
        np.save(job.frames(DENSE), r.frames)
    else:
        entry["vs_fastwan_dense_eager"] = compare(r.frames, job.frames(DENSE))
    res[key] = entry
    log(f"{key}: {e2e:.2f}s ({entry['s_per_step']:.3f} s/step), peak {gib(entry['peak_gib'])} GiB, "
        f"vs diffusers {entry['vs_diffusers']}, vs dense {entry.get('vs_fastwan_dense_eager')}")
    del gen
    release(compile_, job.device)


def phase_cfg_ab(job: Job, backend: str, repeats: int, res: dict, compile_: bool = False,
                 labels: tuple[str, ...] = ("sequential", "batched")) -> None:
    """Same-run A/B of generators that differ in ``cfg_mode`` and DiT options (:func:`parse_ab`): every variant
    is its own generator, all held at once, run in interleaved rounds so that clock drift hits all alike."""
    variants = {label: parse_ab(label) for label in labels}
    raise_recompile_limit()
    gens = {label: generator(job, backend, mode, compile_, overrides=o) for label, (mode, o) in variants.items()}
    kw = job.kwargs()
    steps = job.steps
    for gen in gens.values():  # warm-up (FA4 JIT; with --compile, a graph per batch size)
        gen.generate_video(PROMPT, **{**kw, "num_inference_steps": 2})
    per_step: dict[str, list[float]] = {label: [] for label in gens}
    peaks: dict[str, float] = {}
    frames: dict[str, np.ndarray] = {}
    for _ in range(repeats):
        for label, gen in gens.items():
            r = gen.generate_video(PROMPT, **kw)
            per_step[label].append(r.timings["denoising"] / steps)
            peaks[label] = r.peak_memory and r.peak_memory / 2**30
            frames[label] = r.frames
    first = labels[0]
    out = {m: {"s_per_step_runs": v, "s_per_step_median": statistics.median(v), "spread": max(v) - min(v),
               "peak_gib": peaks[m], f"max_abs_vs_{first}": int(np.abs(frames[m].astype(int)
                                                                       - frames[first].astype(int)).max())}
           for m, v in per_step.items()}
    res[f"cfg_ab[{backend},{steps} steps,x{repeats}{',compiled' if compile_ else ''}]"] = out
    for m, o in out.items():
        log(f"cfg {m}: median {o['s_per_step_median']:.4f} s/step (runs {[round(x, 4) for x in o['s_per_step_runs']]}),"
            f" peak {gib(o['peak_gib'])} GiB, max |frames - {first}| {o[f'max_abs_vs_{first}']}")
    del gens
    release(compile_, job.device)


def summary(res: dict) -> None:
    """The end-to-end figures of this run as a short table: each fastwan run against both diffusers peers."""
    peers = {k: res[k]["seconds"] for k in ("diffusers_e2e", "diffusers_tuned_e2e") if k in res}
    rows = [(k, v["seconds"], v["peak_gib"]) for k, v in res.items() if k.startswith(("diffusers_e2e",
                                                                                      "diffusers_tuned_e2e"))]
    rows += [(k, v["seconds"], v["peak_gib"]) for k, v in res.items()
             if k.startswith("fastwan_e2e[") and isinstance(v, dict)]
    log("\n| run | seconds | peak GiB | " + " | ".join(f"vs {p}" for p in peers) + " |")
    for name, sec, peak in rows:
        log(f"| {name} | {sec:.2f} | {gib(peak)} | " + " | ".join(f"{p / sec:.3f}x" for p in peers.values()) + " |")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.e2e", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--phase", default="make,forward,diffusers,fastwan", help="comma-separated phases, run in order")
    p.add_argument("--ckpt", default="/tmp/wan13b-random")
    p.add_argument("--size", default="1.3b", choices=("1.3b", "14b", "tiny"),
                   help="make: the checkpoint's DiT size (tiny: fastwan's tiny checkpoint)")
    p.add_argument("--video", default=f"{H}x{W}x{F}", metavar="HxWxF", help="e2e phases: height x width x frames")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--guidance", type=float, default=5.0)
    p.add_argument("--backends", default="TORCH_SDPA[flash],TORCH_SDPA[cudnn],FLASH_ATTN,SAGE_ATTN",
                   help="forward: attention backends, NAME or NAME[kernel] (FLASH_ATTN[4]: version 4)")
    p.add_argument("--backend", default="FLASH_ATTN", help="fastwan and cfgab: the attention backend")
    p.add_argument("--cfg-modes", default="auto", help="fastwan: cfg_mode values, comma-separated")
    p.add_argument("--ab", default="sequential,batched",
                   help="cfgab: variants MODE[/DIT], MODE batched|sequential|auto, DIT a DiT variant of "
                        "benchmarks.harness.option_variants (defaults, reference, fast)")
    add_device(p, compile_default=False)
    p.add_argument("--repeats", type=int, default=3, help="cfgab: interleaved runs per variant")
    p.add_argument("--sparse-variants", default="sta-auto-fa4,vsa-auto-fa4,gna-auto-fa4")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", default="e2e.json")
    add_smoke(p, ckpt=str(SMOKE_DIR / "wan2.1"), size="tiny", phase="make,diffusers,fastwan", video="32x32x5", steps=2,
              backend="TORCH_SDPA", out=str(SMOKE_DIR / "e2e.json"))
    return p


def main(argv=None) -> int:
    p = build_parser()
    a = parse_args(p, argv)
    phases = parse_phases(p, a.phase, PHASES)
    device = device_arg(p, a.device, *(f"--phase {ph}" for ph in phases if ph in GPU_PHASES))
    try:  # every variant checked before a phase runs
        ab = tuple(a.ab.split(","))
        for label in ab:
            parse_ab(label)
        job = Job(a, Path(a.ckpt), output(a.out), device)
    except ValueError as exc:
        p.error(str(exc))
    root = Path(a.ckpt)
    res = json.loads(job.out.read_text()) if job.out.exists() else {}
    res.setdefault("versions", versions())
    res.setdefault("commands", []).append(command(p.prog, argv))
    for ph in phases:
        if ph == "make":
            make_checkpoint(root, a.size)
        elif ph == "forward":
            phase_forward(root, a.backends.split(","), res, a.iters, a.compile)
        elif ph == "diffusers":
            phase_diffusers(job, res)
        elif ph == "diffusers_tuned":
            phase_diffusers(job, res, tuned=True)
        elif ph == "sparse":
            from benchmarks.sparse_configs import variants

            chosen = {v[0]: v for v in variants((21, 30, 52))}
            for label in a.sparse_variants.split(","):
                _, name, conf, _ = chosen[label]
                phase_fastwan(job, name, "batched", a.compile, res, attention_config=conf, tag=label)
        elif ph == "cfgab":
            phase_cfg_ab(job, a.backend, a.repeats, res, a.compile, ab)
        elif ph == "fastwan":
            for mode in a.cfg_modes.split(","):
                phase_fastwan(job, a.backend, mode, a.compile, res)
        job.out.write_text(json.dumps(res, indent=1))
    log(json.dumps(res, indent=1))
    summary(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
