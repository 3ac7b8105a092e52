"""The video side of video-to-video: reading the user's video, the steps it is denoised through, and the latents
the denoising starts from, with the numerics of diffusers' ``WanVideoToVideoPipeline``.

* :func:`read_video`: a local video file (``str`` / ``os.PathLike``; read frame by frame with imageio's ffmpeg
  plugin, as diffusers' ``load_video`` reads one; a ``.gif`` with Pillow), a sequence of images (each read as
  :func:`fastwan.pipelines.image.read_image` reads an image: PIL, ``np.uint8`` array or path), or an ``np.uint8``
  array [T, H, W, 3] (or x 4, x 1, or [T, H, W]) -> RGB PIL frames; at most :data:`MAX_VIDEO_FRAMES`.
* :func:`steps_run`: ``strength`` of ``num_inference_steps`` -> how many of the last steps run: diffusers'
  ``min(int(n * strength), n)``; at least one, else the request is refused.
* :func:`check_video_request`: the rules before compute: a text-to-video checkpoint (no image conditioning, no
  per-token timesteps), no ``image`` beside ``video``, ``strength`` only with ``video``, ``num_frames`` (when
  given) the video's frame count; :func:`check_steps`: at least one step runs, and no step cache (its step indices
  count the whole schedule).
* :func:`start_latents`: the frames resized to the video's size and scaled to [-1, 1] (diffusers'
  ``VideoProcessor.preprocess_video``), VAE-encoded (the distribution's mode), normalised by ``latents_mean`` /
  ``latents_std``: the clean latents that the first step's noise level mixes with the noise.
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fastwan.errors import InvalidArgument, InvalidArgumentType
from fastwan.pipelines.image import normalized_latents, read_image
from fastwan.values import python_number

MAX_VIDEO_FRAMES = 2049  # far past any checkpoint's frame limit: a longer input is a mistake
DEFAULT_STRENGTH = 0.8  # diffusers' WanVideoToVideoPipeline default


@dataclass(frozen=True)
class VideoRequest:
    """A checked video-to-video input: ``frames`` (RGB PIL images), ``strength`` and a ``digest`` of the pixels
    (the automatic file name's identity)."""

    frames: tuple
    strength: float
    digest: str


def read_video(video: Any, name: str = "video") -> list:
    """``video`` (a file path, a sequence of images, or an np.uint8 array [T, H, W(, C)]) -> RGB PIL frames."""
    if isinstance(video, (str, os.PathLike)):
        frames = _read_file(Path(os.fspath(video)).expanduser(), f"{name}={os.fspath(video)!r}", name)
    elif isinstance(video, (np.ndarray, Sequence)) and not isinstance(video, (str, bytes)):
        if isinstance(video, np.ndarray) and (video.dtype != np.uint8 or video.ndim not in (3, 4)):
            raise InvalidArgument(f"{name}: an array must be np.uint8 of shape T x H x W x 3 (or x 4, x 1, or "
                                  f"T x H x W), got {video.dtype} {video.shape}.", field=name)
        frames = [read_image(frame, f"{name}[{i}]", name) for i, frame in enumerate(video[:MAX_VIDEO_FRAMES + 1])]
    else:
        raise InvalidArgumentType(f"{name}={video!r} must be a video file path, a list of images, or an np.uint8 "
                                  "array T x H x W x 3.", field=name)
    if not frames:
        raise InvalidArgument(f"{name} has no frames; give a video of 4k+1 frames (e.g. 81).", field=name)
    if len(frames) > MAX_VIDEO_FRAMES:
        raise InvalidArgument(f"{name} has more than {MAX_VIDEO_FRAMES} frames; cut it to the frames to be "
                              "regenerated (4k+1 of them, e.g. 81).", field=name)
    sizes = {f.size for f in frames}
    if len(sizes) > 1:
        raise InvalidArgument(f"{name}: its frames differ in size ({sorted(sizes)[:3]}...); give frames of one size.",
                              field=name)
    return frames


def _read_file(path: Path, label: str, field: str) -> list:
    from PIL import Image

    if not path.is_file():
        raise InvalidArgument(f"{label}: no such file; give the path of a video file (e.g. .mp4).",
                              field=field)
    if path.suffix.lower() == ".gif":
        try:
            with Image.open(path) as gif:
                frames = []
                for k in range(min(getattr(gif, "n_frames", 1), MAX_VIDEO_FRAMES + 1)):
                    gif.seek(k)
                    frames.append(gif.convert("RGB"))
                return frames
        except OSError as exc:
            raise InvalidArgument(f"{label}: not a readable GIF ({exc}).", field=field) from None
    import imageio.v3 as iio

    frames = []
    try:
        for frame in iio.imiter(path):
            frames.append(Image.fromarray(np.asarray(frame)).convert("RGB"))
            if len(frames) > MAX_VIDEO_FRAMES:
                break
    except Exception as exc:  # noqa: BLE001 -- any decoder failure is the file's
        raise InvalidArgument(f"{label}: not a readable video ({type(exc).__name__}: {exc}); give an .mp4 (or "
                              "any file ffmpeg reads), a .gif, or the frames themselves.", field=field) from None
    return frames


def check_strength(value) -> float | None:
    """None, or a number in (0, 1]."""
    if value is None:
        return None
    value = python_number(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgumentType(f"strength={value!r} must be a number in (0, 1] (e.g. {DEFAULT_STRENGTH}).",
                                  field="strength")
    if not 0 < value <= 1:
        raise InvalidArgument(f"strength={value!r} must be in (0, 1]: 1 regenerates from pure noise, smaller keeps "
                              f"more of the video (e.g. {DEFAULT_STRENGTH}).", field="strength")
    return float(value)


def steps_run(num_inference_steps: int, strength: float) -> int:
    """How many of the schedule's last steps a video-to-video request runs (diffusers' rule)."""
    return min(int(num_inference_steps * strength), num_inference_steps)


def check_video_request(checkpoint, video, strength, image, num_frames) -> VideoRequest | None:
    """The video-to-video rules of a request, before any compute (see the module docstring)."""
    if video is None:
        if strength is not None:
            raise InvalidArgument(f"strength={strength} is given without video=; strength says how much of an input "
                                  "video is regenerated: pass video= too, or leave the strength out.", field="strength")
        return None
    if checkpoint.needs_image or checkpoint.expand_timesteps:
        raise InvalidArgument(f"video= (video-to-video) needs a text-to-video checkpoint; this one "
                              f"({checkpoint.variant}) conditions on an image or on per-token timesteps. Use a Wan2.1 "
                              "or Wan2.2 A14B text-to-video checkpoint, or leave the video out.", field="video")
    if image is not None:
        raise InvalidArgument("video= and image= are both given; video-to-video starts from the whole video, "
                              "image-to-video from one frame: give one.", field="video")
    frames = read_video(video)
    if num_frames is not None and num_frames != len(frames):
        raise InvalidArgument(f"num_frames={num_frames} differs from the video's {len(frames)} frames; "
                              "video-to-video makes as many frames as it is given: leave num_frames out.",
                              field="num_frames")
    digest = hashlib.sha256()
    for frame in frames:
        digest.update(repr(frame.size).encode())
        digest.update(frame.tobytes())
    return VideoRequest(tuple(frames), DEFAULT_STRENGTH if strength is None else strength, digest.hexdigest()[:16])


def check_steps(video: VideoRequest, num_inference_steps: int, cache) -> int:
    """The steps the request runs (:func:`steps_run`); none is refused, and so is a step cache (``cache``: the one
    in force, the request's or the generator's default)."""
    if cache is not None:
        raise InvalidArgument(f"the step cache {cache.name} does not run with video= yet: a step cache counts the "
                              "whole schedule, video-to-video runs its last steps only; pass cache='none' (CLI "
                              "--cache none).", field="cache")
    run = steps_run(num_inference_steps, video.strength)
    if run < 1:
        raise InvalidArgument(f"strength={video.strength:g} of {num_inference_steps} steps runs no step "
                              f"(int({num_inference_steps} x {video.strength:g}) = 0); raise strength to at least "
                              f"{1 / num_inference_steps:.3g} or the step count.", field="strength")
    return run


@torch.no_grad()
def start_latents(vae, video: VideoRequest, height: int, width: int, spatial_factor: int) -> torch.Tensor:
    """The video's clean latents [1, z_dim, F_lat, height/s, width/s] fp32 (see the module docstring)."""
    from diffusers.video_processor import VideoProcessor

    pixels = VideoProcessor(vae_scale_factor=spatial_factor).preprocess_video(list(video.frames), height=height,
                                                                            width=width)
    return normalized_latents(vae, pixels.float())
