"""LoRA files for the Wan DiT: read (safetensors only), map onto the model's linear layers, merge into the weights.

Key formats (the ones diffusers' Wan LoRA loader reads):

* diffusers / PEFT: ``[transformer.]blocks.N.attn1.to_q.lora_A.weight`` and ``lora_B.weight`` under the
  model's own module names, optionally ``<module>.alpha`` and a bias ``lora_B.bias`` (PEFT's ``lora_bias``); PEFT's
  in-memory names with the adapter's (``lora_A.default.weight``), and diffusers' older spellings
  (``lora.down`` / ``lora.up``, attention-processor keys ``attn1.processor.to_q_lora.down.weight``);
* the original Wan / ComfyUI / lightx2v layout: ``diffusion_model.blocks.N.self_attn.q.lora_down.weight`` /
  ``lora_up.weight`` (or ``lora_A`` / ``lora_B``), ``<module>.alpha``, full deltas ``<module>.diff`` and bias
  deltas ``<module>.diff_b``, under the original module names (:data:`WAN_NAMES` maps them);
* kohya / musubi-tuner: ``lora_unet_blocks_N_self_attn_q.lora_down.weight`` (the same parts): ``lora_unet_`` and
  the original module name with each dot written as an underscore (:func:`_kohya_name` reads it back).

A module's update is ``W += scale * (alpha / rank) * B @ A``, ``W += scale * diff``,
``b += scale * diff_b`` and ``b += scale * (alpha / rank) * lora_B.bias`` (PEFT scales its bias as its product),
computed in fp32 and rounded once into the weight's dtype; an FP8 layer's weight is
dequantized, updated in fp32 and quantized again (new per-channel scales). Merged weights cost nothing at run time;
:class:`LoraState` keeps each changed tensor's original (on the CPU) so unloading restores it bit for bit.
The layers are the linear ones and the convolutions (the patch embedding: there ``A`` holds the kernel,
``[rank, in, *kernel]``, and ``B`` is ``[out, rank, 1, ...]``, as PEFT trains one). Deltas of norms (zeros in the
files that carry them) are skipped. Where diffusers drops a delta it cannot express as a PEFT LoRA (full-weight
``diff`` keys, a ``time_projection`` ``diff_b`` without its weights), fastwan merges it as written.

A module's alpha is its ``<module>.alpha`` tensor; else, for ``lora_A`` / ``lora_B`` keys, the LoraConfig that
diffusers / PEFT save in the file's safetensors metadata (``lora_adapter_metadata``: ``lora_alpha``, its
``alpha_pattern``, ``use_rslora`` for ``alpha / sqrt(rank)``; the ``transformer.``-prefixed entries of a pipeline
save, or the unprefixed ones of a model save), as diffusers' ``load_lora_weights`` reads it; else the rank.
Each module takes its update from one set of keys: two keys giving one module the same part (two formats or two
names in one file) are an error, and so are other adapter kinds (LyCORIS LoHa / LoKr / Tucker, kohya's DoRA
``dora_scale``, which diffusers refuses or drops), whose updates are not ``B @ A``.

A PEFT DoRA's magnitude ``<module>.lora_magnitude_vector`` (``.weight`` or ``.<adapter>.weight`` may follow; one
value per output feature: ``[out]``, a convolution's ``[1, out, 1, ...]``) merges as PEFT merges it: with
``D = scale * (alpha / rank) * B @ A``, ``W <- m / ||W0 + D|| * (W + D)``, the norm per output feature, ``W0`` the
weight before any LoRA merged (PEFT's norm leaves out the adapters merged before). A file whose metadata's
``use_dora`` contradicts its tensors (diffusers would make up or drop the magnitudes) is refused.
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
OTHER_ADAPTERS = (("dora_scale", "kohya DoRA (dora_scale)"), ("hada_", "LyCORIS LoHa"), ("lokr_", "LyCORIS LoKr"),
                  ("lora_mid", "LyCORIS Tucker (lora_mid)"))
PART_NAMES = {"A": "lora_A / lora_down", "B": "lora_B / lora_up", "alpha": "alpha", "diff": "diff",
              "diff_b": "diff_b", "B_bias": "lora_B.bias", "M": "lora_magnitude_vector"}
# a key's end -> its part: lora_A / lora_down / lora.down (A) and the B names likewise, each with PEFT's optional
# adapter name before the tensor's ('lora_A.default.weight'); B's bias is PEFT's lora_bias; or alpha, diff, diff_b;
# or a DoRA's magnitude (M): 'lora_magnitude_vector' as PEFT saves it, '.weight' or '.default.weight' after it
PART_RE = re.compile(r"\.(?:(?:(?P<a>lora_A|lora_down|lora\.down)|(?P<b>lora_B|lora_up|lora\.up))"
                     r"(?:\.(?!(?:weight|bias)$)[^.]+)?\.(?P<tensor>weight|bias)|(?P<other>alpha|diff|diff_b)"
                     r"|(?P<m>lora_magnitude_vector)(?:(?:\.(?!weight$)[^.]+)?\.weight)?)$")
# diffusers' attention-processor LoRA spelling (as its loader reads it): 'attn1.processor.to_q_lora.down.weight'
OLD_SPELLINGS = ((re.compile(r"\.processor\."), "."), (re.compile(r"\.to_out_lora\."), ".to_out.0.lora."),
                 (re.compile(r"\.(to_[qkv])_lora\."), r".\1.lora."))
LAYERS = (torch.nn.Linear, Fp8Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)  # the layers LoRAs change


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
    _check_use_dora(tensors, flags["use_dora"], path)
    out = {}
    for key, a in tensors.items():
        module, part = _split_part(key) or ("", None)
        if part != "A" or module + ".alpha" in tensors:
            continue
        name = module[len("transformer."):] if module.startswith("transformer.") else module
        alpha = _metadata_alpha(config, name, path)
        if alpha is not None and a.dim() >= 2:
            out[module + ".alpha"] = torch.tensor(alpha * (math.sqrt(a.shape[0]) if flags["use_rslora"] else 1.0))
    return out


def _check_use_dora(tensors: dict, use_dora: bool, path: Path) -> None:
    """Raises when a LoraConfig's ``use_dora`` contradicts the magnitudes: with it, every LoRA module (``transformer.``
    ones, where there are) needs one (diffusers would make one up); without it, none has one (diffusers drops it)."""
    parts: dict[str, set] = {}
    for key in tensors:
        module, part = _split_part(key) or ("", None)
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


def _split_part(key: str) -> tuple[str, str] | None:
    """A file key -> (its module name as written, part: A, B, B_bias, alpha, diff, diff_b, M), or None for a key that
    is no LoRA part (lora_A's bias included: PEFT gives lora_A none)."""
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
    return None if part is None else (key[: m.start()], part)


def _module_name(key: str, modules: set[str]) -> tuple[str, str] | None:
    """A file key -> (the model's module name, part: A, B, B_bias, alpha, diff, diff_b), or None for a key of no
    module."""
    found = _split_part(key)
    if found is None:
        return None
    name, part = found
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
    """{module name: {part: tensor}} for the model's linear and convolution layers; raises when no key names one
    of them (with examples of both sides), a tensor's shape does not fit its module or an alpha is not one finite
    number (naming the key)."""
    linears = {n: m for n, m in model.named_modules() if isinstance(m, LAYERS)}
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
        raise InvalidArgument(f"{source}: none of its {len(tensors)} keys names a layer of this model, e.g. "
                              f"{sorted(tensors)[:3]}; the model's layers are named like {sorted(linears)[:3]} "
                              "(diffusers names, the original Wan names with a 'diffusion_model.' prefix, or "
                              "kohya's 'lora_unet_' with the original names' dots as underscores).")
    if unmatched:  # e.g. text-encoder keys, or blocks this model does not have: the rest still applies
        logger.warning("%s: %d of its %d keys name no layer of this model and are not applied, e.g. %s",
                       source, len(unmatched), len(tensors), sorted(unmatched)[:3])
    if skipped_norms:
        logger.warning("%s: %d norm deltas hold non-zero values and are not applied (fastwan, like diffusers, merges "
                       "no norms), e.g. %s", source, len(skipped_norms), sorted(skipped_norms)[:3])
    for name, parts in updates.items():
        weight = linears[name].weight
        ones = (1,) * (weight.dim() - 2)
        if ("A" in parts) != ("B" in parts):
            key = (parts.get("A") or parts.get("B"))[0]
            raise InvalidArgument(f"{source}: {key} has no matching {'lora_B' if 'A' in parts else 'lora_A'} "
                                  "tensor; a LoRA module needs both.")
        if "A" in parts:  # a convolution's A holds the kernel, its B is 1 x ... x 1 (as PEFT trains one)
            (ka, a), (kb, b) = parts["A"], parts["B"]
            if a.dim() != weight.dim() or b.dim() != weight.dim() or a.shape[1:] != weight.shape[1:] \
                    or b.shape[0] != weight.shape[0] or a.shape[0] != b.shape[1] or tuple(b.shape[2:]) != ones:
                want_a = ", ".join(map(str, ["rank", *weight.shape[1:]]))
                want_b = ", ".join(map(str, [weight.shape[0], "rank", *ones]))
                raise InvalidArgument(f"{source}: {ka} {tuple(a.shape)} and {kb} {tuple(b.shape)} do not fit {name} "
                                      f"(weight {tuple(weight.shape)}: A must be [{want_a}], B [{want_b}]); the "
                                      "LoRA is for another model.")
        if "M" in parts:  # a DoRA magnitude: one per output feature, shaped as PEFT's layer holds it
            km, mag = parts["M"]
            want = (weight.shape[0],) if weight.dim() == 2 else (1, weight.shape[0], *ones)
            odd = [PART_NAMES[p] for p in ("diff", "B_bias") if p in parts]
            odd += [] if "A" in parts else ["no lora_A / lora_B"]
            if odd:  # PEFT refuses a DoRA with lora_bias; a full diff is no LoRA
                raise InvalidArgument(f"{source}: {km} is a DoRA magnitude, which scales a LoRA's B @ A update, but "
                                      f"{name} has {' and '.join(odd)}; a DoRA module takes lora_A, lora_B, alpha "
                                      "and its magnitude (PEFT refuses a DoRA with lora_B.bias): fix the file.")
            if tuple(mag.shape) != want:
                raise InvalidArgument(f"{source}: {km} {tuple(mag.shape)} does not fit {name} (weight "
                                      f"{tuple(weight.shape)}: a DoRA magnitude must be {list(want)}, one value per "
                                      "output feature); the LoRA is for another model.")
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
        if "diff_b" in parts and "B_bias" in parts:
            raise InvalidArgument(f"{source}: {parts['diff_b'][0]} and {parts['B_bias'][0]} both give the bias "
                                  f"delta of {name} (two formats of one module in one file); keep one of them.")
        bias = linears[name].bias
        for key, value in (parts[p] for p in ("diff_b", "B_bias") if p in parts):
            if bias is None or value.shape != bias.shape:
                raise InvalidArgument(f"{source}: {key} {tuple(value.shape)} does not fit the bias of {name} "
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
            fp8 = isinstance(lin, Fp8Linear)
            delta = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
            factor = 1.0  # alpha / rank; a lora_B.bias without lora_A / lora_B (no rank) is added as it is
            if "A" in parts:
                a = parts["A"].to(w.device, torch.float32)
                b = parts["B"].to(w.device, torch.float32)
                factor = (float(parts["alpha"]) if "alpha" in parts else float(a.shape[0])) / a.shape[0]
                delta += factor * (b.flatten(1) @ a.flatten(1)).view(w.shape)  # a convolution's too
            if "diff" in parts:
                delta += parts["diff"].to(w.device, torch.float32)
            if "A" in parts or "diff" in parts:
                current = dequantize_weight(w, lin.weight_scale) if fp8 else w.float()
                new = current + scale * delta
                if "M" in parts:  # DoRA: each output feature rescaled to its magnitude (PEFT's merge)
                    norm = (self._unmerged(lin, current) + scale * delta).flatten(1).norm(dim=1)
                    dora = parts["M"].to(w.device, torch.float32).flatten() / norm
                    new = dora.view(-1, *[1] * (w.dim() - 1)) * new
                self._keep(lin, "weight")
                if fp8:  # requantized, new scales
                    self._keep(lin, "weight_scale")
                    w8, w_scale = quantize_weight(new)
                    w.copy_(w8)
                    lin.weight_scale.copy_(w_scale)
                else:
                    w.copy_(new.to(w.dtype))
            if "diff_b" in parts or "B_bias" in parts:  # PEFT scales its lora_B.bias as its B @ A
                self._keep(lin, "bias")
                bias = parts["diff_b"] if "diff_b" in parts else factor * parts["B_bias"].float()
                lin.bias.copy_((lin.bias.float() + scale * bias.to(w.device, torch.float32)).to(lin.bias.dtype))
        return len(updates)

    def _unmerged(self, lin: torch.nn.Module, current: torch.Tensor) -> torch.Tensor:
        """``lin``'s weight before this state's merges (PEFT's DoRA norm leaves them out), fp32; else ``current``."""
        kept = self.originals.get((id(lin), "weight"))
        if kept is None:
            return current
        if isinstance(lin, Fp8Linear):
            scale = self.originals[(id(lin), "weight_scale")][2]
            return dequantize_weight(kept[2].to(current.device), scale.to(current.device))
        return kept[2].to(current.device, torch.float32)

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
