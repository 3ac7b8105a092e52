"""Few-step generation: a FastWan (DMD-distilled) checkpoint with its own settings, or any Wan checkpoint with a
step-distill LoRA sampled by 4-step Euler and no CFG; the video goes to outputs/.

    python examples/distilled.py --model FastVideo/FastWan2.1-T2V-1.3B-Diffusers
    python examples/distilled.py --model Wan-AI/Wan2.1-T2V-14B-Diffusers \\
        --lora wan2.1_t2v_14b_lora_rank64_lightx2v_4step.safetensors
    python examples/distilled.py --model tiny-fastwan2.1          # tiny random FastWan, runs on a CPU

A mistake (a LoRA file or a model that does not exist) ends with one line, ``fastwan: error: ...``, and exit code 2.
"""
import sys

import torch

from fastwan import VideoGenerator
from fastwan.cli import Parser, report_user_errors

# lightx2v's 4-step distill LoRAs: these timesteps of the 1000-step grid, flow shift 5, guidance 1
LORA_SAMPLING = dict(sampler="euler", timesteps=[1000, 750, 500, 250], flow_shift=5.0, guidance_scale=1.0)


def main(argv=None):
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-fastwan2.1")
    p.add_argument("--lora", default=None, help="a step-distill LoRA (safetensors); sampled as lightx2v does")
    p.add_argument("--prompt", default="a red fox running through fresh snow, cinematic")
    p.add_argument("--seed", type=int, default=None, help="default: a random seed (printed)")
    p.add_argument("--compile", action="store_true", help="torch.compile the DiT blocks (CUDA)")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    gen = VideoGenerator.from_pretrained(args.model, dtype=torch.bfloat16 if cuda else torch.float32,
                                         enable_torch_compile=args.compile, lora=args.lora)
    kw = LORA_SAMPLING if args.lora else {}  # a FastWan checkpoint brings its own (DMD, 3 steps, VSA)
    res = gen.generate_video(args.prompt, seed=args.seed, **kw)
    s = res.settings
    print(f"{res.video_path}  (seed {res.seed}; {s['sampler']} at {s['timesteps']}, {s['num_inference_steps']} "
          f"steps, {res.num_transformer_forwards} DiT forwards; {res.attention_backend})")
    print({k: round(v, 2) for k, v in res.timings.items()})


if __name__ == "__main__":
    if code := report_user_errors(main):  # a mistake: one line and exit code 2, as the fastwan command does
        sys.exit(code)
