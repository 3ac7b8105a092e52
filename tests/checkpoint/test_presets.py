"""Presets follow what a checkpoint is, not what it is called: a tiny checkpoint keeps its tiny preset when it is
copied under a published model's name, laid out as a Hub-cache snapshot of a published id, or quantized with
``fastwan quantize`` (the run that made an 832x480, 81-frame, 50-step video of a tiny model)."""
from __future__ import annotations

import shutil

import pytest

from fastwan.checkpoint.presets import (
    PRESETS,
    PUBLISHED_MIN_WIDTH,
    TINY_PRESETS,
    checkpoint_preset,
)
from fastwan.checkpoint.resolver import resolve
from fastwan.checkpoint.tiny import write_hub_cache, write_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("presets") / "tiny", "wan2.1")


def test_copy_under_a_published_name_keeps_the_tiny_preset(tiny, tmp_path):
    copy = tmp_path / "Wan2.1-T2V-1.3B-Diffusers"
    shutil.copytree(tiny, copy)
    assert resolve(copy).preset == resolve(tiny).preset == TINY_PRESETS["wan2.1"]


def test_hub_snapshot_of_a_published_id_keeps_the_tiny_preset(tiny, tmp_path):
    snapshot = write_hub_cache(tiny, tmp_path / "hub", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers")
    assert resolve(snapshot).preset == TINY_PRESETS["wan2.1"]


def test_quantized_copy_keeps_the_preset_of_its_source(tiny, tmp_path):
    """`fastwan quantize --model <tiny> --output q`, then `fastwan generate --model q` without sizes."""
    from fastwan.cli import main

    out = tmp_path / "q"
    assert main(["quantize", "--model", str(tiny), "--output", str(out), "--device", "cpu"]) == 0
    ckpt = resolve(out)
    assert ckpt.preset == resolve(tiny).preset == TINY_PRESETS["wan2.1"]
    assert ckpt.preset != PRESETS["wan2.1"]


@pytest.mark.parametrize("variant", sorted(TINY_PRESETS))
def test_rule_by_width(variant):
    """Below the narrowest published DiT: the kind's tiny preset; from it up: the kind's published one."""
    label = "any-name"
    assert checkpoint_preset(variant, PUBLISHED_MIN_WIDTH - 1, label, False) == TINY_PRESETS[variant]
    assert checkpoint_preset(variant, PUBLISHED_MIN_WIDTH, label, False) == PRESETS[variant]
    assert checkpoint_preset(variant, 5120, "wan-ai/" + variant + "-tiny", False) == PRESETS[variant]


def test_720p_name_picks_the_720p_area_at_published_width_only():
    assert checkpoint_preset("wan2.1-i2v", 5120, "wan2.1-i2v-14b-720p-diffusers", False) == PRESETS["wan2.1-i2v-720p"]
    assert checkpoint_preset("wan2.1-i2v", 24, "wan2.1-i2v-14b-720p-diffusers", False) == TINY_PRESETS["wan2.1-i2v"]
