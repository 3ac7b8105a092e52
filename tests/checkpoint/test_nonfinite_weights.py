"""A DiT whose weights hold NaN or infinity is refused when it loads (a CheckpointError naming the tensor and its
file), instead of loading and making an all-black video."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from fastwan.checkpoint.tiny import write_tiny_checkpoint
from fastwan.errors import CheckpointError
from fastwan.models import load_transformer


def spoil(folder, key: str, value: float, dtype=None):
    """Set one element of tensor ``key`` in ``folder``'s single safetensors file to ``value`` (the file's tensors
    stored as ``dtype`` when given); returns the file."""
    (path,) = folder.glob("*.safetensors")
    state = load_file(path)
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    state[key].view(-1)[3] = value
    save_file(state, path)
    return path


@pytest.fixture
def ckpt(tmp_path):
    return write_tiny_checkpoint(tmp_path / "ckpt", "wan2.1")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_dit_with_nonfinite_weight_is_refused(ckpt, value):
    key = "blocks.1.attn1.to_q.weight"
    path = spoil(ckpt / "transformer", key, value)
    with pytest.raises(CheckpointError) as err:
        load_transformer(ckpt / "transformer", dtype=torch.float32, device="cpu")
    assert key in str(err.value) and str(path) in str(err.value)
    assert "NaN" in str(err.value) or "infinite" in str(err.value)


def test_bf16_dit_with_nan_is_refused(ckpt):
    key = "patch_embedding.bias"
    spoil(ckpt / "transformer", key, float("nan"), dtype=torch.bfloat16)
    with pytest.raises(CheckpointError, match=key.replace(".", r"\.")):
        load_transformer(ckpt / "transformer", dtype=torch.bfloat16, device="cpu")


def test_generator_refuses_before_any_video(ckpt):
    from fastwan import VideoGenerator

    spoil(ckpt / "transformer", "proj_out.weight", float("nan"))
    with pytest.raises(CheckpointError, match=r"proj_out\.weight"):
        VideoGenerator.from_pretrained(ckpt, device="cpu", dtype=torch.float32)


def test_quantizing_load_names_the_file_tensor(ckpt):
    """quantization='fp8' quantizes each weight as it is read; the non-finite source tensor is named, not the
    NaN scale quantization would make of it."""
    key = "blocks.0.ffn.net.0.proj.weight"
    spoil(ckpt / "transformer", key, float("inf"))
    with pytest.raises(CheckpointError, match=key.replace(".", r"\.")):
        load_transformer(ckpt / "transformer", dtype=torch.bfloat16, device="cpu", quantization="fp8")


def test_finite_checkpoint_loads(ckpt):
    model = load_transformer(ckpt / "transformer", dtype=torch.float32, device="cpu")
    assert all(torch.isfinite(p).all() for p in model.state_dict().values() if p.is_floating_point())
