"""Text to video with fastwan; the video goes to outputs/ (its path and seed are printed).

    python examples/text_to_video.py --model Wan-AI/Wan2.1-T2V-1.3B-Diffusers --prompt "a cat surfing"
    python examples/text_to_video.py            # tiny random model, runs on a CPU

A mistake (a bad argument, a model that does not exist) ends with one line, ``fastwan: error: ...``, and exit code 2.
"""
import sys

import torch

from fastwan import VideoGenerator
from fastwan.cli import Parser, report_user_errors


def main(argv=None):
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--prompt", default="a red fox running through fresh snow, cinematic")
    p.add_argument("--attention-backend", default=None, help="default: the fastest that runs here")
    p.add_argument("--seed", type=int, default=None, help="default: a random seed (printed)")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    gen = VideoGenerator.from_pretrained(args.model, dtype=torch.bfloat16 if cuda else torch.float32,
                                         attention_backend=args.attention_backend)
    res = gen.generate_video(args.prompt, seed=args.seed)
    print(f"{res.video_path}  (seed {res.seed}, {res.attention_backend})")
    print({k: round(v, 2) for k, v in res.timings.items()})


if __name__ == "__main__":
    if code := report_user_errors(main):  # a mistake: one line and exit code 2, as the fastwan command does
        sys.exit(code)
