"""One video on several GPUs: sequence parallelism (and CFG parallelism) through torch.distributed; the video goes
to outputs/.

    python examples/multi_gpu.py --model Wan-AI/Wan2.1-T2V-14B-Diffusers --gpus 4 --cfg-parallel --height 720 \\
        --width 1280                                      # fastwan starts 4 processes (CFG 2 x sequence 2)
    torchrun --nproc_per_node 2 examples/multi_gpu.py --model Wan-AI/Wan2.1-T2V-14B-Diffusers --gpus 2
    python examples/multi_gpu.py --model tiny --gpus 2 --cpu  # tiny random model, 2 gloo processes on a CPU

Under torchrun every process runs this script and rank 0 alone gets the frames and writes the video. A mistake
(--gpus 0, more GPUs than the model's heads allow, a model that does not exist) ends with one line,
``fastwan: error: ...``, and exit code 2.
"""
import sys

import torch
import torch.distributed as dist

from fastwan import VideoGenerator
from fastwan.cli import Parser, report_user_errors
from fastwan.parallel.workers import ParallelGenerator


def main(argv=None):
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--gpus", type=int, default=2, help="processes, one GPU each")
    p.add_argument("--cfg-parallel", action="store_true", help="the two CFG passes on two halves of the GPUs")
    p.add_argument("--cpu", action="store_true", help="gloo processes on the CPU (for trying it out)")
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--prompt", default="a red fox running through fresh snow, morning light")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.cpu
    gen = None
    try:
        gen = VideoGenerator.from_pretrained(args.model, device="cuda" if cuda else "cpu",
                                             dtype=torch.bfloat16 if cuda else torch.float32,
                                             enable_torch_compile=cuda, num_gpus=args.gpus,
                                             cfg_parallel=args.cfg_parallel)
        res = gen.generate_video(args.prompt, height=args.height, width=args.width, seed=args.seed)
        if res.video_path is not None:  # rank 0 (or this process, when fastwan started the workers)
            print(f"{res.video_path}  (seed {res.seed})")
            print({k: round(v, 2) for k, v in res.timings.items()})
    finally:
        if isinstance(gen, ParallelGenerator):  # fastwan started the worker processes: end them
            gen.close()
        if dist.is_initialized():  # a launcher's rank: end its process group before the interpreter exits
            dist.destroy_process_group()


if __name__ == "__main__":
    if code := report_user_errors(main):  # a mistake: one line and exit code 2, as the fastwan command does
        sys.exit(code)
