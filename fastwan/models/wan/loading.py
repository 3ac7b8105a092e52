"""Build a Wan DiT from a Diffusers ``transformer/`` folder: meta-device init, then the checkpoint's tensors
assigned in place (safetensors; the modules Diffusers keeps in fp32 stay fp32; FP8 layers as
:mod:`fastwan.models.wan.quantize` rules)."""
from __future__ import annotations

import re
from pathlib import Path

import torch

from fastwan.errors import CheckpointError
from fastwan.checkpoint.safetensors import (
    CheckpointTensors,
    FLOAT_TAGS,
    check_names,
    header_tensors,
    load_into,
    shape_error,
    weight_files,
)
from fastwan.models.wan.config import WanConfig
from fastwan.models.wan.quantize import (
    SCALE_SUFFIX,
    QuantizingTensors,
    check_fp8_state,
    check_quantization,
    fp8_layer_names,
    prequantized_layers,
    use_fp8,
)
from fastwan.models.wan.transformer import WanTransformer, keep_in_fp32
from fastwan.options import DiTOptions


VSA_GATE_KEY = "attn1.to_gate_compress.weight"  # the weight a VSA-trained DiT carries in every block
# Tensors a checkpoint may carry that the DiT never reads, skipped as diffusers skips them (WanTransformer3DModel.
# _keys_to_ignore_on_load_unexpected): the published Wan2.1 I2V / FLF2V checkpoints hold an unused
# ``blocks.N.attn2.norm_added_q.weight`` per block.
UNUSED_TENSOR_PARTS = ("norm_added_q",)


# FastVideo's FastWan checkpoints name VSA's gate projection by FastVideo's module path, ``blocks.N.to_gate_compress``
# (its loader and saver map no other name for it); the DiT holds it in the self-attention, ``blocks.N.attn1.``.
_FASTVIDEO_GATE = re.compile(r"^(blocks\.\d+)\.to_gate_compress\.")


def has_vsa_gates(keys) -> bool:
    """Whether tensor names ``keys`` (the DiT's names, :func:`dit_names`) include VSA's gate projections (the DiT
    was trained with VSA)."""
    return any(k.endswith(VSA_GATE_KEY) for k in keys)


def unused_tensor(key: str) -> bool:
    """Whether the tensor named ``key`` is one the DiT never reads (:data:`UNUSED_TENSOR_PARTS`)."""
    return any(part in UNUSED_TENSOR_PARTS for part in key.split("."))


def dit_names(keys, source: str) -> dict[str, str]:
    """The DiT's name -> the checkpoint's name, for each tensor of ``keys`` the DiT reads (the unused ones left
    out; FastVideo's gate names read as the DiT's). Rule: two checkpoint tensors may not name one DiT tensor."""
    out: dict[str, str] = {}
    for key in keys:
        if unused_tensor(key):
            continue
        name = _FASTVIDEO_GATE.sub(r"\1.attn1.to_gate_compress.", key)
        if name in out:
            raise CheckpointError(
                f"{source}: tensors {out[name]!r} and {key!r} are both the DiT's {name!r} (FastVideo and diffusers "
                "names of one VSA gate); the checkpoint is inconsistent: keep one of them, or download it again.")
        out[name] = key
    return out


class UsedTensors:
    """A checkpoint's tensors (a :class:`fastwan.checkpoint.safetensors.CheckpointTensors`) the DiT reads, by the DiT's
    names (:func:`dit_names`)."""

    def __init__(self, state, source: str = "checkpoint"):
        self.state = state
        self.names = dit_names(state.keys(), source)
        self._dit_name = {key: name for name, key in self.names.items()}

    def keys(self) -> list[str]:
        return list(self.names)

    def items(self):
        return ((self._dit_name[k], v) for k, v in self.state.items() if k in self._dit_name)


def check_transformer_files(files: list[Path], cfg: WanConfig, source: str) -> bool:
    """Before any weight is read: the tensors named in the safetensors headers of ``files`` are those of the DiT
    ``cfg`` describes (VSA gates when the files carry them, FP8 scales for layers saved in FP8), each of the
    model's shape and of a floating-point dtype -> whether the files carry VSA gates. Pickle files are checked
    when they load."""
    if not files or any(f.suffix != ".safetensors" for f in files):
        return False
    header = header_tensors(files)
    found = {name: header[key] for name, key in dit_names(header, source).items()}
    gates = has_vsa_gates(found)
    with torch.device("meta"):
        model = WanTransformer(cfg, None, DiTOptions(block="reference"))
        if gates:
            model.add_gate_compress()
    saved = set(prequantized_layers(found))
    if saved:
        check_fp8_state(sorted(saved), fp8_layer_names(model), source)
    slots = model.state_dict()
    found = {k: v for k, v in found.items() if not (k.endswith(SCALE_SUFFIX) and k[: -len(SCALE_SUFFIX)] in saved)}
    check_names(slots, found, source)
    for key, (shape, tag) in found.items():
        if shape != tuple(slots[key].shape):
            raise shape_error(source, key, shape, slots[key].shape)
        if tag not in FLOAT_TAGS:
            raise CheckpointError(f"{source}: tensor {key!r} is stored as {tag}, but the model holds a "
                                  "floating-point weight there; the checkpoint is corrupt: re-download it.")
    return gates


def load_transformer(folder, *, dtype, device, attention=None, options: DiTOptions | None = None,
                     allow_pickle: bool = False, quantization: str | None = None,
                     compute_device: torch.device | str | None = None, tensors=None) -> WanTransformer:
    """``folder``: a Diffusers ``transformer/`` (or ``transformer_2/``) folder (config.json + safetensors)
    -> the :class:`WanTransformer` in eval mode without gradients, built as ``options`` (default
    ``DiTOptions()``) resolve for the device it will run on, ``compute_device`` (default: ``device``, where the
    weights are put; a model kept on the host for offloading runs on the GPU), and ``dtype``.

    ``quantization="fp8"``: the block linears get e4m3 weights, quantized tensor by tensor while loading (on the
    compute device; the FP8 route is chosen for activations of ``dtype`` there). A folder fastwan saved in FP8
    loads as FP8 whatever ``quantization``.

    ``tensors``: the DiT's tensors from elsewhere than the folder's files (``keys()`` and ``items()`` by the DiT's
    names, e.g. a causal generator file: :class:`fastwan.checkpoint.causal_files.GeneratorWeights`); the folder then
    gives the config alone."""
    folder = Path(folder)
    quantization = check_quantization(quantization)
    cfg = WanConfig.from_file(folder / "config.json")
    compute = torch.device(compute_device or device)
    with torch.device("meta"):
        model = WanTransformer(cfg, attention, (options or DiTOptions()).resolve(compute, dtype))
    source = str(folder) if tensors is None else str(getattr(tensors, "path", folder))
    state = UsedTensors(tensors if tensors is not None else
                        CheckpointTensors(weight_files(folder, allow_pickle=allow_pickle)), source)
    if has_vsa_gates(state.keys()):
        with torch.device("meta"):
            model.add_gate_compress()
    layers = fp8_layer_names(model)
    saved = prequantized_layers(state.keys())
    if saved:
        check_fp8_state(saved, layers, str(folder))
    if saved or quantization == "fp8":
        use_fp8(model, layers, device=compute, dtype=dtype)
    if quantization == "fp8" and not saved:
        state = QuantizingTensors(state, layers, compute)
    load_into(model, state, dtype=dtype, device=device, source=source,
              keep_fp32=lambda name: keep_in_fp32(name) or name.endswith(SCALE_SUFFIX))
    return model.eval().requires_grad_(False)
