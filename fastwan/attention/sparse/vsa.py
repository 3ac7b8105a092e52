"""VIDEO_SPARSE_ATTN: video sparse attention (VSA), a trainable coarse-to-fine sparse attention.

Per call, on the tile-major layout (one tile = one cube of ``tile`` tokens):

1. coarse stage: q, k, v are mean-pooled per tile over the tile's *real* tokens (dummy slots excluded) ->
   ``[B, n_tiles, H, D]``; dense attention over tiles gives the coarse output and, per query tile, the
   scores of every key tile;
2. selection: each query tile keeps its ``k = ceil((1 - sparsity) * n_tiles)`` best-scoring key tiles (per
   batch element and head);
3. fine stage: block-sparse token-level attention of each query tile over the real tokens of its selected
   key tiles;
4. output: ``fine + coarse * gate`` when the DiT passes ``meta.extra["gate_compress"]`` ([B, P, H, D], layout
   order; the checkpoint's ``to_gate_compress`` projection), the coarse output of a tile being broadcast to
   its tokens; ``fine`` alone otherwise.

The selection is data dependent, so the block mask is rebuilt on every call -- from the top-k indices
directly, at tile level (a sort over k entries per query tile), not from a token mask; it is small and cheap
next to the attention itself, but it is per layer, unlike STA/NA whose masks are cached.
:meth:`VideoSparseBackend.select` runs stages 1-2: on CUDA (Triton available) as one pooling kernel, the cuBLAS
score matmul and one top-k kernel that writes the FA4 block tables directly
(:mod:`fastwan.kernels.vsa`); elsewhere in PyTorch (:meth:`VideoSparseBackend.coarse`,
``torch.topk``, then the tables from the top-k indices).

``dense_steps``: during the first steps ``sparsity`` is 0 (every key tile is kept; the coarse branch still
adds ``coarse * gate``).

Config::

    {"sparsity": 0.9, "tile": [4, 4, 4], "block_size": null, "dense_steps": 0, "kernel": "auto",
     "kernel_options": {}}

VSA checkpoints are trained with a tile shape (FastVideo: 4x4x4 = 64 tokens); keep ``tile`` equal to it.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from fastwan.attention.base import AttentionMetadata, reject_unknown
from fastwan.attention.sparse.layout import TokenLayout
from fastwan.attention.sparse import config as cfg
from fastwan.kernels import vsa as vsa_kernels
from fastwan.attention.sparse.common import SparseVideoBackend
from fastwan.attention.sparse.plan import BlockPlan


def topk_count(sparsity: float, num_tiles: int) -> int:
    """k = ceil((1 - sparsity) * num_tiles) in float arithmetic, clamped to [1, num_tiles]: FastVideo's rule, float
    error included (0.85 of 100 tiles -> 16), so VSA-trained checkpoints keep as many tiles as there."""
    return max(1, min(num_tiles, math.ceil((1.0 - sparsity) * num_tiles)))


def rank_scores(qc: torch.Tensor, kc: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Tile scores: pooled q, k fp32 [B, H, n, D] -> [B, H, n, n] scaled, in ``dtype`` for bf16 / fp16 inputs and
    fp32 otherwise.

    In bf16 / fp16 the scores are rounded as FastVideo's ``video_sparse_attn`` rounds them -- tile means in the
    input dtype, their product in that dtype, divided by sqrt(D) -- so the top-k (ties to the lower tile index)
    selects what a VSA-trained checkpoint selected.
    """
    if dtype not in (torch.bfloat16, torch.float16):
        return torch.matmul(qc, kc.transpose(-1, -2)) * scale
    divisor = qc.shape[-1] ** 0.5 if scale == qc.shape[-1] ** -0.5 else 1.0 / scale
    return torch.matmul(qc.to(dtype), kc.to(dtype).transpose(-1, -2)) / divisor


def tile_pool(x: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
    """Mean over each tile's real tokens: [B, P, H, D] (layout order) -> fp32 [B, n_tiles, H, D].

    The sums accumulate in fp32, as the pooling kernel's do: over each tile's first ``tile_tokens`` slots when
    every tile keeps its real tokens there (the tile divides the grid), else over all slots with the dummy ones
    replaced by zeros (whatever they hold).
    """
    return vsa_kernels.pool_reference(x, layout.key_valid, layout.tile_valid_counts, layout.block_size,
                                      layout.tile_tokens, layout.real_prefix_tiles)


def coarse_output(scores: torch.Tensor, vc: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Attention over tiles: scaled scores [B, H, n, n] (see :func:`rank_scores`) and pooled values fp32
    [B, n, H, D] -> [B, n, H, D] in ``dtype``, computed in the scores' dtype."""
    return torch.matmul(torch.softmax(scores, dim=-1), vc.transpose(1, 2).to(scores.dtype)).transpose(1, 2).to(dtype)


class VideoSparseBackend(SparseVideoBackend):
    name = "VIDEO_SPARSE_ATTN"
    KEYS = ("sparsity",) + SparseVideoBackend.COMMON_KEYS

    def __init__(
        self,
        sparsity: float = 0.9,
        tile: Any = (4, 4, 4),
        block_size: int | None = None,
        dense_steps: int = 0,
        kernel: str = "auto",
        kernel_options: dict | None = None,
        **unknown: Any,
    ):
        reject_unknown(self.name, unknown, self.KEYS)
        super().__init__(tile=tile, block_size=block_size, dense_steps=dense_steps, kernel=kernel,
                         kernel_options=kernel_options)
        self.sparsity = cfg.sparsity_option(sparsity)

    def coarse(self, q, k, v, layout: TokenLayout, scale: float, *, with_output: bool = True):
        """Pooled attention over tiles: -> (scores fp32 [B, H, n, n], coarse output [B, n, H, D] in q.dtype or
        None when ``with_output`` is False -- the top-k needs the scores only)."""
        qc, kc = (tile_pool(t, layout).transpose(1, 2) for t in (q, k))  # fp32 [B, H, n, D]
        scores = rank_scores(qc, kc, q.dtype, scale)
        if not with_output:
            return scores, None
        return scores, coarse_output(scores, tile_pool(v, layout), q.dtype)

    def select(self, q, k, v, layout: TokenLayout, scale: float, sparsity: float, with_output: bool = False
               ) -> tuple[BlockPlan, torch.Tensor | None]:
        """Stages 1-2: q, k, v [B, P, H, D] (layout order) -> (BlockPlan of the selected key tiles, coarse output
        [B, n, H, D] in q.dtype, or None when ``with_output`` is False).

        On CUDA with Triton (and no autograd): one pooling kernel for q, k (and v), the score matmul
        (:func:`rank_scores`), and one top-k kernel writing the plan's FA4 tables (rows of up to
        ``vsa_kernels.N_MAX`` tiles; longer rows use a stable sort). Elsewhere: :meth:`coarse`, the sort and the
        tables built from its indices.
        """
        kk = topk_count(sparsity, layout.num_tiles)
        if not vsa_kernels.pool_usable(q, k, v):
            scores, coarse = self.coarse(q, k, v, layout, scale, with_output=with_output)
            return self.plan_from_scores(scores, layout, kk), coarse
        pooled = vsa_kernels.pool_tiles(q, k, v if with_output else None, layout)
        qc, kc = (t.transpose(1, 2) for t in pooled[:2])  # contiguous fp32 [B, H, n, D]
        scores = rank_scores(qc, kc, q.dtype, scale)
        coarse = coarse_output(scores, pooled[2], q.dtype) if with_output else None
        return self.plan_from_scores(scores, layout, kk), coarse

    def plan_from_scores(self, scores: torch.Tensor, layout: TokenLayout, kk: int) -> BlockPlan:
        """Top-``kk`` key tiles of every row of ``scores`` [B, H, n, n], ties to the lower tile index -> BlockPlan
        (the top-k kernel with its tables where it runs, else a stable sort)."""
        scores = scores.float()  # exact for bf16 / fp16 scores: the same order and ties
        if vsa_kernels.tables_usable(scores):
            return BlockPlan(layout, tables=vsa_kernels.topk_tables(scores, kk, layout), name="keys")
        selected = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :kk]  # [B, H, n, kk]
        return BlockPlan(layout, selected=selected, name="keys")

    def forward(self, q, k, v, *, scale=None, meta: AttentionMetadata | None = None):
        """q, k, v (and optional meta.extra["gate_compress"]): [B, P, H, D] layout order -> [B, P, H, D]."""
        layout = self.check_call(q, k, v, meta)
        gate = meta.extra.get("gate_compress") if meta.extra else None
        if gate is not None and (tuple(gate.shape) != tuple(q.shape) or gate.device != q.device):
            raise ValueError(
                f"{self.name}: gate_compress has shape {tuple(gate.shape)} on {gate.device}; it must match q "
                f"{tuple(q.shape)} on {q.device} (layout order [B, P, H, D])."
            )
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        n = layout.num_tiles
        sparsity = 0.0 if self.is_dense_step(meta) else self.sparsity
        plan, coarse = self.select(q, k, v, layout, scale, sparsity, with_output=gate is not None)
        fine = self.run_plan(plan, q, k, v, scale)
        if gate is None:
            return fine
        B, P, H, D = q.shape
        per_tile = (B, n, layout.block_size, H, D)  # the coarse output of a tile broadcast to its slots
        return torch.addcmul(fine.reshape(per_tile), coarse.unsqueeze(2), gate.reshape(per_tile)).reshape(B, P, H, D)

    def dense_mask(self, grid, **kwargs):
        raise TypeError(
            f"{self.name}'s pattern depends on q and k (top-k over pooled scores); there is no static mask. "
            "Use VideoSparseBackend.select(...)[0].dense_mask() instead."
        )

    def config_repr(self) -> str:
        return f"sparsity={self.sparsity}, " + super().config_repr()
