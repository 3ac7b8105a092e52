"""Where ``export_fp8`` / ``fastwan quantize`` may write, and with which modes: an empty output, the current folder
and the folders above it, a symbolic link and the source checkpoint (or what its components link to) are refused;
``overwrite`` replaces only a former export (a model_index.json, FP8 transformer folders as fastwan writes them and
links to the source's components, nothing else), whatever lies beside it, checked before any weight is read and
again just before the swap, and deletes only what that rule listed; the device and the destination are checked
before the checkpoint is read; the folders and files written get 0o777 / 0o666 less the umask."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import stat
from pathlib import Path

import pytest
import torch

from fastwan.cli import main
from fastwan.errors import InvalidArgument, InvalidArgumentType, OutputPathError
from fastwan.models.wan import export
from fastwan.models.wan.export import export_fp8

REFUSED = "replaces only a former FP8 export"
FIX = "choose another output folder, or remove this one yourself"


def snapshot(root: Path) -> dict[str, str]:
    """Every entry under ``root`` (links not followed) -> what it is: a file's sha256, a link's target, 'dir'."""
    out = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(folder, name)
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = "-> " + os.readlink(p)
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.fixture
def no_loading(monkeypatch):
    monkeypatch.setattr("fastwan.models.load_transformer",
                        lambda *a, **k: pytest.fail("a weight was read before the checks finished"))


@pytest.fixture
def former(tiny_ckpts, tmp_path) -> Path:
    """A former export of the tiny Wan2.1 checkpoint at tmp_path/fp8."""
    return export_fp8(tiny_ckpts["wan2.1"], tmp_path / "fp8", device="cpu")


# ---- the output path itself -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("output", ["", "   ", "\t\n"])
def test_an_empty_output_is_refused_not_taken_as_the_current_folder(tiny_ckpts, tmp_path, monkeypatch, capsys,
                                                                    no_loading, output):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model_index.json").write_text('{"_class_name": "WanPipeline"}')
    (tmp_path / "notes.txt").write_text("mine")
    before = snapshot(tmp_path)
    with pytest.raises(InvalidArgument, match=re.escape(f"output={output!r} is empty; pass the new checkpoint")):
        export_fp8(tiny_ckpts["wan2.1"], output, overwrite=True, device="cpu")
    assert main(["quantize", "--model", str(tiny_ckpts["wan2.1"]), "--output", output, "--overwrite",
                 "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fastwan: error: output={output!r} is empty") and err.count("\n") == 1
    assert snapshot(tmp_path) == before


def test_output_and_overwrite_types_are_checked(tiny_ckpts, tmp_path, no_loading):
    with pytest.raises(InvalidArgumentType, match=r"output=None must be a str or a path"):
        export_fp8(tiny_ckpts["wan2.1"], None, device="cpu")
    with pytest.raises(InvalidArgumentType, match=r"overwrite='yes' must be True or False"):
        export_fp8(tiny_ckpts["wan2.1"], tmp_path / "a", overwrite="yes", device="cpu")
    assert not list(tmp_path.iterdir())


def test_the_current_folder_and_the_folders_above_it_are_refused(tiny_ckpts, former, monkeypatch, capsys):
    """Even a former export: replacing the folder one works in (or one above it) would pull it from under them."""
    before = snapshot(former.parent)
    monkeypatch.setattr("fastwan.models.load_transformer", lambda *a, **k: pytest.fail("a weight was read"))
    monkeypatch.chdir(former)
    with pytest.raises(OutputPathError, match=re.escape(f"output={str(former)!r} is the current folder; ")):
        export_fp8(tiny_ckpts["wan2.1"], ".", overwrite=True, device="cpu")
    monkeypatch.chdir(former / "transformer")
    with pytest.raises(OutputPathError, match="is a folder that holds the current folder"):
        export_fp8(tiny_ckpts["wan2.1"], former, overwrite=True, device="cpu")
    assert main(["quantize", "--model", str(tiny_ckpts["wan2.1"]), "--output", "..", "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fastwan: error: output={str(former)!r} is a folder that holds the current folder")
    assert snapshot(former.parent) == before


def test_a_symbolic_link_is_refused(tiny_ckpts, former, tmp_path, no_loading):
    link = tmp_path / "link"
    link.symlink_to(former, target_is_directory=True)
    (tmp_path / "empty").mkdir()
    (tmp_path / "to-empty").symlink_to(tmp_path / "empty", target_is_directory=True)
    before = snapshot(tmp_path)
    for out, overwrite in ((link, True), (tmp_path / "to-empty", False)):
        with pytest.raises(OutputPathError, match=re.escape(f"output={str(out)!r} is a symbolic link")):
            export_fp8(tiny_ckpts["wan2.1"], out, overwrite=overwrite, device="cpu")
    assert snapshot(tmp_path) == before


def test_cli_never_replaces_the_source(tiny_ckpts, tmp_path, capsys, no_loading):
    src = tmp_path / "src"
    shutil.copytree(tiny_ckpts["wan2.1"], src)
    before = snapshot(src)
    assert main(["quantize", "--model", str(src), "--output", str(src), "--overwrite", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fastwan: error: output={str(src)!r} is or holds {src}, part of the source checkpoint")
    assert snapshot(src) == before


# ---- what overwrite replaces ----------------------------------------------------------------------------------------
def test_an_unrelated_checkpoint_is_never_replaced(tiny_ckpts, tmp_path, capsys, no_loading):
    """A real checkpoint (it holds a model_index.json) of the user's is not a former export."""
    other = tmp_path / "other"
    shutil.copytree(tiny_ckpts["wan2.2-a14b"], other)
    before = snapshot(other)
    assert main(["quantize", "--model", str(tiny_ckpts["wan2.1"]), "--output", str(other), "--overwrite",
                 "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fastwan: error: output={str(other)!r} is not a folder fastwan quantize wrote (")
    assert REFUSED in err and FIX in err and err.count("\n") == 1
    assert snapshot(other) == before and sorted(p.name for p in tmp_path.iterdir()) == ["other"]


def _drop_quantization_entry(former: Path) -> None:
    config = former / "transformer" / "config.json"
    raw = json.loads(config.read_text())
    del raw["fastwan_quantization"]
    config.write_text(json.dumps(raw))


def _plain_weights(former: Path, src: Path) -> None:
    weights = former / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.unlink()
    shutil.copyfile(src / "transformer" / "diffusion_pytorch_model.safetensors", weights)


def _copied_vae(former: Path, src: Path) -> None:
    (former / "vae").unlink()
    shutil.copytree(src / "vae", former / "vae")


def _linked_weights(former: Path, src: Path) -> None:
    weights = former / "transformer" / "diffusion_pytorch_model.safetensors"
    kept = former.parent / "kept.safetensors"
    weights.rename(kept)
    weights.symlink_to(kept)


def _no_transformer(former: Path, src: Path) -> None:
    shutil.rmtree(former / "transformer")


TAMPERED = {
    "a file beside": (lambda f, s: (f / "notes.txt").write_text("mine"), "it holds 'notes.txt', which is no "
                                                                          "component of its model_index.json"),
    "a file inside": (lambda f, s: (f / "transformer" / "notes.txt").write_text("mine"),
                      "transformer/ holds ['config.json', 'diffusion_pytorch_model.safetensors', 'notes.txt']"),
    "a hidden file": (lambda f, s: (f / ".notes").write_text("mine"), "it holds '.notes'"),
    "no FP8 config entry": (lambda f, s: _drop_quantization_entry(f),
                            "transformer/config.json has no 'fastwan_quantization' entry"),
    "other weights": (_plain_weights, "diffusion_pytorch_model.safetensors is not an FP8 weights file fastwan"),
    "linked weights": (_linked_weights, "diffusion_pytorch_model.safetensors is not an FP8 weights file fastwan"),
    "a copied component": (_copied_vae, "vae/config.json has no 'fastwan_quantization' entry"),
    "no transformer": (_no_transformer, "it holds no FP8 transformer folder"),
    "no index": (lambda f, s: (f / "model_index.json").unlink(), "it holds no pipeline's model_index.json"),
    "a linked index": (lambda f, s: ((f / "model_index.json").unlink(),
                                     (f / "model_index.json").symlink_to(s / "model_index.json")),
                       "it holds no pipeline's model_index.json"),
}


@pytest.mark.parametrize("change", TAMPERED)
def test_overwrite_refuses_a_former_export_holding_anything_else(tiny_ckpts, former, tmp_path, no_loading, change):
    tamper, why = TAMPERED[change]
    tamper(former, tiny_ckpts["wan2.1"])
    before = snapshot(tmp_path)
    with pytest.raises(OutputPathError) as err:
        export_fp8(tiny_ckpts["wan2.1"], former, overwrite=True, device="cpu")
    msg = str(err.value)
    assert msg.startswith(f"output={str(former)!r} is not a folder fastwan quantize wrote (")
    assert why in msg and REFUSED in msg and FIX in msg
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("variant", ["wan2.1", "wan2.2-a14b"])
def test_overwrite_replaces_a_former_export_and_leaves_nothing_behind(tiny_ckpts, tmp_path, variant):
    out = export_fp8(tiny_ckpts["wan2.2-a14b" if variant == "wan2.1" else "wan2.1"], tmp_path / "fp8", device="cpu")
    again = export_fp8(tiny_ckpts[variant], out, overwrite=True, device="cpu")
    fresh = export_fp8(tiny_ckpts[variant], tmp_path / "fresh", device="cpu")
    assert snapshot(again) == snapshot(fresh)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp8", "fresh"]


def test_a_file_written_into_the_folder_while_quantizing_stops_the_swap(tiny_ckpts, former, tmp_path, monkeypatch):
    from fastwan import models

    real = models.load_transformer

    def load_and_meddle(*a, **k):
        (former / "notes.txt").write_text("written meanwhile")
        return real(*a, **k)

    monkeypatch.setattr(models, "load_transformer", load_and_meddle)
    before = snapshot(former)
    with pytest.raises(OutputPathError, match="it holds 'notes.txt'"):
        export_fp8(tiny_ckpts["wan2.1"], former, overwrite=True, device="cpu")
    after = snapshot(former)
    assert after.pop("notes.txt") and after == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp8"]  # the new folder was removed


def test_a_file_written_after_the_last_check_is_kept(tiny_ckpts, former, tmp_path, monkeypatch, caplog):
    """Replacing deletes only what the rule listed; a file that appears after the check stays (with a warning)."""
    real, calls = export._replaceable, []

    def check_then_meddle(output, overwrite):
        listed = real(output, overwrite)
        calls.append(output)
        if len(calls) == 2:  # the check just before the swap
            (output / "notes.txt").write_text("written meanwhile")
            (output / "transformer" / "late.txt").write_text("also")
        return listed

    monkeypatch.setattr(export, "_replaceable", check_then_meddle)
    caplog.set_level(logging.WARNING, logger="fastwan")
    out = export_fp8(tiny_ckpts["wan2.1"], former, overwrite=True, device="cpu")
    assert snapshot(out) == snapshot(export_fp8(tiny_ckpts["wan2.1"], tmp_path / "fresh", device="cpu"))
    (park,) = tmp_path.glob(".fp8.*.old")
    assert sorted(snapshot(park)) == ["fp8", "fp8/notes.txt", "fp8/transformer", "fp8/transformer/late.txt"]
    assert (park / "fp8" / "notes.txt").read_text() == "written meanwhile"
    assert calls[:2] == [former, former] and f"left {park}" in caplog.text and "remove it yourself" in caplog.text


# ---- modes ---------------------------------------------------------------------------------------------------------
@pytest.fixture(params=[0o022, 0o027, 0o077])
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_an_export_has_the_modes_of_the_umask(tiny_ckpts, tmp_path, umask):
    out = export_fp8(tiny_ckpts["wan2.2-a14b"], tmp_path / "fp8", device="cpu")
    for folder in (out, out / "transformer", out / "transformer_2"):
        assert mode(folder) == 0o777 & ~umask, folder
    files = [out / "model_index.json", *out.glob("transformer*/*")]
    assert len(files) == 5 and all(mode(f) == 0o666 & ~umask for f in files), {str(f): oct(mode(f)) for f in files}


def test_files_written_atomically_have_the_modes_of_the_umask(tmp_path, umask):
    """Also when the writer makes its file owner-only (safetensors writes a private file and renames it)."""
    from safetensors.torch import save_file

    from fastwan.checkpoint.safetensors import write_atomically
    from fastwan.pipelines.output import _new_temp

    write_atomically(tmp_path / "a.json", lambda tmp: Path(tmp).write_text("{}"))
    write_atomically(tmp_path / "b.safetensors", lambda tmp: save_file({"x": torch.zeros(2)}, tmp))

    def private(tmp):
        fd = os.open(f"{tmp}.x", os.O_CREAT | os.O_WRONLY, 0o600)
        os.close(fd)
        os.replace(f"{tmp}.x", tmp)

    write_atomically(tmp_path / "c.bin", private)
    files = [tmp_path / "a.json", tmp_path / "b.safetensors", tmp_path / "c.bin", _new_temp(tmp_path)]
    assert all(mode(f) == 0o666 & ~umask for f in files), {str(f): oct(mode(f)) for f in files}


def test_the_tiny_checkpoint_cache_has_the_modes_of_the_umask(tmp_path, monkeypatch, umask):
    from fastwan.checkpoint.tiny import tiny_checkpoint

    monkeypatch.setenv("FASTWAN_CACHE", str(tmp_path / "cache"))
    root = tiny_checkpoint("wan2.1")
    folders = [root, *(p for p in root.rglob("*") if p.is_dir())]
    files = [p for p in root.rglob("*") if p.is_file()]
    assert files and all(mode(f) == 0o666 & ~umask for f in files), {str(f): oct(mode(f)) for f in files}
    assert all(mode(d) == 0o777 & ~umask for d in folders), {str(d): oct(mode(d)) for d in folders}


# ---- the source checkpoint and former exports ---------------------------------------------------------------------
def tree(folder) -> dict[str, str]:
    """Every file under ``folder`` -> its sha256 (links followed)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("where", ["source", "parent"])
def test_export_never_replaces_the_source(tiny_ckpts, tmp_path, where, no_loading):
    src = tmp_path / "ckpt" / "wan"
    shutil.copytree(tiny_ckpts["wan2.1"], src)
    (tmp_path / "ckpt" / "model_index.json").write_text("{}")  # the parent looks like a pipeline folder too
    before = tree(tmp_path / "ckpt")
    with pytest.raises(OutputPathError, match="part of the source checkpoint"):
        export_fp8(src, src if where == "source" else src.parent, overwrite=True, device="cpu")
    assert tree(tmp_path / "ckpt") == before and not list(tmp_path.rglob(".*.tmp"))


def test_export_never_replaces_what_the_source_links_to(tiny_ckpts, tmp_path, monkeypatch):
    """An FP8 folder re-exported onto the checkpoint its text encoder and VAE link to; a former export that a
    source's component links into."""
    orig = tmp_path / "orig"
    shutil.copytree(tiny_ckpts["wan2.1"], orig)
    first = export_fp8(orig, tmp_path / "fp8", device="cpu")
    linking = tmp_path / "linking"
    shutil.copytree(orig, linking, ignore=shutil.ignore_patterns("transformer"))
    (linking / "transformer").symlink_to(first / "transformer", target_is_directory=True)
    before, before_first = tree(orig), tree(first)
    monkeypatch.setattr("fastwan.models.load_transformer", lambda *a, **k: pytest.fail("a weight was read"))
    with pytest.raises(OutputPathError, match=re.escape(f"output={str(orig)!r} is not a folder fastwan quantize")):
        export_fp8(first, orig, overwrite=True, device="cpu")
    with pytest.raises(OutputPathError, match=f"is or holds {first}/transformer, part of the source checkpoint"):
        export_fp8(linking, first, overwrite=True, device="cpu")
    assert tree(orig) == before and tree(first) == before_first


def test_export_overwrites_only_a_former_export(tiny_ckpts, tmp_path, no_loading):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(OutputPathError, match=r"is not a folder fastwan quantize wrote \(it holds no pipeline's "
                                              r"model_index.json\); overwrite \(--overwrite\) replaces only a former"):
        export_fp8(tiny_ckpts["wan2.1"], out, overwrite=True, device="cpu")
    assert (out / "notes.txt").read_text() == "keep me"


def test_export_checks_device_and_destination_first(tiny_ckpts, tmp_path, monkeypatch, no_loading, capsys):
    monkeypatch.setattr("fastwan.checkpoint.resolver.resolve",
                        lambda *a, **k: pytest.fail("the checkpoint was read first"))
    for device in ("gpu", "meta", 3):
        with pytest.raises(InvalidArgument, match=re.escape(f"device={device!r}")):
            export_fp8(tiny_ckpts["wan2.1"], tmp_path / "a", device=device)
    if not torch.cuda.is_available():
        with pytest.raises(InvalidArgument, match="device='cuda' is not available here"):
            export_fp8(tiny_ckpts["wan2.1"], tmp_path / "a", device="cuda")
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputPathError, match="does not exist or is not a folder"):
        export_fp8(tiny_ckpts["wan2.1"], tmp_path / "file" / "out", device="cpu")
    monkeypatch.setattr(export.os, "access", lambda path, mode: str(path) != str(tmp_path / "ro"))
    (tmp_path / "ro").mkdir()
    with pytest.raises(OutputPathError, match="is not writable"):
        export_fp8(tiny_ckpts["wan2.1"], tmp_path / "ro" / "out", device="cpu")
    assert main(["quantize", "--model", str(tiny_ckpts["wan2.1"]), "--output", str(tmp_path / "b"),
                 "--device", "gpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastwan: error: device='gpu' is not a torch device") and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "ro"]


def test_export_expands_home_and_replaces_a_former_export(tiny_ckpts, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    out = export_fp8(tiny_ckpts["wan2.1"], "~/fp8", device="cpu")
    assert out == tmp_path / "fp8" and (out / "transformer").is_dir()
    first = tree(out)
    (tmp_path / ".fp8.old").mkdir()  # something of the user's where a former export's folder could be parked
    (tmp_path / ".fp8.old" / "keep").write_text("k")
    again = export_fp8(tiny_ckpts["wan2.1"], tmp_path / "fp8", overwrite=True, device="cpu")
    assert tree(again) == first and (tmp_path / ".fp8.old" / "keep").read_text() == "k"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".fp8.old", "fp8"]
