"""Streaming a causal Wan (Self-Forcing's recipe) on the GPU: time to the first frames, sustained frames per second
(generated and decoded), the per-chunk breakdown, and peak memory at 10 s and at 60 s of video.

Random weights at the real shapes (a Wan2.1-1.3B DiT in FastVideo's causal layout: the FLOPs and kernels of
Self-Forcing's released generator; quality is not measured here).

Phases (each appends to the JSON given by --out):
  make     a random Wan2.1-1.3B checkpoint (--plain) and its causal-layout twin (--ckpt, links to the plain files)
  stream   for each --variants entry: one untimed stream of --warmup-chunks (compilation), then --repeats streams of
           --seconds of video at --size; each stream's first-chunk latency (from the call until its frames are
           decoded) and its sustained rate (frames of the chunks after the first / their time); the per-chunk
           medians of the DiT steps, the KV-cache write and the decode; peak memory after 10 s of video and at the
           end; the frames of every 10th chunk of its first stream against the first variant's (max difference, PSNR)
  launch   (GPU only) is the causal DiT bound by the host or the GPU? One denoising forward per chunk of a windowed
           stream (--launch-chunks chunks, compiled unless the first variant is eager) is queued while the GPU is
           held busy (torch.cuda._sleep), so the host's queueing time and the GPU's execution (CUDA events) are
           timed apart; host > GPU: launch-bound
Variants: "eager", "compiled" (enable_torch_compile), "+window" (window_frames=21, sink_frames=3: memory flat
over any length; without a window every earlier frame is kept) and "+serial" (overlap_decode=False: each chunk
decoded after its DiT, before the next chunk starts; without it, overlap_decode=True: the decode runs on a side
CUDA stream beside the next chunk's DiT, off CUDA the same order of calls); "+nographs" (cuda_graphs=False: every
chunk forward launched from the host; without it the stream's default, CUDA graphs with a window on CUDA, kept by
the generator from the warm-up stream on). "compiled+window" against "compiled+window+serial" in one run is the
overlap's A/B, against "compiled+window+nographs" the graphs'. Overlapped, the per-chunk DiT / KV write / decode times
are GPU times of each stream's work (they overlap); the sustained rate is the wall-clock figure.

  python -m benchmarks.stream_bench --phase make
  python -m benchmarks.stream_bench --phase stream --variants compiled+window,compiled+window+nographs --seconds 60
  python -m benchmarks.stream_bench --phase launch --launch-chunks 10
  python -m benchmarks.stream_bench --smoke    # CI: a tiny causal checkpoint on the CPU
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

from benchmarks.checkpoints import derive_causal, make_checkpoint
from benchmarks.harness import (
    PROMPT, SMOKE_DIR, add_device, add_smoke, bench_dtype, command, device_arg, frame_diff, gib, log, output,
    parse_args, parse_phases, parse_video, peak_gib, release, reset_peak, versions)

PHASES = ("make", "stream", "launch")
VARIANTS = tuple(f"{base}{window}{serial}" for base in ("eager", "compiled")
                 for window in ("", "+window", "+window+nographs") for serial in ("", "+serial"))
WINDOW = dict(window_frames=21, sink_frames=3)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.stream_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phase", default="stream", help=f"comma-separated: {', '.join(PHASES)}")
    p.add_argument("--plain", default="/tmp/wan13b", help="the random Wan2.1-1.3B checkpoint (make writes it)")
    p.add_argument("--ckpt", default="/tmp/wan13b-causal", help="its causal-layout twin (make writes it)")
    p.add_argument("--size", default="480x832", help="HxW of the video")
    p.add_argument("--seconds", type=float, default=60.0, help="video length of each timed stream, in seconds")
    p.add_argument("--variants", default="compiled,compiled+window,compiled+window+serial",
                   help=f"comma-separated: {', '.join(VARIANTS)}")
    p.add_argument("--repeats", type=int, default=3, help="timed streams per variant (the median is reported)")
    p.add_argument("--warmup-chunks", type=int, default=3, help="chunks of the untimed stream (compilation), >= 1")
    p.add_argument("--launch-chunks", type=int, default=10, help="chunks of the launch phase, >= 1")
    p.add_argument("--out", default="stream_bench.json", help="results JSON (appended)")
    add_device(p)
    add_smoke(p, plain=str(SMOKE_DIR / "wan2.1"), ckpt=str(SMOKE_DIR / "causal"), size="32x32", seconds=2.0,
              variants="eager,eager+window,eager+window+serial,eager+window+nographs", repeats=1, warmup_chunks=1,
              phase="make,stream")
    return p


SAMPLE_EVERY = 10  # chunks 0, 10, 20, ... of each variant's first stream are compared with the first variant's


def one_stream(gen, frames: int, fps: int, h: int, w: int, options: dict, device: torch.device,
               sample: dict | None = None) -> dict:
    """One stream of ``frames`` frames -> its first-chunk latency, sustained rate, per-chunk medians and peaks;
    ``sample`` (if given) receives the frames of every SAMPLE_EVERY-th chunk by index."""
    reset_peak(device)
    chunks, peak_10s = [], None
    with gen.stream_video(PROMPT, height=h, width=w, seed=0, fps=fps, **options) as stream:
        for chunk in stream:
            chunks.append(chunk)
            if sample is not None and chunk.index % SAMPLE_EVERY == 0:
                sample[chunk.index] = chunk.frames
            made = chunk.first_frame + len(chunk.frames)
            if peak_10s is None and made >= 10 * fps:
                peak_10s = peak_gib(device)
            if made >= frames:
                break
    first, rest = chunks[0], chunks[1:]
    span = rest[-1].timings["elapsed"] - first.timings["elapsed"] if rest else float("nan")
    return {"chunks": len(chunks), "frames": sum(len(c.frames) for c in chunks),
            "first_chunk_s": first.timings["elapsed"], "first_chunk_frames": len(first.frames),
            **{f"first_{k}_ms": 1000 * first.timings[k] for k in ("text", "dit", "decode")},
            "sustained_fps": sum(len(c.frames) for c in rest) / span if rest else float("nan"),
            **{f"{k}_ms": 1000 * statistics.median(c.timings[k] for c in rest or chunks)
               for k in ("dit", "kv_write", "decode")},
            "peak_gib_10s": peak_10s, "peak_gib_end": peak_gib(device)}


def run_variant(name: str, args, device: torch.device, sample: dict) -> dict:
    """One variant's streams (``sample``: see :func:`one_stream`, from its first timed stream)."""
    from fastwan import VideoGenerator

    compiled = name.startswith("compiled")
    options = {**(WINDOW if "+window" in name else {}), "overlap_decode": "+serial" not in name,
               "cuda_graphs": False if "+nographs" in name else None}
    h, w = parse_video(f"{args.size}x1")[:2]  # the size's rule (multiples of 16)
    gen = VideoGenerator.from_pretrained(args.ckpt, device=str(device), dtype=bench_dtype(device),
                                         enable_torch_compile=compiled)
    gen.set_progress_bar_config(disable=True)
    fps = gen.preset.fps
    frames = int(args.seconds * fps)
    one_stream(gen, args.warmup_chunks * 12 - 3, fps, h, w, options, device)  # compilation, untimed
    runs = [one_stream(gen, frames, fps, h, w, options, device, sample if i == 0 else None)
            for i in range(args.repeats)]
    release(compiled, device)
    median = {k: statistics.median(r[k] for r in runs) for k in ("first_chunk_s", "sustained_fps", "dit_ms",
                                                                  "kv_write_ms", "decode_ms", "first_text_ms",
                                                                  "first_dit_ms", "first_decode_ms")}
    return {"variant": name, "size": args.size, "seconds": args.seconds, "runs": runs, "median": median,
            "peak_gib_10s": runs[-1]["peak_gib_10s"], "peak_gib_end": runs[-1]["peak_gib_end"]}


def launch(args, variant: str) -> list[dict]:
    """The launch phase (module docstring): per chunk, the host's ms to queue one denoising forward and the GPU's ms
    to run it."""
    from fastwan import VideoGenerator
    from fastwan.models.wan.causal import CausalRun
    from fastwan.pipelines.text import encode_prompts

    compiled = not variant.startswith("eager")
    gen = VideoGenerator.from_pretrained(args.ckpt, device="cuda", dtype=torch.bfloat16, enable_torch_compile=compiled)
    gen.set_progress_bar_config(disable=True)
    h, w = parse_video(f"{args.size}x1")[:2]
    for _ in gen.stream_video(PROMPT, height=h, width=w, num_frames=33, **WINDOW):
        pass  # compilation, untimed
    model = gen.transformers[0]
    _, spatial = gen.vae_scale_factors
    text = encode_prompts([PROMPT], gen.tokenizer, gen.text_encoder, device=gen.device, dtype=gen.dtype)
    shape = (1, model.config.in_channels, gen.causal.frames_per_chunk, h // spatial, w // spatial)
    t = torch.full((1,), 500.0, device="cuda")
    rows = []
    with torch.no_grad(), CausalRun(model, WINDOW["window_frames"], WINDOW["sink_frames"]) as run:
        for c in range(args.launch_chunks):
            x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
            torch.cuda.synchronize()
            torch.cuda._sleep(3_000_000_000)  # ~1.5 s of GPU time: the forward is queued before the GPU reaches it
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            t0 = time.perf_counter()
            run.forward(x, t, text)
            host = time.perf_counter() - t0
            b.record()
            torch.cuda.synchronize()
            rows.append({"chunk": c, "host_ms": 1000 * host, "gpu_ms": a.elapsed_time(b)})
            log(f"launch: chunk {c}: host {rows[-1]['host_ms']:.1f} ms, gpu {rows[-1]['gpu_ms']:.1f} ms")
            run.forward(x, t, text, write=True)
    release(compiled)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_args(parser, argv)
    phases = parse_phases(parser, args.phase, PHASES)
    if args.warmup_chunks < 1 or args.repeats < 1 or args.launch_chunks < 1 or not args.seconds > 0:
        parser.error("--warmup-chunks, --repeats and --launch-chunks must be >= 1 and --seconds > 0")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants {','.join(unknown)}: not a variant; use {', '.join(VARIANTS)}")
    gpu_only = ["--phase launch"] if "launch" in phases else []
    device = device_arg(parser, args.device, *gpu_only)
    out = output(args.out)
    record = {"command": command("benchmarks.stream_bench", argv), "versions": versions(), "results": []}
    if "make" in phases:
        make_checkpoint(Path(args.plain), "tiny" if args.smoke else "1.3b", device=device)  # kept if there
        derive_causal(Path(args.plain), Path(args.ckpt))
    previous = json.loads(out.read_text()) if out.exists() else []
    out.write_text(json.dumps([*previous, record], indent=1, default=str))
    if "stream" in phases:
        reference: dict = {}
        for i, name in enumerate(variants):
            log(f"stream: {name}")
            sample: dict = {}
            result = run_variant(name, args, device, sample)
            if i == 0:
                reference = sample
            result["frames_vs_first"] = compare_samples(sample, reference)
            record["results"].append(result)
            out.write_text(json.dumps([*previous, record], indent=1, default=str))  # each variant kept as it ends
    if "launch" in phases:
        record["launch"] = launch(args, variants[0])
        out.write_text(json.dumps([*previous, record], indent=1, default=str))
        print("| chunk | host ms to queue a forward | GPU ms to run it |\n|---|---|---|")
        for r in record["launch"]:
            print(f"| {r['chunk']} | {r['host_ms']:.1f} | {r['gpu_ms']:.1f} |")
    if "stream" not in phases:
        return 0
    print("| variant | size | first chunk (s) | its text / DiT / decode (ms) | sustained fps | DiT/chunk (ms) | "
          "KV write (ms) | decode (ms) | peak 10 s / end (GiB) | frames vs the first variant |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in record["results"]:
        m, d = r["median"], r["frames_vs_first"]
        print(f"| {r['variant']} | {r['size']} | {m['first_chunk_s']:.3f} | {m['first_text_ms']:.0f} / "
              f"{m['first_dit_ms']:.0f} / {m['first_decode_ms']:.0f} | {m['sustained_fps']:.1f} | "
              f"{m['dit_ms']:.1f} | {m['kv_write_ms']:.1f} | {m['decode_ms']:.1f} | "
              f"{gib(r['peak_gib_10s'])} / {gib(r['peak_gib_end'])} | max {d['max_abs']}, PSNR {d['psnr_db']:.2f} dB "
              f"({d['chunks']} chunks) |")
    return 0


def compare_samples(sample: dict, reference: dict) -> dict:
    """The sampled chunks both streams made: their frames' :func:`~benchmarks.harness.frame_diff` (PSNR inf:
    equal) and the number of chunks compared."""
    common = sorted(set(sample) & set(reference))
    if not common:
        return {"chunks": 0, "max_abs": None, "psnr_db": float("nan")}
    return {"chunks": len(common), **frame_diff(np.concatenate([sample[i] for i in common]),
                                                np.concatenate([reference[i] for i in common]))}


if __name__ == "__main__":
    sys.exit(main())
