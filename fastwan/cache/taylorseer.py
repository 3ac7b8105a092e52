"""TaylorSeer (diffusers' ``TaylorSeerCacheConfig``): at some steps the blocks do not run; the stream after the last
block is extrapolated from the streams of the steps that computed, by a Taylor series in the step index.

A pass keeps, after each computed step, the stream ``F`` and its divided differences up to ``max_order``
(``D0 = F``, ``D(k+1) = (Dk - Dk of the previous computed step) / steps between them``). A predicted step ``d``
steps after the last computed one is ``sum_k Dk * d**k / k!``; the head then runs on it as on a computed stream.

Steps count from the pass's first step (its expert's first step on Wan2.2 A14B; each expert starts fresh). Step
``s`` computes when ``s < disable_cache_before_step``, when ``(s - disable_cache_before_step - 1) %
cache_interval == 0``, or from the request's step ``disable_cache_after_step`` on; the others are predicted.

This is diffusers' hook with ``cache_identifiers`` naming every block (``r"blocks\\.\\d+"``): there each block's
output is predicted, and the last block's prediction is what the head reads. diffusers' default identifiers (its
attention modules' names) match no module of its Wan transformer, and its lite mode predicts the head's output
instead; neither is offered here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from fastwan.cache.checks import number
from fastwan.errors import InvalidArgument, InvalidArgumentType

FACTOR_DTYPES = ("bfloat16", "float16", "float32")
MAX_ORDER = 4  # each order keeps another copy of the stream, and higher differences mostly amplify its noise


@dataclass(frozen=True)
class TaylorSeer:
    """diffusers' TaylorSeer cache. ``cache_interval``: a computed step every this many steps after the warm-up
    (>= 2); ``disable_cache_before_step``: the warm-up, steps that always compute (>= 1: a prediction needs a
    computed step); ``disable_cache_after_step``: the request's step from which every step computes (None: none);
    ``max_order``: the highest order of the expansion (0: the last computed stream held; at most
    :data:`MAX_ORDER`); ``taylor_factors_dtype``: the dtype the differences are kept in (one of
    :data:`FACTOR_DTYPES`, or that torch dtype)."""
    cache_interval: int = 5
    disable_cache_before_step: int = 3
    disable_cache_after_step: int | None = None
    max_order: int = 1
    taylor_factors_dtype: str = "bfloat16"
    name: ClassVar[str] = "taylorseer"

    def __post_init__(self):
        owner = "TaylorSeer"
        number(owner, "cache_interval", self.cache_interval, lo=1, integer=True)
        if self.cache_interval == 1:
            raise InvalidArgument("TaylorSeer(cache_interval=1): every step would compute, so nothing is cached; "
                                  "use cache_interval >= 2 (e.g. 5), or cache=None.")
        number(owner, "disable_cache_before_step", self.disable_cache_before_step, lo=0, integer=True)
        if self.disable_cache_before_step == 0:
            raise InvalidArgument("TaylorSeer(disable_cache_before_step=0): step 0 would be predicted from no "
                                  "computed step; use disable_cache_before_step >= 1 (e.g. 3).")
        after = self.disable_cache_after_step
        if after is not None:
            number(owner, "disable_cache_after_step", after, lo=0, integer=True)
            if after <= self.disable_cache_before_step:
                raise InvalidArgument(f"TaylorSeer(disable_cache_before_step={self.disable_cache_before_step}, "
                                      f"disable_cache_after_step={after}): every step would compute; the "
                                      "after-step must be above the before-step, or None (cache to the end).")
        number(owner, "max_order", self.max_order, lo=0, hi=MAX_ORDER, integer=True)
        dtype = self.taylor_factors_dtype
        if isinstance(dtype, torch.dtype):
            dtype = str(dtype).removeprefix("torch.")
        if not isinstance(dtype, str):
            raise InvalidArgumentType(f"TaylorSeer(taylor_factors_dtype={dtype!r}): must be a dtype name, one of "
                                      f"{', '.join(FACTOR_DTYPES)}.")
        if dtype not in FACTOR_DTYPES:
            raise InvalidArgument(f"TaylorSeer(taylor_factors_dtype={dtype!r}): must be one of "
                                  f"{', '.join(FACTOR_DTYPES)} (or that torch dtype).")
        object.__setattr__(self, "taylor_factors_dtype", dtype)

    def first_predicted(self, num_steps: int) -> int | None:
        """The first step a pass of ``num_steps`` steps predicts (None: it computes every step)."""
        end = num_steps if self.disable_cache_after_step is None else min(num_steps, self.disable_cache_after_step)
        return self.disable_cache_before_step if self.disable_cache_before_step < end else None


class TaylorState:
    """One pass's expansion: :meth:`computes` decides each step, :meth:`update` takes a computed step's stream,
    :meth:`predict` extrapolates the current step's."""

    def __init__(self, config: TaylorSeer):
        self.config = config
        self.dtype = getattr(torch, config.taylor_factors_dtype)
        self.start: int | None = None  # the request's step at which this pass began
        self.step = 0  # the current step, counted from start
        self.last: int | None = None  # the step, counted from start, of the last update
        self.factors: list[torch.Tensor] = []  # the divided differences, order 0 first
        self.out_dtype: torch.dtype | None = None

    def computes(self, step: int) -> bool:
        """Whether the blocks run at the request's step ``step`` (else :meth:`predict` stands in for them)."""
        c = self.config
        if self.start is None:
            self.start = step
        self.step = step - self.start
        before = c.disable_cache_before_step
        return (self.step < before or (self.step - before - 1) % c.cache_interval == 0 or not self.factors
                or c.disable_cache_after_step is not None and step >= c.disable_cache_after_step)

    def update(self, stream: torch.Tensor) -> None:
        """Take the current step's computed stream: its divided differences against the last update's."""
        fresh = [stream]
        if self.last is not None:
            gap = self.step - self.last
            for previous in self.factors[:self.config.max_order]:
                fresh.append((fresh[-1] - previous.to(stream.dtype)) / gap)
        self.factors = [f.to(self.dtype, copy=True) for f in fresh]  # a copy: the stream may be added into
        self.out_dtype, self.last = stream.dtype, self.step

    def predict(self) -> torch.Tensor:
        """The current step's stream, extrapolated from the last update."""
        gap = self.step - self.last
        out = self.factors[0].to(self.out_dtype, copy=True)  # the caller may add into it
        for order, factor in enumerate(self.factors[1:], start=1):
            out = out + factor.to(self.out_dtype) * (gap ** order / math.factorial(order))
        return out
