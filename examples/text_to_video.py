"""Text to video with fastwan.

    python examples/text_to_video.py --model Wan-AI/Wan2.1-T2V-1.3B-Diffusers --prompt "a cat surfing"
    python examples/text_to_video.py            # tiny random model, runs on a CPU
"""
import argparse

import torch

from fastwan import VideoGenerator


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny")
    p.add_argument("--prompt", default="a red fox running through fresh snow, cinematic")
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--seed", type=int, default=None, help="default: a random seed (printed)")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    gen = VideoGenerator.from_pretrained(args.model, dtype=torch.bfloat16 if cuda else torch.float32,
                                         attention_backend=args.attention_backend)
    res = gen.generate_video(args.prompt, seed=args.seed)
    print(f"{res.video_path}  (seed {res.seed}, {res.attention_backend})")
    print({k: round(v, 2) for k, v in res.timings.items()})


if __name__ == "__main__":
    main()
