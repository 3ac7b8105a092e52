"""Environment variables (fastwan/envs.py), `fastwan env` and the profiler's command line: bad values and bad
arguments are user errors that name what was set, raised before any work, printed as one line with exit code 2."""
from __future__ import annotations

import json

import pytest
import torch

from fastwan import cli as fastwan_cli
from fastwan import envinfo, envs
from fastwan.attention.registry import BackendUnavailableError
from fastwan.errors import InvalidArgument, one_line
from fastwan.profiler import cli as profiler_cli

# ---- envs.py -------------------------------------------------------------------------------------------------


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


# ---- fastwan env ---------------------------------------------------------------------------------------------


def _one_line_exit_2(capsys, run, *needles):
    code = run()
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "usage:" not in err and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err


def _exit_code(fn):
    def run():
        try:
            return fn()
        except SystemExit as e:
            return e.code
    return run


@pytest.mark.parametrize("argv,needle", [
    (["--head-dim", "0"], "--head-dim 0"),
    (["--head-dim", "-5"], "--head-dim -5"),
    (["--dtype", "int4"], "'int4'"),
    (["--no-such-flag"], "--no-such-flag"),
    (["--device", "bogus"], "'bogus'"),
])
def test_env_command_user_errors_are_one_line(argv, needle, capsys):
    _one_line_exit_2(capsys, _exit_code(lambda: fastwan_cli.main(["env", *argv])), needle)


def test_env_command_reports_bad_variables_and_the_requested_backend(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("FASTVIDEO_ATTENTION_BACKEND", "FLASH_ATTN")
    monkeypatch.setenv("FASTVIDEO_CFG_GATE_STEP", "1.5")
    assert envinfo.main(["--json", "--device", "cpu"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert len(info["env_problems"]) == 1 and "FASTVIDEO_CFG_GATE_STEP='1.5'" in info["env_problems"][0]
    assert "FLASH_ATTN" in info["requested_backend"] and "'cpu' is not supported" in info["requested_backend"]
    monkeypatch.setenv("FASTVIDEO_ATTENTION_BACKEND", "torch_sdpa")
    monkeypatch.delenv("FASTVIDEO_CFG_GATE_STEP")
    assert envinfo.main(["--json", "--device", "cpu"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["env_problems"] == [] and info["requested_backend"].startswith("TORCH_SDPA (")


def test_parse_device_rejects_a_cuda_index_this_machine_lacks(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert envinfo.parse_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(InvalidArgument, match=r"'cuda:2' .*has 2, cuda:0 to cuda:1"):
        envinfo.parse_device("cuda:2")
    with pytest.raises(InvalidArgument, match="'gpu0' .*not a torch device"):
        envinfo.parse_device("gpu0")


# ---- profiler command line -----------------------------------------------------------------------------------

GRID = ["-i", "2", "4", "4", "-n", "2", "-d", "16", "--dtype", "fp32", "--warmup", "0", "--iters", "1"]


@pytest.mark.parametrize("extra,needle", [
    (["--device", "bogus"], "'bogus'"),
    (["--device", "cuda"], "CUDA is not available"),
    (["--step-index", "-1"], "--step-index -1"),
    (["--step-index", "50", "--num-steps", "50"], "--step-index 50"),
    (["--num-steps", "0", "--step-index", "0"], "--num-steps 0"),
    (["--backend", "TORCH_SDPA", "--config", 'SLIDING_TILE_ATTN={"window": [5, 3, 3]}'], "not profiled"),
    (["--backend", "SLIDING_TILE_ATTN", "--config", 'SLIDING_TILE_ATTN={"windw": [5, 3, 3]}'], "'windw'"),
    (["--backend", "TORCH_SDPA", "--config", 'TORCH_SDPA={"kernel": "math"}'], "fixes kernel='auto'"),
    (["--optimize", "--backend", "FLASH_ATTN", "--config", 'FLASH_ATTN={"version": 3}'], "FLASH_ATTN[FA4]"),
])
def test_profiler_argument_errors_are_one_line_before_work(extra, needle, capsys, monkeypatch, no_profiling):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _one_line_exit_2(capsys, _exit_code(lambda: profiler_cli.main([*GRID, *extra])), needle)


def test_profiler_json_path_is_checked_before_work(tmp_path, capsys, no_profiling):
    missing = tmp_path / "no-such-folder" / "p.json"
    _one_line_exit_2(capsys, _exit_code(lambda: profiler_cli.main([*GRID, "--json", str(missing)])),
                     "does not exist")
    _one_line_exit_2(capsys, _exit_code(lambda: profiler_cli.main([*GRID, "--json", str(tmp_path)])), "is a folder")


def test_profiler_json_report_is_written_whole_or_not_at_all(tmp_path, monkeypatch, capsys):
    path = tmp_path / "p.json"
    path.write_text('{"previous": "report"}')

    class Unprintable:
        def __str__(self):
            raise RuntimeError("cannot be written")

    monkeypatch.setattr(profiler_cli, "report", lambda *a, **k: {"mode": "dry-run", "x": Unprintable()})
    with pytest.raises(RuntimeError, match="cannot be written"):
        profiler_cli.main([*GRID, "--backend", "TORCH_SDPA", "--dry-run", "--json", str(path)])
    assert path.read_text() == '{"previous": "report"}'  # the old report is intact
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]  # and no temporary file is left
    monkeypatch.undo()
    assert profiler_cli.main([*GRID, "--backend", "TORCH_SDPA", "--dry-run", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["mode"] == "dry-run" and [r["label"] for r in data["results"]] == ["TORCH_SDPA[auto]"]


def test_one_line_drops_bullets_but_keeps_flags_and_negative_numbers():
    exc = InvalidArgument("cannot run:\n  - --step-index -1 is negative\n  - -0.5 is below 0\n--sp 3 needs 3 GPUs")
    assert one_line(exc) == "cannot run: --step-index -1 is negative; -0.5 is below 0; --sp 3 needs 3 GPUs"
