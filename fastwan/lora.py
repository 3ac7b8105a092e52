"""LoRA files for the Wan DiT: read (safetensors only), map onto the model's linear layers, merge into the weights.

Key formats (the ones diffusers' Wan LoRA loader reads):

* diffusers / PEFT: ``[transformer.]blocks.N.attn1.to_q.lora_A.weight`` and ``lora_B.weight`` under the
  model's own module names, optionally ``<module>.alpha``;
* the original Wan / ComfyUI / lightx2v layout: ``diffusion_model.blocks.N.self_attn.q.lora_down.weight`` /
  ``lora_up.weight`` (or ``lora_A`` / ``lora_B``), ``<module>.alpha``, full deltas ``<module>.diff`` and bias
  deltas ``<module>.diff_b``, under the original module names (:data:`WAN_NAMES` maps them);
* kohya / musubi-tuner: ``lora_unet_blocks_N_self_attn_q.lora_down.weight`` (the same parts): ``lora_unet_`` and
  the original module name with each dot written as an underscore (:func:`_kohya_name` reads it back).

A module's update is ``W += scale * (alpha / rank) * B @ A``, ``W += scale * diff``,
``b += scale * diff_b``, computed in fp32 and rounded once into the weight's dtype; an FP8 layer's weight is
dequantized, updated in fp32 and quantized again (new per-channel scales). Merged weights cost nothing at run time;
:class:`LoraState` keeps each changed tensor's original (on the CPU) so unloading restores it bit for bit.
Deltas of norms (zeros in the files that carry them) are skipped.

A module's alpha is its ``<module>.alpha`` tensor; else, for ``lora_A`` / ``lora_B`` keys, the LoraConfig that
diffusers / PEFT save in the file's safetensors metadata (``lora_adapter_metadata``: ``lora_alpha``, its
``alpha_pattern``, ``use_rslora`` for ``alpha / sqrt(rank)``; the ``transformer.``-prefixed entries of a pipeline
save, or the unprefixed ones of a model save), as diffusers' ``load_lora_weights`` reads it; else the rank.
Each module takes its update from one set of keys: two keys giving one module the same part (two formats or two
names in one file) are an error, and so are other adapter kinds (DoRA, LyCORIS LoHa / LoKr / Tucker), whose
updates are not ``B @ A``.
"""
from __future__ import annotations

import json
import logging
import math
import numbers
import re
from collections.abc import Iterable
from pathlib import Path

import torch

from fastwan.errors import CheckpointError, InvalidArgument, InvalidArgumentType, MissingFileError
from fastwan.kernels.fp8 import Fp8Linear, dequantize_weight, quantize_weight

logger = logging.getLogger("fastwan")

WAN_NAMES = (  # original Wan module name -> the model's (diffusers') name
    (r"blocks\.(\d+)\.self_attn\.([qkv])", r"blocks.\1.attn1.to_\2"),
    (r"blocks\.(\d+)\.self_attn\.o", r"blocks.\1.attn1.to_out.0"),
    (r"blocks\.(\d+)\.cross_attn\.([qkv])", r"blocks.\1.attn2.to_\2"),
    (r"blocks\.(\d+)\.cross_attn\.o", r"blocks.\1.attn2.to_out.0"),
    (r"blocks\.(\d+)\.cross_attn\.k_img", r"blocks.\1.attn2.add_k_proj"),
    (r"blocks\.(\d+)\.cross_attn\.v_img", r"blocks.\1.attn2.add_v_proj"),
    (r"blocks\.(\d+)\.ffn\.0", r"blocks.\1.ffn.net.0.proj"),
    (r"blocks\.(\d+)\.ffn\.2", r"blocks.\1.ffn.net.2"),
    (r"text_embedding\.0", "condition_embedder.text_embedder.linear_1"),
    (r"text_embedding\.2", "condition_embedder.text_embedder.linear_2"),
    (r"time_embedding\.0", "condition_embedder.time_embedder.linear_1"),
    (r"time_embedding\.2", "condition_embedder.time_embedder.linear_2"),
    (r"time_projection\.1", "condition_embedder.time_proj"),
    (r"head\.head", "proj_out"),
    (r"img_emb\.proj\.1", "condition_embedder.image_embedder.ff.net.0.proj"),
    (r"img_emb\.proj\.3", "condition_embedder.image_embedder.ff.net.2"),
)
PREFIXES = ("diffusion_model.", "transformer.", "base_model.model.", "model.")
KOHYA_PREFIX = "lora_unet_"
# WAN_NAMES with every separating dot read as an underscore; each pattern spells its literal parts out in full and
# matches a whole name, so the underscores inside names (self_attn, k_img, time_embedding) cannot split two ways.
KOHYA_NAMES = tuple((re.compile(pattern.replace(r"\.", "_")), repl) for pattern, repl in WAN_NAMES)
METADATA_KEY = "lora_adapter_metadata"  # the safetensors metadata entry diffusers / PEFT save a LoraConfig in
# a marker in a key -> the adapter kind it belongs to (updates that are not B @ A, which fastwan does not merge)
OTHER_ADAPTERS = (("lora_magnitude_vector", "DoRA"), ("dora_scale", "DoRA"), ("hada_", "LyCORIS LoHa"),
                  ("lokr_", "LyCORIS LoKr"), ("lora_mid", "LyCORIS Tucker (lora_mid)"))
PART_NAMES = {"A": "lora_A / lora_down", "B": "lora_B / lora_up", "alpha": "alpha", "diff": "diff",
              "diff_b": "diff_b / lora_B.bias"}
PARTS = {"lora_A.weight": "A", "lora_down.weight": "A", "lora_B.weight": "B", "lora_up.weight": "B",
         "alpha": "alpha", "diff": "diff", "diff_b": "diff_b", "lora_B.bias": "diff_b"}


def read_lora(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a LoRA file (safetensors only; pickle files are refused, whatever their name)."""
    from safetensors import SafetensorError, safe_open

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
    if path.suffix != ".safetensors":
        raise InvalidArgument(f"LoRA file {str(path)!r} is not a .safetensors file; fastwan loads LoRAs from "
                              "safetensors only (convert pickle files with safetensors.torch.save_file).")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            header = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except SafetensorError as exc:  # truncated or corrupt, or another format (e.g. a pickle) under this name
        raise CheckpointError(f"LoRA file {str(path)!r} is not a valid safetensors file ({exc}); it may be "
                              "truncated or corrupt (download it again), or another format such as a pickle "
                              "under a .safetensors name (convert it with safetensors.torch.save_file).") from exc
    return {**tensors, **_metadata_alphas(tensors, _adapter_config(header, path), path)}


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


def _metadata_alpha(config: dict, module: str, path: Path):
    """The alpha a LoraConfig gives ``module`` (its ``alpha_pattern`` entry, matched as PEFT matches one: the
    pattern is the module name's end, after a dot), or None when it sets no ``lora_alpha``."""
    patterns = config.get("alpha_pattern") or {}
    if not isinstance(patterns, dict):
        raise CheckpointError(f"LoRA file {str(path)!r}: metadata alpha_pattern is {patterns!r}, not an object of "
                              "module pattern -> alpha; the file is corrupt: re-export it.")
    try:
        hit = next((p for p in patterns if re.fullmatch(rf"(.*\.)?({p})", module)), None)
    except re.error as exc:
        raise CheckpointError(f"LoRA file {str(path)!r}: a metadata alpha_pattern key is not a valid pattern "
                              f"({exc}); the file is corrupt: re-export it.") from None
    alpha, what = (patterns[hit], f"alpha_pattern[{hit!r}]") if hit is not None else (config.get("lora_alpha"),
                                                                                   "lora_alpha")
    if alpha is None and hit is None:
        return None
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not _finite(alpha):
        raise CheckpointError(f"LoRA file {str(path)!r}: metadata {what} is {alpha!r}; a LoRA alpha must be one "
                              "finite number (the file is corrupt: re-export it).")
    return float(alpha)


def _metadata_alphas(tensors: dict, config: dict, path: Path) -> dict[str, torch.Tensor]:
    """``<module>.alpha`` tensors for the ``lora_A`` modules of ``tensors`` that carry none, from ``config`` (the
    file's LoraConfig; ``use_rslora`` scales by alpha / sqrt(rank): the alpha given is alpha x sqrt(rank))."""
    if not config:
        return {}
    flags = {k: False if config.get(k) is None else config[k] for k in ("use_rslora", "use_dora")}
    for k, v in flags.items():
        if not isinstance(v, bool):
            raise CheckpointError(f"LoRA file {str(path)!r}: metadata {k} is {v!r}, not true or false; the file is "
                                  "corrupt: re-export it.")
    if flags["use_dora"]:
        raise InvalidArgument(f"LoRA file {str(path)!r} is a DoRA (its metadata sets use_dora); fastwan merges "
                              "plain LoRAs only (W += alpha / rank x B @ A): merge it into a LoRA or the model with "
                              "PEFT first.")
    out = {}
    for key, a in tensors.items():
        if not key.endswith(".lora_A.weight") or (module := key[: -len(".lora_A.weight")]) + ".alpha" in tensors:
            continue
        name = module[len("transformer."):] if module.startswith("transformer.") else module
        alpha = _metadata_alpha(config, name, path)
        if alpha is not None and a.dim() == 2:
            out[module + ".alpha"] = torch.tensor(alpha * (math.sqrt(a.shape[0]) if flags["use_rslora"] else 1.0))
    return out


def _finite(x) -> bool:
    """Whether the number ``x`` is finite as a float (an int too large for a float is not)."""
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def _kohya_name(flat: str, modules: set[str]) -> str | None:
    """A kohya module name without ``lora_unet_`` (dots, where a file has any, read as underscores) -> the model's
    module name: the one original Wan name whose underscored spelling it is, mapped by :data:`WAN_NAMES` and
    present in ``modules``; None when no name (or more than one) fits."""
    flat = flat.replace(".", "_")
    found = {m.expand(repl) for pattern, repl in KOHYA_NAMES if (m := pattern.fullmatch(flat))}
    found &= modules
    return found.pop() if len(found) == 1 else None


def _module_name(key: str, modules: set[str]) -> tuple[str, str] | None:
    """A file key -> (the model's module name, part: A, B, alpha, diff, diff_b), or None for a key of no module."""
    ends = [(suffix, part) for suffix, part in PARTS.items() if key.endswith("." + suffix)]
    if not ends:
        return None
    suffix, part = ends[0]
    name = key[: -len(suffix) - 1]
    if name.startswith(KOHYA_PREFIX):
        name = _kohya_name(name[len(KOHYA_PREFIX):], modules)
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


def lora_updates(tensors: dict[str, torch.Tensor], model: torch.nn.Module, source: str = "the LoRA file"):
    """{module name: {part: tensor}} for the model's linear layers; raises when no key names one of them (with
    examples of both sides), a tensor's shape does not fit its module or an alpha is not one finite number (naming
    the key)."""
    linears = {n: m for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, Fp8Linear))}
    norms = {n for n, m in model.named_modules() if "norm" in n.rsplit(".", 1)[-1]}
    updates: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
    unmatched, skipped_norms = [], []
    for key, value in tensors.items():
        kind = next((k for marker, k in OTHER_ADAPTERS if marker in key), None)
        if kind is not None:
            raise InvalidArgument(f"{source}: {key} is a {kind} tensor; fastwan merges plain LoRAs only (lora_A / "
                                  "lora_down, lora_B / lora_up, alpha, diff, diff_b): merge it into a plain LoRA "
                                  "or into the model first.")
        found = _module_name(key, set(linears) | norms)
        if found is None:
            unmatched.append(key)
            continue
        name, part = found
        if name in norms:  # norm deltas are not applied (as in diffusers): zeros in the files that carry them
            if value.count_nonzero():
                skipped_norms.append(key)
            continue
        if part != "alpha" and value.is_floating_point() and not torch.isfinite(value).all():  # black videos
            bad = int((~torch.isfinite(value)).sum())
            raise InvalidArgument(f"{source}: {key} holds {bad} NaN or infinite values of {value.numel()}; the LoRA "
                                  "file is corrupt (or was trained to divergence): use another copy or checkpoint.")
        if part in updates.setdefault(name, {}):
            raise InvalidArgument(f"{source}: {updates[name][part][0]} and {key} both give the {PART_NAMES[part]} "
                                  f"of {name} (two formats or two names of one module in one file); keep one of "
                                  "them.")
        updates[name][part] = (key, value)
    if not updates:
        raise InvalidArgument(f"{source}: none of its {len(tensors)} keys names a linear layer of this model, e.g. "
                              f"{sorted(tensors)[:3]}; the model's layers are named like {sorted(linears)[:3]} "
                              "(diffusers names, the original Wan names with a 'diffusion_model.' prefix, or "
                              "kohya's 'lora_unet_' with the original names' dots as underscores).")
    if unmatched:  # e.g. text-encoder keys, or blocks this model does not have: the rest still applies
        logger.warning("%s: %d of its %d keys name no layer of this model and are not applied, e.g. %s",
                       source, len(unmatched), len(tensors), sorted(unmatched)[:3])
    if skipped_norms:
        logger.warning("%s: %d norm deltas hold non-zero values and are not applied (fastwan, like diffusers, merges "
                       "linear layers only), e.g. %s", source, len(skipped_norms), sorted(skipped_norms)[:3])
    for name, parts in updates.items():
        weight = linears[name].weight
        if ("A" in parts) != ("B" in parts):
            key = (parts.get("A") or parts.get("B"))[0]
            raise InvalidArgument(f"{source}: {key} has no matching {'lora_B' if 'A' in parts else 'lora_A'} "
                                  "tensor; a LoRA module needs both.")
        if "A" in parts:
            (ka, a), (kb, b) = parts["A"], parts["B"]
            if a.dim() != 2 or b.dim() != 2 or a.shape[1] != weight.shape[1] or b.shape[0] != weight.shape[0] \
                    or a.shape[0] != b.shape[1]:
                raise InvalidArgument(f"{source}: {ka} {tuple(a.shape)} and {kb} {tuple(b.shape)} do not fit {name} "
                                      f"(weight {tuple(weight.shape)}: A must be [rank, {weight.shape[1]}], B "
                                      f"[{weight.shape[0]}, rank]); the LoRA is for another model.")
        if "diff" in parts and parts["diff"][1].shape != weight.shape:
            raise InvalidArgument(f"{source}: {parts['diff'][0]} {tuple(parts['diff'][1].shape)} does not fit {name} "
                                  f"(weight {tuple(weight.shape)}).")
        if "alpha" in parts:  # one finite number: the update's scale is alpha / rank
            ka, alpha = parts["alpha"]
            if alpha.numel() != 1 or not torch.isfinite(alpha.float()).all():
                shown = alpha.tolist() if alpha.numel() <= 4 else f"{alpha.numel()} elements"
                raise InvalidArgument(f"{source}: {ka} is {shown} (shape {tuple(alpha.shape)}); a LoRA alpha must "
                                      "be one finite number (the file is corrupt or not a LoRA: fix or re-export "
                                      "it).")
        bias = linears[name].bias
        if "diff_b" in parts and (bias is None or parts["diff_b"][1].shape != bias.shape):
            raise InvalidArgument(f"{source}: {parts['diff_b'][0]} does not fit the bias of {name} "
                                  f"({None if bias is None else tuple(bias.shape)}).")
    return {name: {p: t for p, (_, t) in parts.items()} for name, parts in updates.items()}


class LoraState:
    """The originals of the tensors a model's merged LoRAs changed (on the CPU), to restore them exactly.

    Each is kept by where it lives (its module and attribute name), not by the tensor object: moving a model
    (``.to()``, a memory plan's pinned or GPU copies) replaces an FP8 layer's buffers with new tensors, and the
    restore must reach the live ones."""

    def __init__(self):
        # (id(module), name) -> (module, name, original copy on the CPU)
        self.originals: dict[tuple[int, str], tuple[torch.nn.Module, str, torch.Tensor]] = {}
        self.loaded: list[tuple[str, float]] = []

    def _keep(self, module: torch.nn.Module, name: str) -> None:
        if (id(module), name) not in self.originals:
            self.originals[(id(module), name)] = (module, name, getattr(module, name).detach().to("cpu", copy=True))

    @torch.no_grad()
    def merge(self, model: torch.nn.Module, updates: dict, scale: float) -> int:
        """Add ``scale`` x each update into ``model``'s weights in place; returns the number of modules changed."""
        modules = dict(model.named_modules())
        for name, parts in updates.items():
            lin = modules[name]
            w = lin.weight
            delta = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
            if "A" in parts:
                a = parts["A"].to(w.device, torch.float32)
                b = parts["B"].to(w.device, torch.float32)
                alpha = float(parts["alpha"]) if "alpha" in parts else float(a.shape[0])
                delta += (alpha / a.shape[0]) * (b @ a)
            if "diff" in parts:
                delta += parts["diff"].to(w.device, torch.float32)
            if ("A" in parts or "diff" in parts) and isinstance(lin, Fp8Linear):  # requantized, new scales
                self._keep(lin, "weight")
                self._keep(lin, "weight_scale")
                w8, w_scale = quantize_weight(dequantize_weight(w, lin.weight_scale) + scale * delta)
                w.copy_(w8)
                lin.weight_scale.copy_(w_scale)
            elif "A" in parts or "diff" in parts:
                self._keep(lin, "weight")
                w.copy_((w.float() + scale * delta).to(w.dtype))
            if "diff_b" in parts:
                self._keep(lin, "bias")
                lin.bias.copy_((lin.bias.float() + scale * parts["diff_b"].to(w.device, torch.float32))
                               .to(lin.bias.dtype))
        return len(updates)

    @torch.no_grad()
    def restore(self) -> None:
        """Every changed tensor back to its original, bit for bit."""
        for module, name, original in self.originals.values():
            live = getattr(module, name)
            live.copy_(original.to(live.device))
        self.originals.clear()
        self.loaded.clear()


def parse_lora_spec(spec) -> list[tuple[str, float]]:
    """``PATH``, ``(PATH, SCALE)`` or a list of them -> [(path, scale)]."""
    if spec is None:
        return []
    items: Iterable = [spec] if isinstance(spec, (str, Path, tuple)) else spec
    if not isinstance(items, (list, tuple)):
        raise InvalidArgumentType(f"lora={spec!r}: give a path, (path, scale), or a list of them.")
    from fastwan.pipelines.inputs import python_number  # imported here: fastwan.pipelines imports this module

    out = []
    for item in items:
        if isinstance(item, (str, Path)):
            item = (item, 1.0)
        if isinstance(item, (tuple, list)) and len(item) == 2:  # a NumPy / torch scalar scale is its Python number
            item = (item[0], python_number(item[1]))
        ok = isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], (str, Path)) \
            and isinstance(item[1], numbers.Real) and not isinstance(item[1], bool)
        if not ok:
            raise InvalidArgumentType(f"lora={spec!r}: give a path, (path, scale), or a list of them.")
        if not _finite(item[1]):
            raise InvalidArgument(f"lora={spec!r}: the scale of {str(item[0])!r} is {item[1]!r}; a LoRA scale must "
                                  "be a finite number (1.0 as trained, 0.5 for half strength).")
        out.append((str(item[0]), float(item[1])))
    return out


def apply_lora(models: list, states: list[LoraState], path, scale: float = 1.0, expert: int | None = None,
               tensors: dict[str, torch.Tensor] | None = None) -> int:
    """Merge the LoRA file at ``path`` into ``models`` (the experts; ``expert``: only that index, None: all), each
    with its :class:`LoraState`; ``tensors``: the file's contents when already read (:func:`check_loras`). Every
    check (file, keys, shapes, alphas, arguments) runs before any weight changes. Returns the number of modules
    changed. NumPy / torch scalars count as the Python numbers they hold."""
    from fastwan.pipelines.inputs import python_number  # imported here: fastwan.pipelines imports this module

    scale, expert = python_number(scale), python_number(expert)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise InvalidArgumentType(f"scale={scale!r} must be a number (the LoRA's strength, 1.0 as trained).")
    if not _finite(scale):
        raise InvalidArgument(f"scale={scale!r} must be a finite number (the LoRA's strength, 1.0 as trained).")
    experts = " or ".join(map(str, range(len(models))))
    if expert is not None and (isinstance(expert, bool) or not isinstance(expert, numbers.Integral)):
        raise InvalidArgumentType(f"expert={expert!r} must be an int ({experts}) or None for all experts.")
    if expert is not None and expert not in range(len(models)):
        raise InvalidArgument(f"expert={expert!r}: this checkpoint has {len(models)} expert(s); use {experts}, "
                              "or None for all.")
    expert = None if expert is None else int(expert)
    tensors = read_lora(path) if tensors is None else tensors
    chosen = range(len(models)) if expert is None else [expert]
    updates = {i: lora_updates(tensors, models[i], f"LoRA {str(path)!r}") for i in chosen}
    changed = 0
    for i, upd in updates.items():
        changed += states[i].merge(models[i], upd, float(scale))
        states[i].loaded.append((str(path), float(scale)))
    return changed


def check_loras(loras: list[tuple[str, float]], config) -> list[dict[str, torch.Tensor]]:
    """Every file of ``loras`` read and matched against a DiT of ``config`` built on the meta device (no weights),
    so a bad file raises before anything is loaded -> the files' tensors, in order (each file is read once)."""
    if not loras:
        return []
    from fastwan.models import WanTransformer

    with torch.device("meta"):
        model = WanTransformer(config)
    files = [read_lora(path) for path, _ in loras]
    for (path, _), tensors in zip(loras, files):
        lora_updates(tensors, model, f"LoRA {path!r}")
    return files
