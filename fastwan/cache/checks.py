"""The checks of the step caches' settings: each refuses a wrong value with its owner, name and rule."""
from __future__ import annotations

import math
import numbers

import torch

from fastwan.errors import InvalidArgument, InvalidArgumentType


def number(owner: str, name: str, value, *, lo: float = 0.0, hi: float = math.inf, integer: bool = False):
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind):
        raise InvalidArgumentType(f"{owner}({name}={value!r}): must be {'an int' if integer else 'a number'}.")
    if not (lo <= value <= hi) or (not integer and not math.isfinite(value)):
        bounds = f">= {lo}" if hi == math.inf else f"in [{lo}, {hi}]"
        raise InvalidArgument(f"{owner}({name}={value!r}): must be a finite number {bounds}.")
    return value


def flag(owner: str, name: str, value) -> None:
    if not isinstance(value, bool):
        raise InvalidArgumentType(f"{owner}({name}={value!r}): must be True or False.")


def floats(owner: str, name: str, values, *, positive: bool = False) -> tuple[float, ...] | None:
    if values is None:
        return None
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise InvalidArgumentType(f"{owner}({name}={values!r}): must be a list of numbers.")
    out = tuple(values)
    if not out or not all(isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)
                          and (v > 0 or not positive) for v in out):
        what = "finite positive" if positive else "finite"
        raise InvalidArgument(f"{owner}({name}=...): must be a non-empty list of {what} numbers, got "
                              f"{list(out)[:8]}{'...' if len(out) > 8 else ''}.")
    return tuple(float(v) for v in out)
