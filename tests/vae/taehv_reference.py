"""TAEHV's published decoder written out for the tests, apart from fastwan's code: the key layout of the published
taew2_1 / taew2_2 files (with random weights, written to a file as they are published, encoder keys included) and a
float64 decode that walks the frames one at a time through the 23 layers, each memory block keeping the input it saw
at the previous frame, each time-growth conv handing its frames on one after the other."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

WIDTH = {0: 256, 1: 128, 2: 64}  # stage -> width; the stage after the last is 64 wide too
GROWTH = {0: 1, 1: 2, 2: 2}  # stage -> frames per frame of its time-growth conv
CHANNELS_PATCH = {"taew2_1": (16, 1), "taew2_2": (48, 2)}


def published_shapes(channels: int, patch: int) -> dict[str, tuple[int, ...]]:
    """The ``decoder.`` keys of a published file and their shapes."""
    shapes = {"decoder.1.weight": (256, channels, 3, 3), "decoder.1.bias": (256,)}
    for stage in range(3):
        w, nxt = WIDTH[stage], WIDTH.get(stage + 1, 64)
        base = 3 + 6 * stage
        for block in (base, base + 1, base + 2):
            for j in (0, 2, 4):
                shapes[f"decoder.{block}.conv.{j}.weight"] = (w, 2 * w if j == 0 else w, 3, 3)
                shapes[f"decoder.{block}.conv.{j}.bias"] = (w,)
        shapes[f"decoder.{base + 4}.conv.weight"] = (GROWTH[stage] * w, w, 1, 1)
        shapes[f"decoder.{base + 5}.weight"] = (nxt, w, 3, 3)
    shapes["decoder.22.weight"] = (3 * patch * patch, 64, 3, 3)
    shapes["decoder.22.bias"] = (3 * patch * patch,)
    return shapes


def random_state(channels: int, patch: int, seed: int = 0, encoder: bool = True) -> dict[str, torch.Tensor]:
    """Random weights in the published layout, scaled so that activations neither die nor blow up and the output
    spreads over [0, 1]; ``encoder``: a few encoder keys, as the published files have."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key, shape in published_shapes(channels, patch).items():
        if key.endswith("bias"):
            out[key] = 0.05 * torch.randn(shape, generator=g)
        else:
            fan_in = shape[1] * shape[2] * shape[3]
            out[key] = torch.randn(shape, generator=g) * (1.2 / fan_in ** 0.5)
    out["decoder.22.bias"] = out["decoder.22.bias"] + 0.5
    if encoder:
        out["encoder.0.weight"] = torch.randn(64, 3 * patch * patch, 3, 3, generator=g)
        out["encoder.0.bias"] = torch.randn(64, generator=g)
    return out


def write_state(path: Path, state: dict[str, torch.Tensor]) -> Path:
    """``state`` saved to ``path``: safetensors, or a torch pickle for a .pth name."""
    if path.suffix == ".pth":
        torch.save(state, path)
    else:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    return path


def reference_decode(state: dict[str, torch.Tensor], z: torch.Tensor) -> torch.Tensor:
    """``z`` [B, C, F, h, w] -> [B, 3, 1 + 4 (F - 1), H, W] in [0, 1], in float64, one video and one frame at a
    time."""
    return torch.stack([_one_video(state, video) for video in z.double()])


def _one_video(state, z):
    w = {k: v.double() for k, v in state.items() if k.startswith("decoder.")}
    patch = int(round((w["decoder.22.weight"].shape[0] // 3) ** 0.5))
    memory: dict[int, torch.Tensor] = {}
    frames: list[torch.Tensor] = []

    def conv(x, name):
        return F.conv2d(x[None], w[f"{name}.weight"], w.get(f"{name}.bias"), padding=1)[0]

    def forward(x, i):  # one frame [c, h, w] through layers i ... 22; finished frames go to ``frames``
        while i < 23:
            if i == 0:
                x = 3 * torch.tanh(x / 3)
            elif i in (1, 8, 14, 20, 22):
                x = conv(x, f"decoder.{i}")
            elif i in (2, 21):
                x = x.clamp_min(0)
            elif i in (6, 12, 18):
                x = x.repeat_interleave(2, 1).repeat_interleave(2, 2)
            elif i in (7, 13, 19):  # time growth: frame j of the k is output channels [j c, (j + 1) c)
                c = x.shape[0]
                grown = torch.einsum("oc,chw->ohw", w[f"decoder.{i}.conv.weight"][:, :, 0, 0], x)
                for j in range(grown.shape[0] // c):
                    forward(grown[j * c:(j + 1) * c], i + 1)
                return
            else:  # a memory block: the previous frame's input of this block (zeros at the first)
                past = memory.get(i, torch.zeros_like(x))
                memory[i] = x
                h = conv(torch.cat([x, past]), f"decoder.{i}.conv.0").clamp_min(0)
                h = conv(h, f"decoder.{i}.conv.2").clamp_min(0)
                x = (conv(h, f"decoder.{i}.conv.4") + x).clamp_min(0)
            i += 1
        frames.append(x)

    for t in range(z.shape[1]):
        forward(z[:, t], 0)
    video = torch.stack(frames[3:])  # the first three frames are dropped
    t, _, h, wd = video.shape
    video = video.view(t, 3, patch, patch, h, wd).permute(0, 1, 4, 2, 5, 3).reshape(t, 3, h * patch, wd * patch)
    return video.clamp(0, 1).permute(1, 0, 2, 3)
