"""LoRA key spellings -> (the model's module name, part): diffusers / PEFT names, the original Wan names
(:data:`WAN_NAMES`), kohya's ``lora_unet_`` spelling and diffusers' older ones (see :mod:`fastwan.lora`)."""
from __future__ import annotations

import re

import torch

from fastwan.kernels.fp8 import Fp8Linear
from fastwan.models.wan.names import ORIGINAL_NAMES

WAN_NAMES = ORIGINAL_NAMES  # original Wan module name -> the model's (diffusers') name
# the parameters (not layers) whose deltas a file may carry, as the model names them: not merged (see
# fastwan.models.wan.names)
TABLES = ("scale_shift_table", "pos_embed")
PREFIXES = ("diffusion_model.", "transformer.", "base_model.model.", "model.")
KOHYA_PREFIX = "lora_unet_"
# WAN_NAMES with every separating dot read as an underscore; each pattern spells its literal parts out in full and
# matches a whole name, so the underscores inside names (self_attn, k_img, time_embedding) cannot split two ways.
KOHYA_NAMES = tuple((re.compile(pattern.replace(r"\.", "_")), repl) for pattern, repl in WAN_NAMES)
METADATA_KEY = "lora_adapter_metadata"  # the safetensors metadata entry diffusers / PEFT save a LoraConfig in
# a marker in a key -> the adapter kind it belongs to (updates that are not B @ A, which fastwan does not merge)
OTHER_ADAPTERS = (("dora_scale", "kohya DoRA (dora_scale)"), ("hada_", "LyCORIS LoHa"), ("lokr_", "LyCORIS LoKr"),
                  ("lora_mid", "LyCORIS Tucker (lora_mid)"))
PART_NAMES = {"A": "lora_A / lora_down", "B": "lora_B / lora_up", "alpha": "alpha", "diff": "diff",
              "diff_b": "diff_b", "diff_m": "diff_m", "B_bias": "lora_B.bias", "M": "lora_magnitude_vector"}
# a key's end -> its part: lora_A / lora_down / lora.down (A) and the B names likewise, each with PEFT's optional
# adapter name before the tensor's ('lora_A.default.weight'); B's bias is PEFT's lora_bias; or alpha, diff, diff_b,
# diff_m (lightx2v's delta of a block's modulation, '<block>.diff_m'); or a DoRA's magnitude (M):
# 'lora_magnitude_vector' as PEFT saves it, '.weight' or '.default.weight' after it
PART_RE = re.compile(r"\.(?:(?:(?P<a>lora_A|lora_down|lora\.down)|(?P<b>lora_B|lora_up|lora\.up))"
                     r"(?:\.(?!(?:weight|bias)$)[^.]+)?\.(?P<tensor>weight|bias)|(?P<other>alpha|diff|diff_b|diff_m)"
                     r"|(?P<m>lora_magnitude_vector)(?:(?:\.(?!weight$)[^.]+)?\.weight)?)$")
# diffusers' attention-processor LoRA spelling (as its loader reads it): 'attn1.processor.to_q_lora.down.weight'
# and its DoRA magnitude of to_out ('attn1.to_out.lora_magnitude_vector', the layer being to_out.0)
OLD_SPELLINGS = ((re.compile(r"\.processor\."), "."), (re.compile(r"\.to_out_lora\."), ".to_out.0.lora."),
                 (re.compile(r"\.(to_[qkv])_lora\."), r".\1.lora."),
                 (re.compile(r"\.to_out\.lora_magnitude_vector\b"), ".to_out.0.lora_magnitude_vector"))
LAYERS = (torch.nn.Linear, Fp8Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)  # the layers LoRAs change


def kohya_name(flat: str, modules: set[str]) -> str | None:
    """A kohya module name without ``lora_unet_`` (dots, where a file has any, read as underscores) -> the model's
    module name: the one original Wan name whose underscored spelling it is, mapped by :data:`WAN_NAMES` and
    present in ``modules``; None when no name (or more than one) fits."""
    flat = flat.replace(".", "_")
    found = {m.expand(repl) for pattern, repl in KOHYA_NAMES if (m := pattern.fullmatch(flat))}
    found &= modules
    return found.pop() if len(found) == 1 else None


def split_part(key: str) -> tuple[str, str] | None:
    """A file key -> (its module name as written, part: A, B, B_bias, alpha, diff, diff_b, diff_m, M), or None for a
    key that is no LoRA part (lora_A's bias included: PEFT gives lora_A none). A ``diff_m``'s module is the
    modulation it changes (``blocks.N.diff_m`` -> ``blocks.N.modulation``, ``head.diff_m`` -> ``head.modulation``)."""
    for pattern, repl in OLD_SPELLINGS:
        key = pattern.sub(repl, key)
    m = PART_RE.search(key)
    if m is None:
        return None
    if m["other"] or m["m"]:
        part = m["other"] or "M"
    elif m["tensor"] == "weight":
        part = "A" if m["a"] else "B"
    else:
        part = "B_bias" if m["b"] else None
    if part is None:
        return None
    return key[: m.start()] + (".modulation" if part == "diff_m" else ""), part


def module_name(key: str, modules: set[str]) -> tuple[str, str] | None:
    """A file key -> (the model's module name, part: A, B, B_bias, alpha, diff, diff_b, diff_m, M), or None for a key
    of no module; ``modules`` may name parameters too (:data:`TABLES`)."""
    found = split_part(key)
    if found is None:
        return None
    name, part = found
    if name.startswith(KOHYA_PREFIX):
        name = kohya_name(name[len(KOHYA_PREFIX):], modules)
        return None if name is None else (name, part)
    for prefix in PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    if name not in modules:
        for pattern, repl in WAN_NAMES:
            mapped, n = re.subn(f"^{pattern}$", repl, name)
            if n:
                name = mapped
                break
    return (name, part) if name in modules else None
