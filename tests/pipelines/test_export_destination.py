"""The folders and files ``export_fp8`` / ``fastwan quantize`` and the tiny checkpoint cache write get 0o777 / 0o666
less the umask."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from fastwan.pipelines.export import export_fp8


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

    from fastwan.models.loading import write_atomically
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
    from fastwan.tiny import tiny_checkpoint

    monkeypatch.setenv("FASTWAN_CACHE", str(tmp_path / "cache"))
    root = tiny_checkpoint("wan2.1")
    folders = [root, *(p for p in root.rglob("*") if p.is_dir())]
    files = [p for p in root.rglob("*") if p.is_file()]
    assert files and all(mode(f) == 0o666 & ~umask for f in files), {str(f): oct(mode(f)) for f in files}
    assert all(mode(d) == 0o777 & ~umask for d in folders), {str(d): oct(mode(d)) for d in folders}
