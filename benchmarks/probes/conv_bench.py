"""The VAE decoder's 3x3x3 convolutions at 480p (bf16): cuDNN conv3d in both layouts, with and without
``cudnn.benchmark``, against the same convolution written as three conv2d over frames (summed in bf16) and as one
conv2d over the three time taps stacked along channels (one accumulation; timed with the stacking copy done by
three strided ``copy_`` calls, and without it).

    python -m benchmarks.probes.conv_bench

Shapes: [1, C, T, H, W] inputs with T = 4 or 8 output frames + 2 cached (one or two latent frames per decoder
call), C = 96 / 192 / 384 at the decoder's three resolutions; per case the median of 3 spans of 10 back-to-back
calls (CUDA events). Prints each result's max error against an fp32 conv3d of the same bf16 inputs.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.harness import span_ms

CASES = [(96, 6, 480, 832), (96, 10, 480, 832), (192, 6, 240, 416), (192, 10, 240, 416), (384, 3, 120, 208),
         (384, 4, 120, 208)]


@torch.no_grad()
def run_case(C: int, T: int, H: int, W: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, C, T, H, W, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(C, C, 3, 3, 3, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    xcl = x.contiguous(memory_format=torch.channels_last_3d)
    wcl = w.contiguous(memory_format=torch.channels_last_3d)
    x2 = xcl[0].permute(1, 0, 2, 3)  # [T, C, H, W] with channels-last strides (a view)
    w2 = [w[:, :, i].contiguous(memory_format=torch.channels_last) for i in range(3)]

    # the three time taps as one conv2d over 3C stacked channels (one fp32 accumulation, as conv3d):
    # input [T-2, 3C, H, W] channels-last with frame t's channels = x[t], x[t+1], x[t+2]; weight [C, 3C, 3, 3]
    w3 = w.permute(0, 2, 1, 3, 4).reshape(C, 3 * C, 3, 3).contiguous(memory_format=torch.channels_last)
    xs = torch.empty(T - 2, H, W, 3 * C, device="cuda", dtype=x.dtype)

    def stack():
        xt = xcl[0].permute(1, 2, 3, 0)  # [T, H, W, C] (dense: channels-last)
        for i in range(3):
            xs[..., i * C:(i + 1) * C].copy_(xt[i:T - 2 + i])
        return xs.permute(0, 3, 1, 2)

    xs_view = stack()

    def stacked_conv2d():
        return F.conv2d(stack(), w3, None, 1, 1).permute(1, 0, 2, 3).unsqueeze(0)

    def stacked_conv2d_only():
        return F.conv2d(xs_view, w3, None, 1, 1).permute(1, 0, 2, 3).unsqueeze(0)

    def three_conv2d():
        o = F.conv2d(x2[0:T - 2], w2[0], None, 1, 1)
        o = o + F.conv2d(x2[1:T - 1], w2[1], None, 1, 1)
        return (o + F.conv2d(x2[2:T], w2[2], None, 1, 1)).permute(1, 0, 2, 3).unsqueeze(0)

    ref = F.conv3d(x.float(), w.float(), None, 1, (0, 1, 1))
    flops = 2 * C * C * 27 * (T - 2) * H * W
    rows = []
    for bench in (False, True):
        torch.backends.cudnn.benchmark = bench
        for name, fn in ((f"conv3d channels-last{' +bench' if bench else ''}",
                          lambda: F.conv3d(xcl, wcl, None, 1, (0, 1, 1))),
                         (f"conv3d channels-first{' +bench' if bench else ''}",
                          lambda: F.conv3d(x, w, None, 1, (0, 1, 1)))):
            rows.append((name, span_ms(fn), float((fn().float() - ref).abs().max())))
    torch.backends.cudnn.benchmark = False
    rows.append(("3 x conv2d", span_ms(three_conv2d), float((three_conv2d().float() - ref).abs().max())))
    for name, fn in (("stacked conv2d (with stacking)", stacked_conv2d), ("stacked conv2d (conv only)",
                                                                          stacked_conv2d_only)):
        rows.append((name, span_ms(fn), float((fn().float() - ref).abs().max())))
    for name, ms, err in rows:
        print(f"C={C} {T}x{H}x{W} {name:30s} {ms:7.2f} ms {flops / ms / 1e9:5.0f} TFLOP/s  max err {err:.2e}",
              flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.conv_bench", description=__doc__.split("\n\n")[0])
    p.parse_args(argv)
    for case in CASES:
        run_case(*case)


if __name__ == "__main__":
    main()
