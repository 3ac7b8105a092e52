"""Build a Wan DiT from a Diffusers ``transformer/`` folder: meta-device init, then the checkpoint's tensors
assigned in place (safetensors; the modules Diffusers keeps in fp32 stay fp32)."""
from __future__ import annotations

from pathlib import Path

import torch

from fastwan.models.loading import CheckpointTensors, load_into, weight_files
from fastwan.models.wan.config import WanConfig
from fastwan.models.wan.transformer import WanTransformer, keep_in_fp32
from fastwan.options import DiTOptions


VSA_GATE_KEY = "attn1.to_gate_compress.weight"  # the weight a VSA-trained DiT carries in every block


def has_vsa_gates(keys) -> bool:
    """Whether tensor names ``keys`` include VSA's gate projections (the DiT was trained with VSA)."""
    return any(k.endswith(VSA_GATE_KEY) for k in keys)


def load_transformer(folder, *, dtype, device, attention=None, options: DiTOptions | None = None,
                     allow_pickle: bool = False) -> WanTransformer:
    """``folder``: a Diffusers ``transformer/`` (or ``transformer_2/``) folder (config.json + safetensors)
    -> the :class:`WanTransformer` in eval mode without gradients, built as ``options`` (default
    ``DiTOptions()``) resolve for ``device`` and ``dtype``."""
    folder = Path(folder)
    cfg = WanConfig.from_file(folder / "config.json")
    files = weight_files(folder, allow_pickle=allow_pickle)
    with torch.device("meta"):
        model = WanTransformer(cfg, attention, (options or DiTOptions()).resolve(device, dtype))
    state = CheckpointTensors(files)
    if has_vsa_gates(state.keys()):
        with torch.device("meta"):
            model.add_gate_compress()
    load_into(model, state, dtype=dtype, device=device, keep_fp32=keep_in_fp32, source=str(folder))
    return model.eval().requires_grad_(False)
