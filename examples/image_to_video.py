"""Image to video with fastwan (Wan2.1 I2V / FLF2V, Wan2.2 I2V-A14B, Wan2.2 TI2V-5B); the video goes to outputs/.

    python examples/image_to_video.py --model Wan-AI/Wan2.1-I2V-14B-480P-Diffusers --image first.png
    python examples/image_to_video.py --model Wan-AI/Wan2.1-FLF2V-14B-720P-diffusers --image a.png --last-image b.png
    python examples/image_to_video.py            # tiny random model and a generated picture, runs on a CPU

A mistake (an image file that does not exist, a model that does not exist) ends with one line,
``fastwan: error: ...``, and exit code 2.
"""
import os
import sys

import numpy as np
import torch

from fastwan import VideoGenerator
from fastwan.cli import Parser, report_user_errors
from fastwan.errors import MissingFileError


def main(argv=None):
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-wan2.1-i2v")
    p.add_argument("--image", default=None, help="first frame (default: a generated gradient)")
    p.add_argument("--last-image", default=None, help="last frame (first-last-frame checkpoints)")
    p.add_argument("--prompt", default="the scene slowly comes to life, cinematic")
    p.add_argument("--seed", type=int, default=None, help="default: a random seed (printed)")
    args = p.parse_args(argv)
    for flag, path in (("--image", args.image), ("--last-image", args.last_image)):
        if path is not None and not os.path.isfile(path):  # before the model loads
            raise MissingFileError(f"the {flag} path {path!r} is not a file; give the path of a PNG/JPEG/WebP image.")
    image = args.image
    if image is None:  # a 2:1 gradient; the video takes its aspect ratio at the model's preset area
        ramp = np.linspace(0, 255, 128, dtype=np.float32)
        image = np.stack(np.broadcast_arrays(ramp[None, :], ramp[:64, None], 128.0), -1).astype(np.uint8)
    cuda = torch.cuda.is_available()
    gen = VideoGenerator.from_pretrained(args.model, dtype=torch.bfloat16 if cuda else torch.float32)
    res = gen.generate_video(args.prompt, image=image, last_image=args.last_image, seed=args.seed)
    print(f"{res.video_path}  (seed {res.seed}, {res.attention_backend})")
    print({k: round(v, 2) for k, v in res.timings.items()})


if __name__ == "__main__":
    if code := report_user_errors(main):  # a mistake: one line and exit code 2, as the fastwan command does
        sys.exit(code)
