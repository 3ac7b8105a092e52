"""FP8 weights for the Wan DiT: which layers, quantizing while loading, and FP8 checkpoints fastwan writes.

Rule: every linear layer inside ``blocks`` (self- and cross-attention projections, the image key/value projections,
the FFN, VSA's gate projections) holds an e4m3 weight with per-output-channel scales
(:class:`fastwan.kernels.fp8.Fp8Linear`); the patch embedding, the time/text/image embedders, the norms, the
modulation tables and the output head keep the model's dtype (or fp32, as diffusers keeps them) -- they are under
1% of the weights and sit where errors reach every token.

A checkpoint is quantized tensor by tensor as it is read (:class:`QuantizingTensors`), each weight from the file's
own precision on the target device, so a 14B DiT never needs its bf16 weights in memory at once. A folder written
by :func:`save_fp8_transformer` holds ``<layer>.weight`` (float8_e4m3fn) and ``<layer>.weight_scale`` (fp32 [O])
and loads without quantizing again.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.nn as nn

from fastwan.errors import CheckpointError, InvalidArgument
from fastwan.kernels.fp8 import E4M3, Fp8Linear, choose_route, fp8_state, quantize_weight
from fastwan.checkpoint.safetensors import FP8, write_atomically

logger = logging.getLogger("fastwan")

QUANTIZATIONS = ("fp8",)
SCALE_SUFFIX = ".weight_scale"
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
CONFIG_KEY = "fastwan_quantization"  # in a saved folder's config.json: {"method": "fp8", "scales": ...}


def check_quantization(value) -> str | None:
    """``quantization`` argument: None (the checkpoint's precision) or "fp8"."""
    if value is None or value in QUANTIZATIONS:
        return value
    raise InvalidArgument(f"quantization={value!r} is not supported; use None (weights in the model dtype) or "
                          "'fp8' (e4m3 DiT weights with per-channel scales: half the memory, FP8 GEMMs on sm89+).")


def fp8_layer_names(model: nn.Module) -> list[str]:
    """The names of the linear layers the FP8 rule covers: every nn.Linear / Fp8Linear inside ``model.blocks``."""
    return [f"blocks.{name}" for name, m in model.blocks.named_modules() if isinstance(m, (nn.Linear, Fp8Linear))]


def prequantized_layers(keys) -> list[str]:
    """The layers a checkpoint already holds in FP8 (those with a ``.weight_scale`` tensor)."""
    return sorted(k[: -len(SCALE_SUFFIX)] for k in keys if k.endswith(SCALE_SUFFIX))


def use_fp8(model: nn.Module, names: list[str], *, device: torch.device | str, dtype: torch.dtype,
            route: str = "auto") -> None:
    """Swap each named nn.Linear of ``model`` for an Fp8Linear whose route is fixed now for activations of
    ``dtype`` on ``device``: empty on a meta-device model (loading fills it), quantized from the weight otherwise.
    Logs once when "auto" cannot take the FP8 GEMM."""
    modules = dict(model.named_modules())
    fallback = set()
    for name in names:
        lin = modules[name]
        if not isinstance(lin, nn.Linear):
            raise InvalidArgument(f"use_fp8: {name} is a {type(lin).__name__}, not an nn.Linear.")
        chosen, why = choose_route(route, device=device, dtype=dtype, in_features=lin.in_features,
                                   out_features=lin.out_features)
        fallback.update(why)
        if lin.weight.is_meta:
            new = Fp8Linear(lin.in_features, lin.out_features, lin.bias is not None, route=chosen, dtype=dtype,
                            device="meta")
        else:
            new = Fp8Linear.from_linear(lin, route=chosen, dtype=dtype)
        parent, _, child = name.rpartition(".")
        setattr(modules[parent] if parent else model, child, new)
    if fallback:
        level = logging.WARNING if torch.device(device).type == "cuda" else logging.INFO
        logger.log(level, "fp8: the DiT's FP8 layers dequantize to %s for each matmul (storage only): the FP8 "
                   "GEMM %s", str(dtype).replace("torch.", ""), "; ".join(sorted(fallback)))


class QuantizingTensors:
    """A checkpoint's tensors (a :class:`fastwan.checkpoint.safetensors.CheckpointTensors`) with each named layer's
    weight quantized as it is read: ``<layer>.weight`` becomes float8_e4m3fn and ``<layer>.weight_scale`` (fp32) is
    added. Quantization runs on ``device`` from the file's precision (fp32 files are not rounded to bf16 first)."""

    def __init__(self, state, layers: list[str], device: torch.device | str):
        self.state, self.device = state, torch.device(device)
        self.weights = {f"{name}.weight": name for name in layers}

    def keys(self) -> list[str]:
        return [*self.state.keys(), *(f"{name}{SCALE_SUFFIX}" for name in self.weights.values())]

    def items(self):
        for key, value in self.state.items():
            name = self.weights.get(key)
            if name is None:
                yield key, value
                continue
            # an FP8 tensor here has no scale (a layer saved with one is prequantized): a plain value in 8 bits
            w8, scale = quantize_weight(value.to(self.device, torch.float32 if value.dtype in FP8 else None))
            yield key, w8
            yield f"{name}{SCALE_SUFFIX}", scale


def check_fp8_state(layers: list[str], expected: list[str], source: str) -> None:
    """A prequantized checkpoint's FP8 layers must be exactly the rule's (:func:`fp8_layer_names`)."""
    extra, missing = sorted(set(layers) - set(expected)), sorted(set(expected) - set(layers))
    if extra or missing:
        what = (f"FP8 scales for layers outside the rule, e.g. {extra[:3]}" if extra else
                f"no FP8 scales for {len(missing)} of the rule's layers, e.g. {missing[:3]}")
        raise CheckpointError(f"{source} holds FP8 weights, but {what}; fastwan loads FP8 DiTs it wrote itself "
                              "(fastwan quantize). Quantize the original checkpoint again.")


def save_fp8_transformer(model: nn.Module, source_config: str | Path, folder: str | Path) -> Path:
    """Write an FP8 DiT ``model`` as a Diffusers transformer folder: ``config.json`` (the source's, plus a
    ``fastwan_quantization`` entry) and one safetensors file, each written to a temporary file and moved into
    place, so a failed write leaves no partial file. -> the folder."""
    from safetensors.torch import save_file

    layers = [n for n, m in model.named_modules() if isinstance(m, Fp8Linear)]
    if not layers:
        raise InvalidArgument("save_fp8_transformer: the model has no FP8 layers; load it with quantization='fp8'.")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    raw = json.loads(Path(source_config).read_text())
    raw[CONFIG_KEY] = {"method": "fp8", "format": "float8_e4m3fn", "scales": "per output channel, fp32",
                       "layers": "every linear layer inside blocks"}
    state = fp8_state(model)
    assert all(state[f"{n}.weight"].dtype == E4M3 for n in layers)
    write_atomically(folder / WEIGHTS_NAME, lambda tmp: save_file(state, tmp, metadata={CONFIG_KEY: "fp8"}))
    write_atomically(folder / "config.json", lambda tmp: Path(tmp).write_text(json.dumps(raw, indent=2) + "\n"))
    return folder

