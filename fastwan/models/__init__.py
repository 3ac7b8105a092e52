"""Wan DiT written for fastwan, loading Diffusers-format checkpoints directly."""
from fastwan.models.config import WanConfig
from fastwan.models.wan import WanTransformer, keep_in_fp32

__all__ = ["WanConfig", "WanTransformer", "keep_in_fp32", "load_transformer"]


def load_transformer(folder, *, dtype, device, attention=None, allow_pickle: bool = False) -> WanTransformer:
    """Build a :class:`WanTransformer` on the meta device and assign the checkpoint's weights.

    ``folder`` is a Diffusers ``transformer/`` (or ``transformer_2/``) folder: config.json + safetensors.
    """
    from pathlib import Path

    import torch

    from fastwan.models.loading import CheckpointTensors, load_into, weight_files

    folder = Path(folder)
    cfg = WanConfig.from_file(folder / "config.json")
    files = weight_files(folder, allow_pickle=allow_pickle)
    with torch.device("meta"):
        model = WanTransformer(cfg, attention)
    state = CheckpointTensors(files)
    if any(k.endswith("attn1.to_gate_compress.weight") for k in state.keys()):
        with torch.device("meta"):
            model.add_gate_compress()
    load_into(model, state, dtype=dtype, device=device, keep_fp32=keep_in_fp32, source=str(folder))
    return model.eval().requires_grad_(False)
