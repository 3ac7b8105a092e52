"""A/B: eager vs torch.compile'd DiT blocks, same seed; the compile warm-up run is excluded and reported apart.
Nothing is written: it prints the two denoising times and the largest frame difference.

    python examples/compile_ab.py --model Wan-AI/Wan2.1-T2V-1.3B-Diffusers --steps 10
    python examples/compile_ab.py --steps 1 --runs 1     # tiny random model (on a CPU, compiling takes a minute)

A mistake (--runs 0, a model that does not exist) ends with one line, ``fastwan: error: ...``, and exit code 2.
"""
import sys
import time

import numpy as np
import torch

from fastwan import VideoGenerator
from fastwan.cli import Parser, report_user_errors
from fastwan.errors import InvalidArgument


def main(argv=None):
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--prompt", default="a sailing boat on a stormy sea")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's preset)")
    p.add_argument("--runs", type=int, default=2, help="timed runs after the warm-up; the median is printed")
    args = p.parse_args(argv)
    for flag, n in (("--steps", args.steps), ("--runs", args.runs)):
        if n is not None and n < 1:  # before any model loads
            raise InvalidArgument(f"got {flag} {n}; it must be an int >= 1.")
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
    if code := report_user_errors(main):  # a mistake: one line and exit code 2, as the fastwan command does
        sys.exit(code)
