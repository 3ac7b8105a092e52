"""The cached tiny checkpoints (``--model tiny``) rebuild themselves when their files are corrupt, missing or
changed (a tiny model cannot be downloaded again), and every tiny checkpoint is written under a temporary name and
moved into place whole, so a killed write leaves no half checkpoint."""
from __future__ import annotations

import hashlib

import pytest

from fastwan.checkpoint import tiny
from fastwan.checkpoint.resolver import resolve
from fastwan.checkpoint.tiny import tiny_checkpoint, write_tiny_checkpoint

DIT = "transformer/diffusion_pytorch_model.safetensors"


def digests(folder):
    """relative path -> sha256 of every checkpoint file (fastwan's own bookkeeping files left out)."""
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and not p.name.startswith(".fastwan")}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTWAN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """What the writer makes of the default tiny model: the reference a rebuilt cache must equal."""
    return digests(write_tiny_checkpoint(tmp_path_factory.mktemp("fresh") / "wan2.1", "wan2.1"))


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip(path):
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [truncate, flip, lambda p: p.unlink()], ids=["truncated", "flipped", "deleted"])
def test_damaged_dit_file_is_rebuilt(cache, fresh, damage):
    first = tiny_checkpoint("wan2.1")
    assert digests(first) == fresh
    damage(first / DIT)
    again = tiny_checkpoint("wan2.1")
    assert again == first and digests(again) == fresh
    assert resolve("tiny").root == first


def test_deleted_model_index_is_rebuilt(cache, fresh):
    first = tiny_checkpoint("wan2.1")
    (first / "model_index.json").unlink()
    assert digests(tiny_checkpoint("wan2.1")) == fresh


def test_extra_or_missing_component_folder_is_rebuilt(cache, fresh):
    first = tiny_checkpoint("wan2.1")
    for p in (first / "vae").iterdir():
        p.unlink()
    (first / "vae").rmdir()
    assert digests(tiny_checkpoint("wan2.1")) == fresh


def test_cache_without_its_manifest_is_rebuilt(cache, fresh):
    """A cache folder written by an older fastwan (or copied without fastwan's bookkeeping) is rebuilt once."""
    first = tiny_checkpoint("wan2.1")
    for p in first.glob(".fastwan*"):
        p.unlink()
    flip(first / DIT)
    assert digests(tiny_checkpoint("wan2.1")) == fresh


def test_killed_write_leaves_no_half_checkpoint(cache, tmp_path, monkeypatch):
    real = tiny._write_clip

    def killed(*a, **k):
        raise KeyboardInterrupt  # the process stopped part-way through writing

    monkeypatch.setattr(tiny, "_write_clip", killed)
    with pytest.raises(KeyboardInterrupt):
        tiny_checkpoint("wan2.1-i2v")
    with pytest.raises(KeyboardInterrupt):
        write_tiny_checkpoint(tmp_path / "direct", "wan2.1-i2v")
    assert not (tmp_path / "direct").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    assert [p.name for p in (cache / "tiny").iterdir()] == []
    monkeypatch.setattr(tiny, "_write_clip", real)
    assert (tiny_checkpoint("wan2.1-i2v") / "image_encoder").is_dir()


def test_writer_refuses_a_folder_with_files(tmp_path):
    from fastwan.errors import OutputExistsError

    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match="notes.txt|not empty"):
        write_tiny_checkpoint(tmp_path / "taken", "wan2.1")
    assert (tmp_path / "taken" / "notes.txt").read_text() == "mine"
    assert write_tiny_checkpoint(tmp_path / "empty", "wan2.1") == tmp_path / "empty"
