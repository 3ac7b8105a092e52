"""8-bit attention: INT8 Q·K^T with smoothed K, FP8 (e4m3) P·V, fp32 softmax and accumulation (SageAttention 2's
recipe, fastwan's own kernel).

The quantization rule (:func:`quantize`, plain PyTorch, shared by both routes):

* K is smoothed: ``k - mean_s(k)`` per (sample, head, channel), the mean over the key tokens (summed in float64,
  divided by the token count, rounded to fp32). Every score of one query row moves by the same amount
  (``q · mean``), so the softmax is unchanged, and a large per-channel offset of K no longer sets its step;
* Q per block of ``block_m`` (default ``BLOCK_M`` = 128) query rows and K per block of ``block_n`` (default
  ``BLOCK_N`` = 64) key rows (per sample and head, over all channels) become INT8: ``scale = max(amax(|x|),
  1e-30) / 127``, ``x8 = round_half_even(x / scale)``, both divisions correctly rounded; the softmax scale (and
  log2(e): the scores are in log2 units) is folded into Q's block scales;
* V per (sample, head, channel) over the key tokens becomes e4m3: ``scale = max(amax(|v|), 1e-30) / 448``,
  ``v8 = e4m3(v / scale)`` rounded to nearest, ties to even.

:mod:`fastwan.kernels.attn8_quant_triton` computes the same values (bit for bit) in three Triton passes.

The attention (:func:`attention_reference` in PyTorch, the Triton kernel in :mod:`fastwan.kernels.attn8_triton`):
an online softmax over key blocks of ``block_n`` rows; block j's scores ``s = (q8 · k8^T) * (qs * ks)`` (exact
integers times one fp32 factor), ``m = max(m, rowmax(s))``, ``p = exp2(s - m)`` in [0, 1]; the row sum ``l`` adds
the fp32 ``p``; P·V takes ``e4m3(448 * p)`` (a fixed scale: p <= 1) times ``v8`` with fp32 accumulation;
finally ``out = acc / l * (vs / 448)``. Keys past the sequence end score -inf.

``fastwan::attn8(q, k, v, scale, smooth_k)``: q [B, Sq, H, D], k/v [B, Skv, H, D] (D in ``HEAD_DIMS``) ->
[B, Sq, H, D] in q's dtype; the Triton route (fused quantization, then the kernel, with the configuration of
:func:`fastwan.kernels.attn8_configs.config_for`) where :func:`fastwan.kernels.triton_runs` allows (CUDA, fp16 /
bf16), else :func:`quantize` and :func:`attention_reference` at that configuration's blocks.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from fastwan.kernels import HALF, triton_runs
from fastwan.kernels.attn8_configs import Attn8Config, check_config, config_for
from fastwan.kernels.attn8_rule import (  # noqa: F401  (the rule's names, re-exported)
    BLOCK_M, BLOCK_N, E4M3, E4M3_MAX, HEAD_DIMS, INT8_MAX, P_SCALE, TINY, Quantized, exact_div, smooth_mean, v_scales)

def _int8_blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x fp32 [B, S, H, D] -> (int8 [B, S, H, D], scales fp32 [B, ceil(S / block), H]) per block of rows."""
    B, S, H, D = x.shape
    nb = -(-S // block)
    amax = F.pad(x, (0, 0, 0, 0, 0, nb * block - S)).view(B, nb, block, H, D).abs().amax(dim=(2, 4))
    scale = exact_div(amax.clamp_min(TINY), INT8_MAX)
    full = scale.repeat_interleave(block, dim=1)[:, :S, :, None]
    return torch.round(x / full).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, smooth_k: bool = True,
             block_m: int = BLOCK_M, block_n: int = BLOCK_N) -> Quantized:
    """The rule in the module docstring; q [B, Sq, H, D], k/v [B, Skv, H, D], ``scale`` the softmax scale, Q's and
    K's blocks of ``block_m`` / ``block_n`` rows."""
    kf = k.float()
    if smooth_k:
        mean = smooth_mean(kf.sum(dim=1, dtype=torch.float64), k.shape[1])
        kf = kf - mean[:, None]
    q8, qs = _int8_blocks(q.float(), block_m)
    k8, ks = _int8_blocks(kf, block_n)
    vf = v.float()
    vscale, vs = v_scales(vf.abs().amax(dim=1))  # [B, H, D]
    v8 = (vf / vscale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    v8 = v8.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)  # token-fastest memory, same shape
    return Quantized(q8, qs * (scale * math.log2(math.e)), k8, ks, v8, vs, block_m, block_n)


def attention_reference(t: Quantized) -> torch.Tensor:
    """The kernel's arithmetic in PyTorch fp32, block by block (the same online softmax, the same roundings of p):
    :class:`Quantized` -> out fp32 [B, Sq, H, D]."""
    B, Sq, H, D = t.q8.shape
    Skv = t.k8.shape[1]
    q = t.q8.float().permute(0, 2, 1, 3)  # [B, H, Sq, D]
    qs = t.qs.repeat_interleave(t.block_m, dim=1)[:, :Sq].permute(0, 2, 1)[..., None]  # [B, H, Sq, 1]
    m = torch.full((B, H, Sq, 1), -math.inf, device=q.device)
    l_sum = torch.zeros(B, H, Sq, 1, device=q.device)
    acc = torch.zeros(B, H, Sq, D, device=q.device)
    for j, start in enumerate(range(0, Skv, t.block_n)):
        stop = min(start + t.block_n, Skv)
        k = t.k8[:, start:stop].float().permute(0, 2, 3, 1)  # [B, H, D, n]
        v = t.v8[:, start:stop].float().permute(0, 2, 1, 3)  # [B, H, n, D]
        s = (q @ k) * (qs * t.ks[:, j, :, None, None])  # integer products: exact in fp32 (|sum| < 2^24)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        p = torch.exp2(s - m_new)
        alpha = torch.exp2(m - m_new)
        l_sum = l_sum * alpha + p.sum(-1, keepdim=True)
        p8 = (p * P_SCALE).to(E4M3).float()
        acc = acc * alpha + p8 @ v
        m = m_new
    out = (acc / l_sum) * t.vs[:, :, None, :]
    return out.permute(0, 2, 1, 3)


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape or k.shape[0] != q.shape[0] or k.shape[2:] != q.shape[2:]:
        raise ValueError(f"attn8: q [B, Sq, H, D] and k, v [B, Skv, H, D] expected, got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[1] == 0:
        raise ValueError("attn8: k and v hold no tokens (Skv = 0); attention needs at least one key")


def kernel_runs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the Triton kernel runs: :func:`fastwan.kernels.triton_runs` for q, k, v (one dtype) and a head dim
    in ``HEAD_DIMS``."""
    return q.shape[-1] in HEAD_DIMS and k.dtype == v.dtype == q.dtype and triton_runs(q, k, v, dtypes=HALF)


@functools.cache
def _kernels():
    from fastwan.kernels import attn8_triton  # imports Triton

    return attn8_triton


@functools.cache
def _quantizer():
    from fastwan.kernels import attn8_quant_triton  # imports Triton

    return attn8_quant_triton


def capability(device: torch.device | str) -> tuple[int, int] | None:
    """The compute capability of a CUDA ``device`` (the configuration table's key); None elsewhere."""
    device = torch.device(device)
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def quantize_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, smooth_k: bool,
                   block_m: int = BLOCK_M, block_n: int = BLOCK_N) -> Quantized:
    """:func:`quantize`'s values from the Triton quantizer (where :func:`kernel_runs`): q8 / k8 / v8 are views of
    head-major buffers padded with zeros to whole blocks, the layout kernel version 2 reads."""
    return _quantizer().quantize(q, k, v, scale, smooth_k, block_m, block_n)


def attend(t: Quantized, cfg: Attn8Config, dtype: torch.dtype) -> torch.Tensor:
    """The Triton kernel of ``cfg.version`` on ``t`` (quantized with ``cfg``'s blocks) -> [B, Sq, H, D] ``dtype``."""
    if (t.block_m, t.block_n) != (cfg.block_m, cfg.block_n):
        raise ValueError(f"attn8: inputs quantized in blocks of {t.block_m} / {t.block_n} rows, configuration "
                         f"{cfg.label} tiles {cfg.block_m} / {cfg.block_n}: quantize with the configuration's blocks")
    out = torch.empty(t.q8.shape, device=t.q8.device, dtype=dtype)
    if out.numel():
        if cfg.version == 1:
            _kernels().launch(t, out, cfg.block_m, cfg.block_n, P_SCALE, cfg.num_warps, cfg.num_stages)
        else:
            _kernels().launch_v2(t, out, cfg, P_SCALE)
    return out


def attn8_config(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, smooth_k: bool,
                 cfg: Attn8Config) -> torch.Tensor:
    """The op's work at configuration ``cfg`` (the op takes the table's): where :func:`kernel_runs`, the kernel of
    ``cfg.version`` on its quantizer's output (version 2: the fused quantizer; 1: :func:`quantize`), else
    :func:`quantize` and :func:`attention_reference` at ``cfg``'s blocks."""
    check_inputs(q, k, v)
    check_config(cfg)
    if not kernel_runs(q, k, v):
        t = quantize(q, k, v, scale, smooth_k, cfg.block_m, cfg.block_n)
        return attention_reference(t).to(q.dtype).contiguous()
    if q.shape[1] == 0:
        return torch.empty(q.shape, device=q.device, dtype=q.dtype)
    quantized = quantize_fused if cfg.version == 2 else quantize  # version 1: the route measured on a GPU
    return attend(quantized(q, k, v, scale, smooth_k, cfg.block_m, cfg.block_n), cfg, q.dtype)


@torch.library.custom_op("fastwan::attn8", mutates_args=())
def attn8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, smooth_k: bool) -> torch.Tensor:
    """8-bit attention (the module docstring's rule): q [B, Sq, H, D], k/v [B, Skv, H, D], ``scale`` the softmax
    scale, ``smooth_k`` K minus its token mean -> [B, Sq, H, D] in q's dtype, at the configuration
    :func:`fastwan.kernels.attn8_configs.config_for` gives for the head dim and q's GPU."""
    return attn8_config(q, k, v, scale, smooth_k, config_for(q.shape[-1], capability(q.device)))


@attn8.register_fake
def _(q, k, v, scale, smooth_k):
    return torch.empty_like(q, memory_format=torch.contiguous_format)
