"""The Wan VAE decoder's RMSNorm + SiLU pairs as one pass each, swapped into diffusers' ``AutoencoderKLWan``.

diffusers' ``WanRMS_norm`` followed by SiLU runs as about eight elementwise kernels in bf16 (an fp32 copy, the
norm, a division, a cast, three products/sums, SiLU), ~40 bytes of memory traffic per element, and the decoder's
full-resolution activations hold ~3e9 elements at 480p x 81 frames. :func:`fuse_decoder_norms` replaces each
(``WanRMS_norm``, ``SiLU``) pair of the decoder's residual blocks and head with :class:`RMSNormSiLU`, which reads x
once and writes once (the op ``fastwan::rms_silu`` of :mod:`fastwan.kernels.vae`, its formula and roundings there).

:class:`RMSNormSiLU` also takes the bias of the convolution before the norm (``pre_bias``; the residual blocks
swapped by :mod:`fastwan.vae.convs` pass their ``conv1``'s): the same bits as the separate bias add, one pass over
the activation fewer.
"""
from __future__ import annotations

import torch
from torch import nn

import fastwan.kernels.vae  # noqa: F401  (registers torch.ops.fastwan.rms_silu)


class RMSNormSiLU(nn.Module):
    """A diffusers ``WanRMS_norm`` (channels first) and the SiLU after it, in one pass; shares its parameters."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.gamma = norm.gamma
        self.bias = norm.bias if isinstance(norm.bias, torch.Tensor) else None

    def forward(self, x: torch.Tensor, pre_bias: torch.Tensor | None = None) -> torch.Tensor:
        """``pre_bias``: the bias of the conv that produced x, not yet added (see
        :func:`fastwan.kernels.vae.rms_silu`)."""
        return torch.ops.fastwan.rms_silu(x, self.gamma, self.bias, pre_bias)


def _fusable(norm: nn.Module, act: nn.Module) -> bool:
    bias = getattr(norm, "bias", None)
    return (type(norm).__name__ == "WanRMS_norm" and getattr(norm, "channel_first", False) and type(act) is nn.SiLU
            and isinstance(getattr(norm, "gamma", None), torch.Tensor)
            and abs(getattr(norm, "scale", 0.0) - norm.gamma.shape[0] ** 0.5) < 1e-6
            and (isinstance(bias, torch.Tensor) or bias == 0.0))


def fuse_decoder_norms(vae: nn.Module) -> int:
    """Swap every (``WanRMS_norm``, ``SiLU``) pair of ``vae.decoder`` -- the two of each ``WanResidualBlock`` and
    the head's -- for :class:`RMSNormSiLU`; their SiLU becomes ``nn.Identity``. A block whose structure is not
    the expected one (another diffusers release) is left alone. Returns the number of norms swapped."""
    decoder = getattr(vae, "decoder", None)
    if decoder is None:
        return 0
    swapped = 0
    for mod in decoder.modules():
        act = getattr(mod, "nonlinearity", None)
        if type(mod).__name__ in ("WanResidualBlock", "FastWanResidualBlock"):  # (fast_decoder_convs's)
            if all(_fusable(getattr(mod, n, None), act) for n in ("norm1", "norm2")):
                mod.norm1, mod.norm2 = RMSNormSiLU(mod.norm1), RMSNormSiLU(mod.norm2)
                mod.nonlinearity = nn.Identity()
                swapped += 2
    if _fusable(getattr(decoder, "norm_out", None), getattr(decoder, "nonlinearity", None)):
        decoder.norm_out = RMSNormSiLU(decoder.norm_out)
        decoder.nonlinearity = nn.Identity()
        swapped += 1
    return swapped
