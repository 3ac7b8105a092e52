"""Plain values for checks and messages: the Python number a NumPy / torch scalar holds, and how a value is spelled
and typed in JSON. Every layer uses them; they import nothing of fastwan."""
from __future__ import annotations

import json

import numpy as np
import torch


def python_number(value):
    """``value`` as the Python scalar it holds when it is a NumPy scalar or a 0-d NumPy array / torch tensor
    (``.item()``: int, float or bool by its dtype); anything else as it is, for the checks to name."""
    if isinstance(value, (np.ndarray, torch.Tensor)) and value.ndim != 0:
        return value
    if isinstance(value, (np.generic, np.ndarray, torch.Tensor)):
        try:
            return value.item()
        except (RuntimeError, ValueError):  # a tensor without data (meta device): left for the checks to name
            return value
    return value


def json_text(value: object) -> str:
    """``value`` as it is written in a JSON file (its repr when it is not JSON data)."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def json_type(value: object) -> str:
    """The JSON type name of a value read from a JSON file ('number', 'string', 'array', 'null', ...)."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    names = {str: "string", list: "array", dict: "object", type(None): "null"}
    return names.get(type(value), type(value).__name__)
