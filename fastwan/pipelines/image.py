"""The image side of image-to-video: reading the user's image, the default video size for it, and what the DiT
is conditioned on, with the numerics of diffusers' ``WanImageToVideoPipeline``.

* :func:`read_image`: a PIL image, an ``np.uint8`` array (H x W x 3, H x W x 4, H x W x 1 or H x W) or a local file
  path (``str`` or ``os.PathLike``, ``~`` expanded; URLs are not fetched) -> RGB PIL image; anything else raises
  naming the value. Files and PIL images are turned upright by their EXIF orientation (what diffusers'
  ``load_image`` does: a phone photo reads as it is shown). Images of more than 8 bits per sample become 8-bit by
  fixed rules, never by clipping: 16-bit greyscale (modes ``I;16``, ``I;16L``, ``I;16B``, ``I;16N``, and ``I``,
  which must hold 16-bit values 0..65535, not only 0..255: those are ambiguous) keep the high byte (``value >> 8``,
  what Pillow itself does with 16-bit colour PNGs, so grey and colour files of one picture read alike); float images
  (mode ``F``) must hold values in [0, 1] and become ``round(value * 255)``. Values outside those ranges, and an
  image too large for Pillow to open (its decompression-bomb limit), raise :class:`InvalidArgument` naming the
  image.
* :func:`default_size`: the image's aspect ratio at a preset's pixel area, each side rounded down to the multiple
  the model needs (VAE factor x patch size), as the Wan and diffusers examples compute it.
* :func:`condition_latents`: the first frame (and for first-last-frame, the last one) as a video with zeros
  between them, VAE-encoded (the distribution's mode), normalised by the VAE's ``latents_mean``/``latents_std``,
  behind a 4-channel mask of the frames given: [1, 4 + z_dim, F_lat, H_lat, W_lat].
* :func:`clip_tokens`: the CLIP vision encoder's penultimate hidden states for one or two images
  ([n_images, N, D]), as the image tokens of Wan2.1 I2V / FLF2V.
"""
from __future__ import annotations

import hashlib
import io
import math
import numbers
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fastwan.errors import InvalidArgument, InvalidArgumentType
from fastwan.fields import checked
from fastwan.values import python_number
from fastwan.vae.decode import vae_scale_factors


SIXTEEN_BIT_MODES = frozenset({"I;16", "I;16L", "I;16B", "I;16N"})  # Pillow's 16-bit greyscale modes
MAX_STREAM_BYTES = 256 * 2**20  # a piped image file's size limit
INT_MODE_MAX = 65535  # an "I" (32-bit integer) image is read as 16-bit data: values 0..65535


def read_image(image: Any, name: str = "image", field: str | None = None):
    """``image`` (PIL image, np.uint8 array H x W [x 1, 3 or 4], or a file path) -> RGB ``PIL.Image.Image``;
    ``name``: the image as messages name it, ``field``: the request field a refusal is about (None: ``name``)."""
    return checked(name if field is None else field, lambda value: _read_image(value, name), image)


def _read_image(image: Any, name: str):
    from PIL import Image

    label = name
    if isinstance(image, (str, os.PathLike)):
        label = f"{name}={os.fspath(image)!r}"
        image = _open_file(image, label)
    elif isinstance(image, np.ndarray):
        if image.ndim == 3 and image.shape[2] == 1:
            image = image[..., 0]  # H x W x 1: greyscale, as H x W
        if image.dtype != np.uint8 or image.ndim not in (2, 3) or (image.ndim == 3 and image.shape[2] not in (3, 4)):
            raise InvalidArgument(f"{name}: an array must be np.uint8 of shape H x W x 3 (or x 4, x 1, or H x W), "
                                  f"got {image.dtype} {image.shape}; {_array_fix(image)}")
        image = Image.fromarray(image)
    elif isinstance(image, Image.Image):
        image = _upright(image, label)
    else:
        hint = (" For a C x H x W tensor in [0, 1]: (t.permute(1, 2, 0) * 255).round().byte().cpu().numpy()."
                if isinstance(image, torch.Tensor) else "")
        raise InvalidArgumentType(f"{name}={type(image).__name__}: give a PIL image, an np.uint8 H x W x 3 array or "
                                  f"an image file path.{hint}")
    if min(image.size) < 1:
        raise InvalidArgument(f"{label} is {image.size[0]} x {image.size[1]} pixels; it must not be empty.")
    return _to_rgb(image, label)


def _open_file(path, label: str):
    """A local image file -> an upright PIL image (its pixels loaded); unreadable files raise naming the file."""
    from PIL import Image

    text = os.fsdecode(path)
    if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*://", text):
        raise InvalidArgument(f"{label} is a URL; fastwan reads local files only: download the image and pass its "
                              "path (or a PIL image, e.g. diffusers.utils.load_image(url)).")
    if not text:
        raise InvalidArgument(f"{label} is an empty path; give the path of a PNG/JPEG/WebP image.")
    path = Path(text).expanduser()
    try:
        if path.is_dir():
            raise InvalidArgument(f"{label} is a folder, not a readable image; give the path of a PNG/JPEG/WebP "
                                  "file.")
        with Image.open(path if path.is_file() else _read_stream(path, label)) as img:
            img.load()
            return _exif_upright(img, label)
    except FileNotFoundError:
        raise InvalidArgument(f"{label}: no such file; give the path of a PNG/JPEG/WebP image.") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise InvalidArgument(f"{label} is too large to read: {_bomb_size(exc)}, Pillow's guard against "
                              "decompression bombs; resize it (a video frame needs about 1 megapixel, e.g. "
                              "1280 x 720) and pass the smaller file.") from None
    except OSError as exc:  # UnidentifiedImageError is an OSError; a stream's names its buffer: the path instead
        detail = f"cannot identify image file {str(path)!r}" if isinstance(exc, Image.UnidentifiedImageError) else exc
        raise InvalidArgument(f"{label} is not a readable image ({detail}); give a PNG/JPEG/WebP file.") from None


def _read_stream(path: Path, label: str) -> io.BytesIO:
    """A path that is not a regular file (a pipe such as bash's ``<(curl ...)``, a device) read into memory, as
    Pillow seeks in what it opens; at most :data:`MAX_STREAM_BYTES`, so an endless device fails instead of filling
    memory."""
    with open(path, "rb") as f:
        data = f.read(MAX_STREAM_BYTES + 1)
    if len(data) > MAX_STREAM_BYTES:
        raise InvalidArgument(f"{label} is a stream of more than {MAX_STREAM_BYTES // 2**20} MiB, too large for an "
                              "image; give the path of a PNG/JPEG/WebP file.")
    return io.BytesIO(data)


def _upright(image, label: str):
    """A PIL image's pixels loaded (a lazily opened file's decoded now) and turned by its EXIF orientation, as a new
    image; pixels that cannot be decoded (a truncated or closed file) raise naming the image."""
    try:
        image.load()
    except (OSError, ValueError, AssertionError, AttributeError) as exc:  # Pillow asserts that the file is open
        raise InvalidArgument(f"{label}: the pixels of this PIL image cannot be read ({str(exc) or 'file closed'}); "
                              "pass the file path, or a PIL image whose pixels are loaded (img.load() or "
                              "img.copy() before its file is closed).") from None
    return _exif_upright(image, label)


def _exif_upright(image, label: str):
    """The image turned by its EXIF orientation (a new image); EXIF metadata that Pillow cannot parse raises naming
    the image (Pillow raises SyntaxError, ValueError, struct.error and others for a corrupt EXIF block)."""
    from PIL import ImageOps

    try:
        return ImageOps.exif_transpose(image)
    except Exception as exc:  # noqa: BLE001 -- any parse failure of the metadata is the same user error
        raise InvalidArgument(f"{label}: its EXIF metadata cannot be read ({type(exc).__name__}: {exc}), so its "
                              "orientation is unknown; save the image again without EXIF metadata, or pass its "
                              "pixels as an np.uint8 H x W x 3 array in the orientation you want.") from None


def _to_rgb(image, label: str):
    """A PIL image of any mode -> RGB, with the 16-bit and float rules of the module docstring."""
    from PIL import Image

    mode = image.mode
    if mode in SIXTEEN_BIT_MODES or mode == "I":
        values = np.asarray(image)
        lo, hi = int(values.min()), int(values.max())
        if lo < 0 or hi > INT_MODE_MAX:
            raise InvalidArgument(f"{label}: a mode {mode!r} image is read as 16-bit greyscale (values 0..65535), "
                                  f"but it holds values {lo}..{hi}; convert it to an 8-bit 'L' or 'RGB' image "
                                  "first.")
        if mode == "I" and hi <= 255:  # 8-bit values in a 32-bit mode (Image.convert("I")): black as 16-bit data
            raise InvalidArgument(f"{label}: a mode 'I' (32-bit integer) image holding only values {lo}..{hi} is "
                                  "ambiguous: as 16-bit data (the rule for mode 'I') it would be black; convert it "
                                  "to 'L' if it holds 8-bit values (img.convert('L')), or to 'I;16' if 16-bit.")
        image = Image.fromarray((values.astype(np.uint32) >> 8).astype(np.uint8))
    elif mode == "F":
        values = np.asarray(image, dtype=np.float64)
        if not np.isfinite(values).all():
            raise InvalidArgument(f"{label}: a float (mode 'F') image must hold finite values in [0, 1], but it "
                                  "holds NaN or infinity; replace them, or convert it to an 8-bit 'L' or 'RGB' "
                                  "image first.")
        lo, hi = float(values.min()), float(values.max())
        if lo < 0 or hi > 1:
            raise InvalidArgument(f"{label}: a float (mode 'F') image must hold values in [0, 1] (scaled by 255), "
                                  f"but it holds {lo:g}..{hi:g}; rescale it to [0, 1], or convert it to an 8-bit "
                                  "'L' or 'RGB' image first.")
        image = Image.fromarray(np.round(values * 255).astype(np.uint8))
    try:
        return image.convert("RGB")
    except ValueError as exc:
        raise InvalidArgument(f"{label}: Pillow cannot convert a mode {mode!r} image to RGB ({exc}); convert it "
                              "to an 8-bit 'RGB' image first.") from None


def _array_fix(array: np.ndarray) -> str:
    """The conversion to suggest for a refused array (the rules of the module docstring)."""
    if array.dtype == np.uint8:
        if array.ndim == 3 and array.shape[0] in (1, 3, 4):
            return "a C x H x W array becomes H x W x C with x.transpose(1, 2, 0)."
        if array.ndim == 4 and array.shape[0] == 1:
            return "give one image, e.g. x[0]."
        return "give one image of that shape."
    if array.dtype == np.bool_:
        return "convert it (a mask: x.astype(np.uint8) * 255)."
    if array.dtype == np.uint16:
        return "convert it (16-bit data keeps its high byte: (x >> 8).astype(np.uint8))."
    if np.issubdtype(array.dtype, np.floating):
        return "convert it (values in [0, 1]: (x * 255).round().astype(np.uint8))."
    return "convert it (e.g. values in [0, 255]: x.astype(np.uint8))."


def _bomb_size(exc: Exception) -> str:
    """The pixel count and limit in Pillow's decompression-bomb message (the message itself if it has none)."""
    found = re.search(r"\((\d+) pixels\) exceeds limit of (\d+) pixels", str(exc))
    if found is None:
        return str(exc)
    return f"{int(found[1]):,} pixels, over the limit of {int(found[2]):,}"


def default_size(image, area: int, multiple: int, height=None, width=None, max_side: int | None = None
                 ) -> tuple[int, int]:
    """(height, width) with the image's aspect ratio, each rounded down to ``multiple`` (at least one multiple):
    neither given -> about ``area`` pixels; one given (a positive int) -> the other from it; both given -> as given.
    A given side that is not a positive int is returned as is, for the size checks to name; NumPy / torch scalars
    count as the Python numbers they hold (:func:`~fastwan.values.python_number`). A side it derives
    longer than ``max_side`` pixels (the DiT's RoPE range) raises, naming the image's aspect ratio."""
    height, width = python_number(height), python_number(width)
    aspect = image.height / image.width

    def side(x: float) -> int:
        out = max(multiple, round(x) // multiple * multiple)
        if max_side is not None and out > max_side:
            raise InvalidArgument(f"the image is {image.width} x {image.height} pixels: its aspect ratio gives a "
                                  f"video side of {out} pixels, more than this model's {max_side}; pass height= and "
                                  "width= (the image is resized to them), or crop the image.", field="image")
        return out

    def usable(x) -> bool:
        return isinstance(x, numbers.Integral) and not isinstance(x, bool) and x > 0

    if height is None and width is None:
        return side(math.sqrt(area * aspect)), side(math.sqrt(area / aspect))
    if width is None and usable(height):
        return height, side(height / aspect)
    if height is None and usable(width):
        return side(width * aspect), width
    return height, width


def pixels(image, height: int, width: int, spatial_factor: int) -> torch.Tensor:
    """The image resized to height x width and scaled to [-1, 1] (diffusers' ``VideoProcessor``) -> fp32
    [1, 3, height, width]."""
    from diffusers.video_processor import VideoProcessor

    return VideoProcessor(vae_scale_factor=spatial_factor).preprocess(image, height=height, width=width).float()


@torch.no_grad()
def normalized_latents(vae, video: torch.Tensor) -> torch.Tensor:
    """video [1, 3, T, H, W] in [-1, 1] -> its VAE latents (the distribution's mode), normalised by the VAE's
    ``latents_mean`` / ``latents_std``, fp32."""
    param = next(vae.parameters())
    latents = vae.encode(video.to(param.device, param.dtype)).latent_dist.mode().float()
    mean = torch.tensor(vae.config.latents_mean, device=latents.device).view(1, -1, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std, device=latents.device).view(1, -1, 1, 1, 1)
    return (latents - mean) * inv_std


@torch.no_grad()
def condition_latents(vae, first: torch.Tensor, last: torch.Tensor | None, num_frames: int) -> torch.Tensor:
    """first (and last) [1, 3, H, W] in [-1, 1] -> [1, 4 + z_dim, F_lat, H/s, W/s] fp32: the mask of the given
    frames (each latent frame's 4 video frames as 4 channels; the first latent frame stands for the first video
    frame only, repeated) and the normalised latents of the condition video."""
    zeros = first.new_zeros(1, 3, num_frames - (1 if last is None else 2), *first.shape[-2:])
    video = torch.cat([first.unsqueeze(2), zeros] + ([] if last is None else [last.unsqueeze(2)]), dim=2)
    latents = normalized_latents(vae, video)
    tf = vae_scale_factors(vae)[0]
    given = torch.zeros(num_frames, device=latents.device)
    given[0] = 1
    if last is not None:
        given[-1] = 1
    given = torch.cat([given[:1].repeat(tf), given[1:]])  # the first frame fills the first latent frame's slots
    mask = given.view(-1, tf).T.reshape(1, tf, -1, 1, 1).expand(1, tf, latents.shape[2], *latents.shape[-2:])
    return torch.cat([mask, latents], dim=1)


@torch.no_grad()
def clip_tokens(image_encoder, image_processor, images: list) -> torch.Tensor:
    """The CLIP vision encoder's penultimate hidden states for ``images`` -> [len(images), N, D] in the encoder's
    dtype (Wan2.1 I2V: N = 257, D = 1280)."""
    param = next(image_encoder.parameters())
    batch = image_processor(images=images, return_tensors="pt")
    out = image_encoder(pixel_values=batch["pixel_values"].to(param.device, param.dtype), output_hidden_states=True)
    return out.hidden_states[-2]


@dataclass(frozen=True)
class ImageRequest:
    """The images of one image-to-video call, read and checked: ``first`` (and ``last``), and a digest of their
    pixels (part of the automatic file name)."""
    first: Any
    last: Any | None
    digest: str
    first_frame_only: bool = False  # Wan2.2-TI2V: the first frame's latents replace the first latent frame


def check_frames(req: ImageRequest | None, num_frames) -> None:
    """A first-last-frame request needs a video longer than one frame (the last frame is not the first); an int
    ``num_frames`` of 1 raises (other values are the size checks' to judge)."""
    if req is not None and req.last is not None and num_frames == 1 and not isinstance(num_frames, bool):
        raise InvalidArgument("num_frames=1 leaves no frame for last_image=: a first-last-frame video needs "
                              "num_frames >= 5 (4k + 1, e.g. 81), or drop last_image=.", field="num_frames")


def check_image_request(checkpoint, image, last_image) -> ImageRequest | None:
    """The rules of a checkpoint's task, before any compute: image-to-video checkpoints need ``image``; text-only
    ones (a DMD-distilled ``WanDMDPipeline`` too, TI2V-5B's layout included) take none; ``last_image``
    (first-last-frame) needs a checkpoint made for it (Wan2.1 FLF2V, which needs it, or Wan2.2 I2V-A14B)."""
    variant = checkpoint.variant
    if image is None:
        if checkpoint.needs_image:
            raise InvalidArgument(f"this checkpoint ({variant}) makes a video from an image: pass image= (a PIL "
                                  "image, an np.uint8 H x W x 3 array or a file path; CLI --image PATH).",
                                  field="image")
        if last_image is not None:
            raise InvalidArgument("last_image is given without image; the first frame comes first (image=).",
                                  field="last_image")
        return None
    if checkpoint.distilled and not checkpoint.needs_image:
        raise InvalidArgument(
            f"image= was given, but this checkpoint ({variant}) is DMD-distilled text-to-video (model_index.json "
            "\"WanDMDPipeline\", FastWan): FastVideo's WanDMDPipeline has no image stage, and FastWan2.2-TI2V-5B was "
            "distilled on text-to-video only (its video does not follow an image). Drop image=, or use "
            "Wan-AI/Wan2.2-TI2V-5B-Diffusers for image-to-video.", field="image")
    if not (checkpoint.needs_image or checkpoint.expand_timesteps):
        raise InvalidArgument(f"image= was given, but this checkpoint ({variant}) is text-to-video; use an "
                              "image-to-video checkpoint (Wan2.1-I2V, Wan2.1-FLF2V, Wan2.2-I2V-A14B, "
                              "Wan2.2-TI2V-5B) or drop image=.", field="image")
    if last_image is not None and checkpoint.expand_timesteps:
        raise InvalidArgument("last_image= is not taken by Wan2.2-TI2V-5B: its image mode fixes the first frame "
                              "only. Drop last_image=.", field="last_image")
    if last_image is None and variant == "wan2.1-flf2v":
        raise InvalidArgument("this first-last-frame checkpoint (Wan2.1-FLF2V) needs last_image= as well "
                              "(CLI --last-image PATH).", field="last_image")
    if last_image is not None and variant == "wan2.1-i2v":
        raise InvalidArgument("last_image= needs a first-last-frame checkpoint (Wan2.1-FLF2V or Wan2.2-I2V-A14B); "
                              "Wan2.1-I2V conditions on the first frame only.", field="last_image")
    first = read_image(image, "image")
    last = None if last_image is None else read_image(last_image, "last_image")
    h = hashlib.sha256()
    for img in (first, last):
        if img is not None:
            h.update(repr(img.size).encode())
            h.update(img.tobytes())
    return ImageRequest(first, last, h.hexdigest()[:16], bool(checkpoint.expand_timesteps))


@torch.no_grad()
def encode_request(req: ImageRequest, height: int, width: int, num_frames: int, vae, image_encoder,
                   image_processor, device, dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(condition [1, 4 + z_dim, F_lat, H_lat, W_lat] fp32 on ``device`` -- for a first-frame model
    (Wan2.2-TI2V, ``expand_timesteps``) the first frame's latents [1, z_dim, 1, H_lat, W_lat] --, CLIP tokens
    [n, N, D] in ``dtype`` or None when the checkpoint has no CLIP encoder)."""
    spatial = vae_scale_factors(vae)[1]
    first = pixels(req.first, height, width, spatial).to(device)
    if req.first_frame_only:
        return normalized_latents(vae, first.unsqueeze(2)).to(device), None
    last = None if req.last is None else pixels(req.last, height, width, spatial).to(device)
    cond = condition_latents(vae, first, last, num_frames).to(device)
    tokens = None
    if image_encoder is not None:
        images = [req.first] if req.last is None else [req.first, req.last]
        tokens = clip_tokens(image_encoder, image_processor, images).to(device, dtype)
    return cond, tokens
