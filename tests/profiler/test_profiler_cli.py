"""`python -m fastwan.profiler` and `fastwan env` as a user runs them: flag values, --model names, the reference every
backend is compared with, and which results count as exact; bad arguments are user errors printed as one line with
exit code 2 before any work, and a JSON report is written whole or not at all. CPU only, tiny problems."""
from __future__ import annotations

import json

import pytest
import torch

from fastwan import cli as fastwan_cli
from fastwan import envinfo
from fastwan.attention.variants import backend_specs
from fastwan.errors import InvalidArgument, OutputPathError
from fastwan.profiler import cli, problem, runner
from fastwan.profiler import cli as profiler_cli

SMALL = ["-n", "2", "-d", "16", "--dtype", "fp32", "--device", "cpu", "--warmup", "0", "--iters", "1"]


def user_error(argv, capsys) -> str:
    """The one-line stderr message of ``argv``, which must stop with exit code 2 and read 'fastwan: error: ...' as
    every fastwan command's errors do."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("fastwan: error: ") and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("argv,needle", [
    (["--bogus"], "unrecognized arguments: --bogus"),  # argparse's own
    (["-i", "2", "4"], "expected 3 arguments"),
    (["-i", "2", "4", "4", "--dtype", "fp7"], "fp7"),
])
def test_usage_errors_read_like_every_fastwan_command(argv, needle, capsys, no_profiling):
    err = user_error([*argv, "--device", "cpu"], capsys)
    assert needle in err and "(see 'python -m fastwan.profiler --help')" in err, err


def test_a_user_error_met_while_profiling_is_one_line(capsys, monkeypatch):
    def fails(*a, **k):
        raise OutputPathError("writing profile.json failed: disk full; nothing at that path was changed.")
    monkeypatch.setattr(cli, "run", fails)
    assert "disk full" in user_error(["-i", "2", "4", "4", *SMALL], capsys)


def test_ctrl_c_is_one_line_and_exit_code_130(capsys, monkeypatch):
    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "run", interrupted)
    assert cli.main(["-i", "2", "4", "4", *SMALL]) == 130
    assert capsys.readouterr().err == "fastwan: interrupted\n"


@pytest.mark.parametrize("argv,needle", [
    (["-i", "2", "4", "4", "-n", "0"], "-n/--heads 0"),
    (["-i", "2", "4", "4", "-d", "0"], "-d/--head-dim 0"),
    (["-i", "2", "4", "4", "-b", "0"], "-b/--batch 0"),
    (["--model", "wan2.1-1.3b", "--height", "0"], "height=0"),
    (["--model", "wan2.1-1.3b", "--width", "0"], "width=0"),
    (["--model", "wan2.1-1.3b", "--num-frames", "0"], "num_frames=0"),
    (["-i", "2", "4", "4", "--seed", "-1"], "--seed -1"),
    (["-i", "2", "4", "4", "--seed", str(2**64)], f"--seed {2**64}"),
    (["-i", "2", "4", "4", "--json", ""], "--json ''"),
    (["-i", "2", "4", "4", "--device", "meta"], "--device meta cannot be timed"),
    (["-i", "2", "4", "4", "--device", "mps"], "--device mps cannot be timed"),
    (["-i", "2", "4", "4", "--device", ""], "not a torch device"),  # '' is a value, not the default device
])
def test_bad_values_are_refused_before_work(argv, needle, capsys, no_profiling):
    # a 0 is a value the user typed, never "use the default"; every refusal comes before planning or timing
    assert needle in user_error(argv if "--device" in argv else [*argv, "--device", "cpu"], capsys)


def read_json(path):
    return json.loads(path.read_text())


def test_model_takes_tiny_names_and_folders_like_generate(tmp_path, tiny_ckpts, capsys):
    out = tmp_path / "p.json"
    # a tiny model name: the DiT's heads and head dim, the grid from Wan2.1's VAE (4x time, 8x space) and patch
    assert cli.main(["--model", "tiny", "--height", "64", "--width", "96", "--num-frames", "9", "--dry-run",
                     "--device", "cpu", "--backend", "TORCH_SDPA", "--json", str(out)]) == 0
    from fastwan.checkpoint.tiny import tiny_checkpoint

    dit = json.loads((tiny_checkpoint("wan2.1") / "transformer" / "config.json").read_text())
    pt, ph, pw = dit["patch_size"]
    grid = [((9 - 1) // 4 + 1) // pt, 64 // (8 * ph), 96 // (8 * pw)]
    heads, head_dim = dit["num_attention_heads"], dit["attention_head_dim"]
    p = read_json(out)["problem"]
    assert (p["grid"], p["heads"], p["head_dim"]) == (grid, heads, head_dim) == ([3, 4, 6], 2, 12)
    tokens = 3 * 4 * 6
    assert p["tokens"] == tokens and p["gflop"] == pytest.approx(4 * heads * tokens**2 * head_dim / 1e9)
    # a Diffusers-format folder (Wan2.2 TI2V: 16x spatial VAE)
    folder = tiny_ckpts["wan2.2-ti2v"]
    assert cli.main(["--model", str(folder), "--height", "128", "--width", "160", "--num-frames", "17", "--dry-run",
                     "--device", "cpu", "--backend", "TORCH_SDPA", "--json", str(out)]) == 0
    dit = json.loads((folder / "transformer" / "config.json").read_text())
    p = read_json(out)["problem"]
    assert p["grid"] == [(17 - 1) // 4 + 1, 128 // (16 * dit["patch_size"][1]), 160 // (16 * dit["patch_size"][2])]
    assert (p["heads"], p["head_dim"]) == (dit["num_attention_heads"], dit["attention_head_dim"])
    # generate's size rules hold: this DiT has 32 pixels per token
    assert "height=48 is not a multiple of 32" in user_error(
        ["--model", str(folder), "--height", "48", "--dry-run", "--device", "cpu"], capsys)


@pytest.mark.parametrize("model,needles", [
    ("nope", ["'nope'", "wan2.1-1.3b", "tiny-wan2.1", "folder"]),
    ("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", ["Hub ids are not downloaded", "pass its folder"]),
])
def test_model_refuses_the_rest_clearly(model, needles, capsys, no_profiling):
    err = user_error(["--model", model, "--dry-run", "--device", "cpu"], capsys)
    for needle in needles:
        assert needle in err, err


def test_model_folder_that_is_no_checkpoint_is_one_line(tmp_path, capsys, no_profiling):
    assert "model_index.json" in user_error(["--model", str(tmp_path), "--dry-run", "--device", "cpu"], capsys)


def test_every_backend_is_compared_with_the_baseline_whatever_the_order(tmp_path):
    # STA whose window covers every tile is dense attention: its error against SDPA must be measured (and tiny)
    # even when --backend lists it before TORCH_SDPA
    out = tmp_path / "p.json"
    config = 'SLIDING_TILE_ATTN={"tile": [2, 2, 2], "window": [3, 5, 7]}'
    assert cli.main(["-i", "3", "5", "7", *SMALL, "--backend", "SLIDING_TILE_ATTN", "--backend", "TORCH_SDPA",
                     "--config", config, "--json", str(out)]) == 0
    data = read_json(out)
    res = {r["label"]: r for r in data["results"]}
    assert [r["label"] for r in data["results"]] == ["SLIDING_TILE_ATTN", "TORCH_SDPA[auto]"]  # the order asked
    assert res["TORCH_SDPA[auto]"]["max_abs_err"] == 0.0
    sta = res["SLIDING_TILE_ATTN"]
    assert sta["error"] is None and sta["max_abs_err"] is not None and sta["max_abs_err"] < 1e-5
    assert sta["speedup"] == pytest.approx(res["TORCH_SDPA[auto]"]["median_ms"] / sta["median_ms"])


def test_sparse_error_is_measured_against_exact_attention(tmp_path):
    # a window smaller than the grid is not dense: the reported error equals a float64 computation's
    from fastwan.attention.synthetic import wan_like_qkv

    out = tmp_path / "p.json"
    config = 'SLIDING_TILE_ATTN={"tile": [1, 2, 2], "window": [1, 1, 1]}'
    assert cli.main(["-i", "2", "4", "4", *SMALL, "--backend", "SLIDING_TILE_ATTN", "--backend", "TORCH_SDPA",
                     "--config", config, "--json", str(out)]) == 0
    res = {r["label"]: r for r in read_json(out)["results"]}
    q, k, v = (x.double() for x in wan_like_qkv((2, 4, 4), 2, 16, dtype=torch.float32, seed=0))
    tiles = torch.arange(2 * 4 * 4).reshape(2, 4, 4)
    t, h, w = (tiles // 16, (tiles // 4) % 4 // 2, tiles % 4 // 2)
    tile_id = (t * 4 + h * 2 + w).flatten()  # each token's (1, 2, 2) tile; window 1 tile: its own tile only
    mask = tile_id[:, None] == tile_id[None, :]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / 16**0.5
    sparse = torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), v)
    dense = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
    expected = float((sparse - dense).abs().max())
    assert expected > 1e-2 and res["SLIDING_TILE_ATTN"]["max_abs_err"] == pytest.approx(expected, rel=1e-3)


def test_nvfp4_from_the_environment_is_not_exact(monkeypatch):
    # FASTVIDEO_NVFP4_FA4=1 turns the plain FLASH_ATTN row into NVFP4 attention: never the "fastest exact"
    prob = problem.Problem(1, 2, 16, (2, 4, 4), torch.bfloat16, torch.device("cpu"))
    (plain,), _ = runner.plan(prob, backend_specs(["FLASH_ATTN"]))
    assert not plain.approximate
    monkeypatch.setenv("FASTVIDEO_NVFP4_FA4", "1")
    (nvfp4,), _ = runner.plan(prob, backend_specs(["FLASH_ATTN"]))
    assert nvfp4.approximate and not nvfp4.error


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
