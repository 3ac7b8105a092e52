"""ATTN_8BIT: fastwan's 8-bit attention (INT8 Q·K^T with K smoothed, FP8 e4m3 P·V; :mod:`fastwan.kernels.attn8`).
Lossy: never picked automatically, only by name.

Its Triton kernel needs CUDA sm90+ (FP8 tensor cores) and a head dim of 64 or 128; it serves self-attention, and
the dispatch sends the text cross-attention (short: little to gain) to the automatic lossless backend. Settings
(``attention_config``):

* ``smooth_k`` (default True): K minus its mean over the tokens before quantization (the softmax is unchanged);
* ``bf16_steps`` (default 0): the hybrid schedule. ``k`` runs the first k and the last k denoising steps'
  self-attention on the lossless backend in the model's dtype (bf16 for Wan); ``[first, last]`` sets the two
  counts apart. Which backend that is is fixed when the model loads; the step picks between the two outside
  compiled code (:meth:`fastwan.attention.AttentionDispatch.step_meta`).
"""
from __future__ import annotations

import math
import numbers

import torch

from fastwan.attention.backends.packages import dist_version
from fastwan.attention.base import AttentionBackend, AttentionMetadata, Capabilities
from fastwan.errors import InvalidArgument, InvalidArgumentType
from fastwan.kernels import attn8 as _attn8  # noqa: F401  (registers torch.ops.fastwan.attn8)
from fastwan.kernels.attn8 import HEAD_DIMS


def steps_option(value) -> tuple[int, int]:
    """``bf16_steps`` as (first, last): an int k >= 0 is (k, k); a pair [first, last] of ints >= 0 is itself."""
    pair = tuple(value) if isinstance(value, (list, tuple)) else (value, value)
    if len(pair) != 2 or not all(isinstance(n, numbers.Integral) and not isinstance(n, bool) for n in pair):
        raise InvalidArgumentType(
            f"ATTN_8BIT: bf16_steps={value!r} must be an int k (the first k and the last k denoising steps run in "
            "bf16) or a pair [first, last] of ints; e.g. {\"bf16_steps\": 2} or {\"bf16_steps\": [3, 1]}.")
    if min(pair) < 0:
        raise InvalidArgument(f"ATTN_8BIT: bf16_steps={value!r} must be >= 0 (a count of steps); use 0 for none.")
    return int(pair[0]), int(pair[1])


class Attn8Backend(AttentionBackend):
    name = "ATTN_8BIT"
    capabilities = Capabilities(
        device_types=("cuda",),
        dtypes=(torch.float16, torch.bfloat16),
        head_dims=HEAD_DIMS,
        min_compute_capability=(9, 0),
        packages=(("triton", "pip install triton"),),
    )
    self_attention_only = True
    KEYS = ("smooth_k", "bf16_steps")

    def __init__(self, smooth_k: bool = True, bf16_steps: int | tuple[int, int] | list[int] = 0):
        if not isinstance(smooth_k, bool):
            raise InvalidArgumentType(f"ATTN_8BIT: smooth_k={smooth_k!r} must be true or false (K minus its token "
                                      "mean before quantization; default true).")
        self.smooth_k = smooth_k
        self.bf16_steps = steps_option(bf16_steps)

    def lossless_steps(self) -> tuple[int, int]:
        return self.bf16_steps

    def unverified(self, device, head_dim=None) -> str | None:
        if torch.device(device).type != "cuda":
            return None
        return "fastwan's 8-bit Triton kernel has run only under Triton's interpreter (CPU), not yet on a GPU"

    def kernel_name(self, device=None) -> str:
        first, last = self.bf16_steps
        hybrid = f", first {first} / last {last} steps lossless" if first or last else ""
        smooth = "" if self.smooth_k else ", K unsmoothed"
        return f"fastwan attn8 Triton (INT8 QK, FP8 PV{smooth}{hybrid})"

    def version_info(self, device=None) -> str | None:
        version = dist_version("triton")
        return f"triton {version}" if version else None

    def forward(self, q, k, v, *, scale=None, meta: AttentionMetadata | None = None):
        """q: [B, Sq, H, D], k/v: [B, Skv, H, D] (fp16/bf16) -> [B, Sq, H, D]."""
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        return torch.ops.fastwan.attn8(q, k, v, scale, self.smooth_k)
