"""A tiny VAE decoder for Wan latents (``vae="tiny"``): the decoder architecture of TAEHV (madebyollin/taehv),
which loads its published Wan weights as they are published (:mod:`fastwan.vae.tiny_weights` reads and checks
them): taew2_1 for Wan2.1's 16-channel latents (also Wan2.2 A14B's, whose VAE is Wan2.1's) and taew2_2 for Wan2.2
TI2V 5B's 48-channel ones. It decodes the latents the denoiser makes, with no de-normalisation (TAEHV was trained on
them), to frames in [0, 1], for a fraction of the full VAE's time and memory and at somewhat lower quality.

The decoder is a sequence of 23 layers; a weight's key is ``decoder.<index>.<name>``:

- 0: a soft clamp of the latents, ``3 * tanh(z / 3)``; 1: 3x3 conv, latent channels -> 256 (with bias); 2: ReLU;
- three stages s = 0, 1, 2 of width w = 256, 128, 64 at indices 3 + 6s ... 8 + 6s: three memory blocks, a 2x nearest
  upsampling in space, a time-growth 1x1 conv without bias (k = 1 frame per frame in stage 0, k = 2 in stages 1 and
  2), a 3x3 conv without bias from w to the next width (64 after the last stage);
- 21: ReLU; 22: 3x3 conv 64 -> 3 p^2 (with bias), then a pixel shuffle by p (1 for taew2_1, 2 for taew2_2) and a
  clamp to [0, 1].

Rule of a memory block (keys ``conv.{0,2,4}.weight/bias``) at frame t, input x_t of w channels:
``relu(c4(relu(c2(relu(c0(cat(x_t, x_{t-1})))))) + x_t)`` with 3x3 convs c0: 2w -> w, c2, c4: w -> w, where x_{t-1}
is the block's own input at the previous frame, zeros at the first. Rule of a time-growth conv (key
``conv.weight``, k w output channels): output channels [j w, (j + 1) w) of frame t are frame k t + j.

Frame count: the two doubling stages turn F latent frames into 4F; the first 3 are dropped, which leaves
1 + 4 (F - 1), the full VAE's count (its first latent frame makes one frame, every other four).

:meth:`TinyDecoder.decode` runs ``chunk`` latent frames per pass, all of a pass's frames at once; each memory block
carries its last input frame into the next pass, so the result is the same function of the latents for any chunk.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fastwan.vae.decode import auto_chunk_frames, check_chunk, host_frames

WIDTHS = (256, 128, 64, 64)  # stage widths; the last is the width before the output conv
TIME_GROWTH = (1, 2, 2)  # frames per frame made by each stage's time-growth conv
TEMPORAL = 4  # output frames per latent frame (the product of TIME_GROWTH)
SPATIAL_UPSAMPLING = 8  # three 2x upsamplings; times the patch size, the VAE's spatial factor
TRIMMED = TEMPORAL - 1  # leading output frames dropped


def stage_index(stage: int) -> int:
    """Index of the first memory block of ``stage`` (0, 1, 2) in the decoder sequence."""
    return 3 + 6 * stage


class _SoftClamp(nn.Module):
    def forward(self, x):
        return torch.tanh(x / 3) * 3


class MemoryBlock(nn.Module):
    """A memory block of width ``width`` (see the module's rule)."""

    def __init__(self, width: int):
        super().__init__()
        self.conv = nn.Sequential(_conv3(2 * width, width), nn.ReLU(), _conv3(width, width), nn.ReLU(),
                                  _conv3(width, width))

    def forward(self, x: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(torch.cat([x, past], 1)) + x)


class TimeGrowth(nn.Module):
    """Each frame's ``width`` channels -> ``frames`` frames (a 1x1 conv to ``frames * width`` channels, split)."""

    def __init__(self, width: int, frames: int):
        super().__init__()
        self.frames = frames
        self.conv = nn.Conv2d(width, width * frames, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[N, width, H, W] -> [N * frames, width, H, W], frame-major, in x's memory format."""
        y = self.conv(x)
        if self.frames == 1:
            return y
        n, _, h, w = y.shape
        if y.is_contiguous():  # frame j's channels are one block: a view
            return y.reshape(n * self.frames, -1, h, w)
        # channels-last, [N, H, W, frames, width] in memory: one copy to [N, frames, H, W, width]
        y = y.permute(0, 2, 3, 1).reshape(n, h, w, self.frames, -1).permute(0, 3, 1, 2, 4)
        return y.reshape(n * self.frames, h, w, -1).permute(0, 3, 1, 2)


def _conv3(n_in: int, n_out: int, bias: bool = True) -> nn.Conv2d:
    return nn.Conv2d(n_in, n_out, 3, padding=1, bias=bias)


def _layers(latent_channels: int, patch: int) -> list[nn.Module]:
    layers: list[nn.Module] = [_SoftClamp(), _conv3(latent_channels, WIDTHS[0]), nn.ReLU()]
    for stage, frames in enumerate(TIME_GROWTH):
        width = WIDTHS[stage]
        layers += [MemoryBlock(width) for _ in range(3)]
        layers += [nn.Upsample(scale_factor=2, mode="nearest"), TimeGrowth(width, frames),
                   _conv3(width, WIDTHS[stage + 1], bias=False)]
    return layers + [nn.ReLU(), _conv3(WIDTHS[3], 3 * patch * patch)]


class TinyDecoder(nn.Module):
    """The TAEHV decoder for ``latent_channels`` (16: taew2_1, patch 1; 48: taew2_2, patch 2). ``digest``: the
    sha256 of the weight file it was loaded from (part of a video's identity), or None."""

    def __init__(self, latent_channels: int, patch: int, digest: str | None = None, channels_last: bool = False):
        super().__init__()
        self.latent_channels, self.patch, self.digest = latent_channels, patch, digest
        self.channels_last = channels_last  # activations in channels-last memory (cuDNN's layout: no conversions)
        self.decoder = nn.Sequential(*_layers(latent_channels, patch))

    @classmethod
    def from_state(cls, state: Mapping[str, torch.Tensor], patch: int, *, dtype: torch.dtype,
                   device: torch.device | str, digest: str | None = None,
                   channels_last: bool | None = None) -> TinyDecoder:
        """A decoder holding ``state`` (checked ``decoder.`` weights: :func:`fastwan.vae.tiny_weights.read_tiny`);
        ``channels_last`` (None: on CUDA) runs it in channels-last memory, weights and activations."""
        if channels_last is None:
            channels_last = torch.device(device).type == "cuda"
        out = cls(state["decoder.1.weight"].shape[1], patch, digest, channels_last)
        out.load_state_dict({k: v for k, v in state.items() if k.startswith("decoder.")}, strict=True)
        out = out.to(device=device, dtype=dtype).eval()
        return out.to(memory_format=torch.channels_last) if channels_last else out

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder[1].weight.dtype

    def _pass(self, x: torch.Tensor, batch: int, carry: dict[int, torch.Tensor]) -> torch.Tensor:
        """One pass over ``x`` [batch * T, C, h, w] (batch-major) -> [batch * 4T, 3 p^2, 8h, 8w] (channels-last
        memory under :attr:`channels_last`); ``carry``: memory block index -> its input's last frames of the previous
        pass [batch, w, H, W], updated."""
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        for i, layer in enumerate(self.decoder):
            x = layer(x, _past(x, batch, carry, i)) if isinstance(layer, MemoryBlock) else layer(x)
        return x

    @torch.no_grad()
    def decode(self, z: torch.Tensor, chunk: int | str = "auto") -> torch.Tensor:
        """``z`` [B, C, F, h, w] (the denoiser's latents) -> video [B, 3, 1 + 4 (F - 1), 8p h, 8p w] in [0, 1];
        ``chunk``: latent frames per pass, or "auto" (:func:`fastwan.vae.decode.auto_chunk_frames`, as the full
        VAE's decode picks its chunk)."""
        check_chunk(chunk)
        if z.dim() != 5 or z.shape[1] != self.latent_channels:
            raise ValueError(f"latents of shape {tuple(z.shape)} must be [B, {self.latent_channels}, F, h, w].")
        return self.decode_part(z, chunk, {})[:, :, TRIMMED:]

    @torch.no_grad()
    def decode_part(self, z: torch.Tensor, chunk: int | str, carry: dict[int, torch.Tensor]) -> torch.Tensor:
        """The next latent frames ``z`` [B, C, F, h, w] of a video whose earlier frames left the memory blocks'
        state ``carry`` (empty at the start; updated) -> its 4F next frames [B, 3, 4F, H, W] in [0, 1], the first
        ``TRIMMED`` of a video not dropped. Over consecutive parts the frames are :meth:`decode`'s (its rule)."""
        batch, channels, num_frames, h, w = z.shape
        scale = SPATIAL_UPSAMPLING * self.patch
        if chunk == "auto":
            chunk = auto_chunk_frames(h * scale, w * scale, TEMPORAL, batch)
        x = z.to(self.dtype).permute(0, 2, 1, 3, 4)  # [B, F, C, h, w]
        outs = []
        for start in range(0, num_frames, chunk):
            part = x[:, start:start + chunk]
            y = self._pass(part.reshape(-1, channels, h, w), batch, carry)
            outs.append(F.pixel_shuffle(y, self.patch) if self.patch > 1 else y)
        if batch == 1:  # the passes in a row, each frame's memory format kept (channels-last: [T, H, W, 3] frames)
            y = outs[0] if len(outs) == 1 else torch.cat(outs)
            video = y.view(1, *y.shape)
        else:
            video = torch.cat([y.view(batch, -1, *y.shape[1:]) for y in outs], 1)
        return video.clamp(0, 1).permute(0, 2, 1, 3, 4)

    def frames(self, latents: torch.Tensor, chunk: int | str = "auto") -> np.ndarray:
        """The denoiser's latents [1, C, F, h, w] -> uint8 video frames [T, H, W, 3]."""
        return uint8_frames(self.decode(latents, chunk))


def _past(x: torch.Tensor, batch: int, carry: dict[int, torch.Tensor], i: int) -> torch.Tensor:
    """What memory block ``i`` reads beside ``x`` [batch * T, w, H, W] (batch-major): each frame's previous frame,
    the carried last frame of the previous pass (zeros at a video's start) for a pass's first, in x's memory format;
    ``carry[i]`` becomes this pass's last frames [batch, w, H, W] (a copy: the pass's input is freed)."""
    samples = x.split(x.shape[0] // batch)
    first = carry.get(i)
    first = torch.zeros_like(x[:batch]) if first is None else first
    parts = [p for b, s in enumerate(samples) for p in (first[b:b + 1], s[:-1]) if len(p)]
    carry[i] = torch.cat([s[-1:] for s in samples])
    return torch.cat(parts)


def uint8_frames(video: torch.Tensor) -> np.ndarray:
    """[1, 3, T, H, W] in [0, 1] -> uint8 [T, H, W, 3] (x 255 rounded), in host memory
    (:func:`fastwan.vae.decode.host_frames`)."""
    return host_frames(uint8_tensor(video))


def uint8_tensor(video: torch.Tensor) -> torch.Tensor:
    """:func:`uint8_frames` left on the video's device: uint8 [T, H, W, 3] (a permuted view)."""
    return (video[0].float() * 255).round().to(torch.uint8).permute(1, 2, 3, 0)
