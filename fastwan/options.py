"""How a Wan DiT is built, fixed once when it is built.

:class:`DiTOptions` is made by ``VideoGenerator.from_pretrained`` (and the CLI) from its arguments, resolved
for the device and dtype (:meth:`DiTOptions.resolve`), and handed to :class:`fastwan.models.WanTransformer`,
which picks its block implementation and cross-attention route from it at construction. Nothing reads an
option inside compiled code, and nothing changes a built model's options: an A/B builds two models.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastwan.errors import InvalidArgument, InvalidArgumentType

if TYPE_CHECKING:
    import torch

BLOCKS = ("auto", "fast", "reference")


@dataclass(frozen=True)
class DiTOptions:
    """``block``: "reference" runs each block in PyTorch with diffusers' rounding points; "fast" runs the
    single-pass norm kernels of :mod:`fastwan.kernels.norms` (each also adds what the residual stream has
    pending), adds the output projections into the stream inside their GEMMs where the modulation is one vector
    for the batch (the biases ride along as an fp32 offset), runs the FFN's bias + GELU in its first GEMM's
    epilogue on CUDA, and reads per-prompt cross-attention keys and values with the text padding collapsed and,
    for short prompts, the output projection folded in (:mod:`fastwan.models.wan.cross`); "auto" is "fast" where
    those kernels run (CUDA, fp16/bf16, Triton), else "reference". The fast block on CPU runs the kernels'
    PyTorch references (how CPU tests check its wiring).
    """

    block: str = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.block, str) and self.block not in BLOCKS:
            raise InvalidArgument(f"block={self.block!r} must be one of {BLOCKS} ('reference' follows diffusers' "
                                  "rounding points; 'fast' uses the fused kernels).")
        if not isinstance(self.block, str):
            raise InvalidArgumentType(f"block={self.block!r} must be a string, one of {BLOCKS}.")

    @property
    def fast(self) -> bool:
        """Whether the fast block is chosen (only meaningful once resolved)."""
        return self.block == "fast"

    def resolve(self, device: torch.device | str, dtype: torch.dtype) -> DiTOptions:
        """"auto" made concrete for a model of ``dtype`` on ``device``."""
        if self.block != "auto":
            return self
        from fastwan.kernels import triton_runs_on

        return dataclasses.replace(self, block="fast" if triton_runs_on(device, dtype) else "reference")
