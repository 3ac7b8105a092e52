"""Configuration parsing for the sparse backends: JSON loading and validation with actionable errors.

Every error is a :class:`ValueError` that names the offending value, the rule it breaks and how to fix it,
and is raised when the backend is constructed (or, for facts that need the grid or the head count, when the
layout/plan is built) -- always before any attention is computed.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from fastwan.errors import InvalidArgument
from fastwan.fields import unique_keys
from fastwan.values import json_type

Triple = tuple[int, int, int]

KERNELS = ("auto", "flex", "sdpa", "fa4")


def load_attention_config(source: str | os.PathLike | Mapping[str, Any] | None, *,
                          given_by: str = "attention_config=") -> dict:
    """Load a sparse-attention config: a JSON file path, a JSON string, a dict, or None (-> {}); ``given_by``
    (the argument, flag or variable it came from) is named in errors.

    The result is a plain dict of constructor keyword arguments for the chosen backend (see the backend
    modules for the keys each accepts). Paths usually come from ``FASTWAN_ATTENTION_CONFIG``
    (``fastwan.envs.attention_config()``).
    """
    if source is None:
        return {}
    if isinstance(source, Mapping):
        return dict(source)
    if not isinstance(source, (str, os.PathLike)):
        raise InvalidArgument(
            f"attention config (from {given_by}) must be a JSON file path, a JSON object string or a dict, got "
            f"{type(source).__name__}."
        )
    text = str(source)
    origin = "JSON string"
    if not text.lstrip().startswith("{"):
        path = os.path.expanduser(text)
        kind = None if os.path.isfile(path) else _json_value(text)
        if kind is not None:
            raise InvalidArgument(
                f"attention config {text!r} (from {given_by}) is a JSON {kind}, not a JSON object; give "
                "a JSON object ({...}) of backend options, the path of a JSON file holding one, or a dict."
            )
        if not os.path.isfile(path):
            raise InvalidArgument(
                f"attention config file {text!r} does not exist (from {given_by}); give the path of a JSON file, "
                "inline JSON ({...}) or a dict."
            )
        with open(path, encoding="utf-8") as f:
            text = f.read()
        origin = f"file {path!r}"
    try:
        data = json.loads(text, object_pairs_hook=unique_keys(f"attention config {origin} (from {given_by})",
                                                              "setting"))
    except json.JSONDecodeError as exc:
        raise InvalidArgument(
            f"attention config {origin} (from {given_by}) is not valid JSON: {exc.msg} at line {exc.lineno}, "
            f"column {exc.colno}. Fix the JSON (keys in double quotes, no trailing commas, no comments)."
        ) from None
    if not isinstance(data, dict):
        raise InvalidArgument(
            f"attention config {origin} (from {given_by}) must hold a JSON object ({{...}}) of backend options, "
            f"got a JSON {json_type(data)}."
        )
    return data


def _json_value(text: str) -> str | None:
    """The JSON type of ``text`` when it is valid JSON (e.g. "array" for "[1]"), else None."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return json_type(value)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def triple(value: Any, name: str, *, minimum: int = 1, allow_minus_one: bool = False) -> Triple:
    """Three ints for (T, H, W); a single int is repeated. ``-1`` means "whole dimension" when allowed."""
    if _is_int(value):
        value = [value] * 3
    if (
        not isinstance(value, Sequence)
        or isinstance(value, str)
        or len(value) != 3
        or not all(_is_int(x) for x in value)
    ):
        raise InvalidArgument(
            f"{name}={value!r} must be one integer or a list of three integers for the (T, H, W) dimensions, "
            "e.g. [3, 3, 3]."
        )
    for x in value:
        if x == -1 and allow_minus_one:
            continue
        if x < minimum:
            extra = " (or -1 for the whole dimension)" if allow_minus_one else ""
            raise InvalidArgument(f"{name}={list(value)!r}: every entry must be >= {minimum}{extra}, got {x}.")
    return (value[0], value[1], value[2])


def bool_triple(value: Any, name: str) -> tuple[bool, bool, bool]:
    if isinstance(value, bool):
        return (value, value, value)
    if (
        not isinstance(value, Sequence)
        or isinstance(value, str)
        or len(value) != 3
        or not all(isinstance(x, bool) for x in value)
    ):
        raise InvalidArgument(f"{name}={value!r} must be a bool or a list of three bools for (T, H, W).")
    return (value[0], value[1], value[2])


def window(value: Any, where: str) -> Triple:
    """An STA window in tiles: three odd positive ints (a single int is repeated)."""
    w = triple(value, where)
    bad = [x for x in w if x % 2 == 0]
    if bad:
        raise InvalidArgument(
            f"{where}={list(w)!r}: STA windows must be odd (a window is centered on the query tile: "
            f"size = 2*radius+1), got {bad[0]}; use {bad[0] - 1} or {bad[0] + 1}."
        )
    return w


def tile_option(value: Any, name: str = "tile", *, allow_auto: bool) -> Triple | str:
    if isinstance(value, str):
        if value.lower() == "auto" and allow_auto:
            return "auto"
        raise InvalidArgument(
            f"{name}={value!r}: give three integers (T, H, W)" + (' or "auto"' if allow_auto else "") + "."
        )
    return triple(value, name)


def block_size_option(value: Any) -> int | None:
    if value is None:
        return None
    if not _is_int(value) or value < 1:
        raise InvalidArgument(
            f"block_size={value!r} must be a positive integer (slots per tile, >= the tile's token count; "
            "a multiple of 16 for the CUDA kernels); use 64 or 128, or leave it unset."
        )
    return value


def kernel_option(value: Any) -> str:
    if not isinstance(value, str) or value.lower() not in KERNELS:
        raise InvalidArgument(f"kernel={value!r} is not a sparse kernel; use one of {', '.join(KERNELS)}.")
    return value.lower()


def dense_steps_option(value: Any) -> int:
    if not _is_int(value) or value < 0:
        raise InvalidArgument(
            f"dense_steps={value!r} must be an integer >= 0 (the number of first denoising steps that use "
            "full attention)."
        )
    return value


def sparsity_option(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0.0 <= float(value) < 1.0) or (
        isinstance(value, float) and math.isnan(value)
    ):
        raise InvalidArgument(
            f"sparsity={value!r} must be a number in [0, 1): the fraction of key tiles each query tile skips "
            "(0 = dense, 0.9 = keep 10%)."
        )
    return float(value)


def kernel_options_option(value: Any) -> dict | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise InvalidArgument(f"kernel_options={value!r} must be a dict of FlexAttention kernel options.")
    return dict(value)
