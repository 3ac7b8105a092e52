"""CHORDS step-parallel sampling: K cores integrate the flow ODE of one Euler-type sampler together, the faster
(coarser, later-starting) cores rectified by the slower (finer) ones, so the fine solution is approached in
fewer sequential rounds of model calls (Han, Ye, Li, Xu, Zou, Ermon: "CHORDS: Diffusion Sampling Accelerator with
Multi-core Hierarchical ODE Solvers", ICCV 2025). The result differs from sequential sampling; with one core it is
sequential Euler sampling, bit for bit.

The rule, on the sampler's grid sigma_0 > sigma_1 > ... > sigma_T = 0 (T steps, step i at sigma_i) with the Euler
map E(x, v, i -> j) = x + (sigma_j - sigma_i) v and the initialization steps 0 = s_0 < s_1 < ... < s_{K-1} < T:

- Core k holds a point (p_k, x_k) (its current step and latents) and an anchor (a_k, y_k, u_k): the step, latents
  and velocity of its last start or correction. Core 0 starts at (0, x) with anchor step 0.
- Round r (one batched model call): every core k <= min(r, K - 1) evaluates v_k = f(x_k, step p_k); a core
  evaluating its anchor records u_k = v_k. Then, with this round's values:
  - a core evaluating its first point (k = r) starts core k + 1 (when k + 1 < K) at step s_{k+1} with the coarse
    jump x_{k+1} = y_{k+1} = E(x_k, v_k, p_k -> s_{k+1}), anchor step s_{k+1};
  - core k > 0 whose anchor step is the step core k - 1 evaluated this round is corrected, to
    x_k <- E(x_k, v_k, p_k -> p_k + 1) - E(y_k, u_k, a_k -> p_k + 1) + E(x_{k-1}, v_{k-1}, a_k -> p_k + 1)
    (its fine step, less its own coarse jump from the anchor, plus the same jump from the slower core's point),
    and its anchor becomes (p_k + 1, x_k); every other core takes its fine step x_k <- E(x_k, v_k, p_k -> p_k + 1);
  - p_k <- p_k + 1 for every core that evaluated.
- The run ends after the first round in which a core reaches step T; the result is that core's latents (of two
  reaching it in one round, the later-starting one). Core k reaches T after round k + T - s_k - 1, so CHORDS runs
  min_k (k + T - s_k) rounds (:func:`rounds_needed`), and round r calls the model on min(r + 1, K) latents.

The published schedule for 8 cores and 50 steps starts the cores at steps 0, 2, 4, 8, 16, 24, 32, 40 (17 rounds);
:func:`default_init` scales its first K points to T steps. The sampler must be Euler-type (one velocity per step,
a jump between any two grid points): fastwan's ``euler``; ``dmd`` (fresh noise each step) and the default UniPC
scheduler (multistep) are refused (:func:`check_chords`).
"""
from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from fastwan.errors import InvalidArgument, InvalidArgumentType

PUBLISHED_STEPS = 50  # the step count of the published schedule
CHORDS_SAMPLERS = ("euler",)
PARALLEL_SAMPLING = ("chords",)


def _published(k: int) -> int:
    """Core k's start in the published 50-step schedule: 0, then doubling 2, 4, 8, 16, then every 8 steps (to 40
    for the published 8 cores; continued every 8 steps for more, fastwan's extension)."""
    return 0 if k == 0 else 2 ** k if k <= 4 else 16 + 8 * (k - 4)


def default_init(cores: int, steps: int) -> tuple[int, ...]:
    """The start steps of ``cores`` cores over ``steps`` steps: the published schedule's first ``cores`` points
    scaled by steps / 50 (rounded), each at least one step after the previous; may reach past ``steps - 1`` when
    the cores are too many for the steps (:func:`check_chords` refuses that)."""
    out = [0]
    for k in range(1, cores):
        out.append(max(out[-1] + 1, round(_published(k) * steps / PUBLISHED_STEPS)))
    return tuple(out)


def rounds_needed(init: Sequence[int], steps: int) -> int:
    """The sequential rounds of model calls CHORDS runs: core k reaches the last step after k + steps - init[k]."""
    return min(k + steps - s for k, s in enumerate(init))


def check_parallel_sampling(name) -> str:
    """Rule: step-parallel sampling is one of :data:`PARALLEL_SAMPLING`."""
    if not isinstance(name, str) or name not in PARALLEL_SAMPLING:
        raise (InvalidArgument if isinstance(name, str) else InvalidArgumentType)(
            f"parallel_sampling={name!r} is not one of {PARALLEL_SAMPLING} (CHORDS: pass it with chords_cores=K).")
    return name


def check_cores(cores) -> int:
    """Rule: a CHORDS core count is an int >= 1 (a NumPy / torch integer as its int)."""
    if hasattr(cores, "item") and getattr(cores, "ndim", None) == 0:
        cores = cores.item()
    if isinstance(cores, bool) or not isinstance(cores, numbers.Integral):
        raise InvalidArgumentType(f"chords_cores={cores!r} must be an int >= 1 (the number of CHORDS cores, e.g. 4).")
    if cores < 1:
        raise InvalidArgument(f"chords_cores={cores} must be >= 1 (the number of CHORDS cores, e.g. 4).")
    return int(cores)


def check_init(init) -> tuple[int, ...]:
    """Rule: CHORDS start steps are a list of ints (a tuple, list or 1-d array; the values are checked against the
    cores and steps by :func:`check_chords`)."""
    if isinstance(init, (str, bytes)) or not hasattr(init, "__iter__") or getattr(init, "ndim", 1) != 1:
        raise InvalidArgumentType(f"chords_init={init!r} must be a list of steps, one per core, e.g. [0, 2, 4, 8].")
    out = tuple(v.item() if hasattr(v, "item") else v for v in init)
    if not out or any(isinstance(v, bool) or not isinstance(v, numbers.Integral) for v in out):
        raise InvalidArgumentType(f"chords_init={list(out)!r} must be a non-empty list of int steps, one per core, "
                                  "e.g. [0, 2, 4, 8].")
    return tuple(int(v) for v in out)


def check_chords(cores, steps: int, init=None, sampler: str = "euler") -> tuple[int, ...]:
    """Rule: CHORDS runs ``cores`` >= 1 cores (an int) over an Euler-type sampler (:data:`CHORDS_SAMPLERS`) of
    ``steps`` >= cores steps, each core starting at a distinct step: ``init`` (None: :func:`default_init`) is
    ``cores`` strictly increasing ints from 0, the last below ``steps``. Returns the start steps; raises before
    any compute."""
    cores = check_cores(cores)
    if sampler not in CHORDS_SAMPLERS:
        raise InvalidArgument(
            f"chords_cores={cores} (CHORDS) needs an Euler-type sampler (one velocity per step, an Euler jump "
            f"between any two steps); sampler={sampler!r} cannot run with it: pass sampler='euler'.",
            field="chords_cores")
    if cores > steps:
        raise InvalidArgument(f"chords_cores={cores} exceeds the {steps} steps: each core starts at its own step; "
                              f"pass chords_cores <= {steps} or more steps.", field="chords_cores")
    if init is None:
        init = default_init(cores, steps)
        if init[-1] >= steps:
            raise InvalidArgument(f"chords_cores={cores} cores cannot start at distinct steps of the published "
                                  f"schedule over {steps} steps ({list(init)}); pass fewer cores or more steps.",
                                  field="chords_cores")
        return init
    init = tuple(init)
    if (len(init) != cores or any(isinstance(s, bool) or not isinstance(s, numbers.Integral) for s in init)
            or init[0] != 0 or any(b <= a for a, b in zip(init, init[1:])) or init[-1] >= steps):
        raise InvalidArgument(f"chords_init={list(init)!r} must be {cores} strictly increasing steps from 0 "
                              f"(one per core), the last below {steps}, e.g. {list(default_init(cores, steps))}.",
                              field="chords_init")
    return tuple(int(s) for s in init)


@dataclass(frozen=True)
class ChordsResult:
    """``latents``: the returned core's final latents; ``rounds``: per round, the step each evaluating core
    evaluated (core order), one batched model call per round; ``core``: the core whose latents are returned."""
    latents: torch.Tensor
    rounds: tuple[tuple[int, ...], ...]
    core: int

    @property
    def calls(self) -> int:
        """The velocity evaluations over all rounds."""
        return sum(map(len, self.rounds))


@dataclass
class _Core:
    step: int
    x: torch.Tensor
    anchor: int
    anchor_x: torch.Tensor
    anchor_v: torch.Tensor | None = None


def chords(velocity: Callable[[torch.Tensor, tuple[int, ...]], torch.Tensor], x: torch.Tensor,
           sigmas: Sequence[float], cores: int, init: Sequence[int] | None = None) -> ChordsResult:
    """CHORDS (the module's rule) from latents ``x`` at step 0 over ``sigmas`` (T + 1 floats, strictly decreasing,
    the last 0). ``velocity(xs, steps)``: the flow velocities [n, *x.shape] at latents ``xs`` [n, *x.shape] (one
    batched call; core order) at grid steps ``steps`` (n ints)."""
    sig = [float(s) for s in sigmas]
    steps = len(sig) - 1
    if steps < 1 or sig[-1] != 0.0 or any(b >= a for a, b in zip(sig, sig[1:])):
        raise InvalidArgument(f"sigmas={sig!r} must strictly decrease to 0 over at least one step.")
    init = check_chords(cores, steps, init)

    def jump(x, v, i, j):
        return x + (sig[j] - sig[i]) * v

    active = [_Core(0, x, 0, x)]
    rounds = []
    while True:
        r = len(rounds)
        here = tuple(c.step for c in active)
        xs = [c.x for c in active]  # the points evaluated this round (a correction reads the slower core's)
        vs = velocity(torch.stack(xs), here)
        rounds.append(here)
        new = []
        for k, (c, v) in enumerate(zip(active, vs)):
            if c.step == c.anchor:
                c.anchor_v = v
            if k == r and k + 1 < len(init):
                nxt = jump(c.x, v, c.step, init[k + 1])
                new.append(_Core(init[k + 1], nxt, init[k + 1], nxt))
            fine = jump(c.x, v, c.step, c.step + 1)
            if k > 0 and here[k - 1] == c.anchor:
                c.x = (fine - jump(c.anchor_x, c.anchor_v, c.anchor, c.step + 1)
                       + jump(xs[k - 1], vs[k - 1], c.anchor, c.step + 1))
                c.anchor, c.anchor_x, c.anchor_v = c.step + 1, c.x, None
            else:
                c.x = fine
        for c in active:
            c.step += 1
        done = [k for k, c in enumerate(active) if c.step == steps]
        if done:
            return ChordsResult(active[done[-1]].x, tuple(rounds), done[-1])
        active += new
