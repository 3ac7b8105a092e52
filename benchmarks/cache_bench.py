"""Step caching end to end (GPU): Wan2.1-1.3B 480x832x81, 50 steps, CFG 5, compiled, on a random checkpoint.

With random weights a method's own skip decisions say nothing about real ones, so each method gets two figures:
its run at a common threshold (with the steps it computed), and its mechanism on a fixed schedule that skips half
of the steps (every odd step: 25 of 50), the figure that carries over to real weights. Then the same half schedule
with CFG gating 0.5 and VSA at 85% sparsity. Every video is compared (PSNR/SSIM) with the uncached dense one of the
same seed. One generator per setup (dense; VSA + gating); each variant gets an untimed 2-step warm-up with its own
cache (a cache's code paths compile on first use), then --repeats timed runs (the median is reported).

  python -m benchmarks.cache_bench --ckpt /tmp/wan13b [--steps 50] [--variants ...]
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

from benchmarks.harness import NEG, PROMPT, F, H, W, compare, log, parse_video, release, versions

VSA = {"tile": "auto", "sparsity": 0.85, "kernel": "fa4"}


def variants(steps: int) -> dict:
    """label -> (setup, cache config or a callable of the earlier results that makes one)."""
    from fastwan.cache import FirstBlockCache, MagCache, SkipSteps, TeaCache

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
        "residual-half": ("dense", SkipSteps(half)),  # TeaCache's and MagCache's mechanism on the half schedule
        "vsa+gate": ("vsa_gated", None),
        "vsa+gate+residual-half": ("vsa_gated", SkipSteps(half)),
    }


def build(root: Path, setup: str, device: str):
    """The generator of a setup: "dense" (automatic attention) or "vsa_gated" (VSA 85%, CFG gating 0.5); compiled
    on CUDA."""
    from fastwan import VideoGenerator

    common = dict(device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32,
                  enable_torch_compile=device == "cuda")
    if setup == "dense":
        return VideoGenerator.from_pretrained(root, **common)
    return VideoGenerator.from_pretrained(root, **common, attention_backend="VIDEO_SPARSE_ATTN", attention_config=VSA,
                                          cfg_gate_step=0.5)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cache_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", default="/tmp/wan13b")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--variants", default=None, help="comma-separated labels (default: all, in order)")
    p.add_argument("--out", default="cache_bench.json")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per variant (median reported)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--video", default=f"{H}x{W}x{F}", metavar="HxWxF")
    a = p.parse_args(argv)
    try:
        h, w, f = parse_video(a.video)
    except ValueError as exc:
        p.error(str(exc))
    table = variants(a.steps)
    labels = list(table) if a.variants is None else a.variants.split(",")
    unknown = [v for v in labels if v not in table]
    if unknown:
        p.error(f"unknown variant(s) {unknown}; use {', '.join(table)}")
    res: dict = {"versions": versions() if a.device == "cuda" else {},
                 "command": " ".join(["python -m benchmarks.cache_bench"] + sys.argv[1:])}
    kw = dict(negative_prompt=NEG, height=h, width=w, num_frames=f, num_inference_steps=a.steps, guidance_scale=5.0,
              seed=0, save_video=False)
    reference = Path(a.out).with_suffix(".none_frames.npy")
    gens: dict = {}
    for label in labels:
        setup, cache = table[label]
        if setup not in gens:
            for other in list(gens):  # one setup's models at a time
                del gens[other]
            release(True, a.device)
            gens[setup] = build(Path(a.ckpt), setup, a.device)
        if callable(cache):
            cache = cache(res)
        cache_arg = cache if cache is not None else "none"
        t0 = time.perf_counter()
        gens[setup].generate_video(PROMPT, **{**kw, "num_inference_steps": 2}, cache=cache_arg)
        warmup = time.perf_counter() - t0
        sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
        runs = []
        for _ in range(a.repeats):
            sync()
            t0 = time.perf_counter()
            r = gens[setup].generate_video(PROMPT, **kw, cache=cache_arg)
            sync()
            runs.append(time.perf_counter() - t0)
        e2e = statistics.median(runs)
        if label == "none":
            np.save(reference, r.frames)
        computed = None if r.cache is None else {k: len(v) for k, v in r.cache["computed"].items()}
        res[label] = {"seconds": e2e, "runs": runs, "warmup_s": warmup, "timings": r.timings,
                      "forwards": r.num_transformer_forwards,
                      "computed": computed, "cache": r.cache, "config": repr(cache),
                      "peak_gib": r.peak_memory and r.peak_memory / 2**30, "vs_uncached": compare(r.frames, reference)}
        log(f"{label}: median {e2e:.2f} s of {[round(x, 2) for x in runs]}, computed {computed}, "
            f"vs uncached {res[label]['vs_uncached']}")
        Path(a.out).write_text(json.dumps(res, indent=1))
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
