"""Matching a LoRA's tensors to the model's layers (shapes checked before any change), merging them into the
weights (:class:`LoraState`, which keeps the originals to restore them bit for bit), and the entry points the
generator calls."""
from __future__ import annotations

import logging
import numbers
from collections.abc import Iterable
from pathlib import Path

import torch

from fastwan.errors import InvalidArgument, InvalidArgumentType
from fastwan.kernels.fp8 import Fp8Linear, dequantize_weight, quantize_weight
from fastwan.lora.files import check_lora_path, finite, read_lora
from fastwan.lora.keys import LAYERS, OTHER_ADAPTERS, PART_NAMES, TABLES, module_name
from fastwan.values import python_number

logger = logging.getLogger("fastwan")


def lora_updates(tensors: dict[str, torch.Tensor], model: torch.nn.Module, source: str = "the LoRA file"):
    """{module name: {part: tensor}} for the model's linear and convolution layers; raises when no key names one
    of them (with examples of both sides), a tensor's shape does not fit its module or an alpha is not one finite
    number (naming the key). Deltas of norms and of the parameters outside the layers (:data:`TABLES`: the
    modulation tables, ``diff_m``) are not merged, as in diffusers: named in a warning where they are not zeros."""
    linears = {n: m for n, m in model.named_modules() if isinstance(m, LAYERS)}
    norms = {n for n, m in model.named_modules() if "norm" in n.rsplit(".", 1)[-1]}
    tables = {n for n, _ in model.named_parameters() if n.rsplit(".", 1)[-1] in TABLES}
    updates: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
    unmatched: list[str] = []
    skipped: dict[str, list[str]] = {"norm": [], "modulation": []}  # deltas not merged (the non-zero ones)
    kinds = set()  # the kinds of deltas not merged the file has
    if not tensors:
        raise InvalidArgument(f"{source}: the file holds no tensors (an empty safetensors file: an export that saved "
                              "nothing?); give the LoRA file itself, with its lora_A / lora_B (or lora_down / "
                              "lora_up) tensors.")
    for key, value in tensors.items():
        kind = next((k for marker, k in OTHER_ADAPTERS if marker in key), None)
        if kind is not None:
            raise InvalidArgument(f"{source}: {key} is a {kind} tensor; fastwan merges plain LoRAs only (lora_A / "
                                  "lora_down, lora_B / lora_up, alpha, diff, diff_b): merge it into a plain LoRA "
                                  "or into the model first.")
        if value.is_floating_point() and value.element_size() == 1:  # FP8 files: bf16 holds each value exactly
            value = value.to(torch.bfloat16)  # (PyTorch's CPU kernels lack the checks below for FP8)
        found = module_name(key, set(linears) | norms | tables)
        if found is None:
            unmatched.append(key)
            continue
        name, part = found
        if name in norms or name in tables:  # not applied, as in diffusers (norm deltas: zeros in the files)
            group = "norm" if name in norms else "modulation"
            kinds.add(group)
            if value.count_nonzero():
                skipped[group].append(key)
            continue
        if part != "alpha" and not value.is_floating_point():  # integer, bool or complex: no LoRA weight
            raise InvalidArgument(f"{source}: {key} is a {str(value.dtype).replace('torch.', '')} tensor; LoRA weights "
                                  "are floating point (float32, bfloat16, float16 or FP8): the file is corrupt or not "
                                  "a LoRA (e.g. quantized by another tool): re-export it in floating point.")
        if part != "alpha" and not torch.isfinite(value).all():  # black videos
            bad = int((~torch.isfinite(value)).sum())
            raise InvalidArgument(f"{source}: {key} holds {bad} NaN or infinite values of {value.numel()}; the LoRA "
                                  "file is corrupt (or was trained to divergence): use another copy or checkpoint.")
        if part in updates.setdefault(name, {}):
            raise InvalidArgument(f"{source}: {updates[name][part][0]} and {key} both give the {PART_NAMES[part]} "
                                  f"of {name} (two formats or two names of one module in one file); keep one of "
                                  "them.")
        updates[name][part] = (key, value)
    if not updates and not unmatched:  # every key is a norm's or a modulation table's
        what = " or ".join(sorted(kinds)) + " deltas"
        raise InvalidArgument(f"{source}: its {len(tensors)} keys are all {what}, e.g. {sorted(tensors)[:3]}, "
                              "which fastwan (like diffusers) does not merge: the file would change nothing; "
                              "check that it is the LoRA you meant.")
    if not updates:
        raise InvalidArgument(f"{source}: none of its {len(tensors)} keys names a layer of this model, e.g. "
                              f"{sorted(tensors)[:3]}; the model's layers are named like {sorted(linears)[:3]} "
                              "(diffusers names, the original Wan names with a 'diffusion_model.' prefix, or "
                              "kohya's 'lora_unet_' with the original names' dots as underscores).")
    if unmatched:  # e.g. text-encoder keys, or blocks this model does not have: the rest still applies
        logger.warning("%s: %d of its %d keys name no layer of this model and are not applied, e.g. %s",
                       source, len(unmatched), len(tensors), sorted(unmatched)[:3])
    if skipped["norm"]:
        logger.warning("%s: %d norm deltas hold non-zero values and are not applied (fastwan, like diffusers, merges "
                       "no norms), e.g. %s", source, len(skipped["norm"]), sorted(skipped["norm"])[:3])
    if skipped["modulation"]:
        logger.warning("%s: %d deltas of parameters outside the layers (modulation tables: diff_m, modulation.diff) "
                       "hold non-zero values and are not applied (diffusers drops them too), e.g. %s", source,
                       len(skipped["modulation"]), sorted(skipped["modulation"])[:3])
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
            if a.shape[0] == 0:  # nothing to merge, and alpha / rank divides by zero
                raise InvalidArgument(f"{source}: {ka} {tuple(a.shape)} and {kb} {tuple(b.shape)} have rank 0 (no "
                                      "update); a LoRA module's rank is at least 1: the file is corrupt: re-export "
                                      "it.")
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
            if alpha.numel() != 1 or alpha.dtype == torch.bool or alpha.is_complex() \
                    or not torch.isfinite(alpha.float()).all():
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


def _factor(parts: dict) -> float:
    """A module's alpha / rank (1 without lora_A / lora_B: a lora_B.bias alone, diff, diff_b are added as written)."""
    if "A" not in parts:
        return 1.0
    rank = parts["A"].shape[0]
    return (float(parts["alpha"]) if "alpha" in parts else float(rank)) / rank


def _weight_delta(parts: dict, shape, device) -> torch.Tensor | None:
    """A module's weight update before the scale, fp32: ``(alpha / rank) B @ A`` (a convolution's too) plus its
    ``diff``; None when the module's weight does not change."""
    if "A" not in parts and "diff" not in parts:
        return None
    delta = torch.zeros(shape, dtype=torch.float32, device=device)
    if "A" in parts:
        a = parts["A"].to(device, torch.float32)
        b = parts["B"].to(device, torch.float32)
        delta += _factor(parts) * (b.flatten(1) @ a.flatten(1)).view(shape)
    if "diff" in parts:
        delta += parts["diff"].to(device, torch.float32)
    return delta


def _merged_weight(current: torch.Tensor, w0: torch.Tensor | None, parts: dict, scale: float,
                   delta: torch.Tensor) -> torch.Tensor:
    """``current + scale * delta`` (fp32); a DoRA's (``M`` in ``parts``) rescaled per output feature to its magnitude
    over the norm of ``w0 + scale * delta`` (``w0``: the weight before any LoRA, fp32; only a DoRA reads it)."""
    new = current + scale * delta
    if "M" in parts:  # DoRA: each output feature rescaled to its magnitude (PEFT's merge)
        norm = (w0 + scale * delta).flatten(1).norm(dim=1)
        dora = parts["M"].to(current.device, torch.float32).flatten() / norm
        new = dora.view(-1, *[1] * (current.dim() - 1)) * new
    return new


def _bias_delta(parts: dict, device) -> torch.Tensor | None:
    """A module's bias update before the scale, fp32 (PEFT scales its lora_B.bias as its B @ A), or None."""
    if "diff_b" in parts:
        return parts["diff_b"].to(device, torch.float32)
    if "B_bias" in parts:
        return _factor(parts) * parts["B_bias"].to(device, torch.float32)
    return None


def _changes_weight(parts: dict, scale: float) -> bool:
    """Whether merging ``parts`` at ``scale`` changes the weight: a scale of 0 adds nothing (diffusers' adapter
    weight 0 leaves the output as it is), except a DoRA's magnitude, which rescales the weight anyway."""
    return ("A" in parts or "diff" in parts) and (scale != 0 or "M" in parts)


def _overflow(source: str, name: str, what: str, scale: float, dtype: torch.dtype, parts: dict) -> InvalidArgument:
    keys = sorted(PART_NAMES[p] for p in parts if p in ("A", "B", "diff", "diff_b", "B_bias", "M"))
    return InvalidArgument(
        f"{source}: with scale={scale:g} the merged {what} of {name} leaves the range of "
        f"{str(dtype).replace('torch.', '')} (|values| up to {torch.finfo(dtype).max:.3g}): the weights would hold "
        f"inf / NaN and the video would be black. The update ({', '.join(keys)}) is too large for that scale: use a "
        "smaller scale (1.0 as trained), or check the file.")


def _finite_in(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the fp32 ``x`` rounded to ``dtype`` is finite everywhere."""
    return bool(torch.isfinite(x if dtype == torch.float32 else x.to(dtype)).all())


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
    def check(self, model: torch.nn.Module, updates: dict, scale: float, source: str = "the LoRA file",
              device: torch.device | str | None = None) -> None:
        """Raises (naming the module, the scale and the fix) when merging ``updates`` at ``scale`` would leave a
        weight or bias outside its dtype's range (inf, then NaN frames), before anything changes. A bound from the
        weight's largest value and the update's factors decides cheaply; only where it cannot, the merged weight
        is computed (on ``device``, as :meth:`merge` computes it)."""
        modules = dict(model.named_modules())
        for name, parts in updates.items():
            lin = modules[name]
            dev = torch.device(device) if device is not None else lin.weight.device
            fp8 = isinstance(lin, Fp8Linear)
            dtype = torch.float32 if fp8 else lin.weight.dtype  # an FP8 weight is requantized from fp32
            if _changes_weight(parts, scale) and not self._fits(lin, parts, scale, dtype):
                current = self._current(lin, dev)
                delta = _weight_delta(parts, current.shape, dev)
                new = _merged_weight(current, self._unmerged(lin, current) if "M" in parts else None, parts, scale,
                                     delta)
                if not _finite_in(new, dtype):
                    raise _overflow(source, name, "weight", scale, dtype, parts)
            bias = _bias_delta(parts, dev)
            if bias is not None and scale != 0:
                if not _finite_in(lin.bias.to(dev).float() + scale * bias, lin.bias.dtype):
                    raise _overflow(source, name, "bias", scale, lin.bias.dtype, parts)

    @staticmethod
    def _current(lin: torch.nn.Module, device: torch.device) -> torch.Tensor:
        """``lin``'s weight as it computes (an FP8 one dequantized), fp32, on ``device``."""
        if isinstance(lin, Fp8Linear):
            return dequantize_weight(lin.weight.to(device), lin.weight_scale.to(device))
        return lin.weight.to(device).float()

    @staticmethod
    def _fits(lin: torch.nn.Module, parts: dict, scale: float, dtype: torch.dtype) -> bool:
        """A sufficient condition for the merged weight to stay within ``dtype``: |W| + |scale| x the largest
        possible |update| below half its largest value (a DoRA's rescaling is not bounded here: False)."""
        if "M" in parts:
            return False
        w = lin.weight
        top = float(lin.weight_scale.max()) * 448.0 if isinstance(lin, Fp8Linear) else float(w.abs().max())
        bound = 0.0
        if "A" in parts:  # |(B @ A)_ij| <= sum_r |B_ir| |A_rj|
            a, b = parts["A"].float().flatten(1), parts["B"].float().flatten(1)
            bound += abs(_factor(parts)) * float(b.abs().sum(dim=1).max()) * float(a.abs().max())
        if "diff" in parts:
            bound += float(parts["diff"].float().abs().max())
        return top + abs(scale) * bound < torch.finfo(dtype).max / 2

    @torch.no_grad()
    def merge(self, model: torch.nn.Module, updates: dict, scale: float,
              device: torch.device | str | None = None) -> int:
        """Add ``scale`` x each update into ``model``'s weights in place; returns the number of modules changed.
        A scale of 0 changes no tensor (but a DoRA's magnitude, which rescales the weight whatever the scale).
        ``device``: where the update is computed (default: where each weight is), e.g. the GPU a generator runs
        on while a memory plan keeps the weights in host memory: the merged weights are then the bits a
        generator without the plan gets (a CPU matmul sums in another order, and an FP8 row's new scale follows
        its largest value)."""
        modules = dict(model.named_modules())
        for name, parts in updates.items():
            lin = modules[name]
            w = lin.weight
            dev = torch.device(device) if device is not None else w.device
            fp8 = isinstance(lin, Fp8Linear)
            if _changes_weight(parts, scale):
                current = self._current(lin, dev)
                delta = _weight_delta(parts, current.shape, dev)
                new = _merged_weight(current, self._unmerged(lin, current) if "M" in parts else None, parts, scale,
                                     delta)
                self._keep(lin, "weight")
                if fp8:  # requantized, new scales
                    self._keep(lin, "weight_scale")
                    w8, w_scale = quantize_weight(new)
                    w.copy_(w8)
                    lin.weight_scale.copy_(w_scale)
                else:
                    w.copy_(new.to(w.dtype))
            bias = _bias_delta(parts, dev)
            if bias is not None and scale != 0:
                self._keep(lin, "bias")
                lin.bias.copy_((lin.bias.to(dev).float() + scale * bias).to(lin.bias.dtype))
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


def parse_lora_spec(spec, allow_pickle: bool = False) -> list[tuple[str, float, int | None]]:
    """``PATH``, ``(PATH, SCALE)``, ``(PATH, SCALE, EXPERT)`` or a list of them -> [(path, scale, expert)].
    EXPERT: 0 (a Wan2.2 A14B checkpoint's high-noise expert), 1 (its low-noise one) or None (every expert, the
    default); its range is checked against the checkpoint by :func:`check_loras`. ``allow_pickle``: pickle files
    (by name) may be given."""
    if spec is None:
        return []
    items: Iterable = [spec] if isinstance(spec, (str, Path, tuple)) else spec
    if not isinstance(items, (list, tuple)):
        raise InvalidArgumentType(f"lora={spec!r}: give a path, (path, scale), (path, scale, expert), or a list of "
                                  "them.")
    out = []
    for item in items:
        if isinstance(item, (str, Path)):
            item = (item, 1.0)
        if isinstance(item, (tuple, list)) and len(item) in (2, 3):  # NumPy / torch scalars: their Python numbers
            item = (item[0], *map(python_number, item[1:]), None)[:3]
        ok = isinstance(item, tuple) and len(item) == 3 and isinstance(item[0], (str, Path)) \
            and isinstance(item[1], numbers.Real) and not isinstance(item[1], bool) \
            and (item[2] is None or isinstance(item[2], numbers.Integral) and not isinstance(item[2], bool))
        if not ok:
            raise InvalidArgumentType(f"lora={spec!r}: give a path, (path, scale), (path, scale, expert) with an int "
                                      "expert (0: high noise, 1: low noise) or None, or a list of them.")
        if not finite(item[1]):
            raise InvalidArgument(f"lora={spec!r}: the scale of {str(item[0])!r} is {item[1]!r}; a LoRA scale must "
                                  "be a finite number (1.0 as trained, 0.5 for half strength).")
        check_lora_path(item[0], allow_pickle)  # a missing file fails before the checkpoint is fetched or built
        out.append((str(item[0]), float(item[1]), None if item[2] is None else int(item[2])))
    return out


def check_repeats(loras: list[tuple[str, float, int | None]]) -> None:
    """Rule: a file merges into a DiT once. The same file (by its resolved path) twice for one DiT (the same expert,
    or either for every expert) is refused: its update would be added twice, at the sum of the scales -- a
    repeated ``--lora`` or list entry is a slip. (``load_lora`` on a generator that holds the file already adds it
    again on purpose.)"""
    seen: dict[Path, tuple[str, float, int | None]] = {}
    for path, scale, expert in loras:
        key = Path(path).expanduser().resolve()
        first = seen.get(key)
        if first is not None and (first[2] is None or expert is None or first[2] == expert):
            where = "" if first[2] is None and expert is None else \
                f" (experts {'all' if first[2] is None else first[2]} and {'all' if expert is None else expert})"
            same = "" if first[0] == path else f" ({first[0]!r} is the same file)"
            raise InvalidArgument(
                f"LoRA file {path!r} is given twice{where}, at scales {first[1]:g} and {scale:g}{same}; a file merges "
                "into a DiT once: give it once, at the scale you want (e.g. "
                f"{first[1] + scale:g} for both together), or once per expert (0: high noise, 1: low noise).")
        seen.setdefault(key, (path, scale, expert))


def apply_lora(models: list, states: list[LoraState], path, scale: float = 1.0, expert: int | None = None,
               tensors: dict[str, torch.Tensor] | None = None, allow_pickle: bool = False,
               device: torch.device | str | None = None) -> int:
    """Merge the LoRA file at ``path`` into ``models`` (the experts; ``expert``: only that index, None: all), each
    with its :class:`LoraState`; ``tensors``: the file's contents when already read (:func:`check_loras`).
    ``allow_pickle``: a pickle file (by name) may be read; ``device``: where the updates are computed (the
    generator's compute device; default: where each weight is, see :meth:`LoraState.merge`). Every check (file,
    keys, shapes, alphas, arguments, the merged weights' range) runs before any weight changes. Returns the number
    of modules changed. NumPy / torch scalars count as the Python numbers they hold."""
    scale, expert = python_number(scale), python_number(expert)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise InvalidArgumentType(f"scale={scale!r} must be a number (the LoRA's strength, 1.0 as trained).")
    if not finite(scale):
        raise InvalidArgument(f"scale={scale!r} must be a finite number (the LoRA's strength, 1.0 as trained).")
    experts = " or ".join(map(str, range(len(models))))
    if expert is not None and (isinstance(expert, bool) or not isinstance(expert, numbers.Integral)):
        raise InvalidArgumentType(f"expert={expert!r} must be an int ({experts}) or None for all experts.")
    if expert is not None and expert not in range(len(models)):
        raise InvalidArgument(f"expert={expert!r}: this checkpoint has {len(models)} expert(s); use {experts}, "
                              "or None for all.")
    if not isinstance(allow_pickle, bool):
        raise InvalidArgumentType(f"allow_pickle={allow_pickle!r} must be True or False.")
    expert = None if expert is None else int(expert)
    scale = float(scale)
    tensors = read_lora(path, allow_pickle) if tensors is None else tensors
    chosen = range(len(models)) if expert is None else [expert]
    source = f"LoRA {str(path)!r}"
    updates = {i: lora_updates(tensors, models[i], source) for i in chosen}
    for i, upd in updates.items():  # every expert checked before any changes
        states[i].check(models[i], upd, scale, source, device)
    changed = 0
    for i, upd in updates.items():
        changed += states[i].merge(models[i], upd, scale, device)
        states[i].loaded.append((str(path), scale))
    return changed


def check_loras(loras: list[tuple[str, float, int | None]], config, experts: int = 1,
                allow_pickle: bool = False) -> list[dict[str, torch.Tensor]]:
    """Every entry of ``loras`` (:func:`parse_lora_spec`) checked for a checkpoint of ``experts`` DiTs of
    ``config``: its expert in range, its file read and matched against a DiT built on the meta device (no
    weights), so a bad entry raises before anything is loaded -> the files' tensors, in order (each file is read
    once)."""
    if not loras:
        return []
    for path, _, expert in loras:
        if expert is not None and expert not in range(experts):
            raise InvalidArgument(
                f"lora {path!r}: expert={expert}, but this checkpoint has {experts} expert(s); an expert (0: high "
                "noise, 1: low noise) is for a Wan2.2 A14B checkpoint: leave it out (None) to merge into every DiT.")
    from fastwan.models import WanTransformer

    with torch.device("meta"):
        model = WanTransformer(config)
    files = [read_lora(path, allow_pickle) for path, _, _ in loras]
    for (path, _, _), tensors in zip(loras, files):
        lora_updates(tensors, model, f"LoRA {path!r}")
    return files
