"""Checkpoint layouts beyond the plain one: diffusers weight-file variants (``*.fp16.safetensors``), a Hub
``revision``, and the checks ``resolve`` makes before any weight loads (component configs, the tokenizer's
files, the scheduler class, every expert's tensor names, shapes and dtypes from the safetensors headers)."""
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from fastwan import VideoGenerator
from fastwan.errors import CheckpointError, InvalidArgument, MissingFileError
from fastwan.checkpoint.resolver import resolve
from fastwan.checkpoint.tiny import write_hub_cache, write_tiny_checkpoint

GEN = dict(prompt="a kite", seed=3, height=32, width=32, num_frames=5, num_inference_steps=2, save_video=False)
WEIGHTS = {"transformer": "diffusion_pytorch_model", "vae": "diffusion_pytorch_model", "text_encoder": "model"}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    return {v: write_tiny_checkpoint(root / v, v) for v in ("wan2.1", "wan2.2-a14b")}


@pytest.fixture(scope="module")
def reference(base):
    return VideoGenerator.from_pretrained(base["wan2.1"], device="cpu", dtype=torch.float32).generate_video(
        **GEN).frames


def copy(base, tmp_path, variant="wan2.1"):
    return shutil.copytree(base[variant], tmp_path / "ckpt")


def frames(root, **kw):
    return VideoGenerator.from_pretrained(root, device="cpu", dtype=torch.float32, **kw).generate_video(**GEN).frames


def test_variant_only_components_load_as_the_plain_ones(base, reference, tmp_path):
    """Every component saved only as diffusers' fp16 variant (names as ``save_pretrained(variant="fp16")``
    writes them): the DiT, the VAE and the text encoder load from those files, the same video."""
    root = copy(base, tmp_path)
    for comp, stem in WEIGHTS.items():
        (root / comp / f"{stem}.safetensors").rename(root / comp / f"{stem}.fp16.safetensors")
    ckpt = resolve(root)
    assert dict(ckpt.variants) == {"transformer": "fp16", "vae": "fp16", "text_encoder": "fp16"}
    assert np.array_equal(frames(root), reference)


def test_plain_files_win_over_a_variant_beside_them(base, reference, tmp_path):
    """A folder holding the plain files and an fp16 variant (as Hub repos do) loads the plain ones: the variant
    here holds zeros, so loading it would change the video."""
    root = copy(base, tmp_path)
    for comp, stem in WEIGHTS.items():
        tensors = load_file(root / comp / f"{stem}.safetensors")
        save_file({k: torch.zeros_like(v) for k, v in tensors.items()}, root / comp / f"{stem}.fp16.safetensors")
    assert dict(resolve(root).variants) == {"transformer": None, "vae": None, "text_encoder": None}
    assert np.array_equal(frames(root), reference)


def test_several_variants_without_plain_files_is_ambiguous(base, tmp_path):
    root = copy(base, tmp_path)
    folder = root / "vae"
    shutil.copy(folder / "diffusion_pytorch_model.safetensors", folder / "diffusion_pytorch_model.bf16.safetensors")
    (folder / "diffusion_pytorch_model.safetensors").rename(folder / "diffusion_pytorch_model.fp16.safetensors")
    with pytest.raises(CheckpointError, match=r"only as the variants bf16, fp16 .*Keep one variant"):
        resolve(root)


def test_hub_revision_is_the_snapshot_loaded(base, reference, tmp_path, monkeypatch):
    """``revision="dev"`` loads the snapshot refs/dev names; without it the default branch (absent) is asked for;
    a revision for a local folder is refused."""
    import huggingface_hub.constants as constants

    cache = tmp_path / "hub"
    write_hub_cache(base["wan2.1"], cache, "owner/tiny-rev", ref="dev")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    assert np.array_equal(frames("owner/tiny-rev", revision="dev"), reference)
    with pytest.raises(MissingFileError, match="not in the Hugging Face cache"):
        resolve("owner/tiny-rev")
    with pytest.raises(InvalidArgument, match=r"revision='dev' .* a local folder; drop revision"):
        resolve(base["wan2.1"], revision="dev")
    with pytest.raises(InvalidArgument, match="model='' is empty"):
        resolve("")


def _write_json(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.mark.parametrize("damage, error, match", [
    (lambda r: (r / "text_encoder" / "config.json").unlink(), MissingFileError, r"text_encoder/config.json is missing"),
    (lambda r: _write_json(r / "vae" / "config.json", "{not json"), CheckpointError, r"vae/config.json is not valid"),
    (lambda r: [p.unlink() for p in (r / "tokenizer").iterdir()], MissingFileError,
     r"tokenizer holds neither tokenizer.json nor spiece.model"),
    (lambda r: _write_json(r / "model_index.json", json.dumps(
        {**json.loads((r / "model_index.json").read_text()), "scheduler": ["diffusers", "FancyScheduler"]})),
     CheckpointError, r"model_index.json: the scheduler class \"FancyScheduler\" is not a diffusers scheduler class"),
])
def test_component_files_are_checked_before_loading(base, tmp_path, damage, error, match):
    root = copy(base, tmp_path)
    damage(root)
    with pytest.raises(error, match=match):
        resolve(root)


def _edit_tensors(folder, edit):
    path = folder / "diffusion_pytorch_model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.pop("blocks.0.attn1.to_q.weight"), r"missing 1 tensors \[blocks.0.attn1.to_q.weight\]"),
    (lambda t: t.update(extra=torch.zeros(2)), r"unexpected 1 tensors \[extra\]"),
    (lambda t: t.update({"blocks.1.ffn.net.2.bias": torch.zeros(3)}),
     r"tensor 'blocks.1.ffn.net.2.bias' has shape \(3,\), the config implies"),
    (lambda t: t.update({"proj_out.bias": t["proj_out.bias"].to(torch.int32)}),
     r"tensor 'proj_out.bias' is stored as I32"),
])
def test_second_expert_is_checked_before_the_first_loads(base, tmp_path, edit, match):
    """A damaged transformer_2 of a two-expert checkpoint is found from the headers, before any expert loads."""
    root = copy(base, tmp_path, "wan2.2-a14b")
    _edit_tensors(root / "transformer_2", edit)
    with pytest.raises(CheckpointError, match=match):
        resolve(root)
