"""The Animate DiT's rules: its checkpoint's tensors are exactly those its config describes (a missing or extra one
named), its config's Animate rules, and the pose / face inputs of a run checked before any block runs."""
from __future__ import annotations

import inspect
import json
import shutil

import pytest
import torch
from diffusers import WanAnimateTransformer3DModel
from safetensors.torch import load_file, save_file

from fastwan.errors import CheckpointError, InvalidArgument
from fastwan.hooks import HookRegistry
from fastwan.models import load_transformer
from fastwan.models.wan.animate import animate_inputs
from fastwan.models.wan.config import WanConfig
from fastwan.models.wan.transformer import WanTransformer
from tests.animate.test_animate_dit import inputs, load


def edited(folder, tmp_path, drop=(), add=None):
    """A copy of the DiT folder ``folder`` without the tensors ``drop`` and with ``add`` (name -> tensor)."""
    out = tmp_path / "transformer"
    shutil.copytree(folder, out)
    (weights,) = out.glob("*.safetensors")
    state = {k: v for k, v in load_file(weights).items() if k not in drop}
    save_file({**state, **(add or {})}, weights)
    return out


@pytest.mark.parametrize("name", ["face_adapter.1.to_k.weight", "pose_patch_embedding.bias",
                                  "motion_encoder.res_blocks.1.conv2.act_fn.bias", "face_encoder.padding_tokens"])
def test_missing_tensor_is_named(animate_dit, tmp_path, name):
    with pytest.raises(CheckpointError, match=f"missing 1 tensors \\[{name}\\]"):
        load(edited(animate_dit, tmp_path, drop=[name]), "reference")


def test_unexpected_tensor_is_named(animate_dit, tmp_path):
    folder = edited(animate_dit, tmp_path, add={"face_adapter.2.to_q.weight": torch.zeros(24, 24)})
    with pytest.raises(CheckpointError, match=r"unexpected 1 tensors \[face_adapter\.2\.to_q\.weight\]"):
        load(folder, "fast")


@pytest.mark.parametrize("change,words", [
    ({"in_channels": 34}, "must be 2 x \"latent_channels\" + 4 = 36"),
    ({"num_layers": 5}, "must be a multiple of \"inject_face_latents_blocks\": 2"),
    ({"motion_encoder_channel_sizes": {"4": 8, "16": 5}}, "no channel count for resolutions 8"),
    ({"motion_encoder_size": 12}, "must be a power of two"),
    ({"patch_size": [2, 2, 2]}, "temporal patch of 1"),
])
def test_animate_config_rules(animate_dit, change, words):
    raw = {**json.loads((animate_dit / "config.json").read_text()), **change}
    with pytest.raises(CheckpointError, match=words.replace("+", r"\+")):
        WanConfig.from_dict(raw)


def test_animate_config_defaults_are_diffusers():
    """An Animate config.json without the Animate keys reads as diffusers' WanAnimateTransformer3DModel defaults."""
    defaults = {k: p.default for k, p in inspect.signature(WanAnimateTransformer3DModel.__init__).parameters.items()}
    cfg = WanConfig.from_dict({"_class_name": "WanAnimateTransformer3DModel", "added_kv_proj_dim": 5120})
    for key in ("in_channels", "latent_channels", "out_channels", "image_dim", "motion_encoder_size",
                "motion_style_dim", "motion_dim", "motion_encoder_dim", "face_encoder_hidden_dim",
                "face_encoder_num_heads", "inject_face_latents_blocks", "motion_encoder_batch_size"):
        assert getattr(cfg, key) == defaults[key], key
    assert dict(cfg.motion_encoder_channel_sizes)[512] == 32


def test_animate_inputs_are_checked(animate_dit):
    ours = load(animate_dit, "reference")
    x, pose, face, (text, _), image = inputs()
    t = torch.tensor([500.0])
    with pytest.raises(InvalidArgument, match="animate_inputs"):
        ours(x, t, text, image=image)  # no pose, no face
    with pytest.raises(InvalidArgument, match=r"face video \[1, 3, 12, 8, 8\] must be \[B, 3, S, 16, 16\]"):
        with animate_inputs(ours, pose, face[..., :8, :8]):
            pass
    with pytest.raises(InvalidArgument, match=r"gives 5 token frames but the latents have 4; pass 9 to 12"):
        with animate_inputs(ours, pose, torch.cat([face, face[:, :, :1]], dim=2)):
            ours(x, t, text, image=image)
    with pytest.raises(InvalidArgument, match=r"pose latents \[1, 16, 4, 6, 8\] must be \[1, 16, 3, 6, 8\]"):
        with animate_inputs(ours, torch.cat([pose, pose[:, :, :1]], dim=2), face):
            ours(x, t, text, image=image)
    assert HookRegistry.of(ours).names() == []


def test_plain_dit_refuses_animate_inputs():
    with torch.device("meta"):
        plain = WanTransformer(WanConfig(num_layers=1, num_attention_heads=2, attention_head_dim=12))
    with pytest.raises(InvalidArgument, match="not Wan2.2-Animate's"):
        with animate_inputs(plain, torch.zeros(1, 16, 1, 2, 2), torch.zeros(1, 3, 1, 16, 16)):
            pass


def test_motion_synthesis_weight_stays_fp32(animate_dit):
    """As diffusers keeps it: the motion directions' weight (orthonormalised by a QR in fp32) loads in fp32 in a
    bf16 DiT; the rest of the motion encoder takes the DiT's dtype."""
    model = load_transformer(animate_dit, dtype=torch.bfloat16, device="cpu")
    assert model.motion_encoder.motion_synthesis_weight.dtype == torch.float32
    assert model.motion_encoder.conv_out.weight.dtype == torch.bfloat16


def test_sequence_parallel_is_refused(animate_dit):
    """The face adapters attend per token frame, over the whole stream: a DiT split over ranks is refused."""
    from fastwan.hooks import Hook
    from fastwan.parallel.plan import SequenceParallelHook

    ours = load(animate_dit, "reference")
    x, pose, face, *_ = inputs()

    class Split(Hook):  # the sequence plan's hook, by its name (its points need a process group)
        name = SequenceParallelHook.name

    HookRegistry.of(ours).add(Split())
    with pytest.raises(InvalidArgument, match="without sequence parallelism"):
        with animate_inputs(ours, pose, face):
            pass


def test_a_pipeline_folder_with_an_animate_dit_is_refused(animate_dit, tiny_ckpts, tmp_path):
    """A checkpoint whose DiT is Animate's is refused from its files, before any weight loads, unless its pipeline is
    Wan2.2-Animate's (only it gives that DiT its pose and face inputs), and that pipeline has its CLIP."""
    from fastwan.checkpoint.resolver import resolve

    root = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpts["wan2.1"], root)
    shutil.rmtree(root / "transformer")
    shutil.copytree(animate_dit, root / "transformer")
    with pytest.raises(CheckpointError, match="describes a Wan2.2-Animate Wan DiT, but model_index.json names no "
                                              "Wan2.2-Animate pipeline"):
        resolve(str(root))
    index = json.loads((root / "model_index.json").read_text())
    (root / "model_index.json").write_text(json.dumps({**index, "_class_name": "WanAnimatePipeline"}))
    with pytest.raises(CheckpointError, match="has no CLIP image encoder"):
        resolve(str(root))
