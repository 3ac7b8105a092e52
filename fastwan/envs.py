"""Every environment variable fastwan reads is parsed here, and only here.

FastVideo's names are honoured so existing launch scripts keep working; where a setting has both a ``FASTVIDEO_``
and a ``FASTWAN_`` spelling, either may be set, and when both are set they must agree (else InvalidArgument).
Errors name the variable the user set, with its value as set. An empty or all-blank value means unset.
"""
from __future__ import annotations

import math
import os
from collections.abc import Mapping

from fastwan.errors import InvalidArgument, InvalidArgumentType


def _get(env: Mapping[str, str] | None, name: str) -> str | None:
    env = os.environ if env is None else env
    value = env.get(name)
    if value is None or value.strip() == "":
        return None
    return value.strip()


def _aliased(env: Mapping[str, str] | None, names: tuple[str, str], same=None) -> tuple[str | None, str | None]:
    """(value, the variable it came from) of a setting with two spellings, or (None, None) when neither is set.
    When both are set, ``same(a, b)`` (default: equal after stripping) must hold, else :class:`InvalidArgument`."""
    a, b = (_get(env, n) for n in names)
    if a is not None and b is not None and not (same(a, b) if same else a == b):
        raise InvalidArgument(
            f"{names[0]}={a!r} and {names[1]}={b!r} disagree; set only one of them (or set both to the same value)."
        )
    if a is not None:
        return a, names[0]
    return (b, names[1]) if b is not None else (None, None)


_BACKEND_VARS = ("FASTVIDEO_ATTENTION_BACKEND", "FASTWAN_ATTENTION_BACKEND")
_CONFIG_VARS = ("FASTWAN_ATTENTION_CONFIG", "FASTVIDEO_ATTENTION_CONFIG")


def _same_name(a: str, b: str) -> bool:
    return a.upper() == b.upper()


def attention_backend(env: Mapping[str, str] | None = None) -> str | None:
    """``FASTVIDEO_ATTENTION_BACKEND`` or ``FASTWAN_ATTENTION_BACKEND`` as set (names are case-insensitive: the
    registry matches them), or None."""
    return _aliased(env, _BACKEND_VARS, same=_same_name)[0]


def attention_backend_variable(env: Mapping[str, str] | None = None) -> str | None:
    """The variable :func:`attention_backend` took its value from (for messages), or None when neither is set."""
    return _aliased(env, _BACKEND_VARS, same=_same_name)[1]


def attention_config(env: Mapping[str, str] | None = None) -> str | None:
    """``FASTWAN_ATTENTION_CONFIG`` (or FastVideo's ``FASTVIDEO_ATTENTION_CONFIG``): a JSON file path (or JSON)."""
    return _aliased(env, _CONFIG_VARS)[0]


def attention_config_variable(env: Mapping[str, str] | None = None) -> str | None:
    """The variable :func:`attention_config` took its value from (for messages), or None when neither is set."""
    return _aliased(env, _CONFIG_VARS)[1]


SDPA_KERNELS = ("auto", "flash", "cudnn", "efficient", "math")


def sdpa_kernel(env: Mapping[str, str] | None = None) -> str:
    """``FASTWAN_SDPA_KERNEL``: one of auto|flash|cudnn|efficient|math (default auto)."""
    value = (_get(env, "FASTWAN_SDPA_KERNEL") or "auto").lower()
    if value not in SDPA_KERNELS:
        raise InvalidArgument(
            f"FASTWAN_SDPA_KERNEL={value!r} is not a PyTorch SDPA kernel; use one of {', '.join(SDPA_KERNELS)}."
        )
    return value


def flash_attn_version(env: Mapping[str, str] | None = None) -> int | None:
    """``FASTWAN_FLASH_ATTN_VERSION``: 2, 3 or 4 pins the FlashAttention generation; unset = best installed."""
    value = _get(env, "FASTWAN_FLASH_ATTN_VERSION")
    if value is None:
        return None
    if value not in ("2", "3", "4"):
        raise InvalidArgument(
            f"FASTWAN_FLASH_ATTN_VERSION={value!r} must be 2, 3 or 4 (or unset for the best installed)."
        )
    return int(value)


def _flag(env: Mapping[str, str] | None, name: str) -> bool | None:
    value = _get(env, name)
    if value is None:
        return None
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise InvalidArgument(f"{name}={value!r} is not a boolean; use 1/0, true/false, yes/no or on/off.")


def nvfp4_fa4(env: Mapping[str, str] | None = None) -> bool:
    """``FASTVIDEO_NVFP4_FA4`` (or ``FASTWAN_NVFP4_FA4``): NVFP4 Q/K in the FLASH_ATTN backend (sm100 only)."""
    a, b = _flag(env, "FASTVIDEO_NVFP4_FA4"), _flag(env, "FASTWAN_NVFP4_FA4")
    if a is not None and b is not None and a != b:
        raise InvalidArgument(
            f"FASTVIDEO_NVFP4_FA4={_get(env, 'FASTVIDEO_NVFP4_FA4')!r} and "
            f"FASTWAN_NVFP4_FA4={_get(env, 'FASTWAN_NVFP4_FA4')!r} disagree; set only one of them."
        )
    return bool(a if a is not None else b)


_GATE_RULE = ("it is the fraction of steps run with full CFG (e.g. 0.5 skips the uncond forward in the second half; "
              "1.0 turns gating off).")


def _same_number(a: str, b: str) -> bool:
    try:
        return float(a) == float(b)
    except ValueError:
        return a == b


def cfg_gate_step(env: Mapping[str, str] | None = None) -> float | None:
    """``FASTVIDEO_CFG_GATE_STEP`` (or ``FASTWAN_CFG_GATE_STEP``): fraction of the steps after which the uncond
    forward is skipped."""
    value, name = _aliased(env, ("FASTVIDEO_CFG_GATE_STEP", "FASTWAN_CFG_GATE_STEP"), same=_same_number)
    if value is None:
        return None
    try:
        x = float(value)
    except ValueError:
        raise InvalidArgument(f"{name}={value!r} is not a number; use a fraction in [0, 1].") from None
    return validate_cfg_gate_step(x, source=name, shown=repr(value))


def validate_cfg_gate_step(x, source: str = "cfg_gate_step", shown: str | None = None) -> float:
    """``x`` as a gating fraction in [0, 1]; errors name ``source`` with ``shown`` (the value as the user wrote it;
    default ``repr(x)``)."""
    shown = repr(x) if shown is None else shown
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise InvalidArgumentType(f"{source}={shown} must be a float in [0, 1] (1.0 = gating off).")
    if not 0.0 <= x <= 1.0 or not math.isfinite(x):  # the range first: an int too large for a float is outside
        raise InvalidArgument(f"{source}={shown} is outside [0, 1]; {_GATE_RULE}")
    return float(x)


def cache_dir(env: Mapping[str, str] | None = None) -> str:
    """``FASTWAN_CACHE``, else ``$XDG_CACHE_HOME/fastwan``, else ``~/.cache/fastwan`` (``~`` expanded)."""
    root = _get(env, "FASTWAN_CACHE")
    if root is None:
        root = os.path.join(_get(env, "XDG_CACHE_HOME") or os.path.join("~", ".cache"), "fastwan")
    return os.path.expanduser(root)


# Every variable read above, for `fastwan env` to show (values are printed as set, not parsed).
KNOWN_VARIABLES: tuple[str, ...] = (
    "FASTVIDEO_ATTENTION_BACKEND",
    "FASTWAN_ATTENTION_BACKEND",
    "FASTWAN_ATTENTION_CONFIG",
    "FASTVIDEO_ATTENTION_CONFIG",
    "FASTWAN_SDPA_KERNEL",
    "FASTWAN_FLASH_ATTN_VERSION",
    "FASTVIDEO_NVFP4_FA4",
    "FASTWAN_NVFP4_FA4",
    "FASTVIDEO_CFG_GATE_STEP",
    "FASTWAN_CFG_GATE_STEP",
    "FASTWAN_CACHE",
    "XDG_CACHE_HOME",
)


def known_variables(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The fastwan variables that are set (raw values)."""
    env = os.environ if env is None else env
    return {name: env[name] for name in KNOWN_VARIABLES if env.get(name, "").strip()}


def torchrun_env(env: Mapping[str, str] | None = None) -> tuple[int, int, int] | None:
    """(rank, local rank, world size) from torchrun's ``RANK`` / ``LOCAL_RANK`` / ``WORLD_SIZE``, or None when
    ``WORLD_SIZE`` is unset (not started by torchrun or a launcher like it)."""
    world = _get(env, "WORLD_SIZE")
    if world is None:
        return None
    values = {}
    for name, default in (("WORLD_SIZE", None), ("RANK", "0"), ("LOCAL_RANK", None)):
        raw = _get(env, name) or default
        if raw is None and name == "LOCAL_RANK":
            raw = values["RANK"]
        try:
            values[name] = int(raw)
        except ValueError:
            raise InvalidArgument(f"{name}={raw!r} must be an integer (set by torchrun).") from None
    w, r, lr = values["WORLD_SIZE"], values["RANK"], values["LOCAL_RANK"]
    if w < 1 or not 0 <= r < w or lr < 0:
        raise InvalidArgument(f"WORLD_SIZE={w}, RANK={r}, LOCAL_RANK={lr}: need WORLD_SIZE >= 1, 0 <= RANK < "
                              "WORLD_SIZE and LOCAL_RANK >= 0 (as torchrun sets them).")
    return r, lr, w


NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def disable_multicast() -> None:
    """Keep NVLink multicast (NVLS) off in this process's collectives (:data:`NO_MULTICAST`), unless the user set
    those variables: called before a process group starts."""
    for name, value in NO_MULTICAST.items():
        os.environ.setdefault(name, value)


def problems(env: Mapping[str, str] | None = None) -> list[str]:
    """The error of every parser in this module that rejects its variable as set (empty: every value parses)."""
    out = []
    for parse in (attention_backend, attention_config, sdpa_kernel, flash_attn_version, nvfp4_fa4, cfg_gate_step,
                  torchrun_env):
        try:
            parse(env)
        except InvalidArgument as exc:
            out.append(str(exc))
    return out
