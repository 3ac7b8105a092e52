"""Step caching end to end (GPU): Wan2.1-1.3B 480x832x81, 50 steps, CFG 5, compiled, on a random checkpoint.

With random weights a method's own skip decisions say nothing about real ones, so each method gets two figures:
its run at a common threshold (with the steps it computed), and its mechanism on a fixed schedule that skips half
of the steps (every odd step: 25 of 50), the figure that carries over to real weights. Then the same half schedule
with CFG gating 0.5 and VSA at 85% sparsity. Every video is compared (PSNR/SSIM) with the uncached dense one of the
same seed. One generator per setup (dense; VSA + gating); each variant gets an untimed warm-up with its own cache (a
cache's code paths compile on first use): 2 steps, or the fewest at which that cache can act, its schedule made for
that step count; then --repeats timed runs (the median is reported).

TaylorSeer decides by a fixed rule, not by the weights: "taylorseer" (fastwan's defaults: steps 0-2 compute, then
one every 5 steps, order 1, bf16 factors) computes the same 13 of 50 steps per pass (0, 1, 2, 4, 9, ..., 49) with
real weights, so its run is already the figure that carries over, its error excepted (how well a first-order
extrapolation follows real features is not what random ones show). Its warm-up runs 4 steps (in 2 or 3 it predicts
none). "taylorseer-half" (interval 2 after a 1-step warm-up) computes exactly the half schedule's steps (0, 2, ...,
48): at the same cost as "residual-half", the two rows differ only in what stands in for a skipped step, an
extrapolation from the last two computed outputs (step 1: step 0's output held) or the last residual added back.

  python -m benchmarks.cache_bench --ckpt /tmp/wan13b [--steps 50] [--variants ...]
  python -m benchmarks.cache_bench --smoke    # CI: a tiny checkpoint on the CPU, 4 steps, each method once

TaylorSeer on the GPU (issue #43; residual-half the same-run peer of taylorseer-half):

  python -m benchmarks.e2e --phase make --ckpt /tmp/wan13b      # the random 1.3B checkpoint
  python -m benchmarks.cache_bench --ckpt /tmp/wan13b --repeats 3 \
      --variants none,taylorseer,taylorseer-half,residual-half --out cache_bench_taylorseer.json
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

from benchmarks.checkpoints import tiny_checkpoint
from benchmarks.harness import (
    NEG, PROMPT, SMOKE_DIR, F, H, W, add_device, add_smoke, bench_dtype, command, compare, device_arg, log, output,
    parse_args, parse_video, release, sync, versions)

VSA = {"tile": "auto", "sparsity": 0.85}  # FA4's kernel on CUDA
WARMUP_STEPS = 2
# each cache method and setup once (TeaCache has published coefficients for the real Wan2.1 sizes only, not for a
# tiny checkpoint)
SMOKE_VARIANTS = ("none,first_block@0.05,magcache-calibrate,magcache@0.12,taylorseer,residual-half,taylorseer-half,"
                  "vsa+gate+residual-half")


def variants(steps: int) -> dict:
    """label -> (setup, cache config or a callable of the earlier results that makes one)."""
    from fastwan.cache import FirstBlockCache, MagCache, SkipSteps, TaylorSeer, TeaCache

    half = tuple(range(1, steps, 2))

    def calibrated(res):  # MagCache on the curve the calibration run recorded (its cond pass)
        return MagCache(threshold=0.12, max_skip_steps=4, retention_ratio=0.2,
                        mag_ratios=res["magcache-calibrate"]["cache"]["calibration"]["cond"])

    return {
        "none": ("dense", None),
        "first_block@0.05": ("dense", FirstBlockCache(0.05)),
        "first_block-half": ("dense", SkipSteps(half, first_block=True)),
        "teacache@0.08": ("dense", TeaCache(0.08)),
        "magcache-calibrate": ("dense", MagCache(calibrate=True)),
        "magcache@0.12": ("dense", calibrated),
        "taylorseer": ("dense", TaylorSeer()),  # its defaults: interval 5 after a 3-step warm-up, order 1
        "residual-half": ("dense", SkipSteps(half)),  # TeaCache's and MagCache's mechanism on the half schedule
        # the half schedule's steps (0, 2, 4, ... compute), the skipped ones extrapolated instead of reused
        "taylorseer-half": ("dense", TaylorSeer(cache_interval=2, disable_cache_before_step=1)),
        "vsa+gate": ("vsa_gated", None),
        "vsa+gate+residual-half": ("vsa_gated", SkipSteps(half)),
    }


def made(cache, res: dict):
    """A variant's cache config: the table's, or the one its callable makes from the earlier results."""
    return cache(res) if callable(cache) else cache


def warmup(label: str, steps: int, res: dict):
    """(steps, cache) of ``label``'s untimed warm-up: its cache made for the fewest steps, from
    :data:`WARMUP_STEPS` up to the timed run's ``steps``, at which it can act (a schedule made for ``steps`` names
    steps that a shorter video lacks, and the step-cache check refuses it)."""
    from fastwan.cache import check_steps
    from fastwan.errors import InvalidArgument

    for n in range(min(WARMUP_STEPS, steps), steps + 1):
        cache = made(variants(n)[label][1], res)
        try:
            check_steps(cache, n)
        except InvalidArgument:
            continue
        return n, cache
    return steps, made(variants(steps)[label][1], res)  # refused again by the timed run (check_labels checks first)


def build(root: Path, setup: str, device: torch.device, compile_: bool):
    """The generator of a setup: "dense" (automatic attention) or "vsa_gated" (VSA 85%, FA4's kernel on CUDA, CFG
    gating 0.5)."""
    from fastwan import VideoGenerator

    common = dict(device=device, dtype=bench_dtype(device), enable_torch_compile=compile_)
    if setup == "dense":
        return VideoGenerator.from_pretrained(root, **common)
    vsa = {**VSA, "kernel": "fa4"} if device.type == "cuda" else VSA
    return VideoGenerator.from_pretrained(root, **common, attention_backend="VIDEO_SPARSE_ATTN", attention_config=vsa,
                                          cfg_gate_step=0.5)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cache_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", default="/tmp/wan13b")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--variants", default=None, help="comma-separated labels (default: all, in order)")
    p.add_argument("--out", default="cache_bench.json")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per variant (median reported)")
    add_device(p, compile_default=True)
    p.add_argument("--video", default=f"{H}x{W}x{F}", metavar="HxWxF")
    add_smoke(p, ckpt=str(SMOKE_DIR / "wan2.1"), video="32x32x5", steps=4, repeats=1, variants=SMOKE_VARIANTS,
              out=str(SMOKE_DIR / "cache_bench.json"))
    return p


def check_labels(p, labels: list[str], table: dict, steps: int) -> None:
    """The parser's error, before any work, for an unknown label, MagCache's calibrated run without the
    calibration before it, or a cache that a run of ``steps`` steps cannot use."""
    from fastwan.cache import check_steps
    from fastwan.errors import InvalidArgument

    unknown = [v for v in labels if v not in table]
    if unknown:
        p.error(f"unknown variant(s) {unknown}; use {', '.join(table)}")
    for i, label in enumerate(labels):
        cache = table[label][1]
        if callable(cache) and "magcache-calibrate" not in labels[:i]:
            p.error(f"variant {label} uses the curve of magcache-calibrate: list magcache-calibrate before it")
        try:
            check_steps(None if callable(cache) else cache, steps)
        except InvalidArgument as exc:
            p.error(f"variant {label}: {exc}")


def main(argv=None) -> int:
    p = build_parser()
    a = parse_args(p, argv)
    try:
        h, w, f = parse_video(a.video)
    except ValueError as exc:
        p.error(str(exc))
    device = device_arg(p, a.device)
    if a.steps < 2:
        p.error(f"--steps {a.steps}: must be at least 2 (the half schedules skip step 1)")
    table = variants(a.steps)
    labels = list(table) if a.variants is None else a.variants.split(",")
    check_labels(p, labels, table, a.steps)
    if a.smoke:
        tiny_checkpoint(a.ckpt)
    res: dict = {"versions": versions(), "command": command(p.prog, argv)}
    kw = dict(negative_prompt=NEG, height=h, width=w, num_frames=f, num_inference_steps=a.steps, guidance_scale=5.0,
              seed=0, save_video=False)
    reference = Path(a.out).with_suffix(".none_frames.npy")
    gens: dict = {}
    for label in labels:
        setup, cache = table[label]
        if setup not in gens:
            for other in list(gens):  # one setup's models at a time
                del gens[other]
            release(a.compile, device)
            gens[setup] = build(Path(a.ckpt), setup, device, a.compile)
        cache = made(cache, res)
        warm_steps, warm_cache = warmup(label, a.steps, res)
        t0 = time.perf_counter()
        gens[setup].generate_video(PROMPT, **{**kw, "num_inference_steps": warm_steps},
                                   cache=warm_cache if warm_cache is not None else "none")
        warm_s = time.perf_counter() - t0
        cache_arg = cache if cache is not None else "none"
        runs = []
        for _ in range(a.repeats):
            sync(device)
            t0 = time.perf_counter()
            r = gens[setup].generate_video(PROMPT, **kw, cache=cache_arg)
            sync(device)
            runs.append(time.perf_counter() - t0)
        e2e = statistics.median(runs)
        if label == "none":
            np.save(reference, r.frames)
        computed = None if r.cache is None else {k: len(v) for k, v in r.cache["computed"].items()}
        res[label] = {"seconds": e2e, "runs": runs, "warmup_s": warm_s, "warmup_steps": warm_steps,
                      "timings": r.timings, "forwards": r.num_transformer_forwards,
                      "computed": computed, "cache": r.cache, "config": repr(cache),
                      "peak_gib": r.peak_memory and r.peak_memory / 2**30, "vs_uncached": compare(r.frames, reference)}
        log(f"{label}: median {e2e:.2f} s of {[round(x, 2) for x in runs]}, computed {computed}, "
            f"vs uncached {res[label]['vs_uncached']}")
        output(a.out).write_text(json.dumps(res, indent=1))
    base = res.get("none", {}).get("seconds")
    log(f"\n| variant | e2e s (median of {a.repeats}) | spread s | x vs none | "
        f"steps computed (cond/uncond of {a.steps}) | PSNR dB | SSIM |")
    for label in labels:
        e = res[label]
        cmp = e["vs_uncached"] or {}
        speedup = base / e["seconds"] if base else float("nan")
        log(f"| {label} | {e['seconds']:.2f} | {max(e['runs']) - min(e['runs']):.2f} | {speedup:.2f} | "
            f"{e['computed']} | {cmp.get('psnr_db', float('nan')):.1f} | {cmp.get('ssim', float('nan')):.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
