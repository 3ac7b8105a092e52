"""The process layout of one parallel generator: ``cfg`` groups of ``sp`` ranks each (world = cfg x sp).

Rank r is in CFG group ``r // sp`` and has sequence rank ``r % sp`` in it. A CFG group's ranks split the DiT's
sequence: ``sp = ulysses x ring`` (:func:`sequence_layout`; Ulysses all-to-alls inside groups of ``ulysses`` ranks,
:mod:`fastwan.parallel.ulysses`, ring attention across the ``ring`` groups, :mod:`fastwan.parallel.ring`); with
``cfg`` = 2, group 0 computes the conditional pass and group 1 the unconditional one, and the ranks of equal
sequence rank in the two groups exchange their predictions once per step (:meth:`Mesh.cfg_pair`). Every rank holds
the whole model and the same latents; every rank ends a step with the same guided prediction, so the sampler runs
everywhere and no latents are broadcast.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fastwan.errors import InvalidArgument
from fastwan.parallel.ulysses import SequenceParallel, check_heads


def degrees(num_gpus, cfg_parallel) -> tuple[int, int]:
    """``num_gpus`` processes, CFG split over 2 groups when ``cfg_parallel`` -> (sp, cfg) degrees."""
    if not isinstance(cfg_parallel, bool):
        raise InvalidArgument(f"cfg_parallel={cfg_parallel!r} must be True or False.")
    if num_gpus is None and cfg_parallel:
        raise InvalidArgument("cfg_parallel=True runs the two CFG passes on two halves of the GPUs: give num_gpus "
                              "too (2, or 2 x the sequence-parallel degree).")
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, numbers.Integral) or num_gpus < 1:
        raise InvalidArgument(f"num_gpus={num_gpus!r} must be a whole number >= 1 (processes, one GPU each).")
    num_gpus, cfg = int(num_gpus), 2 if cfg_parallel else 1
    if num_gpus % cfg:
        near = " or ".join(str(n) for n in (num_gpus - 1, num_gpus + 1) if n >= 2)
        raise InvalidArgument(f"cfg_parallel=True runs the two CFG passes on two halves of the GPUs, so num_gpus "
                              f"must be even, not {num_gpus}; use {near} GPUs.")
    return num_gpus // cfg, cfg


def check_ring_degree(ring_degree) -> int | None:
    """``ring_degree``: None (chosen by :func:`sequence_layout`) or a whole number >= 1."""
    if ring_degree is None:
        return None
    if isinstance(ring_degree, bool) or not isinstance(ring_degree, numbers.Integral) or ring_degree < 1:
        raise InvalidArgument(f"ring_degree={ring_degree!r} must be a whole number >= 1 (the ranks of the ring; 1: "
                              "Ulysses alone), or None to choose it from the attention heads.")
    return int(ring_degree)


def layouts(heads: int, sp: int) -> list[tuple[int, int]]:
    """Every (ulysses, ring) split of ``sp`` sequence ranks that can run ``heads`` attention heads: ulysses x ring
    = sp and ulysses divides the heads."""
    return [(sp // r, r) for r in range(1, sp + 1) if sp % r == 0 and heads % (sp // r) == 0]


def sequence_layout(heads: int, sp: int, ring_degree=None) -> tuple[int, int]:
    """The split of ``sp`` sequence ranks -> (ulysses degree, ring degree). Rule: Ulysses as far as the heads allow,
    ``ulysses = gcd(heads, sp)`` (the largest degree dividing both the heads and ``sp``: all-to-alls move less data
    than a ring's key/value rounds), the ring for the rest, ``ring = sp / ulysses``. A pinned ``ring_degree`` must
    divide ``sp`` and leave a Ulysses degree ``sp / ring_degree`` that divides the heads."""
    ring_degree = check_ring_degree(ring_degree)
    if ring_degree is None:
        u = math.gcd(heads, sp)
        return u, sp // u
    can = layouts(heads, sp)
    if (sp // ring_degree, ring_degree) not in can:
        names = ", ".join(f"ring_degree={r} (Ulysses {u} x Ring {r})" for u, r in can)
        raise InvalidArgument(f"ring_degree={ring_degree} cannot split {sp} sequence-parallel process(es) over a DiT "
                              f"with {heads} attention heads: the ring degree must divide the processes and the "
                              f"Ulysses degree left (processes / ring degree) must divide the heads; use one of "
                              f"{names}, or leave ring_degree unset to choose.")
    return sp // ring_degree, ring_degree


def check_cache(cache, sp: int) -> None:
    """Step caches decide per pass from the whole prediction: not under sequence parallelism (a rank sees its
    shard)."""
    if cache is not None and sp > 1:
        raise InvalidArgument(f"cache={cache!r}: step caches do not run with sequence parallelism (each rank would "
                              "decide on its own shard); pass cache=None, or use cfg_parallel alone.")


def check_parallel_request(heads: int, num_gpus, cfg_parallel, cache, ring_degree=None) -> int:
    """The checks of a parallel generator that need the checkpoint (its heads) and the default step cache -> the
    ring degree."""
    sp, _ = degrees(num_gpus, cfg_parallel)
    ulysses, ring = sequence_layout(heads, sp, ring_degree)
    check_heads(heads, ulysses)
    check_cache(cache, sp)
    return ring


@dataclass(frozen=True, eq=False)
class Mesh:
    """This rank's place in the layout: ``rank`` of ``world``; ``sp``: its CFG group as a
    :class:`SequenceParallel` (None when ``sp`` = 1); ``cfg_group``: the ranks of its sequence rank, one per CFG
    group (None without CFG parallelism); ``cfg_index``: its CFG group (0: conditional pass); ``groups``: the process
    groups made later for this layout (CHORDS's cores: :func:`fastwan.parallel.chords_ranks.core_layout`)."""

    rank: int
    world: int
    sp: SequenceParallel | None
    cfg_group: object
    cfg_index: int
    cfg_size: int
    groups: dict = field(default_factory=dict, repr=False)  # CHORDS's core layouts by core count (chords_ranks)

    @classmethod
    def create(cls, sp: int, cfg: int, ring: int = 1) -> Mesh:
        """The groups of an initialised default process group of ``sp * cfg`` ranks, each CFG group's ``sp`` split
        into Ulysses x ``ring`` (every rank calls this, in the same order, as ``dist.new_group`` requires)."""
        world, rank = dist.get_world_size(), dist.get_rank()
        if world != sp * cfg:
            raise InvalidArgument(f"the process group has {world} ranks but the layout needs {sp * cfg} "
                                  f"({cfg} CFG group(s) x {sp} sequence ranks); start {sp * cfg} processes.")
        mine_sp = mine_cfg = None
        for c in range(cfg):
            ranks = [c * sp + r for r in range(sp)]
            group = SequenceParallel.create(ranks, ring) if sp > 1 else None
            if rank in ranks:
                mine_sp = group
        for r in range(sp):
            ranks = [c * sp + r for c in range(cfg)]
            g = dist.new_group(ranks) if cfg > 1 else None
            if rank in ranks:
                mine_cfg = g
        return cls(rank, world, mine_sp, mine_cfg, rank // sp, cfg)

    def check_cache(self, cache) -> None:
        check_cache(cache, 1 if self.sp is None else self.sp.world)

    @property
    def writes(self) -> bool:
        """Whether this rank decodes and writes the video (rank 0 only)."""
        return self.rank == 0

    def cfg_pair(self, mine: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """With CFG parallelism: this rank's prediction (the conditional pass in CFG group 0, the unconditional one
        in group 1) -> (conditional, unconditional) predictions, equal on every rank."""
        mine = mine.contiguous()
        both = [torch.empty_like(mine) for _ in range(self.cfg_size)]
        dist.all_gather(both, mine, group=self.cfg_group)
        return both[0], both[1]

    def cfg_report(self, report: dict) -> dict:
        """With CFG parallelism: this rank's step-cache report -> the CFG group's: the conditional pass's entries
        from group 0, the unconditional pass's from group 1 (the pass each group ran), equal on every rank."""
        reports: list = [None] * self.cfg_size
        dist.all_gather_object(reports, report, group=self.cfg_group)
        merged = {key: value for key, value in reports[0].items() if key not in ("computed", "calibration")}
        merged["computed"] = {}
        for key in ("computed", "calibration"):
            for index, name in enumerate(("cond", "uncond")):
                if name in reports[index].get(key, {}):
                    merged.setdefault(key, {})[name] = reports[index][key][name]
        return merged
