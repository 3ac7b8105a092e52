"""Wan VAE decode (diffusers ``AutoencoderKLWan``): time and peak memory per setting, on the GPU.

    python benchmarks/vae_bench.py --ckpt /tmp/wan13b-random [--sizes 480x832,720x1280] [--frames 81]

For each size, decodes one random latent video ([1, 16, (frames-1)/4+1, H/8, W/8]) with each variant:

* ``fp32`` / ``bf16``        the VAE's dtype;
* ``bf16+cudnn-bench``       ``torch.backends.cudnn.benchmark = True`` (cuDNN picks conv algorithms by timing);
* ``bf16+channels-last``     weights and latents in ``torch.channels_last_3d``;
* ``...+fused-norms``         the decoder's RMSNorm + SiLU pairs as one Triton pass each
                             (``fastwan.models.vae_norms.fuse_decoder_norms``, what fastwan's generator does);
* ``bf16+tiling``            ``vae.enable_tiling()`` (diffusers' spatial tiling, default tile sizes).

Figures: median ms of ``--iters`` decodes after one warm-up, peak allocated memory above the weights, and the
max |difference| to the ``bf16`` decode of the same latents (tiling blends tile borders, so it is not exact).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

VARIANTS = ("fp32", "bf16", "bf16+cudnn-bench", "bf16+channels-last", "bf16+channels-last+fused-norms",
            "bf16+tiling")


def decode_fn(vae, z):
    def run():
        return vae.decode(z, return_dict=False)[0]
    return run


@torch.no_grad()
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", default="/tmp/wan13b-random")
    p.add_argument("--sizes", default="480x832,720x1280")
    p.add_argument("--frames", type=int, default=81)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", default="vae_bench.json")
    a = p.parse_args(argv)
    from diffusers import AutoencoderKLWan

    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    lat_t = (a.frames - 1) // 4 + 1
    for size in a.sizes.split(","):
        h, w = (int(x) for x in size.split("x"))
        g = torch.Generator(device="cuda").manual_seed(0)
        z32 = torch.randn(1, 16, lat_t, h // 8, w // 8, device="cuda", generator=g)
        ref = None
        for variant in a.variants.split(","):
            dtype = torch.float32 if variant == "fp32" else torch.bfloat16
            torch.backends.cudnn.benchmark = variant == "bf16+cudnn-bench"
            vae = AutoencoderKLWan.from_pretrained(Path(a.ckpt) / "vae", torch_dtype=dtype).cuda().eval()
            z = z32.to(dtype)
            if variant.startswith("bf16+channels-last"):
                for mod in vae.modules():  # the 5-D conv weights (to() would also touch 1-D/2-D tensors)
                    if isinstance(mod, torch.nn.Conv3d):
                        mod.weight.data = mod.weight.data.contiguous(memory_format=torch.channels_last_3d)
                z = z.contiguous(memory_format=torch.channels_last_3d)
            if variant.endswith("+fused-norms"):
                sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
                from fastwan.models.vae_norms import fuse_decoder_norms

                fuse_decoder_norms(vae)
            if variant == "bf16+tiling":
                vae.enable_tiling()
            run = decode_fn(vae, z)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            try:
                t0 = time.perf_counter()
                out = run()
                torch.cuda.synchronize()
                first_s = time.perf_counter() - t0
            except torch.OutOfMemoryError as exc:
                print(f"{size} {variant}: out of memory ({exc})", flush=True)
                res["rows"].append({"size": size, "variant": variant, "error": "OOM"})
                del vae, run
                torch.cuda.empty_cache()
                continue
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30
            times = []
            for _ in range(a.iters):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = run()
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) * 1e3)
            if variant == "bf16":
                ref = out.float()
            diff = float((out.float() - ref).abs().max()) if ref is not None else None
            row = {"size": size, "frames": a.frames, "variant": variant, "ms": round(statistics.median(times), 1),
                   "times_ms": [round(t, 1) for t in times], "first_s": round(first_s, 2),
                   "peak_above_weights_gib": round(peak, 2), "max_diff_vs_bf16": diff}
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
            del vae, run, out
            torch.cuda.empty_cache()
        torch.backends.cudnn.benchmark = False
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(f"\n{'size':<10} {'variant':<30} {'ms':>9} {'peak GiB':>9} {'max diff':>9}")
    for r in res["rows"]:
        if "error" in r:
            print(f"{r['size']:<10} {r['variant']:<30} {r['error']}")
            continue
        d = "-" if r["max_diff_vs_bf16"] is None else f"{r['max_diff_vs_bf16']:.3f}"
        print(f"{r['size']:<10} {r['variant']:<30} {r['ms']:>9.1f} {r['peak_above_weights_gib']:>9.2f} {d:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
