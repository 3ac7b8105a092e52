"""The JSON Schema of a request's ``cache``: the string form, or one object per method (its ``type`` and settings, with
the ranges the configs check), so that a client sees the same rules the request applies."""
from __future__ import annotations

import dataclasses
from typing import Any

from fastwan.cache import CACHES
from fastwan.cache.taylorseer import FACTOR_DTYPES, MAX_ORDER


def _list(item: dict) -> dict:
    return {"type": "array", "items": item, "minItems": 1}


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


# each setting's JSON form (the same name means the same rule in every method)
SETTINGS: dict[str, dict] = {
    "threshold": {"type": "number", "minimum": 0},
    "max_skip_steps": {"type": "integer", "minimum": 1},
    "retention_ratio": {"type": "number", "minimum": 0, "maximum": 1},
    "mag_ratios": _nullable(_list({"type": "number", "exclusiveMinimum": 0})),
    "calibrate": {"type": "boolean"},
    "coefficients": _nullable(_list({"type": "number"})),
    "use_ret_steps": {"type": "boolean"},
    "steps": _list({"type": "integer", "minimum": 1}),
    "first_block": {"type": "boolean"},
    "cache_interval": {"type": "integer", "minimum": 2},
    "disable_cache_before_step": {"type": "integer", "minimum": 1},
    "disable_cache_after_step": _nullable({"type": "integer", "minimum": 2}),
    "max_order": {"type": "integer", "minimum": 0, "maximum": MAX_ORDER},
    "taylor_factors_dtype": {"enum": list(FACTOR_DTYPES)},
}


def cache_schema() -> dict[str, Any]:
    """``cache``'s JSON Schema: a string (``"none"`` or the CLI form) or an object ``{"type": NAME, SETTING: ...}``
    of one method of :data:`fastwan.cache.CACHES`, no other key allowed."""
    methods = []
    for name, cls in CACHES.items():
        props = {"type": {"const": name}}
        props.update({f.name: SETTINGS[f.name] for f in dataclasses.fields(cls)})
        methods.append({"type": "object", "properties": props, "required": ["type"], "additionalProperties": False})
    return {"anyOf": [{"type": "string"}, *methods]}
