"""Build a Wan DiT from a Diffusers ``transformer/`` folder: meta-device init, then the checkpoint's tensors
assigned in place (safetensors; the modules Diffusers keeps in fp32 stay fp32; FP8 layers as
:mod:`fastwan.models.wan.quantize` rules)."""
from __future__ import annotations

from pathlib import Path

import torch

from fastwan.errors import CheckpointError
from fastwan.models.loading import (
    FLOAT_TAGS,
    CheckpointTensors,
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


def has_vsa_gates(keys) -> bool:
    """Whether tensor names ``keys`` include VSA's gate projections (the DiT was trained with VSA)."""
    return any(k.endswith(VSA_GATE_KEY) for k in keys)


def unused_tensor(key: str) -> bool:
    """Whether the tensor named ``key`` is one the DiT never reads (:data:`UNUSED_TENSOR_PARTS`)."""
    return any(part in UNUSED_TENSOR_PARTS for part in key.split("."))


class UsedTensors:
    """A checkpoint's tensors (a :class:`fastwan.models.loading.CheckpointTensors`) without the unused ones."""

    def __init__(self, state):
        self.state = state

    def keys(self) -> list[str]:
        return [k for k in self.state.keys() if not unused_tensor(k)]

    def items(self):
        return ((k, v) for k, v in self.state.items() if not unused_tensor(k))


def check_transformer_files(files: list[Path], cfg: WanConfig, source: str) -> bool:
    """Before any weight is read: the tensors named in the safetensors headers of ``files`` are those of the DiT
    ``cfg`` describes (VSA gates when the files carry them, FP8 scales for layers saved in FP8), each of the
    model's shape and of a floating-point dtype -> whether the files carry VSA gates. Pickle files are checked
    when they load."""
    if not files or any(f.suffix != ".safetensors" for f in files):
        return False
    found = {k: v for k, v in header_tensors(files).items() if not unused_tensor(k)}
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
                     compute_device: torch.device | str | None = None) -> WanTransformer:
    """``folder``: a Diffusers ``transformer/`` (or ``transformer_2/``) folder (config.json + safetensors)
    -> the :class:`WanTransformer` in eval mode without gradients, built as ``options`` (default
    ``DiTOptions()``) resolve for the device it will run on, ``compute_device`` (default: ``device``, where the
    weights are put; a model kept on the host for offloading runs on the GPU), and ``dtype``.

    ``quantization="fp8"``: the block linears get e4m3 weights, quantized tensor by tensor while loading (on the
    compute device; the FP8 route is chosen for activations of ``dtype`` there). A folder fastwan saved in FP8
    loads as FP8 whatever ``quantization``."""
    folder = Path(folder)
    quantization = check_quantization(quantization)
    cfg = WanConfig.from_file(folder / "config.json")
    files = weight_files(folder, allow_pickle=allow_pickle)
    compute = torch.device(compute_device or device)
    with torch.device("meta"):
        model = WanTransformer(cfg, attention, (options or DiTOptions()).resolve(compute, dtype))
    state = UsedTensors(CheckpointTensors(files))
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
    load_into(model, state, dtype=dtype, device=device, source=str(folder),
              keep_fp32=lambda name: keep_in_fp32(name) or name.endswith(SCALE_SUFFIX))
    return model.eval().requires_grad_(False)
