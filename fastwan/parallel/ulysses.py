"""Ulysses sequence parallelism through ``torch.distributed`` (NCCL on GPUs, gloo on CPUs).

Each rank of a group holds a contiguous shard of the DiT's token sequence (:func:`shard_sizes`: sizes differ by
at most one unit, so no token count needs padding). Everything in a block but self-attention is per token and runs
on the local shard; around self-attention one all-to-all turns sequence shards into head shards (every rank sees
the whole sequence for ``heads / world`` heads, in sequence order, so dense and sparse backends run unchanged) and
one all-to-all turns the output back. Uneven shards use ``all_to_all_single``'s split sizes.

The all-to-alls are functional collectives (``torch.distributed._functional_collectives``), so a block compiled with
``fullgraph=True`` traces through them: the split sizes are Python ints fixed by the token count, like any shape.

Ulysses x Ring (USP, :mod:`fastwan.parallel.ring`): a group of ``sp = ulysses x ring`` ranks, sequence rank
``s = g * ulysses + u``. The ``ulysses`` consecutive ranks of group ``g`` exchange sequence for heads among
themselves, so each then holds the contiguous chunk ``g`` of the sequence for its ``heads / ulysses`` heads; the
``ring`` ranks of equal ``u`` (one per chunk, the same heads) run ring attention over their chunks.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from fastwan.attention.base import TOKEN_EXTRAS, AttentionMetadata
from fastwan.errors import InvalidArgument
from fastwan.parallel.ring import Ring, check_ring_backend, ring_attention, ring_device, ring_merge
from fastwan.parallel.ring_kernels import ring_kernel


def shard_sizes(n: int, world: int, unit: int = 1) -> tuple[int, ...]:
    """Contiguous shard sizes of ``n`` tokens over ``world`` ranks: whole ``unit``s, as even as possible (earlier
    ranks take the extra units), the last rank also the ``n % unit`` tokens left over."""
    units, rest = divmod(n, unit)
    base, extra = divmod(units, world)
    sizes = [(base + (r < extra)) * unit for r in range(world)]
    sizes[-1] += rest
    return tuple(sizes)


def check_heads(heads: int, sp: int) -> None:
    """Ulysses splits the attention heads over the ``sp`` ranks of a group."""
    if sp > 1 and heads % sp:
        good = [d for d in range(1, heads + 1) if heads % d == 0]
        raise InvalidArgument(f"sequence parallelism over {sp} ranks splits the DiT's {heads} attention heads, "
                              f"which {sp} does not divide; use a sequence degree among {good}.")


@dataclass(frozen=True)
class SequenceParallel:
    """A process group over which the DiT's sequence is split (``world`` ranks, this one ``rank``). Without
    ``ring`` the whole group is one Ulysses group; with it, ``heads_group`` is this rank's Ulysses group (None: one
    rank, ring attention alone) and ``ring`` its ring."""

    group: object
    world: int
    rank: int
    heads_group: SequenceParallel | None = None
    ring: Ring | None = None

    @classmethod
    def from_group(cls, group=None, ring_degree: int = 1) -> SequenceParallel:
        """The group ``group`` (default: every rank); ``ring_degree`` > 1 splits it into Ulysses x Ring, which
        makes process groups: every rank of the default group calls this then."""
        if not dist.is_initialized():
            raise InvalidArgument("sequence parallelism needs torch.distributed initialised (torchrun, or "
                                  "dist.init_process_group) before the model is set up.")
        if ring_degree > 1:
            if group is not None:
                raise InvalidArgument(f"ring_degree={ring_degree} splits every rank of the job; pass group=None, or "
                                      "build a Ulysses x Ring group of other ranks with SequenceParallel.create.")
            return cls.create(list(range(dist.get_world_size())), ring_degree)
        group = dist.group.WORLD if group is None else group
        return cls(group, dist.get_world_size(group), dist.get_rank(group))

    @classmethod
    def create(cls, ranks: list[int], ring_degree: int = 1) -> SequenceParallel | None:
        """The sequence group of the global ``ranks`` as ``len(ranks) / ring_degree`` Ulysses x ``ring_degree``
        Ring -> this rank's (None if it is not among ``ranks``). Every rank of the default group calls this for
        every group, in the same order (``dist.new_group``'s rule)."""
        sp, me = len(ranks), dist.get_rank()
        u = sp // ring_degree
        whole = dist.new_group(ranks)
        heads_group = ring = None
        for g in range(ring_degree if u > 1 and ring_degree > 1 else 0):
            members = ranks[g * u:(g + 1) * u]
            group = dist.new_group(members)
            if me in members:
                heads_group = cls(group, u, members.index(me))
        for j in range(u if ring_degree > 1 else 0):
            members = ranks[j::u]
            group = dist.new_group(members)
            if me in members:
                ring = Ring(group, tuple(members), members.index(me))
        if me not in ranks:
            return None
        return cls(whole, sp, ranks.index(me), heads_group, ring)

    @property
    def ulysses(self) -> SequenceParallel | None:
        """The ranks that exchange sequence for heads (None: none, ring attention alone)."""
        return self if self.ring is None else self.heads_group

    @property
    def ulysses_degree(self) -> int:
        return 1 if self.ulysses is None else self.ulysses.world

    @property
    def ring_degree(self) -> int:
        return 1 if self.ring is None else self.ring.world

    def check_heads(self, heads: int) -> None:
        check_heads(heads, self.ulysses_degree)

    def check_backend(self, backend) -> None:
        check_ring_backend(backend, self.ring_degree)

    def shard(self, x: torch.Tensor, sizes: tuple[int, ...], dim: int = 1) -> torch.Tensor:
        """This rank's contiguous slice of ``x`` along ``dim``."""
        start = sum(sizes[: self.rank])
        return x.narrow(dim, start, sizes[self.rank])

    def gather(self, x: torch.Tensor, sizes: tuple[int, ...], dim: int = 1) -> torch.Tensor:
        """The shards of every rank concatenated along ``dim`` (in rank order)."""
        longest = max(sizes)
        pad = list(x.shape)
        pad[dim] = longest - x.shape[dim]
        padded = torch.cat([x, x.new_zeros(pad)], dim) if pad[dim] else x
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(parts, padded.contiguous(), group=self.group)
        return torch.cat([p.narrow(dim, 0, s) for p, s in zip(parts, sizes)], dim)

    def seq_to_heads(self, x: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
        """[B, S_rank, H, D] -> [B, S, H / world, D]: this rank's head group over the whole sequence."""
        B, s, H, D = x.shape
        w = self.world
        send = x.reshape(B, s, w, H // w, D).permute(2, 1, 0, 3, 4).reshape(w * s, B, H // w, D)  # [w*s, B, H/w, D]
        recv = funcol.all_to_all_single(send.contiguous(), list(sizes), [s] * w, self.group)
        return funcol.wait_tensor(recv).permute(1, 0, 2, 3)

    def heads_to_seq(self, x: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
        """[B, S, H / world, D] -> [B, S_rank, H, D]: the inverse of :meth:`seq_to_heads`."""
        B, _, h, D = x.shape
        w, s = self.world, sizes[self.rank]
        recv = funcol.all_to_all_single(x.permute(1, 0, 2, 3).contiguous(), [s] * w, list(sizes), self.group)
        return funcol.wait_tensor(recv).reshape(w, s, B, h, D).permute(2, 1, 0, 3, 4).reshape(B, s, w * h, D)


class UlyssesDispatch:
    """An :class:`~fastwan.attention.AttentionDispatch` whose self-attention runs over the whole sequence for
    this rank's heads; everything else is the wrapped dispatch's. ``sizes``: the current forward's shard sizes
    (set by the DiT once per forward)."""

    def __init__(self, inner, sp: SequenceParallel):
        sp.check_backend(inner.self_backend)
        self.inner, self.sp = inner, sp
        self.sizes: tuple[int, ...] | None = None
        # the ring's P2P calls run outside compiled graphs (torch.compiler.disable imports dynamo: applied here)
        self._ring = torch.compiler.disable(ring_attention) if sp.ring is not None else None
        self.ring_kernel = ring_kernel(inner.self_backend) if sp.ring is not None else None
        self.ring_merge = ring_merge(ring_device(sp.ring)) if sp.ring is not None else None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def self_attention(self, q, k, v, meta: AttentionMetadata | None = None) -> torch.Tensor:
        """q, k, v: this rank's tokens, [B, S_rank, H, D] -> [B, S_rank, H, D]."""
        sizes, heads, uly, ring = self.sizes, q.shape[2], self.sp.ulysses, self.sp.ring
        if ring is not None:  # Ulysses among the ranks of this rank's chunk of the sequence; the ring across chunks
            u = self.sp.ulysses_degree
            chunks = tuple(sum(sizes[j * u:(j + 1) * u]) for j in range(ring.world))
            sizes = sizes[ring.rank * u:(ring.rank + 1) * u]
        if uly is not None:
            q, k, v = (uly.seq_to_heads(t, sizes) for t in (q, k, v))
        if ring is not None:
            out = self._ring(q, k, v, ring, chunks, kernel=self.ring_kernel, merge_fn=self.ring_merge)
        else:
            if meta is not None:  # this rank holds heads [rank * H / world, (rank + 1) * H / world) of the layer's H
                extra = {**(meta.extra or {}), "head_range": (uly.rank * (heads // uly.world), heads)}
                for name in TOKEN_EXTRAS:  # per token and head (VSA's gate): split like q
                    if name in extra:
                        extra[name] = uly.seq_to_heads(extra[name], sizes)
                meta = dataclasses.replace(meta, extra=extra)
            out = self.inner.self_attention(q, k, v, meta)
        return out if uly is None else uly.heads_to_seq(out, sizes)
