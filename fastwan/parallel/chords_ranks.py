"""CHORDS over processes: each core of :mod:`fastwan.parallel.chords` on its own ranks, the cores exchanging
latents with point-to-point messages (gloo on the CPU, NCCL on GPUs).

Layout (:func:`check_layout`, :func:`core_layout`): N ranks, K cores, S = N / K ranks a core; core c holds the
consecutive ranks c * S .. c * S + S - 1 (rank 0 is core 0's first). A core's S ranks run its forwards with
sequence parallelism (Ulysses x Ring, the automatic split of S ranks by :func:`fastwan.parallel.mesh.sequence_layout`,
which runs wherever the N-rank split of the generator ran) and hold its latents alike. Rule: N is a multiple of K
and CFG parallelism is off (its halves would each need the K cores); anything else is refused before compute.

The schedule (:class:`ChordsPlan`) follows from the start steps s_k and the step count T alone: in round r core k
(active from round k) evaluates step s_k + r - k, so every start and correction of the rule is known before any
model call. Information flows only from core k - 1 to core k: its start, the coarse jump E(x, v, s_{k-1} -> s_k)
of core k - 1's first round (round k - 1), and, in each round where core k's anchor is core k - 1's step (a
correction round of core k), the jump E(x_{k-1}, v_{k-1}, a_k -> p_k + 1) from core k - 1's point, which core k
adds in place of its own coarse jump from the anchor. The returned core k* (the last-starting of the cores first
to reach step T, after R = min_k (k + T - s_k) rounds) depends on the cores below it only, so cores above k* run
no forward, and core k < k* stops after the last round whose value core k + 1 uses (``last``).

The exchange, and the waits it allows: rank j of core k - 1 sends to rank j of core k (each holds the core's
latents) with non-blocking sends, so a sender never waits for a receiver; a receiver posts its next receive before
the forward of the round that needs it and waits for it only after that forward, where the update needs the value.
So core k waits only in its start and correction rounds, and only for core k - 1's forward of the same round plus
one transfer; the wall time is the returned core's rounds (R forwards) plus those waits. Core k*'s first rank sends
its final latents to rank 0, which decodes. With one core (K = 1) nothing is sent: sequential sampling over N ranks.

Progress: ``on_step(done, R)`` is called on every rank once per round, in order: for the rounds up to core 0's last
as this rank completes them (those before its core's first at once, the last of them once its start arrived), the
others after the result reached rank 0. A step callback of :class:`~fastwan.parallel.workers.ParallelGenerator` is
a broadcast from rank 0 that may stop every rank at one call: with it the ranks keep in step with rank 0 through
those rounds (without one, only the messages above order them), and as every value sent is received before the
receiver's next call, a stop leaves no message for a later request.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fastwan.errors import InvalidArgument
from fastwan.parallel.chords import rounds_needed
from fastwan.parallel.mesh import sequence_layout
from fastwan.parallel.plan import apply_sequence_parallel, remove_sequence_parallel
from fastwan.parallel.ulysses import SequenceParallel


def check_layout(cores: int, num_gpus, cfg_parallel: bool = False) -> None:
    """Rule: CHORDS with ``cores`` cores runs in one process (``num_gpus`` None or 1: the cores batched), or over
    ``num_gpus`` = cores x S processes without CFG parallelism (S ranks a core); raises naming the layouts that
    run."""
    if (num_gpus is None or num_gpus == 1) and not cfg_parallel:
        return
    if cfg_parallel:
        raise InvalidArgument(f"chords_cores={cores} (CHORDS) cannot run with cfg_parallel=True (each CFG half would "
                              f"need all {cores} cores); load with num_gpus={cores} x S for S processes a core "
                              f"(e.g. num_gpus={cores} or {2 * cores}) and cfg_parallel=False, or run the cores in "
                              "one process (num_gpus=1).")
    if num_gpus % cores:
        fits = [k for k in range(1, num_gpus + 1) if num_gpus % k == 0]
        raise InvalidArgument(f"chords_cores={cores} (CHORDS) cannot run on num_gpus={num_gpus} processes: each core "
                              "runs on num_gpus / chords_cores processes, so num_gpus must be a multiple of "
                              f"chords_cores; on {num_gpus} processes use chords_cores in {fits}, or load "
                              f"{cores} cores with num_gpus in {[cores, 2 * cores, 4 * cores]} (or num_gpus=1: the "
                              "cores batched in one process).")


@dataclass(frozen=True)
class ChordsPlan:
    """The rounds of CHORDS with start steps ``init`` over ``steps`` steps: ``rounds`` (R), the returned core
    ``result``, per core up to it its ``last`` round and the rounds it is ``corrected`` in."""

    init: tuple[int, ...]
    steps: int
    rounds: int
    result: int
    last: tuple[int, ...]
    corrected: tuple[frozenset[int], ...]

    @classmethod
    def of(cls, init: Sequence[int], steps: int) -> ChordsPlan:
        init = tuple(init)
        rounds = rounds_needed(init, steps)
        result = max(k for k, s in enumerate(init) if k + steps - s == rounds)
        last, corrected = {result: rounds - 1}, {0: frozenset()}
        for k in range(result, 0, -1):
            anchor, mine = init[k], []
            for r in range(k, last[k] + 1):
                if init[k - 1] + r - (k - 1) == anchor:  # core k - 1 evaluates core k's anchor step this round
                    mine.append(r)
                    anchor = init[k] + r - k + 1
            corrected[k] = frozenset(mine)
            last[k - 1] = max([k - 1, *mine])
        return cls(init, steps, rounds, result, tuple(last[k] for k in range(result + 1)),
                   tuple(corrected[k] for k in range(result + 1)))

    def step(self, core: int, r: int) -> int:
        """The step core ``core`` evaluates in round ``r``."""
        return self.init[core] + r - core

    def runs(self, core: int) -> range:
        """The rounds core ``core`` runs (none above the returned core)."""
        return range(core, self.last[core] + 1) if core <= self.result else range(0)

    def sends(self, core: int, r: int) -> bool:
        """Whether core ``core`` sends core + 1 a value in round ``r`` (its start, or a correction)."""
        nxt = core + 1
        return nxt <= self.result and (r == core or r in self.corrected[nxt])


def run_core(velocity: Callable[[torch.Tensor, int], torch.Tensor], x: torch.Tensor | None, sigmas: Sequence[float],
             plan: ChordsPlan, core: int, send: Callable[[int, torch.Tensor], None],
             receive: Callable[[int], torch.Tensor], on_round: Callable[[int], None] | None = None,
             prepare: Callable[[int], None] | None = None) -> torch.Tensor | None:
    """Core ``core``'s part of CHORDS (the module's rule): ``velocity(x, step)`` of one latent; ``x``: core 0's
    start latents (ignored by other cores, whose start is ``receive(core - 1)``); ``send(r, value)`` to core + 1
    and ``receive(r)`` from core - 1, the value of round ``r``; ``prepare(r)`` before round ``r``'s forward,
    ``on_round(r)`` after the round -> the final latents
    on the returned core (:attr:`ChordsPlan.result`), else None. The arithmetic is :func:`~fastwan.parallel.chords.
    chords`'s, operation for operation (the sender computes the jump the receiver adds)."""
    sig = [float(s) for s in sigmas]

    def jump(x, v, i, j):
        return x + (sig[j] - sig[i]) * v

    if core > plan.result:
        return None
    if core > 0:
        x = receive(core - 1)
    anchor, anchor_x, anchor_v = plan.init[core], x, None
    for r in plan.runs(core):
        p = plan.step(core, r)
        if prepare is not None:
            prepare(r)
        v = velocity(x, p)
        if p == anchor:
            anchor_v = v
        if plan.sends(core, r):  # the next core's start, or its correction: the jump to its next step
            send(r, jump(x, v, p, plan.init[core + 1] if r == core else plan.step(core + 1, r) + 1))
        fine = jump(x, v, p, p + 1)
        if r in plan.corrected[core]:
            x = fine - jump(anchor_x, anchor_v, anchor, p + 1) + receive(r)
            anchor, anchor_x, anchor_v = p + 1, x, None
        else:
            x = fine
        if on_round is not None:
            on_round(r)
    return x if core == plan.result else None


@dataclass(frozen=True)
class CoreLayout:
    """This rank in a K-core layout: its ``core``, the core's sequence group ``sp`` (None: one rank a core),
    ``per_core`` ranks a core, and the group ``link`` of the cores' messages (None: one core)."""

    cores: int
    per_core: int
    core: int
    rank: int
    sp: SequenceParallel | None
    link: object


def core_layout(mesh, cores: int, heads: int) -> CoreLayout:
    """The layout of ``cores`` cores over ``mesh``'s ranks (:meth:`Mesh.groups` keeps it: every rank makes the
    process groups of a new core count, in the same order, at its first request)."""
    if cores in mesh.groups:
        return mesh.groups[cores]
    per = mesh.world // cores
    core, sp, link = mesh.rank // per, mesh.sp, None
    if cores > 1:
        sp = None
        for c in range(cores):
            group = SequenceParallel.create(list(range(c * per, (c + 1) * per)), sequence_layout(heads, per)[1]) \
                if per > 1 else None
            if c == core:
                sp = group
        link = dist.new_group(list(range(mesh.world)))
    mesh.groups[cores] = out = CoreLayout(cores, per, core, mesh.rank, sp, link)
    return out


@contextlib.contextmanager
def core_sequence_parallel(models, whole: SequenceParallel | None, core: SequenceParallel | None):
    """``models`` split over the core's ranks ``core`` (None: not split) meanwhile, over ``whole`` again after."""
    if core is whole:
        yield
        return
    for m in models:
        remove_sequence_parallel(m)
        if core is not None:
            apply_sequence_parallel(m, core)
    try:
        yield
    finally:
        for m in models:
            remove_sequence_parallel(m)
            if whole is not None:
                apply_sequence_parallel(m, whole)


class _Link:
    """This rank's messages: non-blocking sends to the next core's rank; the receive of a round's value from the
    previous core's rank posted before that round's forward (:meth:`prepare`, ``expect``: the rounds whose values
    arrive), waited for after it. No receive is pending between rounds, where a stop (``on_step``) may end the
    run: none is left to take a later request's message."""

    def __init__(self, layout: CoreLayout, like: torch.Tensor, expect: frozenset[int]):
        self.layout, self.like, self.expect, self.sent, self.posted = layout, like, expect, [], None

    def prepare(self, r: int) -> None:
        if r in self.expect:
            self._post(r)

    def _post(self, r: int) -> None:
        buf = torch.empty_like(self.like)
        self.posted = (r, buf, dist.irecv(buf, src=self.layout.rank - self.layout.per_core, group=self.layout.link,
                                           tag=r))

    def send(self, r: int, value: torch.Tensor, dst: int | None = None) -> None:
        self.sent = [(v, w) for v, w in self.sent if not w.is_completed()]  # a value is kept until it is sent
        value = value.contiguous()
        dst = self.layout.rank + self.layout.per_core if dst is None else dst
        self.sent.append((value, dist.isend(value, dst=dst, group=self.layout.link, tag=r)))

    def receive(self, r: int) -> torch.Tensor:
        if self.posted is None or self.posted[0] != r:  # the start: received before this core's first round
            self._post(r)
        _, buf, work = self.posted
        work.wait()
        self.posted = None
        return buf

    def close(self) -> None:
        for _, work in self.sent:
            work.wait()
        self.sent = []


def run_ranks(mesh, models, velocity: Callable[[torch.Tensor, int], torch.Tensor], x: torch.Tensor,
              sigmas: Sequence[float], init: Sequence[int], heads: int,
              on_step: Callable[[int, int], None] | None = None) -> torch.Tensor | None:
    """CHORDS with start steps ``init`` over ``mesh``'s ranks (the module's layout and exchange); ``models``: the
    DiTs whose sequence split follows the core's ranks meanwhile; ``velocity(x, step)`` of one latent; ``x``: the
    start latents (the same on every rank) -> the final latents on rank 0, None elsewhere."""
    check_layout(len(init), mesh.world, mesh.cfg_size == 2)
    layout = core_layout(mesh, len(init), heads)
    plan = ChordsPlan.of(init, len(sigmas) - 1)
    core, cut, done = layout.core, plan.last[0], [0]

    def report(upto: int) -> None:
        while on_step is not None and done[0] <= upto:
            done[0] += 1
            on_step(done[0], plan.rounds)

    # the rounds before this core's first: the last of them once its start arrived, so that no stop (on_step) falls
    # between a value's send and its receive
    report(cut if core > plan.result else min(core - 2, cut))
    link = _Link(layout, x, plan.corrected[core] if core <= plan.result else frozenset())  # one core: no message

    def receive(r: int) -> torch.Tensor:
        value = link.receive(r)
        if r == core - 1:  # the start
            report(min(r, cut))
        return value

    with core_sequence_parallel(models, mesh.sp, layout.sp):
        out = run_core(velocity, x, sigmas, plan, core, link.send, receive, lambda r: report(min(r, cut)),
                       link.prepare)
    result_rank = plan.result * layout.per_core
    if plan.result > 0 and mesh.rank == result_rank:
        link.send(plan.rounds, out, dst=0)
    if plan.result > 0 and mesh.rank == 0:
        out = torch.empty_like(x)
        dist.recv(out, src=result_rank, group=layout.link, tag=plan.rounds)
    link.close()
    report(plan.rounds - 1)
    return out if mesh.rank == 0 else None
