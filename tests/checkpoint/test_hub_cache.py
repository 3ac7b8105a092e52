"""Checkpoints in the Hugging Face cache layout (snapshot files are symlinks into ../../blobs/) load, by Hub id
offline and by snapshot path, and give the same video as a plain copy; shard indexes may only name plain file
names in their own folder."""
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from fastwan import VideoGenerator
from fastwan.checkpoint.tiny import write_hub_cache, write_tiny_checkpoint

REPO = "tiny-owner/tiny-wan-sharded"
GEN = dict(seed=5, height=64, width=64, num_frames=5, num_inference_steps=2, save_video=False)
SHARDED = ("transformer", "text_encoder")


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """A tiny Wan2.1 checkpoint whose transformer and text encoder are sharded (plain files, no links)."""
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("plain") / "ckpt", "wan2.1", max_shard_size=40_000)
    for comp in SHARDED:  # really sharded: an index naming at least two shards, all present
        names = _shards(path / comp)
        assert len(names) >= 2 and all((path / comp / n).is_file() for n in names), (comp, names)
    return path


@pytest.fixture(scope="module")
def reference(plain):
    """Frames generated from the plain folder."""
    gen = VideoGenerator.from_pretrained(plain, device="cpu", dtype=torch.float32)
    return gen.generate_video("a prompt", **GEN).frames


@pytest.fixture
def hub_cache(plain, tmp_path, monkeypatch):
    """``plain`` laid out as the Hub cache holds REPO; huggingface_hub offline and pointed at that cache."""
    import huggingface_hub.constants as constants

    cache = tmp_path / "hub"
    snapshot = write_hub_cache(plain, cache, REPO)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # read at import time: set the constants too
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache, snapshot


def _shards(folder: Path) -> list[str]:
    (index,) = folder.glob("*.safetensors.index.json")
    return sorted(set(json.loads(index.read_text())["weight_map"].values()))


def test_cache_layout_is_the_hubs(plain, hub_cache):
    """Every snapshot file is a relative link into blobs/ (one more '../' per folder level), refs/main holds the
    snapshot's revision, and each link reads the plain file's bytes."""
    cache, snapshot = hub_cache
    storage = cache / ("models--" + REPO.replace("/", "--"))
    assert snapshot.parent == storage / "snapshots"
    assert (storage / "refs" / "main").read_text() == snapshot.name
    files = sorted(p for p in plain.rglob("*") if p.is_file())
    for p in files:
        rel = p.relative_to(plain)
        link = snapshot / rel
        assert link.is_symlink(), rel
        target = os.readlink(link)
        assert target == "../" * (len(rel.parts) + 1) + "blobs/" + Path(target).name, (rel, target)
        assert link.resolve().parent == (storage / "blobs").resolve()
        assert link.read_bytes() == p.read_bytes()
    assert sorted(p.relative_to(snapshot) for p in snapshot.rglob("*") if not p.is_dir()) == \
        [p.relative_to(plain) for p in files]


def test_generate_by_hub_id_offline(hub_cache, reference):
    gen = VideoGenerator.from_pretrained(REPO, device="cpu", dtype=torch.float32)
    assert gen.checkpoint.root == hub_cache[1]
    assert np.array_equal(gen.generate_video("a prompt", **GEN).frames, reference)


def test_generate_by_snapshot_path(hub_cache, reference):
    gen = VideoGenerator.from_pretrained(hub_cache[1], device="cpu", dtype=torch.float32)
    assert np.array_equal(gen.generate_video("a prompt", **GEN).frames, reference)


def test_hub_id_index_checked_before_components_are_fetched(plain, hub_cache, monkeypatch):
    """A Hub id's model_index.json is fetched alone and checked before the component files are asked for."""
    import huggingface_hub

    cache, snapshot = hub_cache
    repo = "tiny-owner/tiny-wan-i2v"
    src = Path(cache).parent / "i2v"
    shutil.copytree(plain, src)
    index = json.loads((src / "model_index.json").read_text())
    index["_class_name"] = "WanVideoToVideoPipeline"
    (src / "model_index.json").write_text(json.dumps(index))
    write_hub_cache(src, cache, repo)
    real, asked = huggingface_hub.snapshot_download, []

    def recording(repo_id, **kw):
        asked.append(kw.get("allow_patterns"))
        return real(repo_id, **kw)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", recording)
    with pytest.raises(ValueError, match="video-to-video is not supported yet"):
        VideoGenerator.from_pretrained(repo, device="cpu")
    assert asked == [["model_index.json"]]


def _cache_copy(plain, tmp_path):
    """A fresh snapshot of ``plain`` in its own cache (each test damages its own)."""
    return write_hub_cache(plain, tmp_path / "hub", REPO)


@pytest.mark.parametrize("entry", ["../x.safetensors", "../../vae/diffusion_pytorch_model.safetensors",
                                   "/abs/model.safetensors", "sub/model.safetensors", "sub\\model.safetensors",
                                   "", ".", "..", "C:model.safetensors", 5, None, ["model.safetensors"]])
def test_index_entry_must_be_a_plain_file_name(plain, tmp_path, entry):
    """Rule: an index names a plain file name in its folder; a path is refused even when it exists there."""
    snap = _cache_copy(plain, tmp_path)
    folder = snap / "transformer"
    (index_path,) = folder.glob("*.safetensors.index.json")
    first = folder / _shards(folder)[0]
    (folder / "sub").mkdir()
    os.symlink(os.readlink(first).replace("../", "../../", 1), folder / "sub" / "model.safetensors")
    assert (folder / "sub" / "model.safetensors").is_file()  # the path exists: refused by its form alone
    index = json.loads(index_path.read_text())
    index["weight_map"][next(iter(index["weight_map"]))] = entry
    index_path.unlink()  # the cache's link; write a real file in its place
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError) as e:
        VideoGenerator.from_pretrained(snap, device="cpu")
    msg = str(e.value)
    assert str(index_path) in msg and json.dumps(entry) in msg and "not a plain file name" in msg


@pytest.mark.parametrize("allow_pickle", [False, True])
def test_index_names_only_safetensors_files(plain, tmp_path, allow_pickle):
    """A safetensors index naming another kind of file is refused, even with allow_pickle (nothing is unpickled
    through an index)."""
    snap = _cache_copy(plain, tmp_path)
    folder = snap / "transformer"
    (index_path,) = folder.glob("*.safetensors.index.json")
    index = json.loads(index_path.read_text())
    first_key = next(iter(index["weight_map"]))
    shard = folder / index["weight_map"][first_key]
    os.symlink(os.readlink(shard), folder / "model.bin")  # the same bytes under a pickle name
    index["weight_map"][first_key] = "model.bin"
    index_path.unlink()
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"names shard \"model.bin\", which is not a \*\.safetensors file"):
        VideoGenerator.from_pretrained(snap, device="cpu", allow_pickle=allow_pickle)


@pytest.mark.parametrize("layout", ["lone", "sharded"])
def test_broken_link_is_named(plain, tmp_path, layout):
    """A weight file whose link points nowhere is reported by its name in the folder."""
    if layout == "lone":
        src = write_tiny_checkpoint(tmp_path / "lone", "wan2.1")
        snap = write_hub_cache(src, tmp_path / "hub", REPO)
        name = "diffusion_pytorch_model.safetensors"
    else:
        snap = _cache_copy(plain, tmp_path)
        name = _shards(snap / "transformer")[-1]
    (snap / "transformer" / name).resolve().unlink()
    with pytest.raises(FileNotFoundError) as e:
        VideoGenerator.from_pretrained(snap, device="cpu")
    assert name in str(e.value) and "broken link" in str(e.value)


def test_lone_file_and_index_follow_one_rule(tmp_path):
    """One rule for a lone .safetensors and for an index's shard: the file is addressed by its name in the
    folder, and a link there is followed to wherever it points (here a suffix-less file in another folder)."""
    from fastwan.checkpoint.safetensors import weight_files

    src = write_tiny_checkpoint(tmp_path / "src", "wan2.1")
    linked = tmp_path / "linked"
    shutil.copytree(src, linked)
    store = tmp_path / "elsewhere"
    store.mkdir()
    weights = linked / "transformer" / "diffusion_pytorch_model.safetensors"
    shutil.move(weights, store / "0123abcd")
    os.symlink(os.path.relpath(store / "0123abcd", weights.parent), weights)
    ref = VideoGenerator.from_pretrained(src, device="cpu", dtype=torch.float32).generate_video("a prompt", **GEN)

    assert weight_files(linked / "transformer") == [weights]  # lone file
    lone = VideoGenerator.from_pretrained(linked, device="cpu", dtype=torch.float32).generate_video("a prompt", **GEN)
    assert np.array_equal(lone.frames, ref.frames)

    from safetensors import safe_open
    with safe_open(str(weights), framework="pt") as f:
        names = list(f.keys())
    index = {"metadata": {}, "weight_map": {k: weights.name for k in names}}
    (weights.parent / (weights.name + ".index.json")).write_text(json.dumps(index))
    assert weight_files(linked / "transformer") == [weights]  # the same file named by an index
    shard = VideoGenerator.from_pretrained(linked, device="cpu", dtype=torch.float32).generate_video("a prompt", **GEN)
    assert np.array_equal(shard.frames, ref.frames)


def test_a_folder_that_is_not_a_pipeline_gets_what_to_pass_instead(plain, tmp_path, monkeypatch):
    """No model_index.json: the original Wan release layout (here and on the Hub) points at the Diffusers repos,
    a component folder at its pipeline folder; nothing is loaded."""
    import huggingface_hub.constants as constants

    from fastwan.errors import MissingFileError

    original = tmp_path / "Wan2.1-T2V-1.3B"
    original.mkdir()
    (original / "config.json").write_text(json.dumps({"_class_name": "WanModel", "dim": 1536}))
    (original / "Wan2.1_VAE.pth").write_bytes(b"\0")
    with pytest.raises(MissingFileError, match="original Wan release layout.*Diffusers-format"):
        VideoGenerator.from_pretrained(original, device="cpu")
    with pytest.raises(MissingFileError, match=f"'transformer' component.*pipeline folder '{plain}'"):
        VideoGenerator.from_pretrained(plain / "transformer", device="cpu")
    with pytest.raises(MissingFileError, match="not a Diffusers-format pipeline folder"):
        VideoGenerator.from_pretrained(tmp_path, device="cpu")

    cache = tmp_path / "hub"
    write_hub_cache(original, cache, "Wan-AI/Wan2.1-T2V-1.3B")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    with pytest.raises(MissingFileError, match="'Wan-AI/Wan2.1-T2V-1.3B' is in the original Wan release layout.*"
                                               r"same weights \('Wan-AI/Wan2.1-T2V-1.3B-Diffusers'\)"):
        VideoGenerator.from_pretrained("Wan-AI/Wan2.1-T2V-1.3B", device="cpu")
