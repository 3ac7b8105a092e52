"""VACE checkpoints' rules, checked from the files before any weight loads: the pipeline class and the DiT class
agree, and vace_layers is a list of increasing block indices from 0 within the DiT."""
from __future__ import annotations

import json
import shutil

import pytest

from fastwan.checkpoint.resolver import resolve
from fastwan.errors import CheckpointError


def edited(src, dst, file: str, **changes):
    shutil.copytree(src, dst)
    path = dst / file
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))
    return dst


def test_a_vace_checkpoint_resolves(vace_ckpts):
    ckpt = resolve(str(vace_ckpts["wan2.2-vace-a14b"]))
    assert ckpt.transformer_config.vace_layers == (0, 2) and ckpt.experts == ("transformer", "transformer_2")


def test_pipeline_and_dit_classes_agree(vace_ckpts, tiny_ckpts, tmp_path):
    plain = edited(tiny_ckpts["wan2.1"], tmp_path / "a", "model_index.json", _class_name="WanVACEPipeline")
    with pytest.raises(CheckpointError, match="describes a plain Wan DiT, but model_index.json names VACE pipeline"):
        resolve(str(plain))
    vace = edited(vace_ckpts["wan2.1-vace"], tmp_path / "b", "model_index.json", _class_name="WanPipeline")
    with pytest.raises(CheckpointError, match="describes a VACE Wan DiT, but model_index.json names no VACE"):
        resolve(str(vace))


@pytest.mark.parametrize("layers,words", [([1, 2], "increasing block indices starting at 0"),
                                          ([0, 2, 2], "increasing block indices starting at 0"),
                                          ("0,2", "increasing block indices starting at 0"),
                                          ([0, 3], "names block 3, but the DiT has \"num_layers\": 3")])
def test_vace_layers_rule(vace_ckpts, tmp_path, layers, words):
    path = edited(vace_ckpts["wan2.1-vace"], tmp_path / "c", "transformer/config.json", vace_layers=layers)
    with pytest.raises(CheckpointError) as info:
        resolve(str(path))
    assert words in str(info.value) and "vace_layers" in str(info.value)
