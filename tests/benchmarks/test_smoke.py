"""Every benchmark that benchmarks/RESULTS.md cites runs here, so that none breaks silently: at its ``--smoke``
size on the CPU (tiny random checkpoints written under the test's own folder, one warm-up and one timed run, no
peer that needs a GPU), or, where only a GPU can run it, with ``--dry-run`` (its arguments checked and its jobs
built and listed, nothing run), with the arguments RESULTS.md records. The last tests keep the lists below and
RESULTS.md from drifting apart."""
import importlib
import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"

# script, or "script[case]" for another run of one script -> (arguments beyond --smoke, with {ckpt}: a tiny
# text-to-video checkpoint and {dir}: the test's folder; the results file it writes, None for a probe that
# only prints; a line of the table it prints)
SMOKE = {
    "cache_bench": (["--ckpt", "{ckpt}", "--out", "{dir}/cache.json"], "cache.json", "| residual-half |"),
    "distilled": (["--ckpt13", "{ckpt}", "--ckpt14", "{ckpt}", "--fastwan13", "{dir}/fastwan", "--fastwan14",
                   "{dir}/fastwan", "--lora", "{dir}/lora.safetensors", "--taehv", "{dir}/taehv/taew2_1.safetensors",
                   "--out", "{dir}/distilled.json"], "distilled.json", "| fastwan13b_tiny | 32x32x5 |"),
    "e2e": (["--ckpt", "{dir}/made", "--out", "{dir}/e2e.json"], "e2e.json", "| fastwan_e2e[TORCH_SDPA,auto] |"),
    "forward_14b": (["--task", "i2v", "--out", "{dir}/forward.json"], "forward.json", "auto/fp8: TORCH_SDPA"),
    "forward_14b[vace]": (["--task", "vace", "--out", "{dir}/forward_vace.json"], "forward_vace.json",
                          "x eager, rel err"),
    "forward_14b[animate]": (["--task", "animate", "--out", "{dir}/forward_animate.json"], "forward_animate.json",
                             "x eager, rel err"),
    "i2v": (["--ckpt", "{dir}/i2v", "--out", "{dir}/i2v.json"], "i2v.json", "| i2v-14b:fastwan[auto,2 steps] |"),
    "editing_e2e[vace]": (["--job", "vace-1.3b", "--ckpt", "{dir}/vace", "--out", "{dir}/editing_vace.json"],
                          "editing_vace.json", "| vace-1.3b:fastwan[auto,2 steps] |"),
    "editing_e2e[animate]": (["--job", "animate-14b", "--ckpt", "{dir}/animate", "--out",
                              "{dir}/editing_animate.json"], "editing_animate.json",
                             "| animate-14b:fastwan[auto,2 steps] |"),
    "budget_bench": (["--ckpt", "{ckpt}", "--out", "{dir}/budget.jsonl"], "budget.jsonl", "4-step e2e"),
    "parallel_bench": (["--ckpt", "{ckpt}", "--out", "{dir}/parallel.json"], "parallel.json", "| chords2 | 2 |"),
    "fp8_bench": (["--ckpt", "{ckpt}", "--out", "{dir}/fp8.json"], "fp8.json", "e2e: bf16"),
    "vae_bench": (["--ckpt", "{ckpt}", "--taehv-dir", "{dir}/taehv", "--out", "{dir}/vae.json"], "vae.json",
                  "bf16+tiny"),
    "vae_bench[wan2.2]": (["--smoke-task", "ti2v", "--ckpt", "{dir}/ti2v", "--taehv-dir", "{dir}/taehv", "--variants",
                           "fp32,bf16+tiny,fp32+tiny+channels-last+cudnn-bench+chunk1,bf16+tiny+nchw+frames",
                           "--out", "{dir}/vae_wan22.json"], "vae_wan22.json", "bf16+tiny+nchw+frames"),
    "serve_bench": (["--ckpt", "{ckpt}", "--out", "{dir}/serve.json"], "serve.json", "| fastwan serve (cpu) |"),
    "ring_bench": (["--out", "{dir}/ring.json"], "ring.json", "| tiny-ring4 | ring | "),
    "attn8_bench": (["--out", "{dir}/attn8.json"], "attn8.json", "| tiny | v1-torchquant | "),
    "probes/tiny_decode": ([], None, "| TinyDecoder.frames (the generator's decode) |"),
    "stream_bench": (["--plain", "{dir}/stream-plain", "--ckpt", "{dir}/stream-causal", "--out", "{dir}/stream.json"],
                     "stream.json", "| eager+window | 32x32 |"),
}
# GPU-only script -> the argument lists RESULTS.md and HISTORY.md record for it, checked with --dry-run
PLAN = {
    "attention_bench": [["--out", "attention_bench.json"]],
    "cross_bench": [["--quick", "--prompt-tokens", "20,150"], ["--fold", "--prompt-tokens", "7,20,40,63,100"]],
    "fa4_tiles": [["--configs", "0,6", "--calls", "10"],
                  ["--shapes", "1.3B-480p-B1,14B-720p-B1", "--configs", "0,11,12,13,14", "--rounds", "3", "--calls",
                   "20"]],
    "sparse_bench": [["--variants", "sta-auto85-fa4,vsa-auto-fa4,gna-auto85-fa4", "--rounds", "3", "--graph",
                      "--kernel-time"]],
    "vsa_fastvideo": [["--shapes", "1.3b-480p,14b-720p", "--cases", "fastvideo,fastwan auto,fastwan own,dense FA4",
                       "--budget-s", "200", "--out", "vsa.json"]],
    "l2_probe": [[]],
    "ab_trees": [["--job", "e2e", "--tree", "old=../old", "--tree", "new=.", "--rounds", "2", "--ckpt", "/tmp/wan13b"],
                 ["--job", "forward14b", "--tree", "old=../old", "--tree", "new=.", "--rounds", "1", "--sequential",
                  "--", "--iters", "3", "--prompt-tokens", "100"]],
}
SUITES = ("14b", "a14b", "a14b-short", "vsa")  # benchmarks/budget_suite.sh, checked with --dry-run
SCRIPTS = {**dict.fromkeys(name.partition("[")[0] for name in SMOKE), **dict.fromkeys(PLAN), "budget_suite": None}
HELPERS = ("__init__", "harness", "checkpoints", "sparse_configs", "ab_worker",
           "editing_inputs")  # imported or run by the scripts
DOCUMENTS = ("RESULTS", "HISTORY", "probes")  # names after "benchmarks/" that are no script


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The test's folder, with a tiny text-to-video checkpoint the smoke runs share (each run that makes its own
    checkpoint makes it elsewhere in the folder)."""
    from benchmarks.checkpoints import tiny_checkpoint

    root = tmp_path_factory.mktemp("smoke")
    tiny_checkpoint(root / "wan2.1")
    return root


@pytest.mark.parametrize("name", list(SMOKE))
def test_smoke(name, folder, capsys):
    args, results, line = SMOKE[name]
    argv = [a.format(ckpt=folder / "wan2.1", dir=folder) for a in args]
    module = importlib.import_module(f"benchmarks.{name.partition('[')[0].replace('/', '.')}")
    assert module.main(["--smoke", *argv]) == 0
    assert line in capsys.readouterr().out
    if results is None:  # a probe: its table only
        return
    text = (folder / results).read_text()
    data = [json.loads(x) for x in text.splitlines()] if results.endswith(".jsonl") else json.loads(text)
    assert data


def plan_lines(out: str) -> list[str]:
    """The jobs --dry-run listed, after checking its header's count."""
    head, *jobs = out.strip().splitlines()
    count = int(re.search(r"--dry-run: (\d+) job\(s\), nothing run", head).group(1))
    assert count == len(jobs) > 0 and all(j.startswith("  ") for j in jobs)
    return jobs


@pytest.mark.parametrize("name,argv", [(n, a) for n, cases in PLAN.items() for a in cases])
def test_plan(name, argv, capsys):
    module = importlib.import_module(f"benchmarks.{name}")
    cut = argv.index("--") if "--" in argv else len(argv)
    assert module.main([*argv[:cut], "--dry-run", *argv[cut:]]) == 0
    plan_lines(capsys.readouterr().out)


@pytest.mark.parametrize("suite", SUITES)
def test_budget_suite_jobs_parse(suite, tmp_path):
    """Each job of a suite is a budget_bench command that budget_bench takes."""
    from benchmarks import budget_bench

    out = subprocess.run(["bash", str(BENCHMARKS / "budget_suite.sh"), "--dry-run", suite, str(tmp_path)],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    jobs = out.strip().splitlines()
    assert jobs and not list(tmp_path.iterdir())  # listed, nothing run or written
    for job in jobs:
        words = shlex.split(job)
        assert words[:3] == ["python", "-m", "benchmarks.budget_bench"]
        budget_bench.build_parser().parse_args(words[3:])


def test_budget_suite_refuses_an_unknown_suite(tmp_path):
    run = subprocess.run(["bash", str(BENCHMARKS / "budget_suite.sh"), "--dry-run", "15b", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "unknown suite '15b'" in run.stderr


@pytest.mark.parametrize("argv,msg", [
    (["e2e", "--phase", "diffusers_tuned"], "--phase diffusers_tuned: only a GPU runs this"),
    (["forward_14b", "--profile"], "--profile: only a GPU runs this"),
    (["i2v", "--phase", "make,diffusers_tuned"], "--phase diffusers_tuned: only a GPU runs this"),
    (["editing_e2e", "--job", "animate-14b", "--phase", "make,diffusers_tuned"],
     "--phase diffusers_tuned: only a GPU runs this"),
    (["budget_bench", "--budget", "8GiB"], "--budget: only a GPU runs this"),
    (["vae_bench", "--profile"], "--profile: only a GPU runs this"),
    (["vae_bench", "--variants", "bf16+tiny+fast-convs"], "+fast-convs changes the full VAE, not the tiny decoder"),
    (["vae_bench", "--variants", "bf16+frames"], "+frames applies to the tiny decoder only"),
    (["stream_bench", "--phase", "launch"], "--phase launch: only a GPU runs this"),
    (["cache_bench", "--variants", "magcache@0.12"], "list magcache-calibrate before it"),
    (["cache_bench", "--steps", "1"], "--steps 1: must be at least 2"),
    (["cache_bench", "--variants", "teacache@0.08"], "cannot skip any step of a request of 4 step(s)"),
])
def test_smoke_refuses_what_needs_a_gpu_before_any_work(argv, msg, tmp_path, capsys):
    """A --smoke run (on the CPU) that asks for a GPU-only phase, peer or option stops at the arguments (exit 2),
    before writing anything."""
    name, *rest = argv
    module = importlib.import_module(f"benchmarks.{name}")
    with pytest.raises(SystemExit) as e:
        module.main(["--smoke", *rest, "--out", str(tmp_path / "r.json")])
    assert e.value.code == 2 and msg in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def cited(document: str) -> set[str]:
    """The names after "benchmarks." / "benchmarks/" in ``document`` as paths below benchmarks/ without suffix
    ("e2e", "probes/fused_bench"): the scripts it cites, and its documents."""
    text = (BENCHMARKS / document).read_text(encoding="utf-8")
    return {name.replace(".", "/") for name in re.findall(r"(?<![\w/])benchmarks[./]((?:probes[./])?\w+)", text)}


def test_every_script_results_cites_runs_here():
    names = cited("RESULTS.md") - set(DOCUMENTS)
    assert {"e2e", "forward_14b", "cache_bench", "parallel_bench", "budget_suite"} <= names  # the reading works
    for name in names:
        assert (BENCHMARKS / f"{name}.py").exists() or (BENCHMARKS / f"{name}.sh").exists(), \
            f"RESULTS.md cites benchmarks.{name}, which does not exist"
        assert name in SCRIPTS or name in HELPERS, f"RESULTS.md cites benchmarks.{name}: give it a smoke or plan test"


def test_every_script_beside_results_runs_here():
    """A script in benchmarks/ runs here (or is a helper of those that do); one-off probes go to probes/."""
    scripts = {p.stem for p in [*BENCHMARKS.glob("*.py"), *BENCHMARKS.glob("*.sh")]} - set(HELPERS)
    assert scripts == {name for name in SCRIPTS if not name.startswith("probes/")}


def test_history_cites_scripts_that_exist():
    names = cited("HISTORY.md") - set(DOCUMENTS) - {"levers"}  # levers: the old-API script of an old commit
    assert {"ab_trees", "probes/fused_bench", "probes/vsa_profile"} <= names  # the reading works
    for name in names:
        assert (BENCHMARKS / f"{name}.py").exists(), f"HISTORY.md cites benchmarks/{name}, which does not exist"
