"""``AutoencoderKLWan`` decode with several latent frames per decoder call.

diffusers' ``_decode`` runs the decoder once per latent frame: the first call turns latent frame 0 into one video
frame, every later call turns one latent frame into four, and each causal convolution carries the last two frames
of its input from one call to the next (the feature cache). At 480p a call then convolves 4-6 frames at the low
resolutions (384 channels at 60x104), too little work to fill an H100, and the decode is 21 sequential trips
through ~100 modules.

:func:`decode_latents` keeps the first call (latent frame 0 alone: the temporal upsamplers leave that frame
undoubled, which is what the cache's first call encodes) and then feeds ``chunk`` latent frames per call. Every
operation in the decoder is either per frame (norms, spatial convolutions, the mid-block attention, spatial
upsampling) or a causal convolution over time whose input is the cached last two frames followed by the chunk, so
the output is the same function of the latents for any chunk size: the same values, up to the summation order the
convolution kernels pick for the larger batch. The temporal upsampler's special second call (zeros instead of a
cached frame) also covers a chunk of several frames: each frame sees the zero-padded window of a frame-by-frame decode.

It also collects the chunks' outputs and concatenates them once (diffusers concatenates the growing output with
each new chunk: quadratic in the frame count), and shows a progress bar over the decoder calls ("decoding").
:func:`iter_decode_latents` and :func:`iter_decode_frames` yield each call's frames as soon as they exist (a
stream's consumer takes them chunk by chunk).

:func:`vae_tiling_kwargs` checks the ``vae_tiling`` option against the VAE's config before anything is loaded.
"""
from __future__ import annotations

import mmap
import numbers
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from fastwan.errors import InvalidArgument, InvalidArgumentType

# decode_latents(chunk="auto"): latent frames per call such that a call's output holds at most this many
# pixel-frames (frames x height x width). Two latent frames at 480x832 = 8 output frames (3.2M).
AUTO_CHUNK_PIXEL_FRAMES = 8 * 480 * 832


def auto_chunk(vae, height: int, width: int, batch: int = 1) -> int:
    """Latent frames per decoder call after the first for ``batch`` videos of ``height`` x ``width`` pixels:
    the most whose output fits ``AUTO_CHUNK_PIXEL_FRAMES``, at least 1."""
    return auto_chunk_frames(height, width, vae.config.scale_factor_temporal or 4, batch)


def auto_chunk_frames(height: int, width: int, temporal: int, batch: int = 1) -> int:
    """:func:`auto_chunk` for a VAE of ``temporal`` frames per latent frame."""
    return max(1, AUTO_CHUNK_PIXEL_FRAMES // (batch * temporal * height * width))


def check_chunk(chunk) -> None:
    """``chunk`` must be "auto" or an int >= 1 (raised before any work)."""
    if chunk == "auto":
        return
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise InvalidArgument(f"vae_chunk_frames={chunk!r} must be 'auto' or an int >= 1 (latent frames per VAE "
                              "decoder call after the first; 1 is diffusers' frame-by-frame decode).")


@torch.no_grad()
def decode_latents(vae, z: torch.Tensor, chunk: int | str = "auto", bars: bool = True) -> torch.Tensor:
    """Decode with ``chunk`` latent frames per decoder call after the first.

    vae: diffusers ``AutoencoderKLWan`` (any of its decoders; fastwan's module swaps optional).
    z: [B, z_dim, F, h, w] latents, already de-normalised (what ``vae.decode`` takes).
    Returns [B, 3, T, H, W] in [-1, 1], what ``vae.decode(z, return_dict=False)[0]`` returns. With spatial tiling
    enabled and a latent larger than a tile, this is ``vae.decode`` itself (its tiled path, one call, no progress
    bar); otherwise a progress bar ("decoding", cleared when done; none when ``bars`` is False) counts the decoder
    calls.
    """
    outs = list(iter_decode_latents(vae, z, chunk, bars))
    return outs[0] if len(outs) == 1 else torch.cat(outs, 2)


@torch.no_grad()
def iter_decode_latents(vae, z: torch.Tensor, chunk: int | str = "auto", bars: bool = True):
    """:func:`decode_latents` one decoder call at a time: yields [B, 3, t, H, W] in [-1, 1], the frames of each call
    as soon as it returns (1 frame, then ``chunk`` x the temporal factor, the last call fewer); their concatenation
    over time is :func:`decode_latents`'s video. Under spatial tiling (a latent larger than a tile) the one tiled
    ``vae.decode`` yields the whole video. The decoder's feature cache lives until the last chunk or until the
    caller closes the generator."""
    from tqdm.auto import tqdm

    check_chunk(chunk)
    if z.dim() != 5:
        raise ValueError(f"latents of shape {tuple(z.shape)} must be [B, C, F, h, w].")
    batch, _, num_frames, h, w = z.shape
    if tiles_latent(vae, h, w):
        yield vae.decode(z, return_dict=False)[0]
        return
    if chunk == "auto":
        chunk = auto_chunk(vae, h * vae.spatial_compression_ratio, w * vae.spatial_compression_ratio, batch)
    vae.clear_cache()
    try:
        x = vae.post_quant_conv(z)
        calls = decoder_calls(0, num_frames, chunk)
        for start, stop in tqdm(calls, desc="decoding", unit="call", leave=False, disable=not bars):
            yield decoder_call(vae, x[:, :, start:stop], vae._feat_map, first=start == 0)
    finally:
        vae.clear_cache()


def tiles_latent(vae, h: int, w: int) -> bool:
    """Whether ``vae`` decodes an ``h`` x ``w`` latent by diffusers' spatial tiling: tiling on and the latent larger
    than a tile on either axis (each tile then has its own feature cache inside one ``vae.decode``)."""
    if not getattr(vae, "use_tiling", False):
        return False
    s = vae.spatial_compression_ratio
    return w > vae.tile_sample_min_width // s or h > vae.tile_sample_min_height // s


def decoder_calls(start: int, stop: int, chunk: int) -> list[tuple[int, int]]:
    """The (start, stop) latent frames of each decoder call over frames [start, stop) of a video: latent frame 0
    alone (the first call, whose temporal upsamplers leave it undoubled), then at most ``chunk`` frames a call."""
    out = [(0, 1)] if start == 0 else []
    first = max(start, 1)
    return out + [(i, min(i + chunk, stop)) for i in range(first, stop, chunk)]


def decoder_call(vae, x: torch.Tensor, cache: list, first: bool) -> torch.Tensor:
    """One call of ``vae``'s decoder on post-quant latents ``x`` [B, C, f, h, w] with the feature cache ``cache``
    (one slot per causal convolution, updated in place; ``first``: latent frame 0 alone, the cache empty) ->
    [B, 3, t, H, W] in [-1, 1]."""
    out = vae.decoder(x, feat_cache=cache, feat_idx=[0], first_chunk=first)
    patch = vae.config.patch_size
    if patch is not None:
        from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

        out = unpatchify(out, patch_size=patch)
    return torch.clamp(out, min=-1.0, max=1.0)


def decode_frames(vae, latents: torch.Tensor, chunk: int | str = "auto", bars: bool = True) -> np.ndarray:
    """Normalised latents [1, C, F, h, w] (what the denoiser makes) -> uint8 video frames [T, H, W, 3] (``bars``:
    :func:`decode_latents`'s progress bar)."""
    return uint8_frames(decode_pixels(vae, latents, chunk, bars))


def decode_pixels(vae, latents: torch.Tensor, chunk: int | str = "auto", bars: bool = True) -> torch.Tensor:
    """Normalised latents [1, C, F, h, w] -> the video [1, 3, T, H, W] in [-1, 1] (:func:`decode_frames` before its
    rounding to uint8: :func:`uint8_frames`)."""
    return decode_latents(vae, _denormalised(vae, latents), chunk, bars)


def uint8_frames(video: torch.Tensor) -> np.ndarray:
    """A decoded video [1, 3, T, H, W] in [-1, 1] -> uint8 frames [T, H, W, 3] (diffusers' postprocess, x 255
    rounded), in host memory (:func:`host_frames`)."""
    return host_frames(uint8_tensor(video))


def host_frames(frames: torch.Tensor) -> np.ndarray:
    """uint8 frames [T, H, W, 3] -> a C-contiguous numpy array in host memory. From a GPU the work that makes them
    is queued first: the host touches the new array's pages (its page faults) while the GPU runs, and the copy then
    only moves bytes (a fresh array's faults during the copy cost more than the copy itself)."""
    if frames.device.type == "cpu":
        return np.ascontiguousarray(frames.numpy())
    frames = frames.contiguous()
    out = np.empty(frames.shape, np.uint8)
    out.reshape(-1)[::mmap.PAGESIZE] = 0
    torch.from_numpy(out).copy_(frames)
    return out


def iter_decode_frames(vae, latents: torch.Tensor, chunk: int | str = "auto", bars: bool = True):
    """:func:`decode_frames` as the frames are made: yields uint8 [t, H, W, 3] per decoder call
    (:func:`iter_decode_latents`); their concatenation is :func:`decode_frames`'s video."""
    for video in iter_decode_latents(vae, _denormalised(vae, latents), chunk, bars):
        yield uint8_frames(video)


def latent_stats(vae, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``vae``'s latent (mean, std) [1, C, 1, 1, 1] in its dtype on ``device`` (made from the config's lists: on
    CUDA a copy that waits for the current stream; a caller that decodes often makes them once)."""
    c = vae.config
    mean = torch.tensor(c.latents_mean, device=device, dtype=vae.dtype).view(1, -1, 1, 1, 1)
    std = torch.tensor(c.latents_std, device=device, dtype=vae.dtype).view(1, -1, 1, 1, 1)
    return mean, std


def _denormalised(vae, latents: torch.Tensor, stats: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """WanPipeline's ``latents / (1 / std) + mean``, the reciprocal taken in the VAE's dtype (``stats``:
    :func:`latent_stats` made earlier, else made here)."""
    z = latents.to(vae.dtype)
    mean, std = latent_stats(vae, z.device) if stats is None else stats
    return z / (1.0 / std) + mean


def uint8_tensor(video: torch.Tensor) -> torch.Tensor:
    """:func:`uint8_frames` left on the video's device: uint8 [T, H, W, 3] (a permuted view)."""
    video = (video[0] / 2 + 0.5).clamp(0, 1).float()
    return (video * 255).round().to(torch.uint8).permute(1, 2, 3, 0)


# AutoencoderKLWan's default: which of its three downsampling stages also halve time
TEMPORAL_DOWNSAMPLE_DEFAULT = (False, True, True)


def scale_factors(config: Mapping) -> tuple[int, int]:
    """(temporal, spatial) latent compression of a Wan VAE, from its config (the loaded model's or config.json)."""
    stages = config.get("temperal_downsample") or TEMPORAL_DOWNSAMPLE_DEFAULT
    t = config.get("scale_factor_temporal") or 2 ** sum(stages)
    s = config.get("scale_factor_spatial") or 2 ** len(stages)
    return int(t), int(s)


def vae_scale_factors(vae) -> tuple[int, int]:
    """(temporal, spatial) latent compression of a loaded ``vae``."""
    return scale_factors(vae.config)


VAE_TILING_KEYS = ("tile_sample_min_height", "tile_sample_min_width", "tile_sample_stride_height",
                   "tile_sample_stride_width")
VAE_TILING_DEFAULTS = (256, 192)  # AutoencoderKLWan's tile_sample_min_* and tile_sample_stride_* (pixels)


def tiling_state(vae) -> dict | None:
    """The spatial tiling ``vae`` decodes with (its four tile sizes, pixels; a memory plan may have turned it on),
    None when untiled: tiles change the decoded values, so this is part of what determines a video."""
    if not getattr(vae, "use_tiling", False):
        return None
    return {key: int(getattr(vae, key)) for key in VAE_TILING_KEYS}


def vae_tiling_kwargs(value, vae_folder: Path) -> dict | None:
    """vae_tiling (False / True / dict of tile sizes) -> enable_tiling kwargs, or None for no tiling. Checked
    against the VAE's config.json before anything is loaded."""
    if isinstance(value, bool):
        return {} if value else None
    if not isinstance(value, Mapping):
        raise InvalidArgumentType(
            f"vae_tiling={value!r} must be True, False or a dict with keys among {VAE_TILING_KEYS}."
        )
    unknown = sorted(set(value) - set(VAE_TILING_KEYS), key=repr)  # keys of any type
    if unknown:
        raise InvalidArgument(f"vae_tiling has unknown keys {unknown}; allowed: {list(VAE_TILING_KEYS)} (pixels).")
    from fastwan.checkpoint.safetensors import read_json

    factor = scale_factors(read_json(vae_folder / "config.json", missing="the VAE component needs it."))[1]
    out = {}
    for key, v in value.items():
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v <= 0 or v % factor:
            raise InvalidArgument(f"vae_tiling[{key!r}]={v!r} must be a positive multiple of the VAE's spatial "
                                  f"factor {factor} (pixels), e.g. {factor * 32}.")
        out[key] = int(v)
    for axis in ("height", "width"):  # a size not given keeps diffusers' default (tile 256, stride 192 pixels)
        tile = out.get(f"tile_sample_min_{axis}", VAE_TILING_DEFAULTS[0])
        stride = out.get(f"tile_sample_stride_{axis}", VAE_TILING_DEFAULTS[1])
        if stride > tile:
            raise InvalidArgument(f"vae_tiling: tile_sample_stride_{axis}={stride} exceeds "
                                  f"tile_sample_min_{axis}={tile}; tiles must overlap or touch (stride <= tile).")
    return out
