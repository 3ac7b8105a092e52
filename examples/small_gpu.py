"""Wan on a smaller GPU: FP8 DiT weights and a GPU memory budget that fastwan plans the offloading for
(the plan is printed); the video goes to outputs/.

    python examples/small_gpu.py --model Wan-AI/Wan2.1-T2V-14B-Diffusers --budget 24GiB --fp8 --height 720 \\
        --width 1280
    python examples/small_gpu.py --model Wan-AI/Wan2.1-T2V-1.3B-Diffusers --budget 8GiB
    python examples/small_gpu.py --model tiny --fp8          # tiny random model on a CPU (no budget there)

A mistake (a budget without a unit, a budget off CUDA, a model that does not exist) ends with one line,
``fastwan: error: ...``, and exit code 2.
"""
import sys

import torch

from fastwan import VideoGenerator
from fastwan.cli import Parser, report_user_errors


def main(argv=None):
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--budget", default=None, help="GPU memory budget, e.g. 24GiB (CUDA only)")
    p.add_argument("--fp8", action="store_true", help="FP8 DiT weights (half the DiT's memory)")
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--prompt", default="a lighthouse on a cliff at dusk, waves breaking below")
    p.add_argument("--seed", type=int, default=None, help="default: a random seed (printed)")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    gen = VideoGenerator.from_pretrained(args.model, dtype=torch.bfloat16 if cuda else torch.float32,
                                         enable_torch_compile=cuda, quantization="fp8" if args.fp8 else None,
                                         max_gpu_memory=args.budget)
    if gen.memory_plan is not None:
        print(gen.memory_plan.describe())
    res = gen.generate_video(args.prompt, height=args.height, width=args.width, seed=args.seed)
    peak = "" if res.peak_memory is None else f", peak {res.peak_memory / 2**30:.2f} GiB"
    print(f"{res.video_path}  (seed {res.seed}{peak})")
    print({k: round(v, 2) for k, v in res.timings.items()})


if __name__ == "__main__":
    if code := report_user_errors(main):  # a mistake: one line and exit code 2, as the fastwan command does
        sys.exit(code)
