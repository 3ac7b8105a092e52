"""Compact block tables, the form every block-sparse attention kernel reads: per query tile a count and the
indices of its key tiles, full blocks (no token mask needed) and partial blocks (masked inside) listed
separately. :class:`fastwan.attention.sparse.plan.BlockPlan` builds them from its block tables; VSA's top-k kernel
(:mod:`fastwan.kernels.vsa`) writes them directly."""
from __future__ import annotations

import torch


def compact(table: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bool [..., nK] -> (count int32 [...], indices int32 [..., width]) with the True columns first."""
    num = table.sum(-1, dtype=torch.int32)
    order = torch.sort((~table).to(torch.uint8), dim=-1, stable=True).indices[..., :width]
    return num.contiguous(), order.to(torch.int32).contiguous()


def split_selected(selected: torch.Tensor, tile_full: torch.Tensor, uniform: bool | None = None
                   ) -> tuple[torch.Tensor, ...]:
    """Top-k key tiles [..., k] (long) -> (full_num, full_idx, partial_num, partial_idx), all int32, [.., k].

    Full (no dummy slot) tiles come first in ``full_idx``, partial ones first in ``partial_idx`` (each kind in
    the order of ``selected``).
    """
    k = selected.shape[-1]
    if uniform is not None:  # all tiles partial (True) or all full (False): nothing to partition
        idx = selected.to(torch.int32)
        zeros = torch.zeros(selected.shape[:-1], dtype=torch.int32, device=selected.device)
        counts = torch.full_like(zeros, k)
        return (zeros, idx, counts, idx) if uniform else (counts, idx, zeros, idx)
    # stable partition by scatter (no sort): a full tile goes to its rank among the full ones, a partial tile
    # to its rank among the partial ones, each list continuing with the other kind
    is_partial = ~tile_full[selected]
    rank_p = torch.cumsum(is_partial, dim=-1) - 1
    rank_f = torch.cumsum(~is_partial, dim=-1) - 1
    p = rank_p[..., -1:] + 1
    f = k - p
    sel32 = selected.to(torch.int32)
    full_first = torch.empty_like(sel32).scatter_(-1, torch.where(is_partial, f + rank_p, rank_f), sel32)
    partial_first = torch.empty_like(sel32).scatter_(-1, torch.where(is_partial, rank_p, p + rank_f), sel32)
    return f[..., 0].to(torch.int32), full_first, p[..., 0].to(torch.int32), partial_first
