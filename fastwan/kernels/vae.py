"""The Wan VAE decoder's kernels (Triton on CUDA), each with its PyTorch reference; :mod:`fastwan.vae` swaps
them into diffusers' ``AutoencoderKLWan``.

* ``fastwan::rms_silu`` (custom op): diffusers' ``WanRMS_norm`` followed by SiLU in one pass,
  ``y = silu(x / max(||x||_2 over channels, 1e-12) * sqrt(C) * gamma + bias)`` in fp32, rounded once to x's dtype
  (diffusers rounds after the norm, each product and the SiLU: bf16 results differ by a few units in the last
  place, fp32 ones agree to rounding). With ``pre_bias`` (the bias of the conv before the norm) x is first
  replaced by ``x + pre_bias`` rounded to x's dtype: what the separate bias add would have stored.
* :func:`add_channel_bias_`: a conv's bias added in place, PyTorch's fp32 sum and rounding, with vector accesses
  (H100: ~2.9 TB/s, against ~1.35 TB/s for the strided broadcast add PyTorch runs after a cuDNN conv).
* :func:`add_bias_residual`: ``(y + bias) + res`` with PyTorch's two roundings, in one pass where y and res are
  dense in one layout.
* :func:`stack_time_taps`: the time taps of a causal conv stacked along channels, read straight from the feature
  cache and x (:func:`time_pad` is the frame sequence it reads).

Each runs its kernel where :func:`fastwan.kernels.triton_runs` holds for its inputs (with the dtypes below) and
its layout predicate holds; its PyTorch reference elsewhere. ``<name>_triton`` is the kernel route itself, on any
device the kernel can address (the tests run it on the CPU under ``TRITON_INTERPRET=1``).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from fastwan.kernels import triton_runs

CL3D = torch.channels_last_3d
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # every kernel here computes in fp32
MIN_BIAS_C = 16  # fewer channels (the 3-channel conv_out): PyTorch's add is as fast (H100: 0.016 vs 0.037 ms)
RMS_EPS = 1e-12  # F.normalize's default, as WanRMS_norm uses it
RMS_MAX_C = 4096  # one program holds all channels of its positions


# ---------------------------------------------------------------------------------------------- layouts
def dense_layout(t: torch.Tensor) -> str | None:
    """'cl' when t's channels (dim 1) are its innermost dense dim (channels-last 4-D / 5-D), 'cf' when t is
    contiguous, else None. (A tensor that is both indexes the same either way.)"""
    cl = CL3D if t.dim() == 5 else torch.channels_last if t.dim() == 4 else None
    if cl is not None and t.is_contiguous(memory_format=cl):
        return "cl"
    return "cf" if t.is_contiguous() else None


def no_autograd(*tensors: torch.Tensor | None) -> bool:
    """No gradient to feed through these tensors (the kernels have no backward)."""
    return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))


def bias_fits(y: torch.Tensor, bias: torch.Tensor) -> bool:
    """``bias`` is y's per-channel vector (y's dtype and device, one value per channel of dim 1), y is non-empty
    and dense (:func:`dense_layout`), and no autograd is involved."""
    return (y.dim() >= 2 and bias.dtype == y.dtype and bias.device == y.device and bias.numel() == y.shape[1]
            and y.numel() > 0 and dense_layout(y) is not None and no_autograd(y, bias))


def residual_fits(y: torch.Tensor, bias: torch.Tensor, res) -> bool:
    """:func:`bias_fits`, and ``res`` a tensor of y's shape, dtype and device, dense in y's layout."""
    return (isinstance(res, torch.Tensor) and res.shape == y.shape and res.dtype == y.dtype
            and res.device == y.device and bias_fits(y, bias) and dense_layout(res) == dense_layout(y)
            and no_autograd(res))


def rms_silu_fits(x: torch.Tensor, pre_bias: torch.Tensor | None) -> bool:
    """x at least 3-D, non-empty, dense (:func:`dense_layout`), at most ``RMS_MAX_C`` channels; pre_bias (if
    any) on x's device."""
    return (x.dim() >= 3 and x.numel() > 0 and x.shape[1] <= RMS_MAX_C and dense_layout(x) is not None
            and (pre_bias is None or pre_bias.device == x.device))


# ---------------------------------------------------------------------------------------------- kernels
@functools.cache
def _kernels():
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

    return bias_rows, bias_planes, stack_taps, rms_silu_tiles


# ---------------------------------------------------------------------------------------------- conv bias
def add_bias_triton(y: torch.Tensor, bias: torch.Tensor, res: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel route of :func:`add_channel_bias_` (``res`` None) and :func:`add_bias_residual`: writes
    ``y + bias`` (then ``+ res``, rounded after each sum) into y, which must be dense (:func:`dense_layout`)."""
    import triton

    c = y.shape[1]
    b = bias.reshape(-1).contiguous()
    rows, planes = _kernels()[:2]
    if dense_layout(y) == "cl":
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
    """``y += bias`` over dim 1, in place, with PyTorch's fp32 sum and one rounding to y's dtype: the kernel for
    dense tensors of at least ``MIN_BIAS_C`` channels, PyTorch's broadcast add otherwise."""
    if triton_runs(y, bias, dtypes=KERNEL_DTYPES) and bias_fits(y, bias) and y.shape[1] >= MIN_BIAS_C:
        return add_bias_triton(y, bias)
    return y.add_(bias.reshape((1, -1) + (1,) * (y.dim() - 2)))


def add_bias_residual(y: torch.Tensor, bias: torch.Tensor | None, res: torch.Tensor) -> torch.Tensor:
    """``add_channel_bias_(y, bias) + res`` (a residual block's conv2 output, its deferred bias, the shortcut).
    Where :func:`residual_fits`, one kernel pass writes ``(y + bias rounded to y's dtype) + res``, rounded again,
    into y: the bits of the two steps (any channel count: the alternative is two passes). Otherwise the two steps,
    the second out of place as diffusers adds."""
    if bias is None:
        return y + res
    if residual_fits(y, bias, res) and triton_runs(y, bias, res, dtypes=KERNEL_DTYPES):
        return add_bias_triton(y, bias, res)
    return add_channel_bias_(y, bias) + res


# ---------------------------------------------------------------------------------------------- time taps
def _check_cache(x: torch.Tensor, cache: torch.Tensor | None, n: int) -> None:
    if n and (cache.dim() != 5 or cache.shape[:2] != x.shape[:2] or cache.shape[3:] != x.shape[3:]):
        raise ValueError(f"feature cache {tuple(cache.shape)} does not fit input {tuple(x.shape)} "
                         "(sizes must match except along time)")


def time_pad(x: torch.Tensor, cache: torch.Tensor | None, pad_t: int,
             memory_format: torch.memory_format = torch.contiguous_format) -> torch.Tensor:
    """[zeros, last cached frames, x] along dim 2, ``pad_t`` frames in front of x, as one new tensor.

    What diffusers' ``cat([cache, x], 2)`` + ``F.pad(time: pad_t - cache frames)`` puts on the time axis: the
    last ``min(frames, pad_t)`` cached frames (a longer cache is cropped from the front, as a negative pad does),
    zero frames in front of them for the rest."""
    b, c, t, h, w = x.shape
    n = 0 if cache is None else min(cache.shape[2], pad_t)
    _check_cache(x, cache, n)
    dtype = torch.promote_types(x.dtype, cache.dtype) if n else x.dtype  # as torch.cat would
    out = torch.empty((b, c, pad_t + t, h, w), dtype=dtype, device=x.device, memory_format=memory_format)
    z = pad_t - n
    if z:
        out[:, :, :z].zero_()
    if n:
        out[:, :, z:pad_t].copy_(cache[:, :, cache.shape[2] - n:])
    out[:, :, pad_t:].copy_(x)
    return out


def stack_time_taps_reference(x: torch.Tensor, cache: torch.Tensor | None, pad_t: int, kt: int) -> torch.Tensor:
    """:func:`stack_time_taps` as PyTorch copies out of :func:`time_pad`."""
    b, c, t, h, w = x.shape
    out = torch.empty((b, t, h, w, kt * c), dtype=x.dtype, device=x.device)
    padded = time_pad(x, cache, pad_t, CL3D).permute(0, 2, 3, 4, 1)  # [B, T + pad_t, H, W, C]
    for i in range(kt):
        out[..., i * c:(i + 1) * c] = padded[:, i:i + t]
    return out.view(b * t, h, w, kt * c).permute(0, 3, 1, 2)


def stack_time_taps_triton(x: torch.Tensor, cache: torch.Tensor | None, pad_t: int, kt: int) -> torch.Tensor:
    """:func:`stack_time_taps` as one kernel launch."""
    import triton

    b, c, t, h, w = x.shape
    n = 0 if cache is None else min(cache.shape[2], pad_t)
    _check_cache(x, cache, n)
    out = torch.empty((b, t, h, w, kt * c), dtype=x.dtype, device=x.device)
    xs = x.contiguous(memory_format=CL3D)
    cs = cache.to(x.dtype).contiguous(memory_format=CL3D) if n else xs  # unread when n == 0
    bc = triton.next_power_of_2(c)
    bp = max(1, 4096 // bc)
    _kernels()[2][(triton.cdiv(h * w, bp), b * t * kt)](
        xs, cs, out, t, cs.shape[2], h * w, c, pad_t, pad_t - n, n, KT=kt, BP=bp, BC=bc, num_warps=4)
    return out.view(b * t, h, w, kt * c).permute(0, 3, 1, 2)


def stack_time_taps(x: torch.Tensor, cache: torch.Tensor | None, pad_t: int, kt: int) -> torch.Tensor:
    """The time taps of a causal conv stacked along channels.

    x: [B, C, T, H, W]; cache: [B, C, Tc, H, W] (the last frames of the previous chunk) or None. Returns
    [B * T, kt * C, H, W] channels-last whose frame (b, t) holds, in channel blocks i = 0..kt-1, frame t + i of
    [zeros, last cached frames, x] (``pad_t`` frames in front of x, as :func:`time_pad` builds them); ``pad_t``
    must be at least ``kt - 1``, so that every tap of the last frame exists."""
    if kt < 1 or pad_t < kt - 1:
        raise ValueError(f"stack_time_taps: kt={kt} taps need pad_t >= kt - 1 = {kt - 1} frames in front of x, got "
                         f"pad_t={pad_t} (a causal conv pads kt - 1)")
    n = 0 if cache is None else min(cache.shape[2], pad_t)
    _check_cache(x, cache, n)
    if triton_runs(x, dtypes=KERNEL_DTYPES):
        return stack_time_taps_triton(x, cache, pad_t, kt)
    return stack_time_taps_reference(x, cache, pad_t, kt)


# ---------------------------------------------------------------------------------------------- rms_silu
def rms_silu_reference(x: torch.Tensor, gamma: torch.Tensor, bias: torch.Tensor | None,
                       pre_bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, C, *spatial] -> silu(normalize(x, dim=1) * sqrt(C) * gamma + bias), fp32 math, x's dtype; with
    ``pre_bias``, of ``(x + pre_bias).to(x.dtype)`` (a conv bias added as ``x.add_(pre_bias)`` would: fp32 sum,
    one rounding)."""
    c = x.shape[1]
    shape = (1, c) + (1,) * (x.dim() - 2)
    if pre_bias is not None:
        x = torch.add(x, pre_bias.reshape(shape)).to(x.dtype)
    y = F.normalize(x.float(), dim=1, eps=RMS_EPS) * (c ** 0.5 * gamma.float().reshape(shape))
    if bias is not None:
        y = y + bias.float().reshape(shape)
    return F.silu(y).to(x.dtype)


def rms_silu_triton(x: torch.Tensor, gamma: torch.Tensor, bias: torch.Tensor | None,
                    pre_bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel route of ``fastwan::rms_silu``; x must satisfy :func:`rms_silu_fits`."""
    import triton

    B, C = x.shape[0], x.shape[1]
    P = x.numel() // (B * C)
    y = torch.empty_like(x)  # a dense input keeps its strides
    bc = triton.next_power_of_2(C)
    bp = max(1, min(triton.next_power_of_2(P), 4096 // bc))
    g = gamma.reshape(-1).contiguous()
    bb = bias.reshape(-1).contiguous() if bias is not None else g
    pb = pre_bias.reshape(-1).contiguous() if pre_bias is not None else g
    _kernels()[3][(triton.cdiv(P, bp), B)](x, g, bb, pb, y, C, P, float(C) ** 0.5, RMS_EPS,
                                           CL=dense_layout(x) == "cl", HAS_BIAS=bias is not None,
                                           HAS_PRE=pre_bias is not None, BC=bc, BP=bp, num_warps=4)
    return y


@torch.library.custom_op("fastwan::rms_silu", mutates_args=())
def rms_silu(x: torch.Tensor, gamma: torch.Tensor, bias: torch.Tensor | None,
             pre_bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, C, *spatial], gamma/bias/pre_bias [C] -> like x (a dense input keeps its strides). ``pre_bias`` is
    added to x first, rounded to x's dtype (:func:`rms_silu_reference`)."""
    if any(t is not None and t.numel() != x.shape[1] for t in (gamma, bias, pre_bias)):
        raise ValueError(f"rms_silu: gamma {tuple(gamma.shape)} / bias {None if bias is None else tuple(bias.shape)}"
                         f" / pre_bias {None if pre_bias is None else tuple(pre_bias.shape)}"
                         f" do not have the {x.shape[1]} channels of x {tuple(x.shape)}")
    if triton_runs(x, pre_bias, dtypes=KERNEL_DTYPES) and rms_silu_fits(x, pre_bias):
        return rms_silu_triton(x, gamma, bias, pre_bias)
    return rms_silu_reference(x, gamma, bias, pre_bias)


@rms_silu.register_fake
def _(x, gamma, bias, pre_bias=None):
    return torch.empty_like(x)
