"""Where a generation's tiny-decoder time goes (issue #43; GPU): TAEHV's decoder (random weights, taew2_1's shapes)
on 480x832x81 latents (21 frames of 60x104), bf16. Times, median of --repeats after a warm-up: the decode alone at
several latent frames per pass, channels-last (as the generator loads it on CUDA) and NCHW, with ``cudnn.benchmark``;
the frames' way to the host (uint8 on the device, then ``.cpu()``, :func:`fastwan.vae.decode.host_frames`, pinned
memory made once); the whole ``TinyDecoder.frames`` (the generator's decode) both ways; and the top CUDA kernels of
one decode.

  python -m benchmarks.probes.tiny_decode
  python -m benchmarks.probes.tiny_decode --smoke   # CI: a tiny latent on the CPU
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.harness import add_device, add_smoke, device_arg, parse_args, sync
from fastwan.vae.decode import host_frames
from fastwan.vae.tiny import TinyDecoder, uint8_tensor


def timed(fn, repeats: int, device: torch.device) -> float:
    """Median ms of ``fn`` over ``repeats`` calls after one warm-up, each synchronised."""
    fn()
    sync(device)
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        runs.append(1000 * (time.perf_counter() - t0))
    return statistics.median(runs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.tiny_decode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--latent", default="21x60x104", help="latent frames x height x width")
    p.add_argument("--top", type=int, default=15)
    add_device(p)
    add_smoke(p, latent="3x4x6", repeats=1)
    a = parse_args(p, argv)
    f, h, w = (int(x) for x in a.latent.split("x"))
    dev = device_arg(p, a.device)
    cuda = dev.type == "cuda"
    torch.manual_seed(0)
    state = TinyDecoder(16, 1).state_dict()
    dec, nchw = (TinyDecoder.from_state(state, 1, dtype=torch.bfloat16, device=dev, channels_last=cl)
                 for cl in (None, False))  # as the generator loads it (channels-last on CUDA), and NCHW
    z = torch.randn(1, 16, f, h, w, device=dev)
    rows = []

    def row(name, fn):
        ms = timed(fn, a.repeats, dev)
        rows.append((name, ms))
        print(f"{name}: {ms:.1f} ms", flush=True)

    for chunk in ("auto", 1, 3, 7, 21):
        row(f"decode, chunk {chunk}", lambda c=chunk: dec.decode(z, c))
        row(f"decode, chunk {chunk}, NCHW", lambda c=chunk: nchw.decode(z, c))
    video = dec.decode(z)
    row("uint8 on the device", lambda: uint8_tensor(video))
    frames = uint8_tensor(video)
    row("host: .cpu() of the uint8 frames", lambda: frames.cpu().numpy())
    row("host: host_frames (pages touched first)", lambda: host_frames(frames))
    if cuda:
        pinned = torch.empty(frames.shape, dtype=torch.uint8, pin_memory=True)
        row("host: into pinned memory made once", lambda: pinned.copy_(frames))
    row("TinyDecoder.frames (the generator's decode)", lambda: dec.frames(z))
    row("TinyDecoder.frames, NCHW", lambda: nchw.frames(z))
    row("decode, then .cpu() (the decode before)", lambda: uint8_tensor(nchw.decode(z)).cpu().numpy())
    torch.backends.cudnn.benchmark = True
    row("decode, chunk auto, cudnn.benchmark", lambda: dec.decode(z))
    torch.backends.cudnn.benchmark = False
    if cuda:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            dec.decode(z)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=a.top), flush=True)
    print(f"\n{torch.cuda.get_device_name() if cuda else dev}, torch {torch.__version__}, latents {a.latent}, bf16")
    print("| what | ms |\n|---|---|")
    for name, ms in rows:
        print(f"| {name} | {ms:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
