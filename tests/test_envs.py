"""Environment variables (fastwan/envs.py): bad values are user errors that name what was set (the variable and its
spelling), raised before any work; two spellings of one setting must agree."""
from __future__ import annotations

import pytest
import torch

from fastwan import envs
from fastwan.attention.registry import BackendUnavailableError
from fastwan.errors import InvalidArgument


@pytest.mark.parametrize("value", ["2", "abc", "-0.5", "nan"])
def test_cfg_gate_step_error_names_the_variable_that_was_set(value):
    with pytest.raises(InvalidArgument) as e:
        envs.cfg_gate_step({"FASTWAN_CFG_GATE_STEP": value})
    assert f"FASTWAN_CFG_GATE_STEP={value!r}" in str(e.value)
    assert "FASTVIDEO_CFG_GATE_STEP" not in str(e.value)  # the user did not set that one


@pytest.mark.parametrize("parse,a,b", [
    (envs.cfg_gate_step, ("FASTVIDEO_CFG_GATE_STEP", "0.8"), ("FASTWAN_CFG_GATE_STEP", "0.3")),
    (envs.nvfp4_fa4, ("FASTVIDEO_NVFP4_FA4", "0"), ("FASTWAN_NVFP4_FA4", "1")),
    (envs.attention_config, ("FASTVIDEO_ATTENTION_CONFIG", "a.json"), ("FASTWAN_ATTENTION_CONFIG", "b.json")),
])
def test_two_spellings_that_disagree_raise(parse, a, b):
    with pytest.raises(InvalidArgument, match="disagree") as e:
        parse(dict([a, b]))
    assert a[0] in str(e.value) and b[0] in str(e.value)


@pytest.mark.parametrize("parse,env,expected", [
    (envs.cfg_gate_step, {"FASTVIDEO_CFG_GATE_STEP": "0.5", "FASTWAN_CFG_GATE_STEP": ".5"}, 0.5),
    (envs.cfg_gate_step, {"FASTWAN_CFG_GATE_STEP": " 0.25 "}, 0.25),
    (envs.nvfp4_fa4, {"FASTVIDEO_NVFP4_FA4": "1", "FASTWAN_NVFP4_FA4": "true"}, True),
    (envs.nvfp4_fa4, {"FASTWAN_NVFP4_FA4": "off"}, False),
    (envs.nvfp4_fa4, {"FASTVIDEO_NVFP4_FA4": "", "FASTWAN_NVFP4_FA4": "yes"}, True),  # empty = unset
    (envs.attention_config, {"FASTVIDEO_ATTENTION_CONFIG": "c.json"}, "c.json"),
])
def test_two_spellings_that_agree_or_one_alone_are_read(parse, env, expected):
    assert parse(env) == expected


def test_backend_variable_names_where_the_value_came_from():
    assert envs.attention_backend_variable({"FASTWAN_ATTENTION_BACKEND": "torch_sdpa"}) == "FASTWAN_ATTENTION_BACKEND"
    assert envs.attention_backend_variable({"FASTVIDEO_ATTENTION_BACKEND": "x"}) == "FASTVIDEO_ATTENTION_BACKEND"
    assert envs.attention_backend_variable({}) is None


def test_problems_lists_every_variable_that_does_not_parse():
    env = {"FASTWAN_SDPA_KERNEL": "bogus", "FASTVIDEO_CFG_GATE_STEP": "3", "FASTWAN_FLASH_ATTN_VERSION": "4",
           "WORLD_SIZE": "two"}
    found = envs.problems(env)
    assert len(found) == 3
    assert any("FASTWAN_SDPA_KERNEL='bogus'" in p for p in found)
    assert any("FASTVIDEO_CFG_GATE_STEP='3'" in p for p in found)
    assert any("WORLD_SIZE='two'" in p for p in found)
    assert envs.problems({"FASTWAN_SDPA_KERNEL": "math", "FASTWAN_NVFP4_FA4": "0"}) == []


def test_env_backend_that_cannot_run_here_raises_before_weights_load(tmp_path, monkeypatch):
    import fastwan.pipelines.generator as generator
    from fastwan.checkpoint.tiny import write_tiny_checkpoint

    ckpt = write_tiny_checkpoint(tmp_path / "wan2.1", "wan2.1", seed=0)

    def loaded(*a, **k):
        raise AssertionError("weights loaded before the attention backend was checked")

    monkeypatch.setattr(generator, "load_transformer", loaded)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("FASTVIDEO_ATTENTION_BACKEND", "flash_attn")
    with pytest.raises(BackendUnavailableError) as e:
        generator.VideoGenerator.from_pretrained(ckpt, device="cpu", dtype=torch.float32)
    msg = str(e.value)
    assert "FLASH_ATTN" in msg and "FASTVIDEO_ATTENTION_BACKEND" in msg and "'cpu' is not supported" in msg
