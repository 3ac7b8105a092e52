"""The attention of one ring step (:func:`fastwan.parallel.ring.ring_attention`): a chunk of queries over one
chunk of keys and values, with the log-sum-exp of its scaled scores, which the ring needs to merge the steps.

Every kernel takes q [B, Sq, H, D], k and v [B, Sk, H, D] and a scale, and returns (out [B, Sq, H, D], lse
[B, Sq, H] in fp32, natural log); no keys: out 0, lse -inf. The ring's kernel is chosen once, when its dispatch is
built (:func:`ring_kernel`), from the model's self-attention backend:

- ``fa4``: FlashAttention 4 (``flash_attn.cute``'s forward with ``return_lse``), for a ``FLASH_ATTN`` backend that
  picks FA4 on this GPU (the kernel the model's own attention runs);
- ``sdpa_flash``: PyTorch's flash kernel (``aten._scaled_dot_product_flash_attention``, which returns the
  log-sum-exp), for any other backend on a CUDA machine;
- ``exact``: fp32 attention written in torch (:func:`attention_lse`), on the CPU.

Rule: the two GPU kernels run bf16 / fp16 tensors on a CUDA device; any other call of theirs (an fp32 DiT, CPU
tensors) runs ``exact``, which is what the kernels approximate.
"""
from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType

import torch

SCORES_PER_CALL = 1 << 26  # fp32 attention scores held at once by attention_lse (256 MiB); heads are split to fit
HALF = (torch.bfloat16, torch.float16)

ChunkKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Softmax attention of q [B, Sq, H, D] over k, v [B, Sk, H, D] in fp32 -> (out [B, Sq, H, D], log-sum-exp of
    the scaled scores [B, Sq, H]); no keys: out 0, lse -inf."""
    B, Sq, H, D = q.shape
    Sk = k.shape[1]
    step = max(1, SCORES_PER_CALL // max(1, B * Sq * Sk))
    outs, lses = [], []
    for h in range(0, H, step):
        qh, kh, vh = (t[:, :, h:h + step].float() for t in (q, k, v))
        scores = torch.einsum("bqhd,bkhd->bhqk", qh, kh) * scale
        lse = scores.logsumexp(-1)  # [B, h, Sq]
        probs = torch.exp(scores - lse.unsqueeze(-1)) if Sk else scores
        outs.append(torch.einsum("bhqk,bkhd->bqhd", probs, vh))
        lses.append(lse.transpose(1, 2))
    return torch.cat(outs, 2), torch.cat(lses, 2)


def _gpu_half(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether a GPU kernel runs this call (the module's rule): half precision on CUDA, and keys to attend to."""
    return q.is_cuda and q.dtype in HALF and k.shape[1] > 0 and q.shape[1] > 0


def fa4_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """FlashAttention 4's forward with its log-sum-exp (flash_attn.cute returns it as [B, H, Sq])."""
    if not _gpu_half(q, k):
        return attention_lse(q, k, v, scale)
    from flash_attn.cute.interface import _flash_attn_fwd

    from fastwan.attention.backends.packages import fa4_lock

    with fa4_lock():
        out, lse = _flash_attn_fwd(q, k, v, softmax_scale=scale, causal=False, return_lse=True)[:2]
    return out, lse.transpose(1, 2)


def sdpa_flash_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """PyTorch's flash attention with its log-sum-exp (the op takes and returns [B, H, S, D], lse [B, H, Sq])."""
    if not _gpu_half(q, k):
        return attention_lse(q, k, v, scale)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, False, False, scale=scale)[:2]
    return out.transpose(1, 2), lse.transpose(1, 2)


KERNELS: MappingProxyType[str, ChunkKernel] = MappingProxyType(
    {"fa4": fa4_lse, "sdpa_flash": sdpa_flash_lse, "exact": attention_lse})


def ring_kernel(backend) -> str:
    """The ring step's kernel (a :data:`KERNELS` name) for the model's self-attention ``backend``, by the module's
    rule: ``fa4`` where a ``FLASH_ATTN`` backend picks FlashAttention 4 for this process's GPU."""
    if not torch.cuda.is_available():
        return "exact"
    if getattr(backend, "name", None) == "FLASH_ATTN" and backend.select(torch.device("cuda"))[0] == 4:
        return "fa4"
    return "sdpa_flash"
