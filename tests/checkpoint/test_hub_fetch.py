"""A Hub id fetches only the files fastwan reads: the plain weights (or the one variant), safetensors before pickle,
an index's own shards; never a second variant, a pickle copy or a stray file beside them. The Hub is simulated by a
cache plus a repository listing (online), so what is asked of ``snapshot_download`` can be recorded."""
import fnmatch
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from fastwan import VideoGenerator
from fastwan.errors import CheckpointError
from fastwan.checkpoint.tiny import write_hub_cache, write_tiny_checkpoint

REPO = "tiny-owner/tiny-wan-extra"
GEN = dict(seed=3, height=64, width=64, num_frames=5, num_inference_steps=2, save_video=False)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """A tiny Wan2.1 checkpoint with a sharded transformer and text encoder (plain files)."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("plain") / "ckpt", "wan2.1", max_shard_size=40_000)


@pytest.fixture(scope="module")
def reference(plain):
    gen = VideoGenerator.from_pretrained(plain, device="cpu", dtype=torch.float32)
    return gen.generate_video("a prompt", **GEN).frames


def _fp16_copy(folder: Path) -> None:
    """Add an fp16 variant of every safetensors file (and index) in ``folder``, as diffusers names them."""
    for f in sorted(folder.glob("*.safetensors")):
        stem, _, shard = f.stem.partition("-")
        name = f"{stem}.fp16{'-' + shard if shard else ''}.safetensors"
        from safetensors.torch import load_file
        save_file({k: v.half() for k, v in load_file(f).items()}, str(folder / name))
    for idx in sorted(folder.glob("*.safetensors.index.json")):
        data = json.loads(idx.read_text())
        data["weight_map"] = {k: v.replace("-", ".fp16-", 1) for k, v in data["weight_map"].items()}
        (folder / idx.name.replace(".json", ".fp16.json")).write_text(json.dumps(data))


@pytest.fixture
def online(plain, tmp_path, monkeypatch):
    """``plain`` plus files fastwan must not fetch, in a cache; the Hub "online": listing = the snapshot's files,
    each snapshot_download recorded (then served from the cache)."""
    import huggingface_hub
    import huggingface_hub.constants as constants

    src = tmp_path / "src"
    shutil.copytree(plain, src)
    for comp in ("transformer", "text_encoder", "vae"):
        _fp16_copy(src / comp)
    torch.save({"w": torch.zeros(1)}, src / "text_encoder" / "pytorch_model.bin")  # a pickle copy beside it
    (src / "vae" / "backup.safetensors").write_bytes((src / "vae" / "diffusion_pytorch_model.safetensors").read_bytes())
    cache = tmp_path / "hub"
    snapshot = write_hub_cache(src, cache, REPO)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    listing = sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if not p.is_dir())
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", lambda self, repo_id, revision=None, **kw: listing)
    real, asked = huggingface_hub.snapshot_download, []

    def recording(repo_id, **kw):
        asked.append(kw.get("allow_patterns"))
        with pytest.MonkeyPatch.context() as m:  # served from the cache
            m.setattr(constants, "HF_HUB_OFFLINE", True)
            return real(repo_id, **kw)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", recording)
    return listing, asked, src


def _fetched(listing, asked) -> set[str]:
    return {f for f in listing for patterns in asked if any(fnmatch.fnmatchcase(f, p) for p in patterns)}


def test_only_the_read_files_are_fetched(online, reference):
    listing, asked, src = online
    gen = VideoGenerator.from_pretrained(REPO, device="cpu", dtype=torch.float32)
    assert np.array_equal(gen.generate_video("a prompt", **GEN).frames, reference)
    fetched = _fetched(listing, asked)
    assert asked[0] == ["model_index.json"]
    unread = {f for f in listing  # weight data fastwan does not read (small files such as indexes may come)
              if (".fp16" in f and f.endswith(".safetensors")) or f.endswith((".bin", "backup.safetensors"))}
    assert unread and not fetched & unread, sorted(fetched & unread)
    # every plain weight file is fetched, and the configs, indexes and tokenizer files
    weights = {f for f in listing if f.endswith(".safetensors") and f not in unread}
    assert weights and weights <= fetched
    small = {f for f in listing if f.endswith((".json", ".model", ".txt"))}
    assert small <= fetched


def test_a_lone_variant_is_fetched_and_loads(online, tmp_path, monkeypatch, reference):
    """Without plain files the one variant is fetched (and loads), and the plain names are not asked for."""
    listing, asked, src = online
    repo = "tiny-owner/tiny-wan-fp16-vae"
    only = tmp_path / "only"
    shutil.copytree(src, only)
    (only / "vae" / "diffusion_pytorch_model.safetensors").unlink()
    (only / "vae" / "backup.safetensors").unlink()
    snapshot = write_hub_cache(only, tmp_path / "hub", repo)
    lone = sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if not p.is_dir())
    import huggingface_hub
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", lambda self, repo_id, revision=None, **kw: lone)
    VideoGenerator.from_pretrained(repo, device="cpu", dtype=torch.float32)
    fetched = _fetched(lone, asked)
    assert "vae/diffusion_pytorch_model.fp16.safetensors" in fetched
    assert not {f for f in fetched if f.startswith("transformer/") and f.endswith(".fp16.safetensors")}
    assert not {f for f in fetched if f.startswith("transformer/") and ".fp16-" in f}


def test_two_variants_without_plain_files_fail_before_weights_are_fetched(online, tmp_path, monkeypatch):
    listing, asked, src = online
    repo = "tiny-owner/tiny-wan-two-variants"
    two = tmp_path / "two"
    shutil.copytree(src, two)
    vae = two / "vae"
    (vae / "diffusion_pytorch_model.safetensors").rename(vae / "diffusion_pytorch_model.bf16.safetensors")
    (vae / "backup.safetensors").unlink()
    snapshot = write_hub_cache(two, tmp_path / "hub", repo)
    names = sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if not p.is_dir())
    import huggingface_hub
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", lambda self, repo_id, revision=None, **kw: names)
    with pytest.raises(CheckpointError, match="bf16, fp16.*ambiguous"):
        VideoGenerator.from_pretrained(repo, device="cpu", dtype=torch.float32)
    assert not {f for f in _fetched(names, asked) if f.endswith(".safetensors")}
