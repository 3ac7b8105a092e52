"""Wan2.2-Animate's segments, request rules and inputs (the rules of diffusers' ``WanAnimatePipeline``; the DiT is
:mod:`fastwan.models.wan.animate`, the segment loop :mod:`fastwan.pipelines.animate_run`): how a driving video of
any length is cut into segments, how the pose and face videos are padded to the segments' end, the 4-channel mask
the DiT reads before each latent frame, and the request's Animate fields.

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
* :func:`check_animate_fields`: a request's Animate fields together (``pose_video`` and ``face_video`` both or
  neither; ``mode`` "replace" needs ``background_video`` and ``mask_video``, which only it takes; ``mode``,
  ``segment_frames``, ``overlap`` and ``motion_batch_size`` only with the driving videos).
  :func:`read_animate_videos`: the videos read, of one length (pose, face, background, mask) and one size
  (background, mask). :func:`check_animate_request`: the request for a checkpoint, an :class:`AnimateRequest`
  (refused on a checkpoint whose DiT is not Animate's; an Animate checkpoint needs them).
* The pixels the pipeline encodes: :func:`reference_pixels` (the character image fitted inside the frame, its
  aspect kept, Lanczos, centred on black), :func:`driving_pixels` (pose and background frames at the video's size,
  face frames at the motion encoder's, Lanczos), all in [-1, 1]; :func:`mask_pixels` (the mask frames at the video's
  size, Lanczos, then grey, in [0, 1]) and :func:`latent_mask` (1 - mask, nearest, at the latent size: 1 where the
  background is kept).
* The conditioning latents (normalised VAE latents, the distribution's mode, behind their 4-channel mask):
  :func:`reference_latents` of the character image; :func:`segment_latents` of a segment (the last frames made, then
  zeros or the background).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from fastwan.errors import InvalidArgument
from fastwan.pipelines.image import normalized_latents, read_image
from fastwan.pipelines.video import read_video

MODES = ("animate", "replace")  # animation of the character image; replacement of a character in a video
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
    if segment_frames is None or overlap is None:
        raise InvalidArgument(f"segment_frames={segment_frames!r} and overlap={overlap!r} must be numbers; pass "
                              "e.g. 77 and 1.",
                              field="segment_frames" if segment_frames is None else "overlap")
    check_segment_frames(segment_frames)
    check_overlap(overlap)
    if 2 * overlap >= segment_frames:
        raise InvalidArgument(f"segment_frames={segment_frames} must be more than twice overlap={overlap} (a segment "
                              "makes more new frames than it takes from the one before); pass longer segments.",
                              field="segment_frames")
    if not (_is_int(frames) and frames > overlap):
        raise InvalidArgument(f"the driving videos have {frames!r} frames; they need more than overlap={overlap} "
                              "(pass longer pose and face videos).", field="pose_video")
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


ANIMATE_FIELDS = ("pose_video", "face_video", "background_video", "mask_video", "mode", "segment_frames", "overlap",
                  "motion_batch_size")


def check_mode(value) -> str | None:
    """None (animate) or one of :data:`MODES`."""
    if value is None or (isinstance(value, str) and value in MODES):
        return value
    raise InvalidArgument(f"mode={value!r} must be 'animate' (the character image moves as the pose and face "
                          "videos) or 'replace' (it replaces the character of background_video where mask_video is "
                          "white).", field="mode")


def check_segment_frames(value) -> int | None:
    """None (77) or 4 n + 1, n >= 1."""
    if value is not None and not (_is_int(value) and value > 1 and value % TEMPORAL == 1):
        raise InvalidArgument(f"segment_frames={value!r} must be 4 n + 1 frames, n >= 1 (whole latent frames of the "
                              "Wan VAE), e.g. 77; pass such a number.", field="segment_frames")
    return value


def check_overlap(value) -> int | None:
    """None (1) or one of :data:`OVERLAPS`."""
    if value is not None and (value not in OVERLAPS or not _is_int(value)):
        raise InvalidArgument(f"overlap={value!r} must be 1 or 5 (the frames of a segment that condition the next, "
                              "as Wan2.2-Animate was trained); pass 1 or 5.", field="overlap")
    return value


def check_motion_batch_size(value) -> int | None:
    """None (the DiT's own) or a whole number >= 1."""
    if value is not None and not (_is_int(value) and value >= 1):
        raise InvalidArgument(f"motion_batch_size={value!r} must be a whole number >= 1 (face frames the motion "
                              "encoder reads at once), e.g. 8; or leave it out (the checkpoint's).",
                              field="motion_batch_size")
    return value


def check_animate_fields(r) -> None:
    """The Animate fields of the request ``r`` together (see the module docstring); raises before any file is read."""
    if (r.pose_video is None) != (r.face_video is None):
        given, missing = ("pose_video", "face_video") if r.face_video is None else ("face_video", "pose_video")
        raise InvalidArgument(f"{given} is given without {missing}; Wan2.2-Animate reads both (the body's pose and "
                              f"the face, one frame each per video frame): pass {missing} too.", field=given)
    if r.pose_video is None:
        given = [name for name in ANIMATE_FIELDS if getattr(r, name) is not None]
        if given:
            raise InvalidArgument(f"{', '.join(given)} given without pose_video and face_video; they are "
                                  "Wan2.2-Animate's: pass pose_video= and face_video= (an Animate checkpoint), or "
                                  "leave them out.", field=given[0])
        return
    replace = r.mode == "replace"
    missing = [name for name in ("background_video", "mask_video") if getattr(r, name) is None]
    if replace and missing:
        raise InvalidArgument(f"mode='replace' needs {' and '.join(missing)} (the video whose character is replaced "
                              "and the mask of that character, white where the new one is drawn): pass them, or "
                              "mode='animate'.", field="mode")
    extra = [name for name in ("background_video", "mask_video") if getattr(r, name) is not None]
    if not replace and extra:
        them = "them" if len(extra) > 1 else "it"
        raise InvalidArgument(f"{' and '.join(extra)} given with mode={r.mode or 'animate'!r}; only mode='replace' "
                              f"reads {them}: pass mode='replace', or leave {them} out.", field=extra[0])
    segment = 77 if r.segment_frames is None else r.segment_frames
    overlap = 1 if r.overlap is None else r.overlap
    if 2 * overlap >= segment:
        raise InvalidArgument(f"segment_frames={segment} must be more than twice overlap={overlap} (a segment makes "
                              "more new frames than it takes from the one before); pass longer segments.",
                              field="segment_frames")


def read_animate_videos(r, default_segment: int = 77) -> dict[str, list]:
    """The driving videos of ``r`` read (RGB PIL frames by name); their rules: pose, face (and background, mask)
    of one length, more frames than the overlap; background and mask of one size (``default_segment``: the
    segment's frames when ``r.segment_frames`` is unset)."""
    videos = {name: read_video(getattr(r, name), name) for name in ANIMATE_FIELDS[:4] if getattr(r, name) is not None}
    frames = {name: len(v) for name, v in videos.items()}
    if len(set(frames.values())) > 1:
        counts = ", ".join(f"{name} {n}" for name, n in frames.items())
        differs = next(name for name, n in frames.items() if n != frames["pose_video"])
        raise InvalidArgument(f"the driving videos differ in length ({counts} frames); Wan2.2-Animate reads one frame "
                              "of each per video frame: cut them to one length.", field=differs)
    if "mask_video" in videos and videos["mask_video"][0].size != videos["background_video"][0].size:
        (mw, mh), (bw, bh) = videos["mask_video"][0].size, videos["background_video"][0].size
        raise InvalidArgument(f"mask_video frames are {mw}x{mh} but background_video frames are {bw}x{bh} (width x "
                              "height); give a mask of the background video's size.", field="mask_video")
    _plan(r, frames["pose_video"], default_segment)
    return videos


def _plan(r, frames: int, default_segment: int) -> SegmentPlan:
    """The segments of ``frames`` driving frames for the request ``r`` (its segment_frames, else
    ``default_segment``; its overlap, else 1)."""
    return plan_segments(frames, default_segment if r.segment_frames is None else r.segment_frames,
                         1 if r.overlap is None else r.overlap)


@dataclass(frozen=True)
class AnimateRequest:
    """A checked Animate request: the character ``image`` (RGB PIL), the driving ``videos`` (RGB PIL frames by
    field name), the segment ``plan``, ``mode`` and ``motion_batch_size`` (None: the DiT's own)."""
    image: object
    videos: dict
    plan: SegmentPlan
    mode: str
    motion_batch_size: int | None

    @property
    def digest(self) -> str:
        """The inputs' identity (the automatic file name's): the image's and every driving frame's pixels, the mode
        and the segments."""
        h = hashlib.sha256(repr((self.mode, self.plan.segment_frames, self.plan.overlap)).encode())
        for name, frames in (("image", [self.image]), *sorted(self.videos.items())):
            h.update(name.encode())
            for frame in frames:
                h.update(repr(frame.size).encode() + frame.tobytes())
        return h.hexdigest()[:16]

    def describe(self) -> str:
        p = self.plan
        return (f"Wan2.2-Animate ({self.mode} mode): {p.frames} frames in {len(p.starts)} segment"
                f"{'s' if len(p.starts) > 1 else ''} of {p.segment_frames} overlapping by {p.overlap}")


# a request's fields an Animate checkpoint does not read, and why
NOT_ANIMATE = (("last_image", "a first-last-frame input"), ("video", "video-to-video's input"),
               ("strength", "video-to-video's"), ("mask", "VACE's"), ("reference_images", "VACE's"),
               ("conditioning_scale", "VACE's"), ("parallel_sampling", "CHORDS'"))


def check_animate_request(checkpoint, r) -> AnimateRequest | None:
    """Rule: Animate fields run on a checkpoint whose DiT is Wan2.2-Animate's, and such a checkpoint needs them
    with the character ``image``; the videos are read and checked here, before any compute. ``num_frames`` unset
    or the driving videos' length (the video has one frame per driving frame); the segment's frames default to
    the preset's ``num_frames``."""
    animate = bool(checkpoint.transformer_config.animate)
    if r.pose_video is None:
        if animate:
            raise InvalidArgument(f"this is a Wan2.2-Animate checkpoint ({checkpoint.variant}): it animates the "
                                  "character image= with the pose_video= and face_video= driving videos; pass all "
                                  "three.", field="pose_video")
        return None
    if not animate:
        raise InvalidArgument(f"pose_video= and face_video= given, but this checkpoint ({checkpoint.variant}) is not "
                              "a Wan2.2-Animate checkpoint; they are inputs of Wan2.2-Animate (model_index.json "
                              "\"_class_name\": \"WanAnimatePipeline\", e.g. Wan-AI/Wan2.2-Animate-14B-Diffusers): "
                              "use such a checkpoint, or leave them out.", field="pose_video")
    for name, what in NOT_ANIMATE:
        if getattr(r, name, None) is not None:
            raise InvalidArgument(f"{name}= is {what}; a Wan2.2-Animate checkpoint reads image=, pose_video=, "
                                  f"face_video= (and in replace mode background_video=, mask_video=): leave {name} "
                                  "out.", field=name)
    if r.image is None:
        raise InvalidArgument("pose_video= and face_video= given without image=; Wan2.2-Animate animates a "
                              "character image: pass image= (a path, PIL image or uint8 array).", field="image")
    default_segment = checkpoint.preset.num_frames
    videos = read_animate_videos(r, default_segment)
    frames = len(videos["pose_video"])
    if r.num_frames is not None and r.num_frames != frames:
        raise InvalidArgument(f"num_frames={r.num_frames!r}, but the driving videos have {frames} frames; "
                              "Wan2.2-Animate makes one frame per driving frame: leave num_frames unset, or cut "
                              "the driving videos.", field="num_frames")
    plan = _plan(r, frames, default_segment)  # its rules were checked as the videos were read
    return AnimateRequest(read_image(r.image, "image"), videos, plan, r.mode or "animate", r.motion_batch_size)


def _tensor(images, grey: bool = False) -> torch.Tensor:
    """PIL images -> [C, T, H, W] float32: RGB in [-1, 1], or grey (one channel) in [0, 1]."""
    arrays = np.stack([np.asarray(i.convert("L" if grey else "RGB"), dtype=np.float32) / 255.0 for i in images])
    pixels = torch.from_numpy(arrays[..., None] if grey else arrays).permute(3, 0, 1, 2)
    return pixels if grey else pixels * 2 - 1


def reference_pixels(image, height: int, width: int) -> torch.Tensor:
    """The character image [1, 3, height, width] in [-1, 1]: scaled (Lanczos: diffusers' pipeline asks its
    WanAnimateImageProcessor for bilinear, but the processor's config keeps Lanczos) to fit inside the frame with its
    aspect kept (whole pixels, rounded down), centred on black."""
    image = image.convert("RGB")
    if image.width * height > width * image.height:  # wider than the frame: its width fills it
        size = (width, image.height * width // image.width)
    else:
        size = (image.width * height // image.height, height)
    canvas = Image.new("RGB", (width, height), color=0)
    canvas.paste(image.resize(size, resample=Image.LANCZOS), (width // 2 - size[0] // 2, height // 2 - size[1] // 2))
    return _tensor([canvas])[:, 0][None]


def driving_pixels(frames, height: int, width: int) -> torch.Tensor:
    """Video frames [1, 3, T, height, width] in [-1, 1], each resized (Lanczos) to the size."""
    return _tensor([f.convert("RGB").resize((width, height), resample=Image.LANCZOS) for f in frames])[None]


def mask_pixels(frames, height: int, width: int) -> torch.Tensor:
    """Mask frames [1, 1, T, height, width] in [0, 1] (white: the character redrawn), each resized (Lanczos) to
    the size, then made grey."""
    return _tensor([f.convert("RGB").resize((width, height), resample=Image.LANCZOS) for f in frames], grey=True)[None]


def latent_mask(mask: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """``mask`` [B, 1, T, H, W] -> 1 - mask at the latent ``height`` x ``width`` (nearest), every frame kept: the
    pixels of the conditioning mask in replacement mode (1 where the background is given)."""
    b, _, t = mask.shape[:3]
    flat = (1 - mask).transpose(1, 2).flatten(0, 1)
    return F.interpolate(flat, size=(height, width), mode="nearest").unflatten(0, (b, t)).transpose(1, 2)


@torch.no_grad()
def reference_latents(vae, image: torch.Tensor) -> torch.Tensor:
    """The character image [1, 3, H, W] in [-1, 1] (:func:`reference_pixels`) -> [1, 4 + z, 1, h, w]: the mask of
    a given frame and the image's normalised latents (the distribution's mode)."""
    latents = normalized_latents(vae, image.unsqueeze(2))
    mask = conditioning_mask(1, 1, *latents.shape[-2:], given=1, device=latents.device)
    return torch.cat([mask, latents], dim=1)


@torch.no_grad()
def segment_latents(vae, plan: SegmentPlan, start: int, size: tuple[int, int], previous: torch.Tensor | None = None,
                    background: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The conditioning latents [1, 4 + z, (segment_frames - 1) / 4 + 1, h, w] of the segment from driving frame
    ``start``, ``size`` (H, W) pixels: the segment's ``background`` ([1, 3, segment_frames, H, W], replacement mode;
    None: zeros) with its first ``plan.overlap`` frames replaced by ``previous`` (the last frames made, None for the
    first segment), encoded and normalised, behind its mask: the overlap frames given after the first segment, and
    in replacement mode the pixels where ``mask`` ([1, 1, segment_frames, H, W], 1: the character) is 0."""
    video = (torch.zeros(1, 3, plan.segment_frames, *size) if background is None else background).clone()
    if previous is not None:
        video[:, :, :plan.overlap] = previous.to(video)
    latents = normalized_latents(vae, video)
    h, w = latents.shape[-2:]
    pixels = None if mask is None else latent_mask(mask, h, w)
    given = plan.overlap if start > 0 else 0
    cond = conditioning_mask(1, latents.shape[2], h, w, given=given, pixels=pixels, device=latents.device)
    return torch.cat([cond, latents], dim=1)
