"""VACE (Wan2.1-VACE, Wan2.2-VACE-Fun-A14B): a video made under the control of a source video, a mask and reference
images, with the semantics of diffusers' ``WanVACEPipeline``.

* :func:`check_vace_request`: the rules before any compute. On a VACE checkpoint (its DiT a
  ``WanVACETransformer3DModel``): ``video`` is the control / source video, ``mask`` (needs ``video``) marks per pixel
  what is generated (white, above half) and what is kept (black); both read as :func:`~fastwan.pipelines.video.
  read_video` reads a video, of one length and one frame size; ``reference_images`` (paths, PIL images or arrays)
  are each fitted onto a white canvas of the video's size and become latent frames before the video's;
  ``conditioning_scale`` scales every hint (a number) or each VACE layer's (a list). ``strength`` (video-to-video)
  and ``image`` are refused there; ``mask``, ``reference_images`` and ``conditioning_scale`` are refused on any
  other checkpoint. The video's frame count and size are the video's (``num_frames``, ``height``, ``width``, when
  given, must agree; unset, they are taken from it).
* :func:`control_latents`: the VACE context the control blocks read, [1, 2 z + 64, n_ref + F_lat, H/8, W/8]: the
  VAE latents of the video's kept part (video x (1 - mask)) and of its generated part (video x mask), the mask
  (binarised at 0.5 for that split) folded 8 x 8 into 64 channels and resampled to the latent frames (its grey
  values kept, as diffusers keeps them), and in front one latent frame per reference image (its latents, zeros for
  the generated part and the mask). With no video the video is all zeros (grey), with no mask all of it generated.
* :func:`vace_run`: the denoising of a VACE request: the noise has a latent frame more per reference image, each
  expert runs with the control (:func:`fastwan.models.wan.vace.vace_control`), and those frames are dropped before
  decoding.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from dataclasses import dataclass

import os

import torch

from fastwan.errors import InvalidArgument
from fastwan.models.wan.vace import control_scales, vace_control
from fastwan.pipelines.image import normalized_latents, read_image
from fastwan.pipelines.video import read_video

MASK_FOLD = 8  # the mask's pixels per latent pixel along each side, stacked as channels (8 x 8 = 64)


@dataclass(frozen=True)
class VaceRequest:
    """A checked VACE input: ``video`` and ``mask`` frames (RGB PIL, or None), ``references`` (RGB PIL images),
    ``scales`` (one per VACE layer) and a ``digest`` of it all (the automatic file name's identity)."""

    video: tuple | None
    mask: tuple | None
    references: tuple
    scales: tuple[float, ...]
    digest: str

    @property
    def frames(self) -> int | None:
        return None if self.video is None else len(self.video)

    @property
    def size(self) -> tuple[int, int] | None:
        """(height, width) of the video, or None."""
        return None if self.video is None else (self.video[0].size[1], self.video[0].size[0])


def _label(value) -> str:
    """A value as a message names it: a path or number as written, a list by its items, else its type."""
    if isinstance(value, (str, os.PathLike, int, float)):
        return repr(os.fspath(value) if isinstance(value, os.PathLike) else value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_label(v) for v in value[:4]) + (", ...]" if len(value) > 4 else "]")
    return f"<{type(value).__name__}>"


def _refuse_elsewhere(checkpoint, mask, reference_images, conditioning_scale) -> None:
    values = {"mask": mask, "reference_images": reference_images, "conditioning_scale": conditioning_scale}
    given = [name for name, value in values.items() if value is not None]
    if given:
        listed = ", ".join(f"{name}={_label(values[name])}" for name in given)
        raise InvalidArgument(
            f"{listed} given, but this checkpoint ({checkpoint.variant}) is not a VACE checkpoint; they are "
            "inputs of VACE (model_index.json \"_class_name\": \"WanVACEPipeline\", e.g. "
            "Wan-AI/Wan2.1-VACE-1.3B-diffusers): use a VACE checkpoint, or leave them out.", field=given[0])


def check_vace_request(checkpoint, r, multiple: int) -> VaceRequest | None:
    """The VACE rules of the request ``r`` (a GenerationRequest) for ``checkpoint`` (see the module docstring;
    ``multiple``: the pixels per token side, VAE factor x patch) -> the checked input, or None on a checkpoint
    without VACE."""
    if not checkpoint.transformer_config.vace:
        _refuse_elsewhere(checkpoint, r.mask, r.reference_images, r.conditioning_scale)
        return None
    cfg = checkpoint.transformer_config
    if r.strength is not None:
        raise InvalidArgument(f"strength={r.strength} is video-to-video's; on a VACE checkpoint video= is the control "
                              "video and every step runs from noise: leave strength out.", field="strength")
    if r.image is not None or r.last_image is not None:
        raise InvalidArgument("image= / last_image= are image-to-video inputs; a VACE checkpoint takes reference "
                              "images instead: pass reference_images=[...] (CLI --reference-image PATH).",
                              field="image" if r.image is not None else "last_image")
    if r.mask is not None and r.video is None:
        raise InvalidArgument("mask= is given without video=; the mask marks which pixels of the video are "
                              "generated: pass video= too (or leave the mask out: all of it is generated).",
                              field="mask")
    scales = control_scales(1.0 if r.conditioning_scale is None else r.conditioning_scale, len(cfg.vace_layers))
    video = None if r.video is None else tuple(read_video(r.video, "video"))
    mask = None if r.mask is None else tuple(read_video(r.mask, "mask"))
    if mask is not None:
        if len(mask) != len(video):
            raise InvalidArgument(f"mask has {len(mask)} frames but video has {len(video)}; give one mask frame per "
                                  "video frame.", field="mask")
        if mask[0].size != video[0].size:
            raise InvalidArgument(f"mask frames are {mask[0].size[0]}x{mask[0].size[1]} but video frames are "
                                  f"{video[0].size[0]}x{video[0].size[1]} (width x height); give a mask of the "
                                  "video's size.", field="mask")
    refs = r.reference_images or ()
    refs = tuple(read_image(img, f"reference_images[{i}]", "reference_images") for i, img in enumerate(refs))
    if video is not None:
        given = {"num_frames": (r.num_frames, len(video)), "height": (r.height, video[0].size[1]),
                 "width": (r.width, video[0].size[0])}
        for name, (value, own) in given.items():
            if value is not None and value != own:
                raise InvalidArgument(f"{name}={value} differs from the control video's {own}; VACE makes a video "
                                      f"of the control video's frames and size: leave {name} out, or resize / cut "
                                      "the video.", field=name)
        if video[0].size[0] % multiple or video[0].size[1] % multiple:
            raise InvalidArgument(f"the control video is {video[0].size[0]}x{video[0].size[1]} (width x height); both "
                                  f"must be multiples of {multiple} (VAE factor x patch): resize it, e.g. to "
                                  f"{video[0].size[0] // multiple * multiple or multiple}x"
                                  f"{video[0].size[1] // multiple * multiple or multiple}.", field="video")
    digest = hashlib.sha256(repr(scales).encode())
    for frame in (*(video or ()), b"mask", *(mask or ()), b"refs", *refs):
        digest.update(frame if isinstance(frame, bytes) else repr(frame.size).encode() + frame.tobytes())
    return VaceRequest(video, mask, refs, scales, digest.hexdigest()[:16])


def check_vace_grid(vace: VaceRequest, grid: tuple[int, int, int], patch: tuple[int, int, int],
                    max_grid: int) -> None:
    """Rule: the latent frames with the reference images' in front stay within the DiT's RoPE range."""
    frames = grid[0] + len(vace.references) // patch[0]
    if frames > max_grid:
        raise InvalidArgument(f"{len(vace.references)} reference images add {len(vace.references)} latent frames to "
                              f"{grid[0]}: {frames} exceeds this DiT's rope_max_seq_len={max_grid}; give fewer "
                              "reference images or frames.", field="reference_images")


def check_vace_composes(vace: VaceRequest | None, cache, chords) -> None:
    """Rules: a VACE request runs without a step cache and without CHORDS (their hooks and solver do not carry the
    control blocks' hints)."""
    if vace is None:
        return
    if cache is not None:
        raise InvalidArgument(f"the step cache {cache.name} does not run with VACE: its cached residual would skip "
                              "the control hints; pass cache='none' (CLI --cache none).", field="cache")
    if chords is not None:
        raise InvalidArgument("parallel_sampling='chords' (CLI --chords) does not run with VACE yet; leave it out.",
                              field="parallel_sampling")


def check_vace_generator(checkpoint, budget) -> None:
    """Rule of the generator: a VACE checkpoint runs with no memory ``budget`` (the control blocks are neither
    sharded nor streamed). Every process layout runs it (sequence parallelism, Ulysses x Ring, CFG parallelism:
    :mod:`fastwan.models.wan.vace`)."""
    if not checkpoint.transformer_config.vace:
        return
    if budget is not None:
        raise InvalidArgument(f"max_gpu_memory={budget!r}: the memory planner does not place VACE's control blocks "
                              "yet; leave it unset for a VACE checkpoint.")


def _pixels(frames, height: int, width: int, spatial: int) -> torch.Tensor:
    """RGB PIL frames -> [1, 3, T, height, width] fp32 in [-1, 1] (diffusers' VideoProcessor, resized if needed)."""
    from diffusers.video_processor import VideoProcessor

    return VideoProcessor(vae_scale_factor=spatial).preprocess_video(list(frames), height=height,
                                                                     width=width).float()


def _reference_pixels(image, height: int, width: int, spatial: int) -> torch.Tensor:
    """A reference image -> [3, height, width] in [-1, 1]: scaled to fit (bilinear, aspect kept), centred on white."""
    from diffusers.image_processor import VaeImageProcessor

    pixels = VaeImageProcessor(vae_scale_factor=spatial).preprocess(image, None, None).float()
    h, w = pixels.shape[-2:]
    fit = min(height / h, width / w)
    nh, nw = int(h * fit), int(w * fit)
    pixels = torch.nn.functional.interpolate(pixels, size=(nh, nw), mode="bilinear", align_corners=False)[0]
    canvas = torch.ones(3, height, width)
    top, left = (height - nh) // 2, (width - nw) // 2
    canvas[:, top:top + nh, left:left + nw] = pixels
    return canvas


def _mask_channels(mask: torch.Tensor, latent_frames: int, spatial: int) -> torch.Tensor:
    """mask [T, H, W] in [0, 1] -> [spatial^2, latent_frames, H/spatial, W/spatial]: each latent pixel's block of
    pixels as channels, the frames resampled (nearest-exact) to the latent frames."""
    t, h, w = mask.shape
    blocks = mask.view(t, h // spatial, spatial, w // spatial, spatial).permute(2, 4, 0, 1, 3).flatten(0, 1)
    return torch.nn.functional.interpolate(blocks[None], size=(latent_frames, h // spatial, w // spatial),
                                           mode="nearest-exact")[0]


@torch.no_grad()
def control_latents(vae, vace: VaceRequest, s, factors: tuple[int, int]) -> torch.Tensor:
    """The VACE context [1, 2 z + 64, n_ref + F_lat, H/s, W/s] fp32 for the settings ``s`` (see the module
    docstring); ``factors``: the VAE's (temporal, spatial)."""
    vt, vs = factors
    if vs != MASK_FOLD:
        raise InvalidArgument(f"VACE folds the mask {MASK_FOLD} x {MASK_FOLD} into channels, but this VAE's spatial "
                              f"factor is {vs}; VACE runs on Wan2.1's VAE (factor 8).")
    h, w, t = s.height, s.width, s.num_frames
    video = torch.zeros(1, 3, t, h, w) if vace.video is None else _pixels(vace.video, h, w, vs)
    mask = torch.ones_like(video) if vace.mask is None else ((_pixels(vace.mask, h, w, vs) + 1) / 2).clamp(0, 1)
    keep = (mask > 0.5).float()
    latents = torch.cat([normalized_latents(vae, video * (1 - keep)), normalized_latents(vae, video * keep)], dim=1)
    channels = _mask_channels(mask[0, 0], (t + vt - 1) // vt, vs)[None].to(latents.device)
    for image in vace.references:  # each one in front of the frames before it
        ref = normalized_latents(vae, _reference_pixels(image, h, w, vs)[None, :, None])
        latents = torch.cat([torch.cat([ref, torch.zeros_like(ref)], dim=1), latents], dim=2)
    channels = torch.cat([channels.new_zeros(1, channels.shape[1], len(vace.references), *channels.shape[3:]),
                          channels], dim=2)
    return torch.cat([latents, channels], dim=1)


@contextlib.contextmanager
def vace_run(gen, vace: VaceRequest | None, s):
    """Around the denoising of a request: for a VACE one, every expert runs with its control latents and the
    settings' frame count covers the reference images' latent frames -> (settings to denoise with, a function of the
    final latents that drops those frames); otherwise (``s``, the identity)."""
    if vace is None:
        yield s, (lambda latents: latents)
        return
    vt = gen.vae_scale_factors[0]
    control = control_latents(gen.vae, vace, s, gen.vae_scale_factors)
    n = len(vace.references)
    with contextlib.ExitStack() as stack:
        for model in gen.transformers:
            stack.enter_context(vace_control(model, control.to(gen.device, model.dtype), vace.scales))
        yield dataclasses.replace(s, num_frames=s.num_frames + n * vt), (lambda latents: latents[:, :, n:])
