"""Checks across a checkpoint's components (``fastwan.checkpoint.components``) and the layouts they let load:
a DiT stored in FP8 without scales, the scheduler and tokenizer classes ``model_index.json`` names, pickle weight
variants; and the mismatches refused before any weight loads (VAE channels, text width, weight file names,
scheduler shifts). Where a layout loads, its frames are diffusers' on the same folder (fp32, within 1)."""
import json
import logging
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from fastwan import VideoGenerator
from fastwan.errors import CheckpointError
from fastwan.checkpoint.resolver import resolve
from fastwan.checkpoint.tiny import write_tiny_checkpoint
from tests.pipelines.test_pipeline_parity import reference_frames

GEN = dict(height=32, width=32, num_frames=5, num_inference_steps=2, guidance_scale=5.0)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("components") / "wan2.1", "wan2.1")


@pytest.fixture
def ckpt(plain, tmp_path):
    return shutil.copytree(plain, tmp_path / "ckpt")


def edit_json(path, **changes):
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is ...:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


def fastwan_frames(root, **load):
    gen = VideoGenerator.from_pretrained(root, device="cpu", dtype=torch.float32, **load)
    return gen.generate_video("a kite", negative_prompt="blurry", seed=7, save_video=False, **GEN).frames


def assert_diffusers_frames(root, **load):
    ours = fastwan_frames(root, **load).astype(int)
    theirs = reference_frames(str(root), "a kite", "blurry", 7, **GEN).astype(int)
    assert np.abs(ours - theirs).max() <= 1


def test_dit_stored_in_fp8_without_scales_loads_as_diffusers_does(ckpt, caplog):
    path = ckpt / "transformer" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(path)
    save_file({k: v.to(torch.float8_e4m3fn) if v.dim() == 2 and k.startswith("blocks.") else v
               for k, v in tensors.items()}, path)
    with caplog.at_level(logging.INFO, logger="fastwan"):
        assert_diffusers_frames(ckpt)
    assert any("stored in FP8 without scales" in r.getMessage() for r in caplog.records)
    gen = VideoGenerator.from_pretrained(ckpt, device="cpu", dtype=torch.float32, quantization="fp8")
    assert gen.generate_video("a kite", seed=7, save_video=False, **GEN).frames.shape == (5, 32, 32, 3)


def test_scheduler_and_tokenizer_classes_come_from_model_index(ckpt):
    edit_json(ckpt / "scheduler" / "scheduler_config.json", _class_name=...)
    (ckpt / "tokenizer" / "tokenizer_config.json").unlink()
    assert_diffusers_frames(ckpt)


def test_a_scheduler_config_naming_another_class_runs_the_index_class_as_diffusers_does(ckpt, caplog):
    edit_json(ckpt / "scheduler" / "scheduler_config.json", _class_name="FlowMatchEulerDiscreteScheduler", shift=3.0)
    with caplog.at_level(logging.WARNING, logger="fastwan"):
        assert_diffusers_frames(ckpt)
    assert any("names the scheduler class \"FlowMatchEulerDiscreteScheduler\"" in r.getMessage()
               and "the scheduler is a UniPCMultistepScheduler" in r.getMessage() for r in caplog.records)


def test_pickle_variant_loads_with_allow_pickle(plain, ckpt):
    vae = ckpt / "vae" / "diffusion_pytorch_model.safetensors"
    torch.save(load_file(vae), ckpt / "vae" / "diffusion_pytorch_model.fp16.bin")
    vae.unlink()
    assert resolve(ckpt, allow_pickle=True).variants["vae"] == "fp16"
    assert np.array_equal(fastwan_frames(ckpt, allow_pickle=True), fastwan_frames(plain))


def _rename(folder, old, new):
    (folder / old).rename(folder / new)


@pytest.mark.parametrize("damage, match", [
    (lambda r: edit_json(r / "vae" / "config.json", z_dim=48, latents_mean=[0.0] * 48, latents_std=[1.0] * 48),
     r"\"z_dim\": 48, but the DiT predicts 16-channel latents"),
    (lambda r: edit_json(r / "vae" / "config.json", latents_mean=[0.0] * 3), r"\"latents_mean\" must list one number "
     r"per latent channel \(16\)"),
    (lambda r: edit_json(r / "text_encoder" / "config.json", d_model=24), r"\"d_model\": 24, but the DiT's "
     r"\"text_dim\" is"),
    (lambda r: _rename(r / "vae", "diffusion_pytorch_model.safetensors", "Wan2.1_VAE.safetensors"),
     r"Wan2.1_VAE.safetensors, but diffusers' AutoencoderKLWan reads diffusion_pytorch_model.safetensors"),
    (lambda r: _rename(r / "text_encoder", "model.safetensors", "umt5-xxl-enc.safetensors"),
     r"umt5-xxl-enc.safetensors, but transformers' UMT5EncoderModel reads model.safetensors"),
    (lambda r: edit_json(r / "scheduler" / "scheduler_config.json", flow_shift="3.0"),
     r"\"flow_shift\": \"3.0\" must be a positive number"),
    (lambda r: edit_json(r / "scheduler" / "scheduler_config.json", flow_shift=-1.0),
     r"\"flow_shift\": -1.0 must be a positive number"),
    (lambda r: edit_json(r / "model_index.json", _class_name="WanPipeline") or
     edit_json(r / "transformer" / "config.json", in_channels=36),
     r"in_channels = 2 x out_channels \+ 4 is an image-to-video DiT, whose model_index.json has \"_class_name\": "
     r"\"WanImageToVideoPipeline\""),
])
def test_component_mismatches_are_refused_before_loading(ckpt, damage, match):
    damage(ckpt)
    with pytest.raises(CheckpointError, match=match):
        resolve(ckpt)


def test_image_to_video_dit_under_a_text_to_video_index_names_the_fix(tmp_path):
    root = write_tiny_checkpoint(tmp_path / "i2v", "wan2.1-i2v")
    edit_json(root / "model_index.json", _class_name="WanPipeline", image_encoder=..., image_processor=...)
    with pytest.raises(CheckpointError, match=r"model_index.json names a text-to-video pipeline; an image-to-video "
                       r"checkpoint's model_index.json has \"_class_name\": \"WanImageToVideoPipeline\""):
        resolve(root)


def test_an_encoder_with_a_single_file_and_an_index_is_checked_on_the_file_transformers_reads(ckpt):
    """transformers' from_pretrained reads model.safetensors when it exists, whatever index sits beside it."""
    te = ckpt / "text_encoder"
    tensors = load_file(te / "model.safetensors")
    save_file(tensors, te / "model-00001-of-00001.safetensors", metadata={"format": "pt"})
    (te / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: "model-00001-of-00001.safetensors" for k in tensors}}))
    resolve(ckpt)  # both sets whole: fine
    data = (te / "model.safetensors").read_bytes()
    (te / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"text_encoder/model.safetensors is not a valid safetensors file"):
        resolve(ckpt)
