"""The Wan VAE decoder's RMSNorm + SiLU as one pass (Triton on CUDA), swapped into diffusers' ``AutoencoderKLWan``.

diffusers' ``WanRMS_norm`` followed by SiLU runs as about eight elementwise kernels in bf16 (an fp32 copy,
the norm, a division, a cast, three products/sums, SiLU), ~40 bytes of memory traffic per element; the
decoder's full-resolution activations hold ~3e9 elements at 480p x 81 frames, so these passes are a large
part of the decode. :func:`fuse_decoder_norms` replaces each (``WanRMS_norm``, ``SiLU``) pair of the decoder's
residual blocks and head with :class:`RMSNormSiLU`, which reads x once and writes once:

    y = silu(x / max(||x||_2 over channels, 1e-12) * sqrt(C) * gamma + bias)

computed in fp32 and rounded once to x's dtype (diffusers rounds after the norm, each product and the SiLU,
so bf16 results differ by a few units in the last place; in fp32 they agree to rounding). Off CUDA, or for
a tensor that is neither channels-first nor channels-last dense, the same formula runs in PyTorch.

The op also takes the bias of the convolution before the norm (``pre_bias``; the residual blocks swapped by
:mod:`fastwan.vae.convs` pass their ``conv1``'s): x is then first replaced by ``x + pre_bias`` rounded to
x's dtype, exactly what the separate bias add (``add_channel_bias_``) would have written and the norm read back --
the same bits, one pass over the activation fewer.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from fastwan.kernels import triton_importable

EPS = 1e-12  # F.normalize's default, as WanRMS_norm uses it
MAX_C = 4096


def rms_silu_reference(x: torch.Tensor, gamma: torch.Tensor, bias: torch.Tensor | None,
                       pre_bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, C, *spatial] -> silu(normalize(x, dim=1) * sqrt(C) * gamma + bias), fp32 math, x's dtype; with
    ``pre_bias``, of ``(x + pre_bias).to(x.dtype)`` (a conv bias added as ``x.add_(pre_bias)`` would: fp32 sum,
    one rounding)."""
    c = x.shape[1]
    shape = (1, c) + (1,) * (x.dim() - 2)
    if pre_bias is not None:
        x = torch.add(x, pre_bias.reshape(shape)).to(x.dtype)
    y = F.normalize(x.float(), dim=1, eps=EPS) * (c ** 0.5 * gamma.float().reshape(shape))
    if bias is not None:
        y = y + bias.float().reshape(shape)
    return F.silu(y).to(x.dtype)


def _layout(x: torch.Tensor) -> str | None:
    """'cf' (channels-first dense), 'cl' (channels-last dense) or None."""
    if x.dim() < 3:
        return None
    if x.is_contiguous():
        return "cf"
    if x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d):
        return "cl"
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
        return "cl"
    return None


_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def kernel_ok(x: torch.Tensor) -> bool:
    return (x.is_cuda and x.dtype in _KERNEL_DTYPES and x.shape[1] <= MAX_C
            and _layout(x) is not None and x.numel() > 0 and triton_importable())


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def rms_silu_tiles(X, G, BIAS, PRE, Y, C, P, scale, eps, CL: tl.constexpr, HAS_BIAS: tl.constexpr,
                       HAS_PRE: tl.constexpr, BC: tl.constexpr, BP: tl.constexpr):
        # one program: all C channels of BP positions of one batch element; x[b, c, p] at
        # b*C*P + (p*C + c if channels-last else c*P + p)
        b = tl.program_id(1).to(tl.int64)
        p = tl.program_id(0).to(tl.int64) * BP + tl.arange(0, BP)[None, :]
        c = tl.arange(0, BC)[:, None]
        m = (c < C) & (p < P)
        offs = b * C * P + (p * C + c if CL else c * P + p)
        x = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
        if HAS_PRE:  # the preceding conv's bias: the value its bias add would have stored (fp32 sum, x's dtype)
            pre = tl.load(PRE + c, mask=c < C, other=0.0).to(tl.float32)
            x = tl.where(m, (x + pre).to(X.dtype.element_ty).to(tl.float32), 0.0)
        norm = tl.sqrt(tl.sum(x * x, axis=0))[None, :]
        g = tl.load(G + c, mask=c < C, other=0.0).to(tl.float32)
        y = x / tl.maximum(norm, eps) * (scale * g)
        if HAS_BIAS:
            y = y + tl.load(BIAS + c, mask=c < C, other=0.0).to(tl.float32)
        y = y / (1.0 + tl.exp(-y))
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=m)

    return rms_silu_tiles


@torch.library.custom_op("fastwan::rms_silu", mutates_args=())
def rms_silu(x: torch.Tensor, gamma: torch.Tensor, bias: torch.Tensor | None,
             pre_bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, C, *spatial] (channels-first or channels-last dense), gamma/bias/pre_bias [C] -> like x (same
    strides). ``pre_bias`` is added to x first, rounded to x's dtype (:func:`rms_silu_reference`)."""
    if any(t is not None and t.numel() != x.shape[1] for t in (gamma, bias, pre_bias)):
        raise ValueError(f"rms_silu: gamma {tuple(gamma.shape)} / bias {None if bias is None else tuple(bias.shape)}"
                         f" / pre_bias {None if pre_bias is None else tuple(pre_bias.shape)}"
                         f" do not have the {x.shape[1]} channels of x {tuple(x.shape)}")
    if not kernel_ok(x) or (pre_bias is not None and (pre_bias.dtype not in _KERNEL_DTYPES
                                                      or pre_bias.device != x.device)):
        return rms_silu_reference(x, gamma, bias, pre_bias)
    import triton

    B, C = x.shape[0], x.shape[1]
    P = x.numel() // (B * C)
    y = torch.empty_like(x)  # a dense input keeps its strides
    bc = triton.next_power_of_2(C)
    bp = max(1, min(triton.next_power_of_2(P), 4096 // bc))
    g = gamma.reshape(-1).contiguous()
    bb = bias.reshape(-1).contiguous() if bias is not None else g
    pb = pre_bias.reshape(-1).contiguous() if pre_bias is not None else g
    _kernel()[(triton.cdiv(P, bp), B)](x, g, bb, pb, y, C, P, float(C) ** 0.5, EPS, CL=_layout(x) == "cl",
                                       HAS_BIAS=bias is not None, HAS_PRE=pre_bias is not None, BC=bc, BP=bp,
                                       num_warps=4)
    return y


@rms_silu.register_fake
def _(x, gamma, bias, pre_bias=None):
    return torch.empty_like(x)


class RMSNormSiLU(nn.Module):
    """A diffusers ``WanRMS_norm`` (channels first) and the SiLU after it, in one pass; shares its parameters."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.gamma = norm.gamma
        self.bias = norm.bias if isinstance(norm.bias, torch.Tensor) else None

    def forward(self, x: torch.Tensor, pre_bias: torch.Tensor | None = None) -> torch.Tensor:
        """``pre_bias``: the bias of the conv that produced x, not yet added (see :func:`rms_silu`)."""
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
        if type(mod).__name__ in ("WanResidualBlock", "FastWanResidualBlock"):  # (swapped by vae_convs)
            if all(_fusable(getattr(mod, n, None), act) for n in ("norm1", "norm2")):
                mod.norm1, mod.norm2 = RMSNormSiLU(mod.norm1), RMSNormSiLU(mod.norm2)
                mod.nonlinearity = nn.Identity()
                swapped += 2
    if _fusable(getattr(decoder, "norm_out", None), getattr(decoder, "nonlinearity", None)):
        decoder.norm_out = RMSNormSiLU(decoder.norm_out)
        decoder.nonlinearity = nn.Identity()
        swapped += 1
    return swapped
