"""Decode a video's latents chunk by chunk as a causal sampler makes them (a stream: frames leave as soon as they
exist, however long the video grows).

:class:`StreamDecoder` takes the denoiser's normalised latents [1, C, f, h, w] one chunk at a time
(:meth:`~StreamDecoder.push`) and returns that chunk's uint8 frames [t, H, W, 3]: t = 1 + 4 (f - 1) for the first
push (latent frame 0 makes one frame) and 4 f after it. Rules:

- The concatenation of its outputs is the whole-video decode of the concatenated latents:
  :func:`fastwan.vae.decode.decode_frames` for diffusers' ``AutoencoderKLWan``, :meth:`TinyDecoder.frames
  <fastwan.vae.tiny.TinyDecoder.frames>` for ``vae="tiny"``; equal in fp32 up to the summation order a convolution
  picks for another frame count (see :mod:`fastwan.vae.decode`). Chunks may have any size >= 1, each its own; a
  push of more than ``chunk`` latent frames runs as several decoder calls, as the whole decode does.
- Both decoders are causal in time: the Wan VAE's causal convolutions keep their last input frames in a feature
  cache, TAEHV's memory blocks their last input frame. The stream keeps that state between pushes, in the
  StreamDecoder itself, never on the VAE: several streams over one VAE, and whole-video decodes between their
  pushes, do not disturb one another (not from several threads at once: one VAE runs one call at a time).
- Spatial tiling (``vae_tiling``) decodes each tile with its own cache inside one ``vae.decode`` call, which a
  stream cannot continue: a latent larger than a tile is refused (at construction when ``height`` and ``width``
  are given, else at the first push), naming the setting and the fix.
- Every chunk has the first chunk's height, width and channel count, batch 1. A push that fails inside the decoder
  leaves the state half-updated: the stream refuses later pushes. :meth:`~StreamDecoder.close` (or leaving the
  ``with`` block) drops the state; a closed stream refuses pushes.
"""
from __future__ import annotations

import numpy as np
import torch

from fastwan.errors import InvalidArgument, InvalidArgumentType
from fastwan.vae import decode, tiny
from fastwan.vae.decode import (_denormalised, auto_chunk, check_chunk, decoder_call, decoder_calls, latent_stats,
                                tiles_latent)
from fastwan.vae.tiny import SPATIAL_UPSAMPLING, TRIMMED, TinyDecoder


class StreamDecoder:
    """Chunk-by-chunk decode of one video's latents (the module's rules).

    vae: diffusers ``AutoencoderKLWan`` (as fastwan loads it or as saved) or a :class:`~fastwan.vae.tiny.TinyDecoder`.
    chunk: latent frames per decoder call, or "auto" (as :func:`~fastwan.vae.decode.decode_frames` picks it).
    height, width: the video's size in pixels, when known: the tiling rule is then checked here, before any work.
    """

    def __init__(self, vae, chunk: int | str = "auto", *, height: int | None = None, width: int | None = None):
        check_chunk(chunk)
        self._vae, self._chunk = vae, chunk
        self._tiny = isinstance(vae, TinyDecoder)
        self._spatial = SPATIAL_UPSAMPLING * vae.patch if self._tiny else vae.spatial_compression_ratio
        self._channels = vae.latent_channels if self._tiny else vae.config.z_dim
        self._shape: tuple[int, int] | None = None  # the latent (h, w) of the first chunk
        self._frames = 0  # latent frames decoded so far
        self._state: dict | list | None = None  # TAEHV's carry / the Wan decoder's feature cache
        self._stats: tuple | None = None  # the Wan VAE's latent (mean, std) on the device, made at the first push
        self._closed = self._broken = False
        if (height is None) != (width is None):
            raise InvalidArgument(f"StreamDecoder(height={height!r}, width={width!r}): give both or neither.")
        if height is not None:
            for name, value in (("height", height), ("width", width)):
                if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value % self._spatial:
                    raise InvalidArgument(f"StreamDecoder({name}={value!r}): must be a positive multiple of the "
                                          f"VAE's spatial factor {self._spatial} (pixels).")
            self._check_tiling(height // self._spatial, width // self._spatial)

    @property
    def frames_decoded(self) -> int:
        """Latent frames pushed and decoded so far."""
        return self._frames

    def push(self, latents: torch.Tensor) -> np.ndarray:
        """The next chunk's normalised latents [1, C, f, h, w] -> its uint8 frames [t, H, W, 3] (t = 1 + 4 (f - 1)
        for the first push, 4 f after)."""
        return self.push_device(latents).cpu().numpy()

    def push_device(self, latents: torch.Tensor) -> torch.Tensor:
        """:meth:`push` with the frames left on the latents' device (uint8 [t, H, W, 3], queued on the current
        CUDA stream). After the first push nothing in it waits for the device: a caller can queue it on a side
        stream and go on."""
        self._check(latents)
        first = self._frames == 0
        self._broken = True  # until the decoder calls return: their state is half-updated if one raises
        video = self._tiny_part(latents, first) if self._tiny else self._wan_part(latents)
        self._broken = False
        self._frames += latents.shape[2]
        return tiny.uint8_tensor(video) if self._tiny else decode.uint8_tensor(video)

    def state_tensors(self) -> list[torch.Tensor]:
        """The tensors the stream keeps between pushes (the causal state, the latent statistics): what the next
        push reads, on whichever CUDA stream it runs."""
        found: list[torch.Tensor] = []

        def walk(value) -> None:
            if isinstance(value, torch.Tensor):
                found.append(value)
            elif isinstance(value, (list, tuple)):
                for v in value:
                    walk(v)
            elif isinstance(value, dict):
                for v in value.values():
                    walk(v)

        walk([self._state, self._stats])
        return found

    def close(self) -> None:
        """Drop the decoder state (idempotent); later pushes are refused."""
        self._closed, self._state, self._stats = True, None, None

    def __enter__(self) -> StreamDecoder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- checks ---------------------------------------------------------------------------------------------------
    def _check(self, latents) -> None:
        if self._closed:
            raise ValueError("StreamDecoder.push on a closed stream; start a new StreamDecoder for a new video.")
        if self._broken:
            raise ValueError("StreamDecoder.push after a push that failed inside the decoder: its state is "
                             "half-updated; start a new StreamDecoder.")
        if not isinstance(latents, torch.Tensor):
            raise InvalidArgumentType(f"StreamDecoder.push takes a torch.Tensor [1, C, f, h, w], not "
                                      f"{type(latents).__name__}.")
        shape = tuple(latents.shape)
        if latents.dim() != 5 or shape[0] != 1 or shape[1] != self._channels or shape[2] < 1:
            raise InvalidArgument(f"StreamDecoder.push: latents of shape {shape} must be [1, {self._channels}, f, h, "
                                  "w] with f >= 1 (one video's next latent frames).")
        if self._shape is None:
            self._check_tiling(*shape[3:])
            self._shape = shape[3:]
        elif shape[3:] != self._shape:
            raise InvalidArgument(f"StreamDecoder.push: a chunk of latent size {shape[3:]} after chunks of "
                                  f"{self._shape}; every chunk of a video has the same height and width.")

    def _check_tiling(self, h: int, w: int) -> None:
        vae = self._vae
        if not self._tiny and tiles_latent(vae, h, w):
            s = self._spatial
            raise InvalidArgument(
                f"a streamed decode of {h * s}x{w * s} pixels cannot use vae_tiling: tiles of "
                f"{vae.tile_sample_min_height}x{vae.tile_sample_min_width} pixels each decode with their own "
                "feature cache in one call, which a stream cannot continue chunk by chunk. Load with "
                "vae_tiling=False (CLI: no --vae-tiling), tiles of at least the video's size, or vae='tiny'.")

    # ---- decoders -------------------------------------------------------------------------------------------------
    def _wan_part(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self._vae
        h, w = self._shape
        chunk = self._chunk
        if chunk == "auto":
            chunk = auto_chunk(vae, h * self._spatial, w * self._spatial)
        if self._state is None:
            self._state = [None] * vae._cached_conv_counts["decoder"]
        if self._stats is None:
            self._stats = latent_stats(vae, latents.device)
        start = self._frames
        with torch.no_grad():
            x = _denormalised(vae, latents, self._stats)
            x = vae.post_quant_conv(x)  # a 1x1x1 convolution: per frame, no cache
            outs = [decoder_call(vae, x[:, :, a - start:b - start], self._state, first=a == 0)
                    for a, b in decoder_calls(start, start + latents.shape[2], chunk)]
        return outs[0] if len(outs) == 1 else torch.cat(outs, 2)

    def _tiny_part(self, latents: torch.Tensor, first: bool) -> torch.Tensor:
        if self._state is None:
            self._state = {}
        video = self._vae.decode_part(latents, self._chunk, self._state)
        return video[:, :, TRIMMED:] if first else video

