"""The weights of ``vae="tiny"`` (:mod:`fastwan.vae.tiny`): where they come from and what they must be.

Rule: the tiny decoder's weights come from one local file, ``vae_path`` (CLI ``--vae-path FILE``), never from the
network: TAEHV's published files (https://github.com/madebyollin/taehv), ``taew2_1`` for models whose VAE makes
16-channel latents (Wan2.1, Wan2.2 A14B) and ``taew2_2`` for 48-channel ones (Wan2.2 TI2V 5B), as
``safetensors/taew2_*.safetensors`` or as the ``taew2_*.pth`` state dicts. A pickle file (.pth, .pt, .bin, .ckpt,
.pkl) is read only with ``allow_pickle`` (unpickling can run code), and then weights-only (tensors and plain
containers). ``vae_path`` without ``vae="tiny"``, or ``vae="tiny"`` without it, is refused.

Before any compute the file must match the checkpoint: its latent channels (``decoder.1.weight``'s input channels)
the checkpoint VAE's ``z_dim``, and its ``decoder.`` keys exactly the decoder's, each with the decoder's shape,
floating point and finite; ``encoder.`` keys (the published files hold TAEHV's encoder too) are not read. A
mismatch is refused naming the file and the key, with the fix.
"""
from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from fastwan.checkpoint.safetensors import PICKLE_SUFFIXES, check_finite
from fastwan.errors import CheckpointError, InvalidArgument, InvalidArgumentType, MissingFileError
from fastwan.vae.decode import scale_factors
from fastwan.vae.tiny import SPATIAL_UPSAMPLING, TEMPORAL, TinyDecoder

VAE_CHOICES = ("full", "tiny")
SOURCE = "https://github.com/madebyollin/taehv"
VARIANTS = {16: ("taew2_1", 1), 48: ("taew2_2", 2)}  # latent channels -> (published name, pixel-shuffle patch)
WAN_Z_DIM = 16  # AutoencoderKLWan's default z_dim (a config without the key)


def _file_for(channels: int) -> str:
    name = VARIANTS[channels][0]
    return f"{name}.safetensors (or {name}.pth with allow_pickle=True) from {SOURCE}"


def check_tiny_options(vae: str, vae_path, allow_pickle: bool) -> Path | None:
    """The rule of ``vae`` with ``vae_path`` (module docstring) -> the weight file's path (``~`` expanded) or None;
    the file must exist and, when it is named as a pickle, ``allow_pickle`` be set."""
    if vae_path is None:
        if vae == "tiny":
            raise InvalidArgument(f"vae='tiny' needs the tiny decoder's weight file: vae_path=, taew2_1.safetensors "
                                  "for Wan2.1 / Wan2.2 A14B or taew2_2.safetensors for Wan2.2 TI2V, downloaded from "
                                  f"{SOURCE} (folder safetensors/); fastwan does not download it.")
        return None
    if not isinstance(vae_path, (str, os.PathLike)):
        raise InvalidArgumentType(f"vae_path={vae_path!r} must be a path to the tiny decoder's weight file.")
    if vae != "tiny":
        raise InvalidArgument(f"vae_path={os.fspath(vae_path)!r} is the tiny decoder's weight file, read only with "
                              "vae='tiny'; pass vae='tiny' too, or leave vae_path= unset.")
    path = Path(vae_path).expanduser()
    if not str(vae_path).strip() or path.is_dir():
        raise InvalidArgument(f"vae_path={os.fspath(vae_path)!r} is not a file; give the tiny decoder's weight file "
                              f"itself, e.g. {_file_for(16)}.")
    if not path.is_file():
        raise MissingFileError(f"vae_path={os.fspath(vae_path)!r} does not exist; check the path (the tiny decoder's "
                               f"weights: {_file_for(16)} or {_file_for(48)}).")
    if path.suffix.lower() in PICKLE_SUFFIXES and not allow_pickle:
        raise InvalidArgument(f"vae_path={os.fspath(vae_path)!r} is a PyTorch pickle file ({path.suffix}); use the "
                              f"published .safetensors file ({SOURCE}, folder safetensors/), or allow pickles for a "
                              "file you trust: allow_pickle=True (CLI --allow-pickle; fastwan reads tensors only).")
    return path


def _read(path: Path, allow_pickle: bool) -> tuple[dict[str, torch.Tensor], str]:
    """The tensors of the weight file ``path`` and the sha256 of its bytes."""
    from safetensors import SafetensorError
    from safetensors.torch import load as load_safetensors

    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if path.suffix.lower() in PICKLE_SUFFIXES:
        if not allow_pickle:
            raise InvalidArgument(f"vae_path={str(path)!r} is a PyTorch pickle file; pass allow_pickle=True for a "
                                  "file you trust, or use the .safetensors file.")
        try:
            tensors = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises several types for a file that is not a weights-only pickle
            raise CheckpointError(f"vae_path={str(path)!r} cannot be read as a weights-only PyTorch state dict "
                                  f"({type(exc).__name__}: {str(exc)[:120]}); use another copy, or the "
                                  f".safetensors file from {SOURCE}.") from None
    else:
        try:
            tensors = load_safetensors(data)
        except SafetensorError as exc:
            raise CheckpointError(f"vae_path={str(path)!r} is not a valid safetensors file ({exc}); it is truncated "
                                  "or corrupt (download it again), or another format under this name.") from None
    if not (isinstance(tensors, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in tensors.items())):
        raise CheckpointError(f"vae_path={str(path)!r} holds a {type(tensors).__name__}, not a state dict of key -> "
                              f"tensor; use the published file from {SOURCE}.")
    return tensors, digest


def _model_channels(vae_config: Mapping, model: str) -> int:
    """The latent channels of the checkpoint's VAE, when the tiny decoder can decode them."""
    channels = int(vae_config.get("z_dim") or WAN_Z_DIM)
    factors = scale_factors(vae_config)
    if channels not in VARIANTS or factors != (TEMPORAL, SPATIAL_UPSAMPLING * VARIANTS[channels][1]):
        raise InvalidArgument(f"vae='tiny' decodes the latents of Wan2.1's VAE (16 channels, 4x time, 8x space) "
                              f"and Wan2.2 TI2V's (48 channels, 4x time, 16x space); {model}'s VAE makes "
                              f"{channels}-channel latents at {factors[0]}x time, {factors[1]}x space: use vae='full'.")
    return channels


def read_tiny(vae_path: str | os.PathLike, vae_config: Mapping, allow_pickle: bool = False,
              model: str = "the model") -> TinyWeights:
    """The tiny decoder's weights from ``vae_path``, checked against the checkpoint's VAE (``vae_config``: its
    config.json; ``model`` names the checkpoint in messages). Raises before any compute when the file does not fit
    (module docstring)."""
    channels = _model_channels(vae_config, model)
    path = Path(vae_path).expanduser()
    tensors, digest = _read(path, allow_pickle)
    where = f"vae_path={str(path)!r}"
    first = tensors.get("decoder.1.weight")
    if first is None:
        raise CheckpointError(f"{where} lacks key 'decoder.1.weight' (the tiny decoder's first conv); it is not a "
                              f"TAEHV decoder file: use {_file_for(channels)}.")
    if first.dim() != 4:
        raise CheckpointError(f"{where}: key 'decoder.1.weight' has shape {tuple(first.shape)}, not a 3x3 conv's "
                              f"[256, {channels}, 3, 3]; use {_file_for(channels)}.")
    if first.shape[1] != channels:
        have = VARIANTS.get(first.shape[1], (f"a {first.shape[1]}-channel decoder",))[0]
        raise CheckpointError(f"{where} is {have} (key 'decoder.1.weight' takes {first.shape[1]} latent channels), "
                              f"but {model}'s VAE makes {channels}-channel latents; use {_file_for(channels)}.")
    patch = VARIANTS[channels][1]
    with torch.device("meta"):
        want = {k: tuple(v.shape) for k, v in TinyDecoder(channels, patch).state_dict().items()}
    decoder = {k: v for k, v in tensors.items() if not k.startswith("encoder.")}
    missing, unexpected = sorted(set(want) - set(decoder)), sorted(set(decoder) - set(want))
    if missing or unexpected:
        what = (f"lacks key {missing[0]!r}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                if missing else f"has the unexpected key {unexpected[0]!r}"
                + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))
        raise CheckpointError(f"{where} {what}: it is not the {VARIANTS[channels][0]} TAEHV decoder (a variant such "
                              f"as a '_super' one has other layers); use {_file_for(channels)}.")
    for key, shape in want.items():
        tensor = decoder[key]
        if tuple(tensor.shape) != shape:
            raise CheckpointError(f"{where}: key {key!r} has shape {tuple(tensor.shape)}, the "
                                  f"{VARIANTS[channels][0]} decoder's is {shape}; use {_file_for(channels)}.")
        if not tensor.is_floating_point():
            raise CheckpointError(f"{where}: key {key!r} is {str(tensor.dtype).removeprefix('torch.')}, not a "
                                  f"floating-point weight; the file is corrupt: use {_file_for(channels)}.")
        check_finite(key, tensor, path)
    return TinyWeights(decoder, patch, digest)


@dataclass(frozen=True)
class TinyWeights:
    """Checked tiny-decoder weights (:func:`read_tiny`): the ``decoder.`` tensors, the pixel-shuffle patch, the
    file's sha256."""

    state: dict
    patch: int
    digest: str

    def load(self, dtype: torch.dtype, device, channels_last: bool | None = None) -> TinyDecoder:
        """The decoder holding these weights, on ``device`` in ``dtype`` (``channels_last``: None, on CUDA)."""
        return TinyDecoder.from_state(self.state, self.patch, dtype=dtype, device=device, digest=self.digest,
                                      channels_last=channels_last)


def read_tiny_for(vae_path, vae_folder: Path, allow_pickle: bool = False, model: str = "the model") -> TinyWeights:
    """:func:`read_tiny` against the VAE config.json in the checkpoint's ``vae_folder``."""
    from fastwan.checkpoint.safetensors import read_json

    config = read_json(Path(vae_folder) / "config.json", missing="the VAE component needs it.")
    return read_tiny(vae_path, config, allow_pickle, model)
