"""Fewer full-tensor passes in diffusers' ``AutoencoderKLWan`` decode, by swapping the classes of its modules.

diffusers decodes one latent frame per call of the decoder and keeps, for every causal 3-D convolution, the last
two frames of its input in a feature cache. Around the convolutions it moves whole activations several times;
:func:`fast_decoder_convs` swaps the class of each module below (``mod.__class__``, this VAE's instances only, same
parameters and buffers) for a subclass whose ``forward`` computes the same values with fewer passes:

1. ``WanCausalConv3d`` (every one: decoder, encoder, ``quant_conv``/``post_quant_conv``). diffusers concatenates
   the cached frames in front of x along time (one copy of x) and then ``F.pad``s time *and* height/width (a
   zero fill of the whole padded tensor plus a second, strided copy of it), and convolves with padding 0; a conv
   without padding (the 1x1x1 shortcuts and quant convs) still gets a full copy from ``F.pad`` with all-zero
   pads. Now height and width are padded by the convolution itself (``padding=(0, ph, pw)``: the same zeros, not
   materialised; bit-identical output on an H100) and only the time axis is built explicitly, in one buffer:
   zero frames for what the cache does not cover, then the last cached frames, then x (:func:`time_pad`) -- one
   dense copy of x instead of three passes; a conv with no time padding takes x as it is (no copy). The buffer
   has the layout cuDNN computes in (channels-last when x or the weight is), so cuDNN does not transpose it.
2. The conv bias, on CUDA. cuDNN convolves without it and PyTorch then runs ``output.add_(bias[None, :, None,
   ...])``, a broadcast that TensorIterator runs on its strided, non-vectorised path (the ~880
   ``elementwise_kernel<128, 4, ... CUDAFunctor_add>`` calls of a 480p decode, ~1.35 TB/s). The swapped convs
   (and the ``nn.Conv2d`` of each ``WanResample``) convolve without bias and add it with
   :func:`add_channel_bias_`: the same fp32 sum and rounding, in a Triton kernel at ~2.9 TB/s. In a
   ``WanResidualBlock`` they are folded into the next pass where it allows (item 7).
3. ``WanResample`` in ``upsample3d`` mode (the decoder's temporal x2). diffusers interleaves the two halves of
   ``time_conv``'s output with ``torch.stack``, which always writes a channels-first tensor. With channels-last
   weights (fastwan on CUDA) everything else is channels-last, so the block's spatial upsample and the next
   block's first residual block ran on a time-major layout: the upsample took its NCHW path, the fused
   RMSNorm+SiLU fell back to its PyTorch formula (its kernel needs a dense layout), cuDNN transposed conv inputs
   (nchwToNhwc/nhwcToNchw), and the residual ``x + h`` mixed a channels-last and a time-major operand (the
   strided add). The interleave is now one copy into the layout of ``time_conv``'s output (:func:`interleave_time`).
4. ``WanUpsample`` (nearest-exact x2 before each resample conv). diffusers upsamples in fp32 (``x.float()``,
   then ``type_as``): with a bf16 VAE a bf16->fp32 copy of x, an fp32 upsample, and an fp32->bf16 copy of the 4x
   larger output. Nearest-neighbour upsampling only selects elements and bf16 -> fp32 -> bf16 is lossless, so it
   now runs in x's dtype (identical bits), and for a channels-last input with power-of-two factors as one
   broadcasting copy that moves each pixel's channels as 8-byte words (:func:`repeat_pixels`, 6x faster than
   ``F.interpolate`` in bf16). Swapped only for modes ``nearest``/``nearest-exact``.
5. ``WanResidualUpBlock`` (Wan2.2's residual decoder) and its ``DupUp3D`` shortcut. The block cloned its input
   (``x_copy = x.clone()``) although nothing writes into x; it now keeps a reference. ``DupUp3D`` materialised
   ``repeat_interleave`` (a pass the size of its output) and then permuted it into a channels-first tensor, so
   ``x + shortcut`` with a channels-last x took the strided add; the repeat is now a broadcasting view where the
   factors allow (:func:`repeated_channels`) and the one permuting copy writes the layout of the input.

6. Narrow causal convolutions (at most ``STACK_TAPS_MAX_CHANNELS`` = 96 input channels: the Wan2.1 decoder's
   full-resolution stage), bf16/fp16 on CUDA. cuDNN runs them as conv3d with an sm80 kernel at ~245 TFLOP/s on an
   H100; the same products as one conv2d over the time taps stacked along channels run at ~510
   (:func:`stacked_taps_conv`; a Triton kernel writes the stacked input from the cached frames and x directly, in
   place of :func:`time_pad`'s copy). One fp32 accumulation per output, like conv3d, in another order.
7. ``WanResidualBlock`` (encoder and decoder). diffusers' forward, the feature cache included, with each conv's
   bias added, on CUDA, by the pass that reads the conv output next (:class:`ResidualBlockMixin`): conv1's by the
   fused RMSNorm+SiLU of norm2 (its ``pre_bias``; decoder blocks swapped by ``fuse_decoder_norms``), conv2's by
   the residual add (:func:`add_bias_residual`, one kernel for ``(y + bias) + shortcut`` where both are dense in
   one layout). Each rounds as the separate add did (bit-identical): two kernels and two read+write passes over
   the block's output fewer per block where both fold (not yet timed on a GPU; the profile before: 48 ms of bias
   adds in an 810 ms 480p decode).

All of it is exact: zero padding is zero padding, the bias add (folded or not) has PyTorch's rounding, and the
other changes move the same elements. What does change in a bf16 decode on CUDA is that the blocks after a temporal
upsample now get the fused RMSNorm+SiLU kernel instead of its PyTorch fallback (same fp32 formula, another summation
order), a few bf16 units in the last place. In fp32 on the CPU the decode matches diffusers' to rounding.

Measured (``benchmarks/vae_bench.py --profile``, H100, random weights, bf16, channels-last conv weights, fused
norms): Wan2.1 480x832x81 1,354 -> 987 ms and 3.95 -> 3.66 GiB peak; Wan2.2-TI2V 704x1280x41 1,626 -> 1,305 ms
(before :func:`repeated_channels`) and 9.24 -> 7.52 GiB. Item 6: Wan2.1 480p 989 -> 852 ms, 720p 2,275 -> 1,959 ms
(RESULTS.md 11.2).

Not changed (the next steps): the copy of x into the time-padded buffer (about half of the remaining ~99 ms of
device-to-device copies at 480p: the producer, the RMSNorm+SiLU kernel, would have to write into the buffer's tail), the
two-frame feature-cache clones, the bias of the 1x1x1 shortcut convs (it could join the residual kernel).
(``AutoencoderKLWan._decode``'s per-frame ``torch.cat`` of the output is gone with
:func:`fastwan.vae.decode.decode_latents`, which concatenates once.)
"""
from __future__ import annotations

import functools
import inspect
import math

import torch
import torch.nn.functional as F
from torch import nn

from fastwan.kernels import triton_importable

CACHE_T = 2  # frames each causal conv keeps from the previous chunk (diffusers' CACHE_T)
CL3D = torch.channels_last_3d
_NEAREST_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
MIN_BIAS_C = 16  # fewer channels (the 3-channel conv_out): PyTorch's add is as fast (H100: 0.016 vs 0.037 ms)


def _channels_last(t: torch.Tensor) -> bool:
    """A 5-D tensor dense in channels-last-3d order (and not also plain contiguous, as tensors with C == 1 are)."""
    return t.dim() == 5 and not t.is_contiguous() and t.is_contiguous(memory_format=CL3D)


def _layout_like(*ts: torch.Tensor) -> torch.memory_format:
    """channels_last_3d if any of ``ts`` is channels-last (what cuDNN and oneDNN then compute in), else
    contiguous."""
    return CL3D if any(_channels_last(t) for t in ts) else torch.contiguous_format


def time_pad(x: torch.Tensor, cache: torch.Tensor | None, pad_t: int,
             memory_format: torch.memory_format = torch.contiguous_format) -> torch.Tensor:
    """[zeros, last cached frames, x] along dim 2, ``pad_t`` frames in front of x, as one new tensor.

    What diffusers' ``cat([cache, x], 2)`` + ``F.pad(time: pad_t - cache frames)`` puts on the time axis: the
    last ``min(frames, pad_t)`` cached frames (a longer cache is cropped from the front, as a negative pad does),
    zero frames in front of them for the rest."""
    b, c, t, h, w = x.shape
    n = 0 if cache is None else min(cache.shape[2], pad_t)
    dtype = x.dtype
    if n:
        if cache.dim() != 5 or cache.shape[:2] != x.shape[:2] or cache.shape[3:] != x.shape[3:]:
            raise ValueError(f"feature cache {tuple(cache.shape)} does not fit input {tuple(x.shape)} "
                             "(sizes must match except along time)")
        dtype = torch.promote_types(dtype, cache.dtype)  # as torch.cat would
    out = torch.empty((b, c, pad_t + t, h, w), dtype=dtype, device=x.device, memory_format=memory_format)
    z = pad_t - n
    if z:
        out[:, :, :z].zero_()
    if n:
        out[:, :, z:pad_t].copy_(cache[:, :, cache.shape[2] - n:])
    out[:, :, pad_t:].copy_(x)
    return out


@functools.cache
def _bias_kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def bias_rows(Y, BIAS, RES, R, C, HAS_RES: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
        # channels-last: Y is [R, C] dense (R = batch x positions); a [BR, BC] tile, the bias loaded once.
        # HAS_RES: then + RES (same layout), rounded again: PyTorch's (y + bias) + res, in one pass
        r = (tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR))[:, None]
        c = tl.arange(0, BC)[None, :]
        m = (r < R) & (c < C)
        b = tl.load(BIAS + c, mask=c < C, other=0.0).to(tl.float32)
        y = tl.load(Y + r * C + c, mask=m, other=0.0).to(tl.float32)
        out = (y + b).to(Y.dtype.element_ty)
        if HAS_RES:
            out = (out.to(tl.float32) + tl.load(RES + r * C + c, mask=m, other=0.0).to(tl.float32)).to(
                Y.dtype.element_ty)
        tl.store(Y + r * C + c, out, mask=m)

    @triton.jit
    def bias_planes(Y, BIAS, RES, S, C, HAS_RES: tl.constexpr, BS: tl.constexpr):
        # channels-first: Y is [B * C, S] dense; program (i, plane) adds channel plane % C's bias to BS elements
        # (and, HAS_RES, then RES's elements, rounding in between as above)
        plane = tl.program_id(1).to(tl.int64)
        p = tl.program_id(0).to(tl.int64) * BS + tl.arange(0, BS)
        b = tl.load(BIAS + plane % C).to(tl.float32)
        y = tl.load(Y + plane * S + p, mask=p < S, other=0.0).to(tl.float32)
        out = (y + b).to(Y.dtype.element_ty)
        if HAS_RES:
            out = (out.to(tl.float32) + tl.load(RES + plane * S + p, mask=p < S, other=0.0).to(tl.float32)).to(
                Y.dtype.element_ty)
        tl.store(Y + plane * S + p, out, mask=p < S)

    return bias_rows, bias_planes


def _dense_layout(y: torch.Tensor) -> str | None:
    """'cl' when y's channels are its innermost dense dim, 'cf' when y is contiguous, else None."""
    cl = CL3D if y.dim() == 5 else torch.channels_last if y.dim() == 4 else None
    if cl is not None and y.is_contiguous(memory_format=cl):
        return "cl"
    return "cf" if y.is_contiguous() else None


def _bias_kernel_usable(y: torch.Tensor, bias: torch.Tensor) -> bool:
    return (_kernel_device(y) and y.dtype in (torch.float16, torch.bfloat16, torch.float32) and bias.dtype == y.dtype
            and not (torch.is_grad_enabled() and (y.requires_grad or bias.requires_grad))
            and bias.device == y.device and bias.numel() == y.shape[1] and y.numel() > 0
            and _dense_layout(y) is not None and triton_importable())


def bias_kernel_ok(y: torch.Tensor, bias: torch.Tensor) -> bool:
    """Where :func:`add_channel_bias_` runs its kernel: CUDA, a dense layout, >= MIN_BIAS_C channels, and no
    autograd to feed (the kernel has no backward)."""
    return y.dim() >= 2 and y.shape[1] >= MIN_BIAS_C and _bias_kernel_usable(y, bias)


def residual_kernel_ok(y: torch.Tensor, bias: torch.Tensor, res: torch.Tensor) -> bool:
    """Where :func:`add_bias_residual` runs its one-pass kernel: as for :func:`bias_kernel_ok` (any channel
    count: the alternative is two passes), and ``res`` of y's shape, dtype, device and dense layout."""
    return (y.dim() >= 2 and isinstance(res, torch.Tensor) and res.shape == y.shape and res.dtype == y.dtype
            and res.device == y.device and not (torch.is_grad_enabled() and res.requires_grad)
            and _bias_kernel_usable(y, bias) and _dense_layout(res) == _dense_layout(y))


def _launch_bias(y: torch.Tensor, bias: torch.Tensor, res: torch.Tensor | None) -> torch.Tensor:
    import triton

    c = y.shape[1]
    b = bias.reshape(-1).contiguous()
    rows, planes = _bias_kernels()
    if _dense_layout(y) == "cl":
        r = y.numel() // c
        bc = triton.next_power_of_2(c)
        br = max(1, 4096 // bc)
        rows[(triton.cdiv(r, br),)](y, b, y if res is None else res, r, c, HAS_RES=res is not None, BR=br, BC=bc,
                                    num_warps=4)
    else:
        s = y.numel() // (y.shape[0] * c)
        bs = min(4096, triton.next_power_of_2(s))
        planes[(triton.cdiv(s, bs), y.shape[0] * c)](y, b, y if res is None else res, s, c,
                                                      HAS_RES=res is not None, BS=bs, num_warps=4)
    return y


def add_channel_bias_(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``y += bias`` over dim 1, in place: what PyTorch does after a cuDNN convolution (``output.add_(bias
    reshaped)``), with the same fp32 sum and one rounding to y's dtype, but as a Triton kernel that reads and
    writes y with vector accesses. PyTorch's add broadcasts the bias through TensorIterator's strided,
    non-vectorised path (``elementwise_kernel<128, 4>``: ~115 ms of a 480p 81-frame decode on an H100)."""
    if not bias_kernel_ok(y, bias):
        return y.add_(bias.reshape((1, -1) + (1,) * (y.dim() - 2)))
    return _launch_bias(y, bias, None)


def add_bias_residual(y: torch.Tensor, bias: torch.Tensor | None, res: torch.Tensor) -> torch.Tensor:
    """``add_channel_bias_(y, bias) + res`` (a residual block's conv2 output, its deferred bias, the shortcut):
    where :func:`residual_kernel_ok`, one kernel pass that writes ``(y + bias rounded to y's dtype) + res``,
    rounded again, into y -- the bits of the two-step route (fp32 sums, one rounding after each), one read and
    write of the activation fewer. Otherwise the two steps (``x + res`` out of place, as diffusers adds)."""
    if bias is None:
        return y + res
    if residual_kernel_ok(y, bias, res):
        return _launch_bias(y, bias, res)
    return add_channel_bias_(y, bias) + res


def _conv_deferred(conv, x, weight, bias, stride, padding, dilation, groups):
    """(y, bias still to add): on CUDA (cuDNN adds the bias as a separate pass anyway) the convolution without
    its bias; elsewhere ``conv(x, weight, bias, ...)`` and None."""
    if bias is None or not (_kernel_device(x) and torch.backends.cudnn.enabled):
        return conv(x, weight, bias, stride, padding, dilation, groups), None
    return conv(x, weight, None, stride, padding, dilation, groups), bias


def _conv(conv, x, weight, bias, stride, padding, dilation, groups):
    """``conv(x, weight, bias, ...)``; on CUDA the bias is added by :func:`add_channel_bias_`."""
    y, pending = _conv_deferred(conv, x, weight, bias, stride, padding, dilation, groups)
    return y if pending is None else add_channel_bias_(y, pending)


class CausalConv3dMixin:
    """Mixin for ``WanCausalConv3d``: H/W zero padding by the conv itself, time padding (cache + zeros) built
    once, no copy at all when there is no time padding; the bias by :func:`add_channel_bias_` on CUDA; narrow
    convolutions as one conv2d over stacked time taps (:func:`stacked_taps_ok`)."""

    def forward(self, x, cache_x=None):
        y, bias = self.forward_deferred_bias(x, cache_x)
        return y if bias is None else add_channel_bias_(y, bias)

    def forward_deferred_bias(self, x, cache_x=None):
        """(y, bias): where the bias would be a pass of its own (CUDA), the convolution without it and the bias
        -- ``add_channel_bias_(y, bias)`` is :meth:`forward`'s output --, else (forward's output, None). The
        residual blocks (:class:`ResidualBlockMixin`) add it in the pass that reads y next."""
        pw, ph, pt = self._padding[0], self._padding[2], self._padding[4]
        if pt > 0 and stacked_taps_ok(self, x, pt):
            return stacked_taps_conv(self, x, cache_x, pt, add_bias=False), self.bias
        if pt > 0:  # diffusers ignores the cache of a conv without time padding, and so does this
            x = time_pad(x, cache_x, pt, _layout_like(x, self.weight))
        return _conv_deferred(F.conv3d, x, self.weight, self.bias, self.stride, (0, ph, pw), self.dilation,
                              self.groups)


# -- narrow 3-D convolutions as one conv2d over stacked time taps ------------------------------------------------
# cuDNN 9.19 runs the Wan2.1 decoder's full-resolution 96-channel 3x3x3 convolution with an sm80 kernel at ~245
# TFLOP/s on an H100, while the same sums as a conv2d over 3 x 96 stacked channels run at ~510 (RESULTS.md 11.2;
# 192 and 384 channels: conv3d is as fast or faster). Convolutions with at most this many input channels take the
# stacked route on CUDA in half precision.
STACK_TAPS_MAX_CHANNELS = 96
STACK_TAPS_DTYPES = (torch.bfloat16, torch.float16)  # where it was measured


def _kernel_device(x: torch.Tensor) -> bool:
    """Whether x lives where the Triton kernels run (CUDA; the interpreter tests widen this)."""
    return x.is_cuda


def stacked_taps_ok(conv: nn.Conv3d, x: torch.Tensor, pad_t: int) -> bool:
    """Whether ``conv`` (a causal conv with ``pad_t`` frames of time padding) on ``x`` takes
    :func:`stacked_taps_conv`: CUDA, bf16/fp16, at most ``STACK_TAPS_MAX_CHANNELS`` input channels, a dense
    channels-last x, time stride and dilation 1, one group, kernel time size pad_t + 1 (causal), and no autograd."""
    w = conv.weight
    return (_kernel_device(x) and x.dtype in STACK_TAPS_DTYPES and w.dtype == x.dtype
            and x.shape[1] <= STACK_TAPS_MAX_CHANNELS and conv.groups == 1 and conv.stride[0] == 1
            and conv.dilation[0] == 1 and w.shape[2] == pad_t + 1 and x.shape[2] > 0
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
            and _dense_layout(x) == "cl" and triton_importable())


@functools.cache
def _stack_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def stack_taps(X, CACHE, OUT, T, TC, P, C, PAD_T, Z, N, KT: tl.constexpr, BP: tl.constexpr,
                   BC: tl.constexpr):
        # program (pixel block, b * T * KT + t * KT + i): tap i of output frame t of sample b. Its source is frame
        # j = t + i of [Z zero frames, the last N cached frames, x]; all tensors channels-last (rows of C values).
        pid = tl.program_id(1)
        i = pid % KT
        t = (pid // KT) % T
        b = pid // (KT * T)
        j = t + i
        p = (tl.program_id(0).to(tl.int64) * BP + tl.arange(0, BP))[:, None]
        c = tl.arange(0, BC)[None, :]
        m = (p < P) & (c < C)
        jj = tl.zeros([BP, 1], dtype=tl.int32) + j  # the source frame as a tensor, for the masks
        from_x = m & (jj >= PAD_T)
        from_cache = m & (jj >= Z) & (jj < PAD_T)
        xrow = (b.to(tl.int64) * T + (j - PAD_T)) * P
        crow = (b.to(tl.int64) * TC + (TC - N + j - Z)) * P
        v = tl.load(X + (xrow + p) * C + c, mask=from_x, other=0.0)
        v += tl.load(CACHE + (crow + p) * C + c, mask=from_cache, other=0.0)
        orow = (b.to(tl.int64) * T + t) * P
        tl.store(OUT + (orow + p) * (KT * C) + i * C + c, v, mask=m)

    return stack_taps


def stack_time_taps(x: torch.Tensor, cache: torch.Tensor | None, pad_t: int, kt: int) -> torch.Tensor:
    """The time taps of a causal conv stacked along channels.

    x: [B, C, T, H, W] channels-last; cache: [B, C, Tc, H, W] (the last frames of the previous chunk) or None.
    Returns [B * T, kt * C, H, W] channels-last whose frame (b, t) holds, in channel blocks i = 0..kt-1, frame
    t + i of [zeros, last cached frames, x] (``pad_t`` frames in front of x, as :func:`time_pad` builds them).
    On CUDA one Triton kernel; elsewhere PyTorch copies (the reference)."""
    b, c, t, h, w = x.shape
    n = 0 if cache is None else min(cache.shape[2], pad_t)
    if n and (cache.dim() != 5 or cache.shape[:2] != x.shape[:2] or cache.shape[3:] != x.shape[3:]):
        raise ValueError(f"feature cache {tuple(cache.shape)} does not fit input {tuple(x.shape)} "
                         "(sizes must match except along time)")
    out = torch.empty((b, t, h, w, kt * c), dtype=x.dtype, device=x.device)
    if _kernel_device(x) and triton_importable():
        import triton

        xs = x.contiguous(memory_format=CL3D)
        cs = cache.to(x.dtype).contiguous(memory_format=CL3D) if n else xs  # unread when n == 0
        bc = triton.next_power_of_2(c)
        bp = max(1, 4096 // bc)
        _stack_kernel()[(triton.cdiv(h * w, bp), b * t * kt)](
            xs, cs, out, t, cs.shape[2], h * w, c, pad_t, pad_t - n, n, KT=kt, BP=bp, BC=bc, num_warps=4)
    else:
        padded = time_pad(x, cache, pad_t, CL3D).permute(0, 2, 3, 4, 1)  # [B, T + pad_t, H, W, C]
        for i in range(kt):
            out[..., i * c:(i + 1) * c] = padded[:, i:i + t]
    return out.view(b * t, h, w, kt * c).permute(0, 3, 1, 2)


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
    """Mixin for the ``nn.Conv2d`` of a ``WanResample``: the bias by :func:`add_channel_bias_` on CUDA."""

    def forward(self, x):
        return _conv(F.conv2d, x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


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
    conv's bias added where the activation is read next instead of in a pass of its own (on CUDA, where the
    convs defer it): conv1's by the fused RMSNorm+SiLU (``pre_bias`` of
    :class:`~fastwan.vae.norms.RMSNormSiLU`), conv2's by the residual add (:func:`add_bias_residual`).
    Without a fused norm2, or with hooks on the convs, the bias is added by :func:`add_channel_bias_` as before."""

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


def _swap(mod: nn.Module, mixin: type) -> None:
    mod.__class__ = _swapped_class(type(mod), mixin)


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


def fast_decoder_convs(vae: nn.Module) -> int:
    """Swap, in place, the modules of ``vae`` (a diffusers ``AutoencoderKLWan``) listed in this module's
    docstring for subclasses that copy less: every ``WanCausalConv3d``, the ``upsample3d`` ``WanResample``\\ s,
    nearest ``WanUpsample``\\ s, ``DupUp3D``\\ s, ``WanResidualUpBlock``\\ s and ``WanResidualBlock``\\ s.
    Parameters, buffers, state-dict names and ``isinstance`` checks are unchanged. A module whose attributes are
    not the expected ones (another diffusers release, or one already swapped) is left alone. Independent of
    :func:`fastwan.vae.norms.fuse_decoder_norms` (either order). Returns the number of modules swapped."""
    swapped = 0
    in_resample = _resample_parts(vae)
    for mod in vae.modules():
        if id(mod) in in_resample and _is_resample_conv2d(mod):
            _swap(mod, ResampleConv2dMixin)
            swapped += 1
            continue
        for check, mixin in _SWAPS:
            if check(mod):
                _swap(mod, mixin)
                swapped += 1
                break
    return swapped
