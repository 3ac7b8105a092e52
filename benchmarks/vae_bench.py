"""Wan VAE decode (diffusers ``AutoencoderKLWan``; TAEHV's tiny decoder): time and peak memory per setting, on the GPU.

    python -m benchmarks.vae_bench --ckpt /tmp/wan13b-random [--sizes 480x832,720x1280] [--frames 81] [--profile]

The tiny decoder against the full VAE's (issue #43: TAEHV at 480p 81 frames), each in the same run; Wan2.1's
16-channel latents (taew2_1), then Wan2.2 TI2V's 48-channel ones (taew2_2):

    FULL=bf16+channels-last+fused-norms+fast-convs+chunkauto
    V=$FULL,bf16+tiny,bf16+tiny+nchw,bf16+tiny+frames,bf16+tiny+nchw+frames,bf16+tiny+chunk21
    python -m benchmarks.vae_bench --ckpt random --sizes 480x832 --variants $V --out vae_tiny_wan21.json
    python -m benchmarks.vae_bench --ckpt random-wan2.2 --sizes 480x832 --variants $V --out vae_tiny_wan22.json

(The first variant is the full VAE as fastwan's generator decodes in bf16: its decoder swaps, 2 latent frames per
call at 480p; ``bf16+tiny`` the tiny decoder as the generator runs it, 2 latent frames per pass at 480p; ``+chunk21``
all 21 in one pass.)

For each size, decodes one random latent video ([1, z_dim, (frames-1)/4+1, H/f, W/f]; Wan2.1: 16 channels,
f = 8) with each variant:

* ``fp32`` / ``bf16``        the VAE's dtype;
* ``bf16+cudnn-bench``       ``torch.backends.cudnn.benchmark = True`` (cuDNN picks conv algorithms by timing);
* ``bf16+channels-last``     weights and latents in ``torch.channels_last_3d``;
* ``...+fused-norms``         the decoder's RMSNorm + SiLU pairs as one Triton pass each
                             (``fastwan.vae.norms.fuse_decoder_norms``, what fastwan's generator does);
* ``...+fast-convs``          and the modules swapped by ``fastwan.vae.convs.fast_decoder_convs``
                             (causal convs padded in time only, conv bias by a Triton kernel, layout-keeping
                             temporal interleave, nearest upsample as a wide copy, 96-channel convs as a conv2d
                             over stacked time taps);
* ``bf16+tiling``            ``vae.enable_tiling()`` (diffusers' spatial tiling, default tile sizes);
* ``fp32+ieee`` / ``fp32+tf32`` fp32 math in full precision or on TF32 tensor cores (fastwan's ``fp32_precision``,
                             set as a CUDA load sets it); list ``fp32+ieee`` first to get TF32's error against it;
* ``fp32+tiny`` / ``bf16+tiny`` TAEHV's tiny decoder (``vae="tiny"``, :mod:`fastwan.vae.tiny`) in place of the
                             VAE's, from a random weight file in the published layout (taew2_1 for 16 latent
                             channels, taew2_2 for 48) that the run writes under ``--taehv-dir``
                             (``benchmarks.checkpoints.write_taehv``) and reads as ``vae="tiny"`` does; it takes
                             ``+cudnn-bench``, ``+channels-last`` / ``+nchw`` (its activations and weights in
                             channels-last memory or not; default: as the generator loads it, channels-last on CUDA),
                             ``+frames`` (the generator's whole decode: uint8 frames in host memory), ``+tf32`` /
                             ``+ieee`` and ``+chunkN`` (default: ``auto``, as the generator decodes), not the full
                             VAE's module swaps;
* any of them ``+chunkN``    decoded by ``fastwan.vae.decode.decode_latents`` with N latent frames per
                             decoder call after the first (``+chunkauto``: its size rule), instead of one.

Figures: median ms of ``--iters`` decodes after one warm-up, peak allocated memory above the weights, and the
max |difference| to the ``bf16`` decode of the same latents (tiling blends tile borders, so it is not exact), and
the max |difference| and PSNR (outputs in [-1, 1]) to the first variant listed. A tiny row has time and memory
only: with random weights its frames are no approximation of the full VAE's, so no difference or PSNR is reported
for it (nor is it the "first variant"); its error against the full VAE needs the published weights.
``--profile`` also prints, per variant, the CUDA kernel time of one decode (torch.profiler) by group and its top
kernels; ``--ckpt random`` builds the VAE from diffusers' default config (Wan2.1's) with random weights, and
``--ckpt random-wan2.2`` the Wan2.2-TI2V-5B one (48 latent channels, spatial factor 16). ``--smoke`` (CI): the tiny
checkpoint's VAE on the CPU at 32x32, 5 frames, every variant (the kernels' PyTorch references stand in for Triton);
``--smoke-task ti2v`` writes the tiny Wan2.2 TI2V checkpoint (48 channels) instead of the Wan2.1 one.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.checkpoints import tiny_checkpoint, write_taehv
from benchmarks.harness import (
    SMOKE_DIR, add_device, add_smoke, device_arg, gib, kernel_times, output, parse_args, peak_gib, release, reset_peak,
    sync)
from fastwan.vae.tiny_weights import VARIANTS as TAEHV_FILES

VARIANTS = ("fp32", "bf16", "bf16+cudnn-bench", "bf16+channels-last", "bf16+channels-last+fused-norms",
            "bf16+channels-last+fused-norms+fast-convs", "bf16+channels-last+fused-norms+fast-convs+cudnn-bench",
            "bf16+tiling", "bf16+tiny")
PARTS = ("cudnn-bench", "channels-last", "fused-norms", "fast-convs", "tiling", "tf32", "ieee", "tiny", "nchw",
         "frames")
TINY_ONLY = ("nchw", "frames")  # the tiny decoder's memory format and its whole decode to host frames
NOT_TINY = ("fused-norms", "fast-convs", "tiling")  # the full VAE's module swaps and tiling
TAEHV_CHANNELS = tuple(TAEHV_FILES)  # the latent channels of TAEHV's Wan decoders
# the Wan2.2-TI2V-5B VAE's config (its published vae/config.json), for --ckpt random-wan2.2
WAN22_VAE = dict(base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                 temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12,
                 patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4, latents_mean=[0.0] * 48,
                 latents_std=[1.0] * 48)


def load_vae(ckpt: str, dtype, device: torch.device):
    from diffusers import AutoencoderKLWan

    if ckpt in ("random", "random-wan2.2"):
        torch.manual_seed(0)
        vae = AutoencoderKLWan(**(WAN22_VAE if ckpt == "random-wan2.2" else {})).to(dtype)
    else:
        vae = AutoencoderKLWan.from_pretrained(Path(ckpt) / "vae", torch_dtype=dtype)
    return vae.to(device).eval()


def vae_config(ckpt: str) -> dict:
    """The VAE's config (no weights loaded): ``--ckpt random``'s is diffusers' default, i.e. empty."""
    from diffusers import AutoencoderKLWan

    if ckpt in ("random", "random-wan2.2"):
        return dict(WAN22_VAE) if ckpt == "random-wan2.2" else {}
    return dict(AutoencoderKLWan.load_config(Path(ckpt) / "vae"))


def latent_params(ckpt: str) -> tuple[int, int]:
    """(latent channels, spatial factor) of the VAE, from its config (no weights loaded)."""
    cfg = vae_config(ckpt)
    return cfg.get("z_dim", 16), cfg.get("scale_factor_spatial") or 8


def load_tiny(ckpt: str, folder: Path, dtype, device: torch.device, channels_last: bool | None = None):
    """TAEHV's tiny decoder for the latents of ``ckpt``'s VAE, read as ``vae="tiny"`` reads it from a random file in
    the published layout (written in ``folder`` when missing: ``taew2_1.safetensors`` or ``taew2_2.safetensors``);
    ``channels_last``: None as the generator loads it."""
    from fastwan.vae.tiny_weights import read_tiny

    cfg = vae_config(ckpt)
    channels = cfg.get("z_dim") or 16
    path = write_taehv(Path(folder) / f"{TAEHV_FILES[channels][0]}.safetensors", channels)
    return read_tiny(path, cfg, model=ckpt).load(dtype, device, channels_last)


def kernel_group(name: str) -> str:
    n = name.lower()
    if "memcpy" in n or "memset" in n or "copy" in n or "fillfunctor" in n or "cat" in n.split("<")[0]:
        return "copy/fill"
    if any(s in n for s in ("xmma", "fprop", "conv", "implicit", "cutlass", "nvjet", "gemm", "dgrad")):
        return "conv/gemm"
    if "nchwtonhwc" in n or "nhwctonchw" in n:
        return "layout transpose"
    if "upsample" in n:
        return "upsample"
    if "rms_silu" in n:
        return "fused norm (triton)"
    return "elementwise/other"


def profile_decode(run, label: str, top: int) -> dict:
    """CUDA kernel time of one ``run()`` (already warm) by kernel_group, and its ``top`` kernels by total time."""
    per = kernel_times(run, warmup=False)
    groups: dict[str, float] = defaultdict(float)
    for name, (ms, _) in per.items():
        groups[kernel_group(name)] += ms
    total = sum(groups.values())
    print(f"--- {label}: CUDA kernel time {total:.1f} ms", flush=True)
    for g, ms in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"   {g:22s} {ms:9.1f} ms")
    rows = sorted(per.items(), key=lambda kv: -kv[1][0])[:top]
    for k, (ms, n) in rows:
        print(f"      {ms:9.2f} ms  x{int(n):<5d} {k[:110]}")
    return {"kernel_total_ms": round(total, 1), "groups_ms": {g: round(v, 1) for g, v in groups.items()},
            "top": [(k[:110], round(ms, 2), int(n)) for k, (ms, n) in rows]}


def decode_fn(vae, z, chunk=None, frames=False):
    """One decode: diffusers' ``vae.decode`` (frame by frame), or fastwan's ``decode_latents`` with ``chunk``; a tiny
    decoder's ``decode`` with ``chunk`` (None: "auto"), or with ``frames`` its ``frames`` (uint8 frames on the
    host, as the generator's decode returns them)."""
    from fastwan.vae.decode import decode_latents
    from fastwan.vae.tiny import TinyDecoder

    def run():
        if isinstance(vae, TinyDecoder):
            return (vae.frames if frames else vae.decode)(z, "auto" if chunk is None else chunk)
        if chunk is None:
            return vae.decode(z, return_dict=False)[0]
        return decode_latents(vae, z, chunk)
    return run


def chunk_of(variant: str):
    """The ``+chunkN`` / ``+chunkauto`` suffix of a variant (latent frames per decoder call), else None."""
    m = re.search(r"\+chunk(\d+|auto)\b", variant)
    return None if m is None else (m.group(1) if m.group(1) == "auto" else int(m.group(1)))


def psnr(out: torch.Tensor, ref: torch.Tensor) -> float:
    """PSNR in dB of ``out`` against ``ref``, both in [-1, 1] (peak-to-peak 2); inf when equal."""
    mse = float(((out.clamp(-1, 1) - ref.clamp(-1, 1)).double() ** 2).mean())
    return float("inf") if mse == 0 else 10 * math.log10(4.0 / mse)


def check_variant(variant: str) -> None:
    """ValueError unless ``variant`` is fp32 or bf16 followed by known ``+`` parts."""
    dtype, *parts = variant.split("+")
    unknown = [x for x in parts if x not in PARTS and not re.fullmatch(r"chunk(\d+|auto)", x)]
    if dtype not in ("fp32", "bf16") or unknown:
        raise ValueError(f"VAE variant {variant!r}: fp32 or bf16, then +parts from {', '.join(PARTS)}, +chunkN, "
                         "+chunkauto")
    if "tiny" not in parts and any(x in TINY_ONLY for x in parts):
        raise ValueError(f"VAE variant {variant!r}: +{' +'.join(x for x in parts if x in TINY_ONLY)} applies to the "
                         "tiny decoder only; add +tiny, or leave it out")
    if "nchw" in parts and "channels-last" in parts:
        raise ValueError(f"VAE variant {variant!r}: +nchw and +channels-last contradict each other; keep one")
    swaps = [x for x in parts if x in NOT_TINY]
    if "tiny" in parts and swaps:
        raise ValueError(f"VAE variant {variant!r}: +{swaps[0]} changes the full VAE, not the tiny decoder; leave it "
                         "out of a +tiny variant (which takes +cudnn-bench, +channels-last, +tf32, +ieee, +chunkN)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.vae_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", default="/tmp/wan13b-random")
    p.add_argument("--sizes", default="480x832,720x1280")
    p.add_argument("--frames", type=int, default=81)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", default="vae_bench.json")
    p.add_argument("--profile", action="store_true", help="print the top CUDA kernels of one decode per variant")
    p.add_argument("--top", type=int, default=25, help="kernels listed by --profile")
    p.add_argument("--taehv-dir", default=str(Path(tempfile.gettempdir()) / "taehv-random"),
                   help="+tiny variants: the folder of the random TAEHV files (written when missing)")
    p.add_argument("--smoke-task", choices=("t2v", "ti2v"), default=None,
                   help="--smoke: the tiny checkpoint written at --ckpt when none is there: t2v (Wan2.1's VAE, "
                        "default) or ti2v (Wan2.2 TI2V's, 48 latent channels)")
    add_device(p)
    add_smoke(p, ckpt=str(SMOKE_DIR / "wan2.1"), sizes="32x32", frames=5, iters=1, out=str(SMOKE_DIR / "vae.json"),
              taehv_dir=str(SMOKE_DIR / "taehv"))
    return p


@torch.no_grad()
def main(argv=None) -> int:
    p = build_parser()
    a = parse_args(p, argv)
    device = device_arg(p, a.device, *(["--profile"] if a.profile else []))
    try:
        for variant in a.variants.split(","):
            check_variant(variant)
        sizes = [tuple(int(x) for x in size.split("x")) for size in a.sizes.split(",")]
        if any(len(s) != 2 or min(s) <= 0 for s in sizes):
            raise ValueError
    except ValueError as exc:
        p.error(str(exc) or f"--sizes {a.sizes!r}: use HEIGHTxWIDTH[,HEIGHTxWIDTH...], e.g. 480x832")
    if a.smoke_task is not None and not a.smoke:
        p.error(f"--smoke-task {a.smoke_task}: it picks --smoke's tiny checkpoint; add --smoke, or leave it out")
    if a.smoke:
        tiny_checkpoint(a.ckpt, a.smoke_task or "t2v")
    cuda = device.type == "cuda"
    res = {"device": torch.cuda.get_device_name(device) if cuda else str(device), "torch": torch.__version__,
           "rows": []}
    lat_t = (a.frames - 1) // 4 + 1
    z_dim, factor = latent_params(a.ckpt)
    if z_dim not in TAEHV_CHANNELS and any("tiny" in v.split("+") for v in a.variants.split(",")):
        p.error(f"--variants {a.variants}: +tiny decodes {' or '.join(map(str, TAEHV_CHANNELS))}-channel latents "
                f"(taew2_1 / taew2_2), --ckpt {a.ckpt}'s VAE makes {z_dim}-channel ones; leave +tiny out")
    for h, w in sizes:
        size = f"{h}x{w}"
        g = torch.Generator(device=device).manual_seed(0)
        z32 = torch.randn(1, z_dim, lat_t, h // factor, w // factor, device=device, generator=g)
        ref = first = None
        for variant in a.variants.split(","):
            dtype = torch.float32 if variant.startswith("fp32") else torch.bfloat16
            parts = set(variant.split("+")[1:])
            torch.backends.cudnn.benchmark = "cudnn-bench" in parts
            precision = torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision
            for mode in parts & {"tf32", "ieee"}:
                from fastwan.pipelines.setup import set_fp32_precision

                set_fp32_precision(device, mode)
            tiny = "tiny" in parts
            layout = True if "channels-last" in parts else False if "nchw" in parts else None
            vae = load_tiny(a.ckpt, a.taehv_dir, dtype, device, layout) if tiny else load_vae(a.ckpt, dtype, device)
            z = z32.to(dtype)
            if "channels-last" in parts and not tiny:
                for mod in vae.modules():  # the 5-D conv weights (to() would also touch 1-D/2-D tensors)
                    if isinstance(mod, torch.nn.Conv3d):
                        mod.weight.data = mod.weight.data.contiguous(memory_format=torch.channels_last_3d)
                z = z.contiguous(memory_format=torch.channels_last_3d)
            if "fused-norms" in parts:
                from fastwan.vae.norms import fuse_decoder_norms

                fuse_decoder_norms(vae)
            if "fast-convs" in parts:
                from fastwan.vae import convs as vae_convs

                print(f"{variant}: fast_decoder_convs swapped {vae_convs.fast_decoder_convs(vae)} modules", flush=True)
            if "tiling" in parts:
                vae.enable_tiling()
            run = decode_fn(vae, z, chunk_of(variant), "frames" in parts)
            sync(device)
            base = torch.cuda.memory_allocated(device) / 2**30 if cuda else None
            reset_peak(device)
            try:
                t0 = time.perf_counter()
                out = run()
                sync(device)
                first_s = time.perf_counter() - t0
            except torch.OutOfMemoryError as exc:
                print(f"{size} {variant}: out of memory ({exc})", flush=True)
                res["rows"].append({"size": size, "variant": variant, "error": "OOM"})
                del vae, run
                release(False, device)
                continue
            peak = peak_gib(device) - base if cuda else None
            times = []
            for _ in range(a.iters):
                sync(device)
                t0 = time.perf_counter()
                out = run()
                sync(device)
                times.append((time.perf_counter() - t0) * 1e3)
            if variant == "bf16":
                ref = out.float()
            if first is None and not tiny:
                first = out.float()
            row = {"size": size, "frames": a.frames, "variant": variant, "ms": round(statistics.median(times), 1),
                   "times_ms": [round(t, 1) for t in times], "first_s": round(first_s, 2),
                   "peak_above_weights_gib": peak and round(peak, 2), "max_diff_vs_bf16": None,
                   "max_diff_vs_first_variant": None, "psnr_vs_first_variant": None}
            if tiny:  # random weights: its frames are no approximation of the full VAE's (module docstring)
                row["frames_compared"] = "no: a random TAEHV decoder, time and memory only"
            else:
                row.update(max_diff_vs_bf16=None if ref is None else float((out.float() - ref).abs().max()),
                           max_diff_vs_first_variant=float((out.float() - first).abs().max()),
                           psnr_vs_first_variant=psnr(out.float(), first))
            if a.profile:
                row["profile"] = profile_decode(run, f"{size} {variant}", a.top)
            res["rows"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
            del vae, run, out
            torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = precision
            release(False, device)
        del ref, first
        torch.backends.cudnn.benchmark = False
    output(a.out).write_text(json.dumps(res, indent=1))
    print(f"\n{'size':<10} {'variant':<42} {'ms':>9} {'peak GiB':>9} {'max diff':>9}")
    for r in res["rows"]:
        if "error" in r:
            print(f"{r['size']:<10} {r['variant']:<42} {r['error']}")
            continue
        d = "-" if r["max_diff_vs_bf16"] is None else f"{r['max_diff_vs_bf16']:.3f}"
        print(f"{r['size']:<10} {r['variant']:<42} {r['ms']:>9.1f} {gib(r['peak_above_weights_gib']):>9} {d:>9}")
    if any("frames_compared" in r for r in res["rows"]):
        print("+tiny: TAEHV's decoder with random weights (the published layout): time and memory only, its frames "
              "not compared")
    return 0


if __name__ == "__main__":
    sys.exit(main())
