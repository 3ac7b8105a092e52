"""Fewer full-tensor passes in diffusers' ``AutoencoderKLWan``, by swapping the classes of its modules.

diffusers decodes latent frames in calls of the decoder and keeps, for every causal 3-D convolution, the last
``CACHE_T`` frames of its input in a feature cache. :func:`fast_decoder_convs` swaps the class of each module below
(``mod.__class__``, this VAE's instances only, same parameters and buffers) for a subclass whose ``forward``
computes the same values with fewer passes over the activations:

1. ``WanCausalConv3d`` (every one: decoder, encoder, ``quant_conv``/``post_quant_conv``): height and width are
   padded by the convolution itself (``padding=(0, ph, pw)``: the same zeros, not materialised) and only the time
   axis is built, as one buffer in the layout cuDNN computes in (:func:`~fastwan.kernels.vae.time_pad`: zero
   frames, the last cached frames, x); a conv without time padding takes x as it is. (diffusers' ``cat`` of cache
   and x and ``F.pad`` of all three axes make three passes over x.)
2. The conv bias, where the convs take the CUDA routes (see :func:`fast_decoder_convs`): the convs (and the
   ``nn.Conv2d`` of each ``WanResample``) convolve without it and add it with
   :func:`~fastwan.kernels.vae.add_channel_bias_`, or in the pass that reads the output next (item 7). cuDNN adds
   a conv bias as a broadcast add on PyTorch's strided path (a 480p decode: ~880 calls at ~1.35 TB/s).
3. ``WanResample`` in ``upsample3d`` mode: the two halves of ``time_conv``'s output are interleaved by one copy
   into that output's layout (:func:`interleave_time`). diffusers' ``torch.stack`` writes channels-first, which puts
   the modules after it in a channels-last decoder on strided paths (NCHW upsample, unfused norm, cuDNN
   transposes, strided residual adds).
4. ``WanUpsample`` (nearest modes): upsampled in x's dtype (it only selects elements: bit-identical to diffusers'
   fp32 round trip); a channels-last input with power-of-two factors by one broadcasting copy of wide words
   (:func:`repeat_pixels`).
5. ``WanResidualUpBlock`` (Wan2.2's residual decoder) keeps a reference to its input (nothing writes into it);
   its ``DupUp3D`` shortcut repeats channels as a broadcasting view where the factors allow
   (:func:`repeated_channels`) and writes the pixel shuffle in the input's layout (one permuting copy).
6. Narrow causal convs (at most ``STACK_TAPS_MAX_CHANNELS`` input channels, half precision, CUDA routes) run as one
   conv2d over the time taps stacked along channels (:func:`stacked_taps_conv`; the stacked input is written by
   :func:`~fastwan.kernels.vae.stack_time_taps` from the cache and x). One fp32 accumulation per output, like
   conv3d, in another order.
7. ``WanResidualBlock`` (encoder and decoder): diffusers' forward, the feature cache included, with each deferred
   conv bias added by the pass that reads the conv output next (:class:`ResidualBlockMixin`): conv1's by the fused
   RMSNorm+SiLU of norm2 (``pre_bias``), conv2's by the residual add (:func:`~fastwan.kernels.vae.add_bias_residual`).
   Each rounds as the separate add does (a 480p profile spends 48 ms of an 810 ms decode in bias adds).

All of it is exact (zero padding is zero padding, the bias add has PyTorch's rounding, the rest moves the same
elements) but the stacked-taps conv's summation order; in a bf16 decode on CUDA the blocks after a temporal
upsample also get the fused RMSNorm+SiLU kernel (item 3), a few bf16 units in the last place from its PyTorch
formula. In fp32 on the CPU the decode matches diffusers' to rounding.

Measured (``benchmarks/vae_bench.py``, H100, random weights, bf16, channels-last conv weights, fused norms), the
swapped modules against diffusers' own: items 1-5, Wan2.1 480x832x81 987 against 1,354 ms (peak 3.66 against 3.95
GiB), Wan2.2-TI2V 704x1280x41 1,305 against 1,626 ms (7.52 against 9.24 GiB); item 6 against items 1-5 alone,
Wan2.1 480p 852 against 989 ms, 720p 1,959 against 2,275 ms.
"""
from __future__ import annotations

import functools
import inspect
import math

import torch
import torch.nn.functional as F
from torch import nn

from fastwan.kernels import triton_runs
from fastwan.kernels.vae import KERNEL_DTYPES, add_bias_residual, add_channel_bias_, dense_layout, no_autograd, \
    stack_time_taps, time_pad

CACHE_T = 2  # frames each causal conv keeps from the previous chunk (diffusers' CACHE_T)
CL3D = torch.channels_last_3d
_NEAREST_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
# Narrow convs as stacked time taps: cuDNN 9.19 runs the Wan2.1 decoder's full-resolution 96-channel 3x3x3 conv with
# an sm80 kernel at ~245 TFLOP/s on an H100, the same sums as a conv2d over 3 x 96 stacked channels at ~510; with 192
# and 384 channels conv3d is as fast or faster. Measured in half precision only.
STACK_TAPS_MAX_CHANNELS = 96
STACK_TAPS_DTYPES = (torch.bfloat16, torch.float16)


def _channels_last(t: torch.Tensor) -> bool:
    """A 5-D tensor dense in channels-last-3d order (and not also plain contiguous, as tensors with C == 1 are)."""
    return t.dim() == 5 and not t.is_contiguous() and t.is_contiguous(memory_format=CL3D)


def _layout_like(*ts: torch.Tensor) -> torch.memory_format:
    """channels_last_3d if any of ``ts`` is channels-last (what cuDNN and oneDNN then compute in), else
    contiguous."""
    return CL3D if any(_channels_last(t) for t in ts) else torch.contiguous_format


def takes_cuda_routes(conv: nn.Module, x: torch.Tensor, dtypes: tuple[torch.dtype, ...] = KERNEL_DTYPES) -> bool:
    """Whether the swapped ``conv`` takes the CUDA routes (deferred bias, stacked time taps) for input x: as
    :func:`fast_decoder_convs`'s ``cuda_routes`` fixed it, or (None) where cuDNN convolves and the kernels run
    for x in ``dtypes``."""
    forced = getattr(conv, "_fastwan_cuda_routes", None)
    if forced is not None:
        return forced
    return torch.backends.cudnn.enabled and triton_runs(x, dtypes=dtypes)


def _conv_deferred(mod, conv, x, weight, bias, stride, padding, dilation, groups):
    """(y, bias still to add): where ``mod`` takes the CUDA routes (cuDNN adds a bias as a separate pass anyway) the
    convolution without its bias; elsewhere ``conv(x, weight, bias, ...)`` and None."""
    if bias is None or not takes_cuda_routes(mod, x):
        return conv(x, weight, bias, stride, padding, dilation, groups), None
    return conv(x, weight, None, stride, padding, dilation, groups), bias


def _conv(mod, conv, x, weight, bias, stride, padding, dilation, groups):
    """``conv(x, weight, bias, ...)``; on the CUDA routes the bias is added by :func:`add_channel_bias_`."""
    y, pending = _conv_deferred(mod, conv, x, weight, bias, stride, padding, dilation, groups)
    return y if pending is None else add_channel_bias_(y, pending)


class CausalConv3dMixin:
    """Mixin for ``WanCausalConv3d``: H/W zero padding by the conv itself, time padding (cache + zeros) built
    once, no copy at all when there is no time padding; on the CUDA routes the bias by :func:`add_channel_bias_`
    and narrow convolutions as one conv2d over stacked time taps (:func:`stacked_taps_ok`)."""

    def forward(self, x, cache_x=None):
        y, bias = self.forward_deferred_bias(x, cache_x)
        return y if bias is None else add_channel_bias_(y, bias)

    def forward_deferred_bias(self, x, cache_x=None):
        """(y, bias): on the CUDA routes, the convolution without its bias and the bias --
        ``add_channel_bias_(y, bias)`` is :meth:`forward`'s output --, else (forward's output, None). The
        residual blocks (:class:`ResidualBlockMixin`) add it in the pass that reads y next."""
        pw, ph, pt = self._padding[0], self._padding[2], self._padding[4]
        if pt > 0 and stacked_taps_ok(self, x, pt):
            return stacked_taps_conv(self, x, cache_x, pt, add_bias=False), self.bias
        if pt > 0:  # diffusers ignores the cache of a conv without time padding, and so does this
            x = time_pad(x, cache_x, pt, _layout_like(x, self.weight))
        return _conv_deferred(self, F.conv3d, x, self.weight, self.bias, self.stride, (0, ph, pw), self.dilation,
                              self.groups)


def stacked_taps_ok(conv: nn.Conv3d, x: torch.Tensor, pad_t: int) -> bool:
    """Whether ``conv`` (a causal conv with ``pad_t`` frames of time padding) on ``x`` takes
    :func:`stacked_taps_conv`: the CUDA routes in ``STACK_TAPS_DTYPES`` (:func:`takes_cuda_routes`), at most
    ``STACK_TAPS_MAX_CHANNELS`` input channels, a dense channels-last x of the weight's dtype, time stride and
    dilation 1, one group, kernel time size pad_t + 1 (causal), and no autograd."""
    w = conv.weight
    return (w.dtype == x.dtype and x.shape[1] <= STACK_TAPS_MAX_CHANNELS and conv.groups == 1
            and conv.stride[0] == 1 and conv.dilation[0] == 1 and w.shape[2] == pad_t + 1 and x.shape[2] > 0
            and dense_layout(x) == "cl" and no_autograd(x, w) and takes_cuda_routes(conv, x, STACK_TAPS_DTYPES))


def _stacked_weight(conv: nn.Conv3d) -> torch.Tensor:
    """[Cout, Cin, kt, kh, kw] -> [Cout, kt * Cin, kh, kw] channels-last (channel block i = time tap i), cached on
    the module until the weight changes."""
    w = conv.weight
    key = (w.data_ptr(), w._version, w.dtype, w.device)
    cached = getattr(conv, "_fastwan_stacked_weight", None)
    if cached is None or cached[0] != key:
        o, i, kt, kh, kw = w.shape
        ws = w.detach().permute(0, 2, 1, 3, 4).reshape(o, kt * i, kh, kw).contiguous(memory_format=torch.channels_last)
        cached = (key, ws)
        conv._fastwan_stacked_weight = cached
    return cached[1]


def stacked_taps_conv(conv: nn.Conv3d, x: torch.Tensor, cache: torch.Tensor | None, pad_t: int,
                      add_bias: bool = True) -> torch.Tensor:
    """``conv`` (a ``WanCausalConv3d``, kernel [kt, kh, kw], time padding ``pad_t`` = kt - 1) on
    [cache frames, x] as one conv2d over the kt time taps stacked along channels: the same products, summed in one
    fp32 accumulation as cuDNN's conv3d does (in another order). x: [B, C, T, H, W] -> [B, Cout, T, H', W'],
    channels-last; without the bias if not ``add_bias``."""
    b, _, t = x.shape[:3]
    kt = conv.weight.shape[2]
    y = F.conv2d(stack_time_taps(x, cache, pad_t, kt), _stacked_weight(conv), None, conv.stride[1:],
                 (conv._padding[2], conv._padding[0]), conv.dilation[1:])  # [B * T, Cout, H', W'] channels-last
    y = y.view(b, t, *y.shape[1:]).permute(0, 2, 1, 3, 4)  # [B, Cout, T, H', W'], channels-last-3d strides
    return y if conv.bias is None or not add_bias else add_channel_bias_(y, conv.bias)


class ResampleConv2dMixin:
    """Mixin for the ``nn.Conv2d`` of a ``WanResample``: on the CUDA routes the bias by :func:`add_channel_bias_`."""

    def forward(self, x):
        return _conv(self, F.conv2d, x, self.weight, self.bias, self.stride, self.padding, self.dilation,
                     self.groups)


def interleave_time(y: torch.Tensor, c: int) -> torch.Tensor:
    """[B, 2C, T, H, W] -> [B, C, 2T, H, W], frame 2t + k = channels k*C..(k+1)*C of frame t (diffusers'
    ``stack((y[:, 0], y[:, 1]), 3)`` after ``reshape(b, 2, c, ...)``), written in y's layout (one copy)."""
    b, _, t, h, w = y.shape
    halves = y.reshape(b, 2, c, t, h, w)
    out = torch.empty((b, c, 2 * t, h, w), dtype=y.dtype, device=y.device, memory_format=_layout_like(y))
    out.view(b, c, t, 2, h, w).copy_(halves.permute(0, 2, 3, 1, 4, 5))
    return out


class Upsample3dResampleMixin:
    """Mixin for ``WanResample(mode="upsample3d")``: diffusers' feature-cache logic unchanged, the time interleave
    by :func:`interleave_time` (kept in the conv output's layout)."""

    def forward(self, x, feat_cache=None, feat_idx=[0]):  # noqa: B006 -- diffusers' signature; never mutated here
        b, c = x.shape[:2]
        if feat_cache is not None:
            idx = feat_idx[0]
            prev = feat_cache[idx]
            if prev is None:  # first chunk: no temporal doubling, the slot is marked "Rep"
                feat_cache[idx] = "Rep"
            else:
                rep = isinstance(prev, str)  # second chunk: no real cache yet (zero frames)
                cache = x[:, :, -CACHE_T:].clone()
                if cache.shape[2] < CACHE_T:  # one frame: prepend the previous chunk's last (or a zero frame)
                    head = torch.zeros_like(cache) if rep else prev[:, :, -1:].to(cache.device)
                    cache = torch.cat([head, cache], 2)
                y = self.time_conv(x) if rep else self.time_conv(x, prev)
                feat_cache[idx] = cache
                x = interleave_time(y, c)
            feat_idx[0] += 1
        t, h, w = x.shape[2:]
        x = self.resample(x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w))
        return x.view(b, t, *x.shape[1:]).permute(0, 2, 1, 3, 4)


def _pow2_factors(up: nn.Upsample, dims: int) -> tuple[int, ...] | None:
    """The integer factors of a scale_factor-only upsample when each is a power of two (then nearest and
    nearest-exact both read source pixel dst // k: 1/k is exact in floating point), else None."""
    sf = up.scale_factor
    if up.size is not None or sf is None or up.recompute_scale_factor:
        return None
    sf = tuple(sf) if isinstance(sf, (tuple, list)) else (sf,) * dims
    if len(sf) != dims or not all(float(f).is_integer() and f >= 1 for f in sf):
        return None
    ks = tuple(int(f) for f in sf)
    return ks if all(k & (k - 1) == 0 for k in ks) else None


def repeat_pixels(x: torch.Tensor, kh: int, kw: int) -> torch.Tensor:
    """Nearest upsampling by integer factors of a channels-last 4-D tensor as one broadcasting copy: each
    pixel's C channels are one contiguous run, moved as int64/int32 words where C's bytes allow (bit copies),
    so the copy moves a few wide elements per pixel. Output channels-last, like ``F.interpolate``'s."""
    n, c, h, w = x.shape
    out = torch.empty((n, c, h * kh, w * kw), dtype=x.dtype, device=x.device, memory_format=torch.channels_last)
    src, dst = x.permute(0, 2, 3, 1), out.permute(0, 2, 3, 1)  # dense [N, H, W, C]
    for wide in (torch.int64, torch.int32):
        if wide.itemsize > x.element_size() and (c * x.element_size()) % wide.itemsize == 0:
            try:
                src, dst = src.view(wide), dst.view(wide)
                break
            except RuntimeError:  # an offset view of storage that the wider type cannot address
                src, dst = x.permute(0, 2, 3, 1), out.permute(0, 2, 3, 1)
    k = src.shape[-1]
    dst.view(n, h, kh, w, kw, k).copy_(src[:, :, None, :, None, :].expand(n, h, kh, w, kw, k))
    return out


class NearestUpsampleMixin:
    """Mixin for ``WanUpsample`` in a nearest mode: upsample in the input's dtype (bit-identical to diffusers'
    fp32 round trip, which only selects elements); a channels-last 4-D input with power-of-two factors by
    :func:`repeat_pixels` (on an H100, a 4x192x240x416 bf16 input: 0.30 ms, against 1.82 ms for
    ``F.interpolate`` in bf16 and 2.67 ms for diffusers' fp32 round trip)."""

    def forward(self, x):
        if x.dtype not in _NEAREST_DTYPES:
            return super().forward(x)
        ks = _pow2_factors(self, x.dim() - 2)
        if ks is not None and x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(
                memory_format=torch.channels_last):
            return repeat_pixels(x, *ks)
        return nn.Upsample.forward(self, x)


def repeated_channels(x: torch.Tensor, oc: int, ft: int, fs: int, r: int) -> torch.Tensor:
    """``x.repeat_interleave(r, 1).reshape(b, oc, ft, fs, fs, t, h, w)`` (what ``DupUp3D`` builds), as a
    broadcasting view of x when r is a product of trailing factors of (ft, fs, fs) -- Wan2.2's decoder has r =
    ft*fs*fs, fs*fs and fs: channel j of the repeat is x's channel j // r = o * (F / r) + (the leading sub-position
    indices), so x's channels split into [oc, leading factors] and the trailing ones are broadcast. Otherwise
    the repeat itself."""
    b, _, t, h, w = x.shape
    factors = (ft, fs, fs)
    for k in range(4):
        if math.prod(factors[k:]) == r:
            lead = factors[:k]
            v = x.reshape(b, oc, *lead, *(1,) * (3 - k), t, h, w)  # a view: only the channel dim is split
            return v.expand(b, oc, ft, fs, fs, t, h, w)
    return x.repeat_interleave(r, dim=1).reshape(b, oc, ft, fs, fs, t, h, w)


class DupUp3DMixin:
    """Mixin for ``DupUp3D``: the repeat as a view (:func:`repeated_channels`) and the pixel-shuffle as one
    permuting copy, written in the input's layout."""

    def forward(self, x, first_chunk=False):
        b, _, t, h, w = x.shape
        ft, fs, oc = self.factor_t, self.factor_s, self.out_channels
        rep = repeated_channels(x, oc, ft, fs, self.repeats)
        out = torch.empty((b, oc, t * ft, h * fs, w * fs), dtype=x.dtype, device=x.device,
                          memory_format=_layout_like(x))
        out.view(b, oc, t, ft, h, fs, w, fs).copy_(rep.permute(0, 1, 5, 2, 6, 3, 7, 4))
        return out[:, :, ft - 1:] if first_chunk else out


class ResidualUpBlockMixin:
    """Mixin for ``WanResidualUpBlock``: no clone of the block input (nothing writes into it)."""

    def forward(self, x, feat_cache=None, feat_idx=[0], first_chunk=False):  # noqa: B006 -- diffusers' signature
        x_in = x
        for resnet in self.resnets:
            x = resnet(x) if feat_cache is None else resnet(x, feat_cache=feat_cache, feat_idx=feat_idx)
        if self.upsampler is not None:
            x = self.upsampler(x) if feat_cache is None else self.upsampler(x, feat_cache=feat_cache,
                                                                           feat_idx=feat_idx)
        if self.avg_shortcut is not None:
            x = x + self.avg_shortcut(x_in, first_chunk=first_chunk)
        return x


def _no_hooks(mod: nn.Module) -> bool:
    """Whether calling ``mod``'s methods directly skips nothing: no forward hooks (its own or global) and no
    instance-level ``forward`` (what diffusers' hook registry and accelerate's offloading install)."""
    from torch.nn.modules import module as _m

    return not (mod._forward_hooks or mod._forward_pre_hooks or mod._backward_hooks or mod._backward_pre_hooks
                or _m._global_forward_hooks or _m._global_forward_pre_hooks or _m._global_backward_hooks
                or _m._global_backward_pre_hooks or "forward" in mod.__dict__)


def _conv_deferred_bias(conv: nn.Module, x: torch.Tensor, cache: torch.Tensor | None, cached: bool):
    """(y, bias still to add) from a residual block's conv: its :meth:`CausalConv3dMixin.forward_deferred_bias`
    where it has one and nothing hooks it, else its ordinary call (with the cache argument as diffusers passes
    it) and None."""
    if isinstance(conv, CausalConv3dMixin) and _no_hooks(conv):
        return conv.forward_deferred_bias(x, cache)
    return (conv(x, cache) if cached else conv(x)), None


def _cached_conv(conv: nn.Module, x: torch.Tensor, feat_cache, feat_idx):
    """diffusers' ``WanResidualBlock.forward`` around each conv, returning (y, bias still to add): with a feature
    cache, the last CACHE_T frames of the conv's *input* are cloned (a one-frame input gets the previous slot's
    last frame in front), the conv runs on x and the previous slot, the slot takes the clone, the index moves on.
    The cache holds conv inputs, so where the conv's bias is added does not touch it."""
    if feat_cache is None:
        return _conv_deferred_bias(conv, x, None, False)
    idx = feat_idx[0]
    cache_x = x[:, :, -CACHE_T:, :, :].clone()
    if cache_x.shape[2] < 2 and feat_cache[idx] is not None:
        cache_x = torch.cat([feat_cache[idx][:, :, -1, :, :].unsqueeze(2).to(cache_x.device), cache_x], dim=2)
    out = _conv_deferred_bias(conv, x, feat_cache[idx], True)
    feat_cache[idx] = cache_x
    feat_idx[0] += 1
    return out


class ResidualBlockMixin:
    """Mixin for ``WanResidualBlock``: diffusers' forward (same order, same feature-cache slots), with each
    conv's bias added where the activation is read next instead of in a pass of its own (where the convs defer it:
    :func:`takes_cuda_routes`): conv1's by the fused RMSNorm+SiLU (``pre_bias`` of
    :class:`~fastwan.vae.norms.RMSNormSiLU`), conv2's by the residual add (:func:`add_bias_residual`).
    Without a fused norm2 conv1's bias is added by :func:`add_channel_bias_`; a conv with hooks runs as diffusers
    calls it (its output with the bias)."""

    def forward(self, x, feat_cache=None, feat_idx=[0]):  # noqa: B006 -- diffusers' signature; never mutated here
        from fastwan.vae.norms import RMSNormSiLU

        h = self.conv_shortcut(x)
        x = self.nonlinearity(self.norm1(x))
        x, bias = _cached_conv(self.conv1, x, feat_cache, feat_idx)
        if bias is not None and isinstance(self.norm2, RMSNormSiLU) and _no_hooks(self.norm2):
            x = self.norm2(x, pre_bias=bias)  # (x + bias, rounded) -> norm -> SiLU in one pass
        else:
            if bias is not None:
                x = add_channel_bias_(x, bias)
            x = self.norm2(x)
        x = self.dropout(self.nonlinearity(x))
        x, bias = _cached_conv(self.conv2, x, feat_cache, feat_idx)
        return add_bias_residual(x, bias, h)


@functools.cache
def _swapped_class(base: type, mixin: type) -> type:
    return type(f"Fast{base.__name__}", (mixin, base), {"__module__": __name__, "__doc__": mixin.__doc__})


_MIXIN_OF = {"WanCausalConv3d": "CausalConv3dMixin", "WanResample": "Upsample3dResampleMixin",
             "WanUpsample": "NearestUpsampleMixin", "DupUp3D": "DupUp3DMixin",
             "WanResidualUpBlock": "ResidualUpBlockMixin", "WanResidualBlock": "ResidualBlockMixin"}


def __getattr__(name: str):
    """``Fast<diffusers class>``: the swapped classes by name, so that pickle finds them (in a new process too)."""
    base_name = name[4:] if name.startswith("Fast") else ""
    if base_name == "Conv2d":
        return _swapped_class(nn.Conv2d, ResampleConv2dMixin)
    if base_name in _MIXIN_OF:
        from diffusers.models.autoencoders import autoencoder_kl_wan

        return _swapped_class(getattr(autoencoder_kl_wan, base_name), globals()[_MIXIN_OF[base_name]])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _swap(mod: nn.Module, mixin: type, routes: bool | None) -> None:
    mod.__class__ = _swapped_class(type(mod), mixin)
    if mixin in (CausalConv3dMixin, ResampleConv2dMixin):
        mod._fastwan_cuda_routes = routes


def _ints(v, n: int) -> bool:
    return isinstance(v, (tuple, list)) and len(v) == n and all(isinstance(i, int) and i >= 0 for i in v)


def _is_causal_conv(m: nn.Module) -> bool:
    p = getattr(m, "_padding", None)
    return (type(m).__name__ == "WanCausalConv3d" and isinstance(m, nn.Conv3d) and m.padding_mode == "zeros"
            and tuple(m.padding) == (0, 0, 0) and _ints(p, 6) and p[0] == p[1] and p[2] == p[3] and p[5] == 0
            and isinstance(m.weight, torch.Tensor) and m.weight.dim() == 5)


def _is_resample_conv2d(m: nn.Module) -> bool:
    return type(m) is nn.Conv2d and m.padding_mode == "zeros" and isinstance(m.padding, tuple)


def _is_upsample3d(m: nn.Module) -> bool:
    return (type(m).__name__ == "WanResample" and getattr(m, "mode", None) == "upsample3d"
            and isinstance(getattr(m, "resample", None), nn.Module) and isinstance(getattr(m, "time_conv", None),
                                                                                 nn.Conv3d)
            and getattr(m.time_conv, "out_channels", None) == 2 * getattr(m.time_conv, "in_channels", -1))


def _is_nearest_upsample(m: nn.Module) -> bool:
    return (type(m).__name__ == "WanUpsample" and isinstance(m, nn.Upsample)
            and m.mode in ("nearest", "nearest-exact"))


def _is_dup_up(m: nn.Module) -> bool:
    names = ("factor_t", "factor_s", "repeats", "in_channels", "out_channels")
    if type(m).__name__ != "DupUp3D" or not all(isinstance(getattr(m, n, None), int) for n in names):
        return False
    return m.in_channels * m.repeats == m.out_channels * m.factor_t * m.factor_s ** 2


def _is_residual_up_block(m: nn.Module) -> bool:
    return (type(m).__name__ == "WanResidualUpBlock" and isinstance(getattr(m, "resnets", None), nn.ModuleList)
            and hasattr(m, "upsampler") and hasattr(m, "avg_shortcut"))


def _is_residual_block(m: nn.Module) -> bool:
    """diffusers' ``WanResidualBlock`` as :class:`ResidualBlockMixin` expects it: its forward's signature, a
    causal conv1/conv2 and the other submodules it calls."""
    if type(m).__name__ != "WanResidualBlock":
        return False
    try:
        params = tuple(inspect.signature(type(m).forward).parameters)
    except (TypeError, ValueError):
        return False
    return (params == ("self", "x", "feat_cache", "feat_idx")
            and all(isinstance(getattr(m, n, None), nn.Conv3d) and type(getattr(m, n)).__name__.endswith(
                "WanCausalConv3d") for n in ("conv1", "conv2"))
            and all(isinstance(getattr(m, n, None), nn.Module)
                    for n in ("conv_shortcut", "norm1", "norm2", "nonlinearity", "dropout")))


_SWAPS = ((_is_causal_conv, CausalConv3dMixin), (_is_upsample3d, Upsample3dResampleMixin),
          (_is_nearest_upsample, NearestUpsampleMixin), (_is_dup_up, DupUp3DMixin),
          (_is_residual_up_block, ResidualUpBlockMixin), (_is_residual_block, ResidualBlockMixin))


def _resample_parts(vae: nn.Module) -> set[int]:
    """ids of the modules in the ``resample`` Sequential of each ``WanResample`` (before any swap)."""
    return {id(c) for m in vae.modules() if type(m).__name__ == "WanResample"
            and isinstance(getattr(m, "resample", None), nn.Sequential) for c in m.resample}


def fast_decoder_convs(vae: nn.Module, *, cuda_routes: bool | None = None) -> int:
    """Swap, in place, the modules of ``vae`` (a diffusers ``AutoencoderKLWan``) listed in this module's
    docstring for subclasses that copy less: every ``WanCausalConv3d``, the ``upsample3d`` ``WanResample``\\ s,
    nearest ``WanUpsample``\\ s, ``DupUp3D``\\ s, ``WanResidualUpBlock``\\ s and ``WanResidualBlock``\\ s.
    Parameters, buffers, state-dict names and ``isinstance`` checks are unchanged. A module whose attributes are
    not the expected ones (another diffusers release, or one already swapped) is left alone. Independent of
    :func:`fastwan.vae.norms.fuse_decoder_norms` (either order). Returns the number of modules swapped.

    ``cuda_routes``: whether the convs defer their bias (items 2 and 7) and narrow ones stack their time taps
    (item 6). None: where cuDNN convolves and the kernels run (:func:`takes_cuda_routes`; those in
    ``STACK_TAPS_DTYPES`` for the stacked taps). True: on every device and dtype the layouts allow, the kernels
    running their PyTorch references where Triton cannot (how the CPU tests take these routes). False: never."""
    swapped = 0
    in_resample = _resample_parts(vae)
    for mod in vae.modules():
        if id(mod) in in_resample and _is_resample_conv2d(mod):
            _swap(mod, ResampleConv2dMixin, cuda_routes)
            swapped += 1
            continue
        for check, mixin in _SWAPS:
            if check(mod):
                _swap(mod, mixin, cuda_routes)
                swapped += 1
                break
    return swapped
