"""The image side of image-to-video: reading the user's image, the default video size for it, and what the DiT
is conditioned on, with the numerics of diffusers' ``WanImageToVideoPipeline``.

* :func:`read_image`: a PIL image, an ``np.uint8`` array (H x W x 3, H x W x 4 or H x W) or a file path -> RGB
  PIL image; anything else raises naming the value.
* :func:`default_size`: the image's aspect ratio at a preset's pixel area, each side rounded down to the multiple
  the model needs (VAE factor x patch size), as the Wan and diffusers examples compute it.
* :func:`condition_latents`: the first frame (and for first-last-frame, the last one) as a video with zeros
  between them, VAE-encoded (the distribution's mode), normalised by the VAE's ``latents_mean``/``latents_std``,
  behind a 4-channel mask of the frames given: [1, 4 + z_dim, F_lat, H_lat, W_lat].
* :func:`clip_tokens`: the CLIP vision encoder's penultimate hidden states for one or two images
  ([n_images, N, D]), as the image tokens of Wan2.1 I2V / FLF2V.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fastwan.errors import InvalidArgument, InvalidArgumentType
from fastwan.vae.decode import vae_scale_factors


def read_image(image: Any, name: str = "image"):
    """``image`` (PIL image, np.uint8 array H x W [x 3 or 4], or a file path) -> RGB ``PIL.Image.Image``."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, (str, Path)):
        path = Path(image).expanduser()
        try:
            with Image.open(path) as img:
                img.load()
                image = img.copy()
        except FileNotFoundError:
            raise InvalidArgument(f"{name}={str(image)!r}: no such file; give the path of a PNG/JPEG/WebP image.") \
                from None
        except (UnidentifiedImageError, OSError) as exc:
            raise InvalidArgument(f"{name}={str(image)!r} is not a readable image ({exc}); give a PNG/JPEG/WebP "
                                  "file.") from None
    elif isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim not in (2, 3) or (image.ndim == 3 and image.shape[2] not in (3, 4)):
            raise InvalidArgument(f"{name}: an array must be np.uint8 of shape H x W x 3 (or x 4, or H x W), got "
                                  f"{image.dtype} {image.shape}; convert it (e.g. (x * 255).round().astype(np.uint8)).")
        image = Image.fromarray(image)
    elif not isinstance(image, Image.Image):
        raise InvalidArgumentType(f"{name}={type(image).__name__}: give a PIL image, an np.uint8 H x W x 3 array or "
                                  "an image file path.")
    if min(image.size) < 1:
        raise InvalidArgument(f"{name} is {image.size[0]} x {image.size[1]} pixels; it must not be empty.")
    return image.convert("RGB")


def default_size(image, area: int, multiple: int) -> tuple[int, int]:
    """(height, width) with the image's aspect ratio and about ``area`` pixels, each rounded down to ``multiple``
    (at least one multiple)."""
    aspect = image.height / image.width
    height = max(multiple, round(math.sqrt(area * aspect)) // multiple * multiple)
    width = max(multiple, round(math.sqrt(area / aspect)) // multiple * multiple)
    return height, width


def pixels(image, height: int, width: int, spatial_factor: int) -> torch.Tensor:
    """The image resized to height x width and scaled to [-1, 1] (diffusers' ``VideoProcessor``) -> fp32
    [1, 3, height, width]."""
    from diffusers.video_processor import VideoProcessor

    return VideoProcessor(vae_scale_factor=spatial_factor).preprocess(image, height=height, width=width).float()


@torch.no_grad()
def condition_latents(vae, first: torch.Tensor, last: torch.Tensor | None, num_frames: int) -> torch.Tensor:
    """first (and last) [1, 3, H, W] in [-1, 1] -> [1, 4 + z_dim, F_lat, H/s, W/s] fp32: the mask of the given
    frames (each latent frame's 4 video frames as 4 channels; the first latent frame stands for the first video
    frame only, repeated) and the normalised latents of the condition video."""
    zeros = first.new_zeros(1, 3, num_frames - (1 if last is None else 2), *first.shape[-2:])
    video = torch.cat([first.unsqueeze(2), zeros] + ([] if last is None else [last.unsqueeze(2)]), dim=2)
    param = next(vae.parameters())
    latents = vae.encode(video.to(param.device, param.dtype)).latent_dist.mode().float()
    cfg = vae.config
    mean = torch.tensor(cfg.latents_mean, device=latents.device).view(1, -1, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(cfg.latents_std, device=latents.device).view(1, -1, 1, 1, 1)
    latents = (latents - mean) * inv_std
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
