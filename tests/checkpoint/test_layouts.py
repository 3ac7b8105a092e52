"""Checkpoint layouts beyond the plain one: diffusers weight-file variants (``*.fp16.safetensors``), a Hub
``revision``, and the checks ``resolve`` makes before any weight loads (component configs, the tokenizer's
files, the scheduler class, every expert's tensor names, shapes and dtypes from the safetensors headers). DiT
folders that diffusers users have: pickle weights beside other pickles, unreadable pickle weights, an index naming
only some shards of its set, a stray safetensors file beside the weights."""
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from fastwan import VideoGenerator
from fastwan.errors import CheckpointError, InvalidArgument, MissingFileError
from fastwan.checkpoint.resolver import resolve
from fastwan.checkpoint.tiny import tiny_checkpoint, write_hub_cache, write_tiny_checkpoint
from fastwan.models.wan.loading import load_transformer

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


# -- DiT folders that diffusers users have --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def folder():
    return tiny_checkpoint("wan2.1") / "transformer"


def ours(folder):
    return load_transformer(folder, dtype=torch.float32, device="cpu")


def pickle_folder(folder, tmp_path):
    """``folder`` (a DiT) with its weights as diffusers' pickle file name, diffusion_pytorch_model.bin."""
    import shutil

    from safetensors.torch import load_file

    out = shutil.copytree(folder, tmp_path / "transformer")
    torch.save(load_file(out / "diffusion_pytorch_model.safetensors"), out / "diffusion_pytorch_model.bin")
    (out / "diffusion_pytorch_model.safetensors").unlink()
    return out


def test_pickle_folder_loads_its_weight_file_beside_other_pickles(folder, tmp_path):
    """A training run's ``training_args.bin`` beside the weights (allow_pickle=True) is not a weight file: as
    diffusers does, only the weight file loads."""
    import argparse

    out = pickle_folder(folder, tmp_path)
    torch.save(argparse.Namespace(learning_rate=1e-4), out / "training_args.bin")
    got = load_transformer(out, dtype=torch.float32, device="cpu", allow_pickle=True).state_dict()
    want = ours(folder).state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("content", [b"not a pickle", None])
def test_unreadable_pickle_weights_are_a_checkpoint_error(folder, tmp_path, content):
    out = pickle_folder(folder, tmp_path)
    if content is None:
        torch.save([torch.zeros(2)], out / "diffusion_pytorch_model.bin")  # a pickle, not a state dict
    else:
        (out / "diffusion_pytorch_model.bin").write_bytes(content)
    with pytest.raises(CheckpointError, match=r"diffusion_pytorch_model\.bin (cannot be read|holds a list)"):
        load_transformer(out, dtype=torch.float32, device="cpu", allow_pickle=True)


def test_index_naming_only_some_shards_of_its_set_is_named(tmp_path):
    """An index that names no tensor of shard 2 of 2 (a stale or partial download): the error names the index and
    the shard, not a config mismatch."""
    import shutil

    from safetensors.torch import load_file

    from fastwan.checkpoint.resolver import resolve

    root = shutil.copytree(tiny_checkpoint("wan2.1"), tmp_path / "ckpt")
    folder = root / "transformer"
    tensors = load_file(folder / "diffusion_pytorch_model.safetensors")
    (folder / "diffusion_pytorch_model.safetensors").unlink()
    keys = sorted(tensors)
    shards = {f"diffusion_pytorch_model-0000{i + 1}-of-00002.safetensors": keys[i::2] for i in range(2)}
    for name, names in shards.items():
        save_file({k: tensors[k] for k in names}, str(folder / name))
    first = next(iter(shards))
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {k: first for k in shards[first]}}))
    with pytest.raises(CheckpointError, match=r"index\.json names no tensor of diffusion_pytorch_model-00002-of-"
                                              r"00002\.safetensors.*index is incomplete"):
        resolve(root)


@pytest.mark.parametrize("stray", ["diffusion_pytorch_model_backup.safetensors", "my_lora.safetensors"])
def test_a_stray_safetensors_file_beside_the_weights_is_not_read(tmp_path, stray):
    """As diffusers reads only ``diffusion_pytorch_model*`` (transformers ``model*``), a backup or a LoRA file left
    beside the weights is not read: the checkpoint resolves and the DiT loads the same tensors."""
    import shutil

    from fastwan.checkpoint.resolver import resolve

    root = shutil.copytree(tiny_checkpoint("wan2.1"), tmp_path / "ckpt")
    save_file({"blocks.0.lora_A.weight": torch.ones(2, 3)}, str(root / "transformer" / stray))
    save_file({"shared.weight": torch.ones(2, 3)}, str(root / "text_encoder" / stray))
    resolve(str(root))
    got = ours(root / "transformer").state_dict()
    want = ours(tiny_checkpoint("wan2.1") / "transformer").state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
