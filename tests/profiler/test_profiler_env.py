"""`fastwan env` and the attention profiler, on CPU with tiny problems."""
from __future__ import annotations

import json

import pytest
import torch

from fastwan import envinfo, envs
from fastwan.attention import registry
from fastwan.attention.base import AttentionBackend, AttentionMetadata, Capabilities
from fastwan.attention.synthetic import reference_attention
from fastwan.attention.variants import backend_specs
from fastwan.profiler import cli, problem, runner

# ---- fastwan env --------------------------------------------------------------------------------------------


def test_env_table(capsys):
    assert envinfo.main([]) == 0
    out = capsys.readouterr().out
    for text in ("Device", "torch", "TORCH_SDPA[auto]", "FLASH_ATTN[FA4]", "SAGE_ATTN", "why not", "Automatic choice"):
        assert text in out, text


def test_env_json(capsys, monkeypatch):
    for name in envs.KNOWN_VARIABLES:  # the report lists every one that is set (the suite sets its cache folders)
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FASTWAN_SDPA_KERNEL", "math")
    assert envinfo.main(["--json", "--device", "cpu", "--dtype", "fp32", "--head-dim", "64"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["software"]["torch"] == torch.__version__
    assert info["problem"] == {"device": "cpu", "dtype": "float32", "head_dim": 64}
    assert info["env"] == {"FASTWAN_SDPA_KERNEL": "math"}
    rows = {r["backend"]: r for r in info["backends"]}
    assert rows["TORCH_SDPA[auto]"]["available"] and rows["TORCH_SDPA[math]"]["available"]
    assert not rows["TORCH_SDPA[cudnn]"]["available"] and rows["TORCH_SDPA[cudnn]"]["reasons"]
    assert not rows["FLASH_ATTN"]["available"] and any("cpu" in r for r in rows["FLASH_ATTN"]["reasons"])
    assert not rows["SAGE_ATTN"]["available"]
    assert set(registry.BACKENDS) <= {r["name"] for r in info["backends"]}
    assert info["auto_backend"].startswith("TORCH_SDPA")


def test_env_rejects_bad_dtype():
    with pytest.raises(SystemExit):
        envinfo.main(["--dtype", "int4"])


# ---- profiler: problem definition ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "model,size,grid",
    [
        ("wan2.1-1.3b", (480, 832, 81), (21, 30, 52)),
        ("wan2.1-14b", (720, 1280, 81), (21, 45, 80)),
        ("wan2.2-a14b", (720, 1280, 81), (21, 45, 80)),
        ("wan2.2-ti2v-5b", (704, 1280, 121), (31, 22, 40)),
    ],
)
def test_model_grid(model, size, grid):
    assert problem.model_grid(model, *size) == grid


def test_model_presets_and_token_counts():
    models = problem.MODELS
    assert models["wan2.1-1.3b"].heads == 12 and models["wan2.2-ti2v-5b"].heads == 24
    assert models["wan2.1-14b"].heads == models["wan2.2-a14b"].heads == 40
    assert all(m.head_dim == 128 for m in models.values())
    assert models["wan2.2-ti2v-5b"].pixels_per_token == 32 and models["wan2.1-14b"].pixels_per_token == 16
    p = cli.problem_from_args(cli.build_parser().parse_args(["--model", "wan2.1-1.3b", "--device", "cpu"]))
    assert (p.tokens, p.heads, p.head_dim) == (32760, 12, 128)
    assert p.flops == 4 * 12 * 32760**2 * 128


def test_model_grid_errors():
    with pytest.raises(ValueError, match="wan2.1-1.3b: height=481 is not a multiple of 16.*use 480 or 496"):
        problem.model_grid("wan2.1-1.3b", 481, 832, 81)
    with pytest.raises(ValueError, match="multiple of 32"):
        problem.model_grid("wan2.2-ti2v-5b", 720, 1280, 121)
    with pytest.raises(ValueError, match="4k\\+1"):
        problem.model_grid("wan2.1-14b", 720, 1280, 80)


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["-i", "2", "4", "4", "--backend", "BOGUS"], "valid names"),
        (["-i", "2", "4", "4", "--height", "480"], "need --model"),
        ([], "token grid"),
        (["-i", "2", "0", "4"], "grid must be positive"),
    ],
)
def test_profiler_argument_errors(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err


# ---- profiler: dry run and timing ----------------------------------------------------------------------------


def test_profiler_dry_run(tmp_path, capsys):
    path = tmp_path / "plan.json"
    argv = ["-i", "2", "4", "4", "-n", "2", "-d", "64", "--dry-run", "--device", "cpu", "--json", str(path)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "TORCH_SDPA[auto]" in out and "why not" in out
    data = json.loads(path.read_text())
    assert data["mode"] == "dry-run" and data["problem"]["tokens"] == 32
    res = {r["label"]: r for r in data["results"]}
    assert res["TORCH_SDPA[auto]"]["runnable"] and res["TORCH_SDPA[auto]"]["median_ms"] is None
    assert not res["FLASH_ATTN"]["runnable"] and res["FLASH_ATTN"]["reasons"]
    for sparse in ("SLIDING_TILE_ATTN", "VIDEO_SPARSE_ATTN", "NEIGHBORHOOD_ATTN"):
        assert sparse in res  # listed whether or not their modules exist yet
        assert res[sparse]["runnable"] or res[sparse]["reasons"]


def test_profiler_optimize_on_cpu(tmp_path, capsys):
    path = tmp_path / "opt.json"
    argv = ["-i", "2", "4", "4", "-n", "2", "-d", "32", "--dtype", "fp32", "--device", "cpu", "--optimize",
            "--backend", "TORCH_SDPA", "--backend", "FLASH_ATTN", "--warmup", "0", "--iters", "2", "--json", str(path)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "fastest" in out and "TFLOP/s" in out
    data = json.loads(path.read_text())
    res = {r["label"]: r for r in data["results"]}
    assert set(res) == {"TORCH_SDPA[auto]", "TORCH_SDPA[flash]", "TORCH_SDPA[cudnn]", "TORCH_SDPA[efficient]",
                        "TORCH_SDPA[math]", "FLASH_ATTN", "FLASH_ATTN[FA4]", "FLASH_ATTN[FA3]", "FLASH_ATTN[FA2]",
                        "FLASH_ATTN[FA4-NVFP4]"}
    for label in ("TORCH_SDPA[auto]", "TORCH_SDPA[flash]", "TORCH_SDPA[math]"):
        r = res[label]
        assert r["median_ms"] > 0 and len(r["times_ms"]) == 2 and r["error"] is None
        assert r["tflops"] == pytest.approx(data["problem"]["gflop"] / r["median_ms"], rel=1e-6)  # GFLOP / ms = TFLOP/s
        assert r["max_abs_err"] < 1e-5  # fp32 kernels agree with the baseline
    assert res["TORCH_SDPA[auto]"]["speedup"] == 1.0
    assert res["TORCH_SDPA[cudnn]"]["median_ms"] is None and res["TORCH_SDPA[cudnn]"]["reasons"]
    assert data["fastest"] in ("TORCH_SDPA[auto]", "TORCH_SDPA[flash]", "TORCH_SDPA[math]")
    assert data["fastest_exact"] == data["fastest"]


# ---- profiler: the sparse-backend contract -------------------------------------------------------------------


class ReversedLayout:
    """Reverses token order and pads to a multiple of 8: stands in for a tile layout."""

    def __init__(self, tokens: int):
        self.tokens = tokens
        self.padded_tokens = -(-tokens // 8) * 8

    def permute(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        x = x.flip(dim)
        pad = [0, 0] * (x.dim() - dim - 1) + [0, self.padded_tokens - self.tokens]
        return torch.nn.functional.pad(x, pad)


class FakeSparse(AttentionBackend):
    name = "FAKE_SPARSE"
    sparse = True
    capabilities = Capabilities(dtypes=(torch.float32,))
    seen: list = []

    def layout(self, grid, device):
        t, h, w = grid
        return ReversedLayout(t * h * w)

    def forward(self, q, k, v, *, scale=None, meta: AttentionMetadata | None = None):
        assert isinstance(meta.layout, ReversedLayout) and q.shape[1] == meta.layout.padded_tokens
        FakeSparse.seen.append((meta.grid, meta.step_index, meta.layer_index))
        n = meta.layout.tokens  # "sparse" = attend over the real tokens only
        out = reference_attention(q[:, :n], k[:, :n], v[:, :n], scale).float()
        return torch.nn.functional.pad(out, (0, 0, 0, 0, 0, q.shape[1] - n))


class BrokenSparse(FakeSparse):
    name = "BROKEN_SPARSE"

    def layout(self, grid, device):
        raise ValueError(f"grid {grid} is not a multiple of the tile")


class FailingSparse(FakeSparse):
    name = "FAILING_SPARSE"

    def forward(self, q, k, v, *, scale=None, meta=None):
        raise RuntimeError("kernel launch failed\nsecond line")


def test_profiler_times_sparse_backends_through_their_layout(monkeypatch):
    for name in ("FAKE_SPARSE", "BROKEN_SPARSE", "FAILING_SPARSE"):
        cls = {"FAKE_SPARSE": "FakeSparse", "BROKEN_SPARSE": "BrokenSparse", "FAILING_SPARSE": "FailingSparse"}[name]
        monkeypatch.setitem(registry.BACKENDS, name, f"{__name__}:{cls}")
    FakeSparse.seen.clear()
    prob = problem.Problem(1, 2, 16, (2, 3, 3), torch.float32, torch.device("cpu"))
    specs = backend_specs(["FAILING_SPARSE", "FAKE_SPARSE", "BROKEN_SPARSE", "FLASH_ATTN"])
    results = {r.label: r for r in runner.run(prob, specs, warmup=1, iters=2, step_index=7)}
    fake = results["FAKE_SPARSE"]
    assert fake.sparse and fake.approximate and fake.error is None and fake.median_ms > 0
    assert fake.tflops == pytest.approx(4 * 2 * 18**2 * 16 / (fake.median_ms * 1e-3) / 1e12)  # unpadded S=18
    assert fake.max_abs_err is None  # its layout has no unpermute: output not compared with dense attention
    assert FakeSparse.seen and FakeSparse.seen[0] == ((2, 3, 3), 7, 0)
    broken = results["BROKEN_SPARSE"]
    assert not broken.runnable and broken.median_ms is None  # its layout refuses the grid: a reason
    assert "layout for grid (2, 3, 3): ValueError: grid (2, 3, 3) is not a multiple of the tile" in broken.reasons[0]
    failing = results["FAILING_SPARSE"]  # fails at run time: reported, and the others still ran
    assert failing.runnable and failing.median_ms is None and failing.error == "RuntimeError: kernel launch failed"
    assert results["TORCH_SDPA[auto]"].median_ms  # baseline added automatically
    assert not results["FLASH_ATTN"].runnable
    assert runner.fastest(list(results.values()), exact_only=True).label == "TORCH_SDPA[auto]"


def test_time_fn_counts_calls():
    calls = []
    times = runner.time_fn(lambda: calls.append(1), warmup=2, iters=5, device=torch.device("cpu"))
    assert len(times) == 5 and len(calls) == 7 and all(t >= 0 for t in times)


def test_span_time_counts_calls():
    import time

    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.002)

    ms = runner.span_time(fn, calls=4, device=torch.device("cpu"))
    assert len(calls) == 5 and 2.0 <= ms < 50  # one warm-up call, then 4 timed; ms per call


def test_profiler_backend_config(tmp_path):
    """--config NAME=JSON reaches the backend (the window shows in the JSON result); bad names are refused."""
    import json

    from fastwan.profiler import main as prof_main

    out = tmp_path / "p.json"
    rc = prof_main(["-i", "3", "5", "7", "-n", "2", "-d", "16", "--dtype", "fp32", "--backend", "SLIDING_TILE_ATTN",
                    "--config", 'SLIDING_TILE_ATTN={"tile": [2, 2, 2], "window": [1, 3, 3]}', "--json", str(out)])
    assert rc == 0
    rows = [r for r in json.loads(out.read_text())["results"] if r["backend"] == "SLIDING_TILE_ATTN"]
    assert rows and rows[0]["config"]["window"] == [1, 3, 3] and rows[0]["runnable"]
    with pytest.raises(SystemExit):
        prof_main(["-i", "3", "5", "7", "--config", "NOPE={}"])
