"""Wan2.2-Animate's segments (the rules of diffusers' ``WanAnimatePipeline``, which fastwan's generator does not run
yet; the DiT is :mod:`fastwan.models.wan.animate`): how a driving video of any length is cut into segments, how the
pose and face videos are padded to the segments' end, and the 4-channel mask the DiT reads before each latent frame.

* :func:`plan_segments`: ``frames`` driving frames in segments of ``segment_frames`` (4 n + 1: whole latent frames)
  that overlap by ``overlap`` frames (1 or 5, fewer than half a segment: the last decoded frames of a segment
  condition the next one). Segment k covers frames k x (segment_frames - overlap) .. + segment_frames; there are as
  few as cover ``frames``, and the driving videos are padded to the last one's end (``target_frames``); the video
  made is cut back to ``frames``.
* :func:`pad_indices`: the frames the padded videos show: the video played forward, then backward, and so on
  (the first and last frame not repeated at the turns).
* :func:`conditioning_mask`: the mask [B, 4, T_lat, h, w] in front of the conditioning latents: per pixel frame 1
  where the frame is given (the reference image; the overlap frames of a segment after the first; in replacement
  mode the background outside the character), 0 where it is generated, the first frame counted 4 times and every 4
  pixel frames folded into the 4 channels of one latent frame.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fastwan.errors import InvalidArgument

OVERLAPS = (1, 5)  # the overlap frames diffusers' pipeline accepts
TEMPORAL = 4  # the Wan VAE's pixel frames per latent frame


@dataclass(frozen=True)
class SegmentPlan:
    """``starts``: each segment's first driving frame; ``segment_frames`` each; ``target_frames``: the padded
    driving videos' length (the last segment's end); ``frames``: the video made."""
    frames: int
    segment_frames: int
    overlap: int
    starts: tuple[int, ...]
    target_frames: int

    @property
    def latent_frames(self) -> int:
        """A segment's latent frames, the reference image's first: 1 + (segment_frames - 1) / 4 + 1."""
        return (self.segment_frames - 1) // TEMPORAL + 2


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def plan_segments(frames: int, segment_frames: int = 77, overlap: int = 1) -> SegmentPlan:
    """The segments of ``frames`` driving frames (see the module docstring); bad values refused naming the rule."""
    if not (_is_int(segment_frames) and segment_frames > 1 and segment_frames % TEMPORAL == 1):
        raise InvalidArgument(f"segment_frames={segment_frames!r} must be 4 n + 1 frames, n >= 1 (whole latent "
                              "frames of the Wan VAE), e.g. 77; pass such a number.")
    if overlap not in OVERLAPS or not _is_int(overlap):
        raise InvalidArgument(f"overlap={overlap!r} must be 1 or 5 (the frames of a segment that condition the "
                              "next, as Wan2.2-Animate was trained); pass 1 or 5.")
    if 2 * overlap >= segment_frames:
        raise InvalidArgument(f"segment_frames={segment_frames} must be more than twice overlap={overlap} (a segment "
                              "makes more new frames than it takes from the one before); pass longer segments.")
    if not (_is_int(frames) and frames > overlap):
        raise InvalidArgument(f"the driving videos have {frames!r} frames; they need more than overlap={overlap} "
                              "(pass longer pose and face videos).")
    step = segment_frames - overlap
    count = max(1, -(-(frames - overlap) // step))
    starts = tuple(k * step for k in range(count))
    return SegmentPlan(frames, segment_frames, overlap, starts, starts[-1] + segment_frames)


def pad_indices(frames: int, target: int) -> list[int]:
    """The indices of ``target`` frames of a video of ``frames``: forward, then backward, ... (a one-frame video
    repeats its frame)."""
    if not (_is_int(frames) and frames >= 1):
        raise InvalidArgument(f"a driving video of {frames!r} frames: it needs at least one.")
    if frames == 1:
        return [0] * target
    period = 2 * (frames - 1)
    return [i if i < frames else period - i for i in (j % period for j in range(target))]


def conditioning_mask(batch: int, latent_frames: int, height: int, width: int, given: int = 1,
                      pixels: torch.Tensor | None = None, *, dtype=torch.float32, device=None) -> torch.Tensor:
    """The mask [batch, 4, latent_frames, height, width] (latent height and width): ``pixels`` [batch, 1,
    4 (latent_frames - 1) + 1, height, width] (1 where the frame is given; None: all 0) with its first ``given``
    frames set to 1, the first frame counted 4 times, then every 4 frames one latent frame's channels."""
    frames = TEMPORAL * (latent_frames - 1) + 1
    if pixels is None:
        mask = torch.zeros(batch, 1, frames, height, width, dtype=dtype, device=device)
    else:
        if tuple(pixels.shape) != (batch, 1, frames, height, width):
            raise InvalidArgument(f"mask pixels {list(pixels.shape)} must be [{batch}, 1, {frames}, {height}, "
                                  f"{width}] (4 per latent frame after the first, at the latent size).")
        mask = pixels.to(device=device, dtype=dtype).clone()
    mask[:, :, :given] = 1
    mask = torch.cat([mask[:, :, :1].expand(-1, -1, TEMPORAL, -1, -1), mask[:, :, 1:]], dim=2)
    return mask.view(batch, latent_frames, TEMPORAL, height, width).transpose(1, 2)
