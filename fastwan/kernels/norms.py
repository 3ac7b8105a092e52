"""Row kernels for the Wan block's norms (Triton on CUDA), as ``torch.library`` custom ops.

Inductor compiles the block's LayerNorm + modulation and q/k RMSNorm + RoPE into looped reductions when the
hidden size is above 1,024 (Wan: 1,536 / 3,072 / 5,120), which read every row twice (H100: 0.8 GB in 0.55 ms,
1.45 TB/s). The LayerNorm kernels hold a whole row in registers and read each input once; the RMSNorm + RoPE
kernel, with four fp32 operands per element, reads its row in two passes of small chunks, the second from cache
(eviction hints keep the row in L2 between them), so that many rows are in flight. Each op has the same math as
the plain PyTorch path of the DiT (fp32 statistics, the same bf16 roundings): its ``*_reference``, which it runs
wherever :func:`fastwan.kernels.triton_runs` does not hold for x (fp16/bf16, at most ``MAX_C`` channels).
``*_triton`` is the kernel route itself (the tests run it on the CPU under ``TRITON_INTERPRET=1``).

Ops (all tensors [B, S, C] unless noted; ``scale``/``shift``/``gate``: fp32 [B, 1, C] or [B, S, C] views):

* ``norm_mod(x, weight?, bias?, scale?, shift?, eps) -> h``:
  ``h = (LN(x) [* weight + bias]) [* (1 + scale) + shift]`` rounded to x's dtype;
* ``residual_norm_mod(x, y, gate?, weight?, bias?, scale?, shift?, eps) -> (r, h)``:
  ``r = x + y [* gate]`` (fp32, rounded to x's dtype), then ``h = norm_mod(r, ...)``;
* ``offset_norm_mod(x, offset?, weight?, bias?, scale?, shift?, eps) -> h``: ``norm_mod(x + offset)`` with an
  fp32 per-channel offset [B or 1, 1, C] that is added in fp32 and not stored;
* ``residual_linear_(x, a, weight)``: ``x += a @ weight^T`` in place, one GEMM reading x as its C operand
  (no kernel of ours: cuBLAS through ``addmm_``; an op so that torch.compile keeps it in place);
* ``residual_bmm_(x, a, u)``: ``x += a @ u`` in place with per-sample u [B or 1, K, N] (cuBLAS, as above);
* ``rms_rope(x, weight, table?, eps, head_dim) -> out``: RMSNorm over C with a low-precision weight, then the
  interleaved-pair RoPE of :func:`apply_rope` (table fp32 [1, S, 1, 2 * head_dim]).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from fastwan.kernels import triton_runs

MAX_C = 16384  # one row in registers
# The RMSNorm + RoPE kernel's chunk (channels) and warps: the best of 3 chunks x 3 warp counts on an H100 over
# the 1.3B, 5B and 14B widths (benchmarks/HISTORY.md, "Decisions"): 0.70-0.93x the time of one whole row in
# registers, whose four fp32 operands per element left one program per SM.
ROPE_CHUNK, ROPE_WARPS = 1024, 2


# ---------------------------------------------------------------------------------------------- reference
def norm_mod_reference(x, weight, bias, scale, shift, eps: float) -> torch.Tensor:
    w = None if weight is None else weight.float()
    b = None if bias is None else bias.float()
    h = F.layer_norm(x.float(), (x.shape[-1],), w, b, eps)
    if scale is not None:
        h = h * (1 + scale) + shift
    return h.to(x.dtype)


def offset_norm_mod_reference(x, offset, weight, bias, scale, shift, eps: float) -> torch.Tensor:
    return norm_mod_reference(x.float() + offset if offset is not None else x, weight, bias, scale, shift,
                              eps).to(x.dtype)


def residual_reference(x, y, gate) -> torch.Tensor:
    return (x.float() + (y.float() * gate if gate is not None else y.float())).to(x.dtype)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved channel pairs in fp32. x: [B, S, H, D]; table: [1, S, 1, 2D] -> x.dtype.

    out[2i] = x[2i] cos - x[2i+1] sin and out[2i+1] = x[2i] sin + x[2i+1] cos, computed as
    x * cos + swap_pairs(x) * signed_sin with every operand contiguous.
    """
    d = x.shape[-1]
    swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return (x * table[..., :d] + swapped * table[..., d:]).type_as(x)  # bf16 * fp32 computes in fp32


def rms_rope_reference(x, weight, table, eps: float, head_dim: int) -> torch.Tensor:
    y = F.rms_norm(x, (x.shape[-1],), eps=eps).to(weight.dtype) * weight
    if table is None:
        return y
    return apply_rope(y.unflatten(-1, (-1, head_dim)), table).flatten(-2)


# ---------------------------------------------------------------------------------------------- kernels
@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def norm_rows(X, Y, G, g_sb, g_ss, P, p_sb, p_ss, W, BIAS, SC, sc_sb, sc_ss, SH, sh_sb, sh_ss, R, H, S, C,
                  eps, HAS_Y: tl.constexpr, HAS_G: tl.constexpr, HAS_P: tl.constexpr, AFFINE: tl.constexpr,
                  MOD: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        b = row // S
        s = row - b * S
        offs = tl.arange(0, BLOCK)
        m = offs < C
        base = row * C
        x = tl.load(X + base + offs, mask=m, other=0.0).to(tl.float32)
        if HAS_Y:
            y = tl.load(Y + base + offs, mask=m, other=0.0).to(tl.float32)
            if HAS_G:
                y = y * tl.load(G + b * g_sb + s * g_ss + offs, mask=m, other=0.0).to(tl.float32)
            r = (x + y).to(R.dtype.element_ty)
            tl.store(R + base + offs, r, mask=m)
            x = r.to(tl.float32)
        if HAS_P:  # the residual stream's pending per-channel offset (fp32, not stored)
            x = x + tl.load(P + b * p_sb + s * p_ss + offs, mask=m, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=0) / C
        d = tl.where(m, x - mean, 0.0)
        var = tl.sum(d * d, axis=0) / C
        h = d * tl.rsqrt(var + eps)
        if AFFINE:
            h = h * tl.load(W + offs, mask=m, other=0.0).to(tl.float32) \
                + tl.load(BIAS + offs, mask=m, other=0.0).to(tl.float32)
        if MOD:
            sc = tl.load(SC + b * sc_sb + s * sc_ss + offs, mask=m, other=0.0).to(tl.float32)
            sh = tl.load(SH + b * sh_sb + s * sh_ss + offs, mask=m, other=0.0).to(tl.float32)
            h = h * (1.0 + sc) + sh
        tl.store(H + base + offs, h.to(H.dtype.element_ty), mask=m)

    @triton.jit
    def rms_rope_rows(X, W, T, OUT, S, C, D, eps, ROPE: tl.constexpr, HALF: tl.constexpr):
        # two passes over the row in chunks of 2 * HALF channels, each chunk as [pairs, 2] (channel 2i and its
        # RoPE partner 2i+1 side by side): the sum of squares, then the output, reading x again while it is still
        # in cache. Few registers per program, so many rows are in flight.
        row = tl.program_id(0).to(tl.int64)
        s = row % S
        base = row * C
        pair = tl.arange(0, HALF)[:, None] * 2 + tl.arange(0, 2)[None, :]
        acc = tl.zeros([HALF, 2], tl.float32)
        for start in range(0, C, 2 * HALF):
            offs = start + pair
            x = tl.load(X + base + offs, mask=offs < C, other=0.0, eviction_policy="evict_last").to(tl.float32)
            acc += x * x
        rstd = tl.rsqrt(tl.sum(tl.sum(acc, axis=1), axis=0) / C + eps)
        for start in range(0, C, 2 * HALF):
            offs = start + pair
            m = offs < C
            x = tl.load(X + base + offs, mask=m, other=0.0, eviction_policy="evict_first").to(tl.float32)
            w = tl.load(W + offs, mask=m, other=0.0).to(tl.float32)
            # the PyTorch path rounds twice: rms_norm's output, then the product with the weight
            y = ((x * rstd).to(OUT.dtype.element_ty).to(tl.float32) * w).to(OUT.dtype.element_ty).to(tl.float32)
            if ROPE:
                c = offs % D  # D is even: a pair never straddles two heads
                cos_e, cos_o = tl.split(tl.load(T + s * 2 * D + c, mask=m, other=0.0))
                sin_e, sin_o = tl.split(tl.load(T + s * 2 * D + D + c, mask=m, other=0.0))  # signed: -sin, +sin
                y_e, y_o = tl.split(y)
                y = tl.join(y_e * cos_e + y_o * sin_e, y_o * cos_o + y_e * sin_o)
            tl.store(OUT + base + offs, y.to(OUT.dtype.element_ty), mask=m)

    return norm_rows, rms_rope_rows


# Warps per row program, measured on an H100 (benchmarks/probes/fused_bench.py): fewer warps with more
# elements per thread beat wide programs at every Wan width; the LayerNorm kernel is fastest at 4 warps up to
# 8,192-wide blocks.
def _launch_cfg(C: int, per_thread: int) -> tuple[int, int]:
    """(power-of-two block >= C, warps: at most ``per_thread`` elements per thread, 4 to 16 warps)."""
    import triton

    block = triton.next_power_of_2(C)
    return block, min(16, max(4, block // (32 * per_thread)))


def _row_strides(t: torch.Tensor | None, S: int) -> tuple[torch.Tensor | None, int, int]:
    """A [B or 1, 1 or S, C] view -> (tensor with unit channel stride, batch stride, token stride); a size-1
    batch or token dim is broadcast (stride 0)."""
    if t is None:
        return None, 0, 0
    if t.dim() != 3 or t.shape[1] not in (1, S):
        raise ValueError(f"modulation/gate tensor of shape {tuple(t.shape)}: expected [B, 1, C] or [B, {S}, C]")
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t, (t.stride(0) if t.shape[0] > 1 else 0), (t.stride(1) if t.shape[1] > 1 else 0)


def _norm_launch(x, y, gate, weight, bias, scale, shift, eps, r, offset=None):
    norm_rows = _kernels()[0]
    x = x.contiguous()
    B, S, C = x.shape
    if (weight is None) != (bias is None):  # the kernel's affine step takes both: w = 1 and b = 0 are exact
        weight = torch.ones_like(bias) if weight is None else weight
        bias = torch.zeros_like(weight) if bias is None else bias
    h = torch.empty_like(x)
    y = y.contiguous() if y is not None else None
    gate, g_sb, g_ss = _row_strides(gate, S)
    offset, p_sb, p_ss = _row_strides(offset, S)
    scale, sc_sb, sc_ss = _row_strides(scale, S)
    shift, sh_sb, sh_ss = _row_strides(shift, S)
    block, warps = _launch_cfg(C, per_thread=64)
    dummy = x
    norm_rows[(B * S,)](
        x, y if y is not None else dummy, gate if gate is not None else dummy, g_sb, g_ss,
        offset if offset is not None else dummy, p_sb, p_ss,
        weight if weight is not None else dummy, bias if bias is not None else dummy,
        scale if scale is not None else dummy, sc_sb, sc_ss, shift if shift is not None else dummy, sh_sb, sh_ss,
        r if r is not None else dummy, h, S, C, eps,
        HAS_Y=y is not None, HAS_G=gate is not None, HAS_P=offset is not None, AFFINE=weight is not None,
        MOD=scale is not None,
        BLOCK=block, num_warps=warps,
    )
    return h


def norm_mod_triton(x, weight, bias, scale, shift, eps: float) -> torch.Tensor:
    """``fastwan::norm_mod``'s kernel route."""
    return _norm_launch(x, None, None, weight, bias, scale, shift, eps, None)


def offset_norm_mod_triton(x, offset, weight, bias, scale, shift, eps: float) -> torch.Tensor:
    """``fastwan::offset_norm_mod``'s kernel route."""
    return _norm_launch(x, None, None, weight, bias, scale, shift, eps, None, offset)


def residual_norm_mod_triton(x, y, gate, weight, bias, scale, shift, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``fastwan::residual_norm_mod``'s kernel route."""
    r = torch.empty_like(x, memory_format=torch.contiguous_format)
    return r, _norm_launch(x, y, gate, weight, bias, scale, shift, eps, r)


def rms_rope_triton(x, weight, table, eps: float, head_dim: int) -> torch.Tensor:
    """``fastwan::rms_rope``'s kernel route (``weight`` in x's dtype)."""
    import triton

    rms_rope_rows = _kernels()[1]
    x = x.contiguous()
    B, S, C = x.shape
    out = torch.empty_like(x)
    t = table.contiguous() if table is not None else x
    half = min(ROPE_CHUNK, triton.next_power_of_2(C)) // 2
    rms_rope_rows[(B * S,)](x, weight.contiguous(), t, out, S, C, head_dim, eps, ROPE=table is not None,
                            HALF=half, num_warps=ROPE_WARPS)
    return out


# ---------------------------------------------------------------------------------------------- ops
def check_norm_args(name: str, x, weight, bias, scale, shift, **views) -> None:
    """The shapes every norm op takes (ValueError naming the value and the rule): x [B, S, C]; weight, bias [C] or
    None (each on its own); scale and shift both or neither; scale, shift and the ``views`` (gate, offset, ...)
    [B or 1, S or 1, C] or None."""
    if x.dim() != 3:
        raise ValueError(f"{name}: x must be [B, S, C], got shape {tuple(x.shape)}")
    B, S, C = x.shape
    for what, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.shape != (C,):
            raise ValueError(f"{name}: {what} must be [{C}] (x's channels) or None, got {tuple(t.shape)}")
    if (scale is None) != (shift is None):
        raise ValueError(f"{name}: scale and shift go together (both [B or 1, S or 1, C] or both None), got scale "
                         f"{None if scale is None else tuple(scale.shape)} and shift "
                         f"{None if shift is None else tuple(shift.shape)}")
    for what, t in (("scale", scale), ("shift", shift), *views.items()):
        if t is not None and (t.dim() != 3 or t.shape[0] not in (1, B) or t.shape[1] not in (1, S) or t.shape[2] != C):
            raise ValueError(f"{name}: {what} must be [B or 1, S or 1, C] = [{B} or 1, {S} or 1, {C}], got "
                             f"{tuple(t.shape)}")


@torch.library.custom_op("fastwan::norm_mod", mutates_args=())
def norm_mod(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, scale: torch.Tensor | None,
             shift: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm over C (fp32 statistics) with optional affine and modulation; x [B, S, C] -> h like x."""
    check_norm_args("norm_mod", x, weight, bias, scale, shift)
    if triton_runs(x, max_last_dim=MAX_C):
        return norm_mod_triton(x, weight, bias, scale, shift, eps)
    return norm_mod_reference(x, weight, bias, scale, shift, eps)


@torch.library.custom_op("fastwan::offset_norm_mod", mutates_args=())
def offset_norm_mod(x: torch.Tensor, offset: torch.Tensor | None, weight: torch.Tensor | None,
                    bias: torch.Tensor | None, scale: torch.Tensor | None, shift: torch.Tensor | None,
                    eps: float) -> torch.Tensor:
    """norm_mod of x + offset, offset an fp32 per-channel vector [B or 1, 1, C] added in fp32 and not stored
    (the residual stream's pending biases, see :func:`residual_linear_`); x [B, S, C] -> h like x."""
    check_norm_args("offset_norm_mod", x, weight, bias, scale, shift, offset=offset)
    if triton_runs(x, max_last_dim=MAX_C):
        return offset_norm_mod_triton(x, offset, weight, bias, scale, shift, eps)
    return offset_norm_mod_reference(x, offset, weight, bias, scale, shift, eps)


@torch.library.custom_op("fastwan::residual_linear_", mutates_args=("x",))
def residual_linear_(x: torch.Tensor, a: torch.Tensor, weight: torch.Tensor) -> None:
    """x += a @ weight^T, in place, as one GEMM that reads x as its C operand (cuBLAS with beta = 1): the
    residual add of a block's output projection without a separate pass over x. x [B, S, N] contiguous;
    a [B, S, K]; weight [N, K] (the caller folds a per-channel gate into it)."""
    if not x.is_contiguous():
        raise ValueError(f"residual_linear_: x with shape {tuple(x.shape)} and strides {x.stride()} must be "
                         "contiguous (it is updated in place as one [B*S, N] matrix).")
    x.view(-1, x.shape[-1]).addmm_(a.reshape(-1, a.shape[-1]), weight.t())


@torch.library.custom_op("fastwan::residual_bmm_", mutates_args=("x",))
def residual_bmm_(x: torch.Tensor, a: torch.Tensor, u: torch.Tensor) -> None:
    """x += a @ u, in place, one (batched) GEMM reading x as its C operand: x [B, S, N] contiguous, a [B, S, K],
    u [B or 1, K, N] (per-sample right operands: the folded text values, :func:`fastwan.kernels.text_cross.
    fold_values`)."""
    if not x.is_contiguous():
        raise ValueError(f"residual_bmm_: x with shape {tuple(x.shape)} and strides {x.stride()} must be "
                         "contiguous (it is updated in place).")
    if a.dim() != 3 or u.dim() != 3 or a.shape[:2] != x.shape[:2] or u.shape[1:] != (a.shape[2], x.shape[2]) \
            or u.shape[0] not in (1, x.shape[0]):
        raise ValueError(f"residual_bmm_: x [B, S, N], a [B, S, K], u [B or 1, K, N] expected, got x "
                         f"{tuple(x.shape)}, a {tuple(a.shape)}, u {tuple(u.shape)}")
    if x.shape[0] == 1 or u.shape[0] == 1:  # one right operand: one plain GEMM over all rows
        x.view(-1, x.shape[-1]).addmm_(a.reshape(-1, a.shape[-1]), u[0])
    else:
        x.baddbmm_(a, u)


@torch.library.custom_op("fastwan::residual_norm_mod", mutates_args=())
def residual_norm_mod(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor | None, weight: torch.Tensor | None,
                      bias: torch.Tensor | None, scale: torch.Tensor | None, shift: torch.Tensor | None,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """r = x + y [* gate] (rounded to x's dtype), h = norm_mod(r, ...): x, y [B, S, C] -> (r, h), both
    contiguous."""
    check_norm_args("residual_norm_mod", x, weight, bias, scale, shift, gate=gate)
    if y.shape != x.shape:
        raise ValueError(f"residual_norm_mod: y must have x's shape {tuple(x.shape)}, got {tuple(y.shape)}")
    if triton_runs(x, max_last_dim=MAX_C):
        return residual_norm_mod_triton(x, y, gate, weight, bias, scale, shift, eps)
    r = residual_reference(x, y, gate).contiguous()  # the kernel's and the fake's layout, whatever x's strides
    return r, norm_mod_reference(r, weight, bias, scale, shift, eps)


@torch.library.custom_op("fastwan::rms_rope", mutates_args=())
def rms_rope(x: torch.Tensor, weight: torch.Tensor, table: torch.Tensor | None, eps: float,
             head_dim: int) -> torch.Tensor:
    """RMSNorm over C times ``weight`` (x's dtype), then RoPE with ``table`` [1, S, 1, 2 * head_dim] (None:
    no rotation). x [B, S, C] -> like x."""
    check_norm_args("rms_rope", x, weight, None, None, None)
    if weight.dtype != x.dtype:
        raise ValueError(f"rms_rope: weight is {weight.dtype} but x is {x.dtype}; the op rounds in x's dtype, so "
                         "pass the weight in x's dtype (or use rms_rope_reference, which computes in the weight's)")
    if table is not None and (table.shape != (1, x.shape[1], 1, 2 * head_dim) or head_dim % 2
                              or x.shape[-1] % head_dim):
        raise ValueError(f"rms_rope: table {tuple(table.shape)} does not fit x {tuple(x.shape)} with head_dim "
                         f"{head_dim} (expected [1, {x.shape[1]}, 1, {2 * head_dim}], an even head_dim dividing "
                         f"C = {x.shape[-1]})")
    if triton_runs(x, max_last_dim=MAX_C):
        return rms_rope_triton(x, weight, table, eps, head_dim)
    return rms_rope_reference(x, weight, table, eps, head_dim)


@norm_mod.register_fake
def _(x, weight, bias, scale, shift, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@residual_norm_mod.register_fake
def _(x, y, gate, weight, bias, scale, shift, eps):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(x, memory_format=torch.contiguous_format))


@offset_norm_mod.register_fake
def _(x, offset, weight, bias, scale, shift, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@residual_linear_.register_fake
def _(x, a, weight):
    return None


@residual_bmm_.register_fake
def _(x, a, u):
    return None


@rms_rope.register_fake
def _(x, weight, table, eps, head_dim):
    return torch.empty_like(x, memory_format=torch.contiguous_format)
