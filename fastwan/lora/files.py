"""Reading a LoRA file (safetensors only) and the alphas its safetensors metadata gives (a diffusers / PEFT
LoraConfig), checked against its tensors."""
from __future__ import annotations

import json
import math
import numbers
import re
from pathlib import Path

import torch

from fastwan.errors import CheckpointError, InvalidArgument, InvalidArgumentType, MissingFileError
from fastwan.lora.keys import METADATA_KEY, split_part


def finite(x) -> bool:
    """Whether the number ``x`` is finite as a float (an int too large for a float is not)."""
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


# file name endings of PyTorch pickle files: refused by name; any other name is read as safetensors (whose parser
# refuses a pickle, whatever its name)
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".pkl", ".pickle")


def check_lora_path(path, allow_pickle: bool = False) -> Path:
    """``path`` (``~`` expanded) when it names an existing file that is not a pickle (or, with ``allow_pickle``,
    may be one); else the user error."""
    if not isinstance(path, (str, Path)):
        raise InvalidArgumentType(f"lora={path!r} must be a path to a .safetensors file.")
    if not str(path).strip():
        raise InvalidArgument(f"lora={str(path)!r} is an empty path; give the path of a .safetensors LoRA file.")
    path = Path(path).expanduser()
    if path.is_dir():
        inside = sorted(p.name for p in path.glob("*.safetensors"))[:3]
        raise InvalidArgument(f"LoRA file {str(path)!r} is a directory, not a .safetensors file; give the path of "
                              f"the LoRA file itself{f', e.g. one of {inside}' if inside else ''}.")
    if not path.is_file():
        raise MissingFileError(f"LoRA file {str(path)!r} does not exist; check the path.")
    if is_pickle(path) and not allow_pickle:
        raise InvalidArgument(f"LoRA file {str(path)!r} is a PyTorch pickle file ({path.suffix}); fastwan loads LoRAs "
                              "from safetensors only (convert it with safetensors.torch.save_file), unless pickles "
                              "are allowed explicitly: allow_pickle=True (CLI --allow-pickle), for a file you trust "
                              "(unpickling can run code; fastwan reads tensors only).")
    return path


def is_pickle(path: Path) -> bool:
    """Whether the file name ``path`` is a PyTorch pickle's (:data:`PICKLE_SUFFIXES`)."""
    return path.suffix.lower() in PICKLE_SUFFIXES


def read_lora(path: str | Path, allow_pickle: bool = False) -> dict[str, torch.Tensor]:
    """The tensors of a LoRA file: safetensors; a pickle file (by its name) only with ``allow_pickle``, read as a
    weights-only state dict of name -> tensor."""
    from safetensors import SafetensorError, safe_open

    path = check_lora_path(path, allow_pickle)
    if is_pickle(path):
        return _read_pickle(path)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            header = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except SafetensorError as exc:  # truncated or corrupt, or another format (e.g. a pickle) under this name
        raise CheckpointError(f"LoRA file {str(path)!r} is not a valid safetensors file ({exc}); it may be "
                              "truncated or corrupt (download it again), or another format such as a pickle "
                              "under a .safetensors name (convert it with safetensors.torch.save_file).") from exc
    return {**tensors, **_metadata_alphas(tensors, _adapter_config(header, path), path)}


def _read_pickle(path: Path) -> dict[str, torch.Tensor]:
    """A pickle LoRA file's state dict (``torch.load(weights_only=True)``: tensors and plain containers only)."""
    import pickle

    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as exc:
        raise CheckpointError(f"LoRA file {str(path)!r} cannot be read as a weights-only PyTorch state dict "
                              f"({type(exc).__name__}: {str(exc)[:120]}); it is corrupt or not a LoRA: use another "
                              "copy, or a .safetensors file.") from None
    if not (isinstance(loaded, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                             for k, v in loaded.items())):
        raise CheckpointError(f"LoRA file {str(path)!r} holds a {type(loaded).__name__}, not a state dict of key -> "
                              "tensor; save the LoRA's state dict itself (or a .safetensors file).")
    return dict(loaded)


def _adapter_config(header: dict, path: Path) -> dict:
    """The DiT's LoraConfig entries that diffusers / PEFT saved in a LoRA file's safetensors ``header`` ({} when
    there are none): the ``transformer.``-prefixed ones of a pipeline save, else a model save's unprefixed ones."""
    raw = header.get(METADATA_KEY)
    if raw is None:
        return {}
    try:
        meta = json.loads(raw)
    except json.JSONDecodeError:
        meta = None
    if not isinstance(meta, dict):
        raise CheckpointError(f"LoRA file {str(path)!r}: its metadata {METADATA_KEY!r} is not a JSON object "
                              f"({str(raw)[:60]!r}); the file is corrupt: re-export it.")
    prefixed = {k[len("transformer."):]: v for k, v in meta.items() if k.startswith("transformer.")}
    return prefixed or (meta if "lora_alpha" in meta else {})


# PEFT's LoraConfig defaults, which diffusers applies to a LoRA file's metadata (``LoraConfig(**metadata)``)
PEFT_DEFAULTS = {"lora_alpha": 8, "r": 8}


def _metadata_number(config: dict, module: str, path: Path, key: str, patterns_key: str) -> float:
    """The ``key`` ("lora_alpha" or "r") a LoraConfig gives ``module``: its ``patterns_key`` entry, matched as
    PEFT matches one (the pattern is the module name's end, after a dot), else ``key``, else PEFT's default."""
    patterns = config.get(patterns_key) or {}
    if not isinstance(patterns, dict):
        raise CheckpointError(f"LoRA file {str(path)!r}: metadata {patterns_key} is {patterns!r}, not an object of "
                              "module pattern -> number; the file is corrupt: re-export it.")
    try:
        hit = next((p for p in patterns if re.fullmatch(rf"(.*\.)?({p})", module)), None)
    except re.error as exc:
        raise CheckpointError(f"LoRA file {str(path)!r}: a metadata {patterns_key} key is not a valid pattern "
                              f"({exc}); the file is corrupt: re-export it.") from None
    if hit is not None:
        value, what = patterns[hit], f"{patterns_key}[{hit!r}]"
    else:
        value, what = config.get(key, PEFT_DEFAULTS[key]), key
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not finite(value):
        raise CheckpointError(f"LoRA file {str(path)!r}: metadata {what} is {value!r}; a LoRA {key} must be one "
                              "finite number (the file is corrupt: re-export it).")
    return float(value)


def _metadata_alphas(tensors: dict, config: dict, path: Path) -> dict[str, torch.Tensor]:
    """``<module>.alpha`` tensors for the ``lora_A`` modules of ``tensors`` that carry none, from ``config`` (the
    file's LoraConfig; ``use_rslora`` scales by alpha / sqrt(rank): the alpha given is alpha x sqrt(rank))."""
    if not config:
        return {}
    flags = {k: False if config.get(k) is None else config[k] for k in ("use_rslora", "use_dora", "lora_bias")}
    for k, v in flags.items():
        if not isinstance(v, bool):
            raise CheckpointError(f"LoRA file {str(path)!r}: metadata {k} is {v!r}, not true or false; the file is "
                                  "corrupt: re-export it.")
    _check_use_dora(tensors, flags["use_dora"], path)
    prefixed = any(k.startswith("transformer.") for k in tensors)  # a pipeline save: its DiT's entries only
    out = {}
    for key, a in tensors.items():
        module, part = split_part(key) or ("", None)
        if prefixed and not module.startswith("transformer."):
            continue
        name = module[len("transformer."):] if prefixed else module
        if part == "B_bias" and not flags["lora_bias"]:
            raise CheckpointError(f"LoRA file {str(path)!r}: its metadata does not set lora_bias but {key} is a "
                                  "lora_B bias (diffusers would drop it); the metadata contradicts the tensors: "
                                  "re-export the file or drop its lora_adapter_metadata.")
        if part != "A" or a.dim() < 2:
            continue
        alpha = _metadata_number(config, name, path, "lora_alpha", "alpha_pattern")
        rank = _metadata_number(config, name, path, "r", "rank_pattern")
        if rank != a.shape[0]:
            raise CheckpointError(f"LoRA file {str(path)!r}: its metadata gives {name} rank {rank:g}, but {key} has "
                                  f"rank {a.shape[0]}; the metadata contradicts the tensors: re-export the file or "
                                  "drop its lora_adapter_metadata.")
        if module + ".alpha" not in tensors:
            out[module + ".alpha"] = torch.tensor(alpha * (math.sqrt(a.shape[0]) if flags["use_rslora"] else 1.0))
    return out


def _check_use_dora(tensors: dict, use_dora: bool, path: Path) -> None:
    """Raises when a LoraConfig's ``use_dora`` contradicts the magnitudes: with it, every LoRA module (``transformer.``
    ones, where there are) needs one (diffusers would make one up); without it, none has one (diffusers drops it)."""
    parts: dict[str, set] = {}
    for key in tensors:
        module, part = split_part(key) or ("", None)
        parts.setdefault(module, set()).add(part)
    scope = [m for m in parts if m.startswith("transformer.")] or list(parts)
    wrong = sorted(m for m in scope if ("M" not in parts[m] and "A" in parts[m] if use_dora else "M" in parts[m]))
    if wrong:
        more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
        raise CheckpointError(f"LoRA file {str(path)!r}: its metadata {'sets' if use_dora else 'does not set'} "
                              f"use_dora but {wrong[0]}{more} " + (
                                  "has no lora_magnitude_vector (diffusers would make one up); the file is "
                                  "incomplete: re-export it." if use_dora else "has a DoRA lora_magnitude_vector "
                                  "(diffusers would drop it); the metadata contradicts the tensors: re-export the "
                                  "file or drop its lora_adapter_metadata."))
