"""One side of a two-tree A/B (run by path, never imported): builds a job with the ``fastwan`` found on
PYTHONPATH, then times it each time the driver (:mod:`benchmarks.ab_trees`) writes ``run`` on stdin, answering
one JSON line per run on stdout. It uses only what every fastwan version has (``VideoGenerator.from_pretrained``
/ ``generate_video``; ``WanTransformer`` + ``load_state_dict(assign=True)``), so an old tree runs it unchanged.

Jobs: ``e2e`` (the 1.3B 480p text-to-video pipeline, compiled, defaults; frames saved as .npy per run) and
``forward14b`` (a 14B DiT forward at 720p on random weights made by diffusers with a fixed seed, compiled blocks,
defaults; its relative L2 error against diffusers' eager forward on the same weights).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

PROMPT = "a red fox running through fresh snow in a pine forest, cinematic lighting"
NEG = "blurry, low quality, static"
WAN14B = dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
              text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
              qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def say(obj) -> None:
    print(json.dumps(obj), flush=True)


def e2e_job(a):
    from fastwan import VideoGenerator

    gen = VideoGenerator.from_pretrained(a.ckpt, enable_torch_compile=True)
    height, width, frames = (int(v) for v in a.video.split("x"))
    kw = dict(negative_prompt=NEG, height=height, width=width, num_frames=frames, guidance_scale=5.0, seed=0,
              return_frames=True, save_video=False)
    gen.generate_video(PROMPT, num_inference_steps=2, **kw)  # compile and warm up

    def run(i: int) -> dict:
        sync()
        t0 = time.perf_counter()
        res = gen.generate_video(PROMPT, num_inference_steps=a.steps, **kw)
        sync()
        out = {"s": time.perf_counter() - t0, "timings": res.timings, "backend": res.attention_backend}
        if a.frames:
            import numpy as np

            np.save(f"{a.frames}_{i}.npy", res.frames)
        return out

    return run


def forward14b_job(a):
    from diffusers import WanTransformer3DModel

    from fastwan.attention import AttentionDispatch
    from fastwan.models import WanConfig, WanTransformer, keep_in_fp32

    with torch.device("cuda"):
        torch.manual_seed(0)
        ref = WanTransformer3DModel(**WAN14B).to(torch.bfloat16).eval()
    for name, prm in ref.named_parameters():
        if keep_in_fp32(name):
            prm.data = prm.data.float()
    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(1, 16, 21, 90, 160, device="cuda", generator=g).to(torch.bfloat16)
    t = torch.full((1,), 500.0, device="cuda")
    text = torch.randn(1, 512, 4096, device="cuda", generator=g).to(torch.bfloat16)
    text[:, a.prompt_tokens:] = 0
    with torch.no_grad():
        want = ref(x, t, text, return_dict=False)[0].float()
    state = ref.state_dict()
    del ref
    att = AttentionDispatch.resolve(None, device="cuda", dtype=torch.bfloat16, head_dim=128)
    cfg = WanConfig.from_dict({"_class_name": "WanTransformer3DModel", **WAN14B})
    try:
        from fastwan.options import DiTOptions
    except ImportError:  # a tree from before build options: its defaults are set on the built model
        DiTOptions = None
    with torch.device("meta"):
        model = WanTransformer(cfg, att) if DiTOptions is None else \
            WanTransformer(cfg, att, DiTOptions().resolve("cuda", torch.bfloat16))
    model.load_state_dict(state, assign=True, strict=True)
    model.eval().requires_grad_(False)
    model.compile_blocks(fullgraph=True)
    with torch.no_grad():
        got = model(x, t, text).float()
    rel = ((got - want).norm() / want.norm()).item()
    del got, want

    def run(i: int) -> dict:
        with torch.no_grad():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(a.iters):
                model(x, t, text)
            end.record()
            end.synchronize()
        return {"ms": start.elapsed_time(end) / a.iters, "rel_err_vs_diffusers": rel,
                "backend": att.describe("cuda")}

    return run


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--job", choices=("e2e", "forward14b"), required=True)
    p.add_argument("--ckpt", default="/tmp/wan13b")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--video", default="480x832x81", help="e2e: HEIGHTxWIDTHxFRAMES")
    p.add_argument("--frames", default=None, help="e2e: save each run's frames to FRAMES_<run>.npy")
    p.add_argument("--iters", type=int, default=3, help="forward14b: forwards per run")
    p.add_argument("--prompt-tokens", type=int, default=100)
    a = p.parse_args()
    import fastwan

    t0 = time.perf_counter()
    run = e2e_job(a) if a.job == "e2e" else forward14b_job(a)
    say({"ready": True, "setup_s": time.perf_counter() - t0, "fastwan": fastwan.__file__,
         "torch": torch.__version__, "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"})
    i = 0
    for line in sys.stdin:
        if line.strip() != "run":
            break
        say(run(i))
        i += 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
