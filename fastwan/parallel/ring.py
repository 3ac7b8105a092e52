"""Ring attention: self-attention over a sequence split across the ranks of a ring, exact for any head count.

Each rank of a ring holds a contiguous chunk of the queries, keys and values (chunk sizes may differ: every rank
knows them all, so no token is padded or masked). The key/value chunks travel round the ring: at step ``t`` rank
``r`` attends its queries to the chunk of rank ``r - t`` while it sends that chunk on to rank ``r + 1`` and receives
the next one from rank ``r - 1`` (``batch_isend_irecv``, started before the step's compute and waited on after it,
so the transfer overlaps the compute). The partial outputs are merged by their log-sum-exp (online softmax):
``lse = logaddexp(lse_a, lse_b)``, ``out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)``, which equals the
softmax over every key at once.

Each step's attention and its log-sum-exp come from a kernel of :mod:`fastwan.parallel.ring_kernels` (FA4 or
PyTorch's flash kernel on GPUs, fp32 torch on the CPU), chosen when the ring's dispatch is built; the merged output
is held in fp32. On CUDA devices the merge runs compiled (``torch.compile``: fused kernels instead of several
elementwise launches a step), chosen when the dispatch is built (:func:`ring_merge`; measured in
benchmarks/RESULTS.md, "Several GPUs"). Sparse backends choose key blocks from the whole sequence, which no rank of
a ring holds, so they are refused under a ring (:func:`check_ring_backend`).

The P2P calls cannot be traced by ``torch.compile``: :func:`ring_attention` runs outside compiled graphs
(``torch.compiler.disable``, applied when a ring dispatch is built), so blocks compile with ``fullgraph=False``; the
compiled merge, called there, compiles as a graph of its own.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fastwan.errors import InvalidArgument
from fastwan.parallel.ring_kernels import KERNELS


@dataclass(frozen=True)
class Ring:
    """The ranks that pass key/value chunks round: ``peers`` are their global ranks in ring order, this one at
    ``rank``; ``group``: their process group."""

    group: object
    peers: tuple[int, ...]
    rank: int

    @property
    def world(self) -> int:
        return len(self.peers)


def check_ring_backend(backend, ring_degree: int) -> None:
    """Rule: a ring runs dense attention only (a sparse backend's block choice needs the whole sequence)."""
    if ring_degree > 1 and backend.sparse:
        raise InvalidArgument(f"the sparse attention backend {backend.name} cannot run under ring attention "
                              f"(ring_degree={ring_degree}): it picks key blocks from the whole sequence, which no "
                              "rank of a ring holds; use a dense backend, or ring_degree=1 (Ulysses only) with a "
                              "process count whose sequence degree divides the attention heads.")


def merge(out, lse, part_out, part_lse):
    """Two partial attentions of the same queries over disjoint key sets -> the attention over their union, out in
    fp32. ``out`` (fp32, from an earlier merge) is updated in place; ``part_out`` may be any float dtype."""
    if out is None:
        return part_out.float(), part_lse
    new = torch.logaddexp(lse, part_lse)
    # both -inf (no keys in either): weights 0 rather than nan
    a = torch.exp(torch.where(torch.isinf(new), 0.0, lse - new)).nan_to_num(0.0)
    b = torch.exp(torch.where(torch.isinf(new), 0.0, part_lse - new)).nan_to_num(0.0)
    return out.mul_(a.unsqueeze(-1)).addcmul_(part_out, b.unsqueeze(-1)), new


Merge = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def ring_device(ring: Ring) -> torch.device:
    """Where a ring's tensors are: CUDA under NCCL (which moves CUDA tensors only), the CPU under gloo."""
    return torch.device("cuda" if dist.get_backend(ring.group) == "nccl" else "cpu")


def ring_merge(device: torch.device | str) -> Merge:
    """The merge a ring on ``device`` runs (:func:`merge`'s semantics): compiled on CUDA devices, where fusing its
    elementwise ops into one kernel pays; plain elsewhere (the CPU, gloo), which spares each process a compile."""
    if torch.device(device).type == "cuda":
        return torch.compile(merge, fullgraph=True, dynamic=False)
    return merge


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring, chunks: tuple[int, ...],
                   scale: float | None = None, kernel: str = "exact", merge_fn: Merge = merge) -> torch.Tensor:
    """q, k, v: this rank's chunk [B, chunks[ring.rank], H, D] -> its queries' attention over every rank's keys
    [B, chunks[ring.rank], H, D]. ``chunks``: every ring rank's token count, in ring order; ``kernel``: a step's
    attention (:data:`fastwan.parallel.ring_kernels.KERNELS`); ``merge_fn``: the merge of the steps after the
    first (:func:`ring_merge`)."""
    step_attention = KERNELS[kernel]
    R, me = ring.world, ring.rank
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kv = torch.stack((k, v)).contiguous()  # [2, B, S, H, D]: one message per step
    out = lse = None
    for step in range(R):
        reqs, nxt = [], None
        if step < R - 1:
            size = chunks[(me - step - 1) % R]
            nxt = kv.new_empty((2, kv.shape[1], size, *kv.shape[3:]))
            ops = []
            if kv.shape[2]:
                ops.append(dist.P2POp(dist.isend, kv, ring.peers[(me + 1) % R], ring.group))
            if size:
                ops.append(dist.P2POp(dist.irecv, nxt, ring.peers[(me - 1) % R], ring.group))
            reqs = dist.batch_isend_irecv(ops) if ops else []
        # the first step only takes its partial as it is: plain, so a compiled merge_fn keeps one graph per shape
        out, lse = (merge if out is None else merge_fn)(out, lse, *step_attention(q, kv[0], kv[1], scale))
        for req in reqs:
            req.wait()
        if nxt is not None:
            kv = nxt
    return out.to(q.dtype)
