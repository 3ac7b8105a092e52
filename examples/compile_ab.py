"""A/B: eager vs torch.compile'd DiT blocks, same seed; the compile warm-up run is excluded and reported apart.

    python examples/compile_ab.py --model Wan-AI/Wan2.1-T2V-1.3B-Diffusers --steps 10
"""
import argparse
import time

import numpy as np
import torch

from fastwan import VideoGenerator


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--prompt", default="a sailing boat on a stormy sea")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--runs", type=int, default=2)
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    kw = dict(num_inference_steps=args.steps, seed=0, save_video=False)
    results = {}
    for compiled in (False, True):
        gen = VideoGenerator.from_pretrained(args.model, dtype=dtype, enable_torch_compile=compiled)
        t0 = time.perf_counter()
        first = gen.generate_video(args.prompt, **kw)  # warm-up (compilation happens here)
        warm = time.perf_counter() - t0
        times = [gen.generate_video(args.prompt, **kw).timings["denoising"] for _ in range(args.runs)]
        results["compiled" if compiled else "eager"] = (warm, float(np.median(times)), first.frames)
        del gen
    (we, e, fe), (wc, c, fc) = results["eager"], results["compiled"]
    diff = np.abs(fe.astype(int) - fc.astype(int)).max()
    print(f"eager    : denoise {e:.2f}s (first run {we:.2f}s)")
    print(f"compiled : denoise {c:.2f}s (first run incl. compile {wc:.2f}s)  speedup {e / c:.2f}x")
    print(f"max |frame difference| eager vs compiled: {diff}")


if __name__ == "__main__":
    main()
