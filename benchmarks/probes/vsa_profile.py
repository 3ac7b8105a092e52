"""Where a FastWan step's time goes (GPU): one profiled 3-step generation per VSA tiling, top CUDA kernels.

  python -m benchmarks.probes.vsa_profile --ckpt /tmp/fastwan13b --video 480x832x81 --tiles 4x4x4,auto
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.harness import PROMPT, log, parse_video, release


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.vsa_profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", default="/tmp/fastwan13b")
    p.add_argument("--video", default="480x832x81")
    p.add_argument("--tiles", default="4x4x4,auto")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--out", default="vsa_profile.json")
    a = p.parse_args(argv)
    from fastwan import VideoGenerator

    h, w, f = parse_video(a.video)
    res = {}
    for tile in a.tiles.split(","):
        cfg = {"tile": "auto" if tile == "auto" else [int(x) for x in tile.split("x")]}
        gen = VideoGenerator.from_pretrained(a.ckpt, device="cuda", enable_torch_compile=True, attention_config=cfg)
        kw = dict(height=h, width=w, num_frames=f, seed=0, save_video=False, return_frames=False)
        gen.generate_video(PROMPT, **kw)
        r = gen.generate_video(PROMPT, **kw)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                torch.profiler.ProfilerActivity.CPU]) as prof:
            r = gen.generate_video(PROMPT, **kw)
        kernels = defaultdict(float)
        for e in prof.key_averages():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                kernels[e.key] += e.self_device_time_total / 1e3
        top = sorted(kernels.items(), key=lambda kv: -kv[1])[: a.top]
        res[tile] = {"attention": gen.attention.describe("cuda"), "timings": r.timings,
                     "cuda_ms_total": sum(kernels.values()), "top": top}
        log(f"== tile {tile}: {res[tile]['attention']}; timings {r.timings}; CUDA kernel total "
            f"{res[tile]['cuda_ms_total']:.0f} ms")
        for name, ms in top:
            log(f"  {ms:9.1f} ms  {name[:110]}")
        gen = None
        release(True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
