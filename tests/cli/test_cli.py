"""The CLI: it makes an mp4 that imageio reads back; a user error is one line on stderr and exit code 2 (before
any work), a bug keeps its traceback; its flags reach the generator."""
import dataclasses
import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

import imageio.v3 as iio
import numpy as np

from fastwan import VideoGenerator, cli
from fastwan.options import DiTOptions
from tests.cli.helpers import assert_one_error_line


def test_cli_generate_writes_mp4(tmp_path):
    out = tmp_path / "clip.mp4"
    r = subprocess.run(
        [sys.executable, "-m", "fastwan.cli", "generate", "--prompt", "a red kite over a beach", "--height", "64",
         "--width", "96", "--num-frames", "9", "--steps", "2", "--output", str(out)],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "FASTWAN_CACHE": str(tmp_path / "cache")},
    )
    assert r.returncode == 0, r.stderr
    assert f"video: {out}" in r.stdout.splitlines()
    assert re.search(r"^seed: \d+$", r.stdout, re.M), r.stdout  # no --seed: a random one, printed
    frames = iio.imread(out)
    assert frames.shape == (9, 64, 96, 3)


def test_user_errors_are_one_line_and_exit_2(tiny_ckpts, tmp_path, capsys):
    """Each kind of user error, through the real loading and generation code."""
    a_file = tmp_path / "a_file.txt"
    a_file.write_text("not a folder")
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('{"kernel_size": [3, 3, 3],}')
    existing = tmp_path / "existing.mp4"
    existing.write_bytes(b"an earlier video")
    out = tmp_path / "out"
    base = ["generate", "--prompt", "a kite", "--model", str(tiny_ckpts["wan2.1"]), "--height", "64", "--width",
            "64", "--num-frames", "5", "--steps", "1", "--device", "cpu", "--output", str(out)]
    cases = [  # (extra args, which win over base; words the message must hold): all before the model loads
        (["--attention-backend", "FLASH_ATTN"], ["FLASH_ATTN"]),  # a multi-line BackendUnavailableError
        (["--attention-backend", "flash_atn"], ["'flash_atn'", "--attention-backend", "FLASH_ATTN"]),
        (["--attention-config", str(tmp_path / "missing.json")], ["missing.json", "does not exist"]),
        (["--attention-backend", "NEIGHBORHOOD_ATTN", "--attention-config", str(bad_json)], ["not valid JSON"]),
        (["--model", str(tmp_path / "no_such_model")], ["no_such_model"]),
        (["--model", str(a_file)], ["a_file.txt", "is a file"]),
        (["--device", "nonsense"], ["--device 'nonsense'"]),
        (["--output", str(a_file / "clip.mp4")], [str(a_file)]),
        (["--output", str(existing)], [str(existing), "--overwrite"]),
        (["--cache", "deepcache"], ["deepcache", "first_block"]),
        (["--cache", "magcache:threshold=0.1"], ["mag_ratios", "calibrate"]),
        (["--lora", str(tmp_path / "missing.safetensors")], ["missing.safetensors", "does not exist"]),
        (["--lora", f"{a_file}:abc"], ["the scale 'abc' after", "a_file.txt", "not a number"]),
        (["--lora", f"{a_file}:0.5x:low"], ["the scale '0.5x' after", "not a number"]),
    ]
    for extra, words in cases:
        capsys.readouterr()
        assert cli.main(base + extra) == 2, extra
        assert_one_error_line(capsys.readouterr().err, words, extra)
    assert sorted(tmp_path.rglob("*.mp4")) == [existing] and existing.read_bytes() == b"an earlier video"
    # a setting checked against the loaded model: after the loading progress bars, the one error line
    assert cli.main(base + ["--num-frames", "8"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.endswith("\n") and [ln for ln in err.split("\n") if "error" in ln] == [
        "fastwan: error: --num-frames 8 is not 4k+1 (the VAE compresses time by 4); use 5 or 9."], err


class FakeGenerator:
    """Stands in for VideoGenerator: records the request's fields, then raises or returns ``outcome``."""

    def __init__(self, outcome):
        self.outcome = outcome
        self.kwargs = None
        self.memory_plan = None  # from_pretrained without max_gpu_memory
        self.parallel = None  # one process

    def generate(self, request):
        request = getattr(request, "request", request)  # the CLI hands over the request it resolved
        self.kwargs = {f.name: getattr(request, f.name) for f in dataclasses.fields(request)}
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome


def fake_generator(monkeypatch, outcome) -> FakeGenerator:
    fake = FakeGenerator(outcome)
    monkeypatch.setattr(VideoGenerator, "load", lambda options: fake)
    return fake


def test_user_errors_print_one_line_and_bugs_keep_their_traceback(monkeypatch, capsys):
    from fastwan.errors import InvalidArgument, OutputExistsError, OutputPathError

    argv = ["generate", "--prompt", "x"]
    for exc, line in (
        (OutputPathError("output folder /o cannot be created\n  - /o is a file"),
         "output folder /o cannot be created; /o is a file"),
        (OutputExistsError("output file /o/v.mp4 exists;\npass --overwrite to replace it"),
         "output file /o/v.mp4 exists;; pass --overwrite to replace it"),
        (InvalidArgument("steps=0 must be >= 1\n\n  use 50"), "steps=0 must be >= 1; use 50"),
    ):
        fake_generator(monkeypatch, exc)
        capsys.readouterr()
        assert cli.main(argv) == 2
        assert capsys.readouterr().err == f"fastwan: error: {line}\n"
    for bug in (ZeroDivisionError("division by zero"), RuntimeError("CUDA error: an illegal memory access\nat"),
                KeyError("weight"), OSError(28, "No space left on device")):
        fake_generator(monkeypatch, bug)
        with pytest.raises(type(bug)) as info:
            cli.main(argv)
        assert info.value is bug


def test_env_errors_are_reported_the_same_way(monkeypatch, capsys):
    from fastwan import envinfo
    from fastwan.errors import InvalidArgument

    def bad_device(*a, **k):
        raise InvalidArgument("device='nonsense' is not a torch device;\nuse 'cpu' or 'cuda:0'")

    monkeypatch.setattr(envinfo, "collect", bad_device)
    capsys.readouterr()
    assert cli.main(["env", "--json"]) == 2
    assert_one_error_line(capsys.readouterr().err, ["device='nonsense'", "; use 'cpu'"], "env")

    def bug(*a, **k):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(envinfo, "collect", bug)
    with pytest.raises(ZeroDivisionError):
        cli.main(["env", "--json"])


def test_seed_and_overwrite_reach_the_generator(monkeypatch, capsys):
    result = SimpleNamespace(video_path="outputs/v.mp4", seed=1234, attention_backend="TORCH_SDPA", peak_memory=None,
                             cache=None,
                             timings={"text_encoding": 0.1, "denoising": 0.2, "decoding": 0.3, "total": 0.6})
    fake = fake_generator(monkeypatch, result)
    capsys.readouterr()
    assert cli.main(["generate", "--prompt", "x"]) == 0
    assert fake.kwargs["seed"] is None and fake.kwargs["overwrite"] is False  # defaults: random seed, no overwrite
    lines = capsys.readouterr().out.splitlines()
    assert "video: outputs/v.mp4" in lines and "seed: 1234" in lines  # the seed used, as the generator reports it
    assert cli.main(["generate", "--prompt", "x", "--seed", "7", "--overwrite"]) == 0
    assert fake.kwargs["seed"] == 7 and fake.kwargs["overwrite"] is True


def test_cli_build_options_reach_the_generator(monkeypatch, tmp_path):
    class Stop(Exception):
        pass

    seen = {}

    def fake_from_pretrained(model, **kw):
        seen.update(kw)
        raise Stop  # the arguments are all this test needs

    monkeypatch.setattr(VideoGenerator, "load", lambda o: fake_from_pretrained(o.model, **o.kwargs()))

    def run(*extra):
        with pytest.raises(Stop):
            cli.main(["generate", "--prompt", "x", *extra])

    run("--vae-tiling")
    assert seen["vae_tiling"] is True
    run()
    assert seen["vae_tiling"] is False and seen["vae_chunk_frames"] == "auto"
    run("--vae-chunk-frames", "3")
    assert seen["vae_chunk_frames"] == 3
    assert seen["dit_options"] == DiTOptions(block="auto")
    run("--dit-block", "reference")
    assert seen["dit_options"] == DiTOptions(block="reference")
    assert seen["lora"] == []
    monkeypatch.chdir(tmp_path)  # LoRA files must exist: the CLI checks them before anything loads
    for name in ("a.safetensors", "c:/x/b.safetensors", "d:e.safetensors", "h.safetensors", "c:/l.safetensors",
                 "x:low.safetensors"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"")
    run("--model", "tiny-wan2.2-a14b", "--lora", "a.safetensors", "--lora", "c:/x/b.safetensors:0.5",
        "--lora", "d:e.safetensors", "--lora", "h.safetensors:high", "--lora", "c:/l.safetensors:0.25:LOW",
        "--lora", "x:low.safetensors")
    assert seen["lora"] == [("a.safetensors", 1.0, None), ("c:/x/b.safetensors", 0.5, None),
                            ("d:e.safetensors", 1.0, None), ("h.safetensors", 1.0, 0), ("c:/l.safetensors", 0.25, 1),
                            ("x:low.safetensors", 1.0, None)]
    named = tmp_path / "style:2"  # an existing file whose name holds a colon is the path itself
    named.write_bytes(b"")
    run("--lora", str(named))
    assert seen["lora"] == [(str(named), 1.0, None)]
    run("--lora", f"{named}:0.5")
    assert seen["lora"] == [(str(named), 0.5, None)]
    for bad in ("0", "two"):
        assert _exit_code(["generate", "--prompt", "x", "--vae-chunk-frames", bad]) == 2


def test_cli_tiny_vae_flags_reach_the_generator(monkeypatch, tmp_path, capsys):
    class Stop(Exception):
        pass

    seen = {}

    def fake_load(o):
        seen.update(o.kwargs())
        raise Stop

    monkeypatch.setattr(VideoGenerator, "load", fake_load)
    path = tmp_path / "taew2_1.safetensors"
    path.write_bytes(b"")  # the file must exist; its contents are checked against the model when it loads
    with pytest.raises(Stop):
        cli.main(["generate", "--prompt", "x", "--vae", "tiny", "--vae-path", str(path)])
    assert seen["vae"] == "tiny" and seen["vae_path"] == str(path)
    seen.clear()
    for bad in (["--vae", "tiny"], ["--vae", "small"], ["--vae-path", str(path)]):
        assert _exit_code(["generate", "--prompt", "x", *bad]) == 2 and not seen, bad
    assert "--vae-path" in capsys.readouterr().err


def test_cli_image_to_video(tmp_path, capsys):
    from PIL import Image

    out = tmp_path / "fox.mp4"
    args = ["generate", "--prompt", "a fox", "--model", "tiny-wan2.1-i2v", "--seed", "1", "--output", str(out)]
    assert cli.main(args) == 2  # an image-to-video checkpoint without --image: a one-line error, no video
    err = capsys.readouterr().err
    assert "pass --image" in err.strip().splitlines()[-1] and "Traceback" not in err and not out.exists()
    image = tmp_path / "first.png"
    Image.fromarray(np.full((48, 64, 3), 200, dtype=np.uint8)).save(image)
    assert cli.main([*args, "--image", str(image)]) == 0
    assert out.is_file() and out.stat().st_size > 0


def test_cli_cache_reports_computed_steps(tmp_path, capsys):
    out = tmp_path / "fox.mp4"
    args = ["generate", "--prompt", "a fox", "--model", "tiny", "--seed", "1", "--steps", "6", "--output", str(out),
            "--cache", "skip_steps:steps=2-3"]
    assert cli.main(args) == 0 and out.is_file()
    lines = capsys.readouterr().out.splitlines()
    assert "skip_steps computed steps: cond 4/6 [0, 1, 4, 5]; uncond 4/6 [0, 1, 4, 5]" in lines


def test_cli_sampler_flags(monkeypatch, tmp_path, capsys):
    result = SimpleNamespace(video_path="outputs/v.mp4", seed=1, attention_backend="TORCH_SDPA", peak_memory=None,
                             cache=None,
                             timings={"text_encoding": 0.1, "denoising": 0.2, "decoding": 0.3, "total": 0.6})
    fake = fake_generator(monkeypatch, result)
    assert cli.main(["generate", "--prompt", "x"]) == 0
    assert (fake.kwargs["sampler"], fake.kwargs["timesteps"], fake.kwargs["flow_shift"]) == (None, None, None)
    assert cli.main(["generate", "--prompt", "x", "--sampler", "dmd", "--timesteps", "1000,757,522",
                     "--flow-shift", "8"]) == 0
    assert (fake.kwargs["sampler"], fake.kwargs["timesteps"], fake.kwargs["flow_shift"]) == (
        "dmd", (1000.0, 757.0, 522.0), 8.0)
    for bad in (["--timesteps", "1000;500"], ["--sampler", "lcm"]):
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            cli.main(["generate", "--prompt", "x", *bad])
        assert e.value.code == 2 and bad[1] in capsys.readouterr().err


def test_cli_bad_timesteps_is_one_line(tmp_path, capsys):
    """Timesteps the generator refuses: one error line, exit 2, no video."""
    out = tmp_path / "v.mp4"
    args = ["generate", "--prompt", "a fox", "--model", "tiny", "--seed", "1", "--output", str(out),
            "--sampler", "euler", "--timesteps", "500,750"]
    capsys.readouterr()
    assert cli.main(args) == 2 and not out.exists()
    err = capsys.readouterr().err  # after the loading progress bars, the one error line
    errors = [ln for ln in err.split("\n") if "error" in ln]
    assert "Traceback" not in err and len(errors) == 1 and "--timesteps [500.0, 750.0]" in errors[0], err
    assert "strictly decreasing" in errors[0]


def _exit_code(argv) -> int:
    try:
        return cli.main(argv)
    except SystemExit as exc:  # argparse's errors end the program
        return exc.code


def test_argument_errors_are_one_line_before_the_model_loads(monkeypatch, tmp_path, capsys):
    """The rules an argument obeys without a model (ranges, an unreadable --image, argparse's own checks) fail as
    one line and exit 2 before from_pretrained is called; argparse's usage text is not dumped."""
    def loaded(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(VideoGenerator, "load", lambda o: loaded(o.model, **o.kwargs()))
    base = ["generate", "--prompt", "a kite", "--output", str(tmp_path / "out")]
    cases = [
        (["--steps", "0"], ["--steps", "must be >= 1"]), (["--fps", "0"], ["--fps"]),
        (["--num-frames", "-3"], ["--num-frames"]), (["--height", "48.0"], ["--height", "'48.0'"]),
        (["--seed", "-1"], ["--seed", ">= 0"]), (["--seed", str(2**64)], ["--seed", "< 2**64"]),
        (["--guidance-scale", "nan"], ["--guidance-scale", "finite"]), (["--guidance-scale-2", "-1"], [">= 0"]),
        (["--flow-shift", "0"], ["--flow-shift", "> 0"]), (["--prompt", "  "], ["--prompt", "empty"]),
        (["--vae-chunk-frames", "0"], ["--vae-chunk-frames"]), (["--dtype", "float64"], ["--dtype", "float64"]),
        (["--image", str(tmp_path / "none.png")], ["none.png", "no such file"]),
        (["--image", str(tmp_path)], ["not a readable image"]),
    ]
    for extra, words in cases:
        capsys.readouterr()
        assert _exit_code(base + extra) == 2, extra
        assert_one_error_line(capsys.readouterr().err, words, extra)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_bad_launcher_variable_does_not_hide_the_user_error(monkeypatch, tmp_path, capsys):
    existing = tmp_path / "v.mp4"
    existing.write_bytes(b"kept")
    monkeypatch.setenv("WORLD_SIZE", "abc")
    assert cli.main(["generate", "--prompt", "p", "--output", str(existing)]) == 2
    assert_one_error_line(capsys.readouterr().err, [str(existing), "--overwrite"], "WORLD_SIZE=abc")
    assert existing.read_bytes() == b"kept"


def test_torchrun_without_sp_or_cfg_parallel_is_refused_before_the_model_loads(monkeypatch, tmp_path, capsys):
    """Several torchrun processes with neither --sp nor --cfg-parallel would each make the same video."""
    def loaded(*a, **k):
        raise AssertionError("the model was loaded before the launch was checked")

    monkeypatch.setattr(VideoGenerator, "load", lambda o: loaded(o.model, **o.kwargs()))
    for name, value in (("WORLD_SIZE", "2"), ("RANK", "1"), ("LOCAL_RANK", "1")):
        monkeypatch.setenv(name, value)
    out = tmp_path / "v.mp4"
    assert cli.main(["generate", "--prompt", "p", "--output", str(out)]) == 2
    assert_one_error_line(capsys.readouterr().err, ["rank 1", "WORLD_SIZE=2", "--sp 2"], "torchrun")
    assert not out.exists()


def test_cli_magcache_calibration_prints_json_that_feeds_mag_ratios(tmp_path, capsys):
    """Each pass's calibration is printed as a JSON list: written to a file, ``mag_ratios=@FILE`` takes it, and
    the MagCache built from it has exactly the printed ratios."""
    from fastwan.cache import check_cache

    args = ["generate", "--prompt", "a fox", "--model", "tiny", "--seed", "1", "--steps", "5",
            "--output", str(tmp_path / "fox.mp4"), "--cache", "magcache:calibrate=true"]
    assert cli.main(args) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("magcache calibration")]
    assert [ln.split(":")[0] for ln in lines] == ["magcache calibration (cond)", "magcache calibration (uncond)"]
    ratios = json.loads(lines[0].split(": ", 1)[1])
    assert len(ratios) == 5 and all(isinstance(r, float) for r in ratios)
    path = tmp_path / "ratios.json"
    path.write_text(lines[0].split(": ", 1)[1])
    assert check_cache(f"magcache:mag_ratios=@{path}").mag_ratios == tuple(ratios)


def test_rules_of_the_checkpoint_fail_before_any_weight_loads(monkeypatch, tmp_path, capsys):
    """Arguments that break a rule of the checkpoint (its VAE factors and patch, its scheduler's step limit, its
    expert count, its sampler) fail as one line and exit 2 from the checkpoint's files, before any weight loads."""
    import fastwan.pipelines.generator as generator

    def loaded(*a, **k):
        raise AssertionError("a DiT was loaded before the arguments were checked")

    monkeypatch.setattr(generator, "load_transformer", loaded)
    base = ["generate", "--prompt", "a kite", "--model", "tiny", "--output", str(tmp_path / "out")]
    cases = [
        (["--height", "33"], ["--height 33 is not a multiple of 16"]), (["--num-frames", "4"], ["--num-frames 4"]),
        (["--steps", "400"], ["--steps 400", "use at most"]),
        (["--guidance-scale-2", "3"], ["--guidance-scale-2 3.0", "one DiT"]),
        (["--timesteps", "1000,500"], ["--timesteps [1000.0, 500.0]", "sampler"]),
    ]
    for extra, words in cases:
        capsys.readouterr()
        assert _exit_code(base + extra) == 2, extra
        assert_one_error_line(capsys.readouterr().err, words, extra)


def test_python_m_fastwan_is_the_command(tmp_path):
    """``python -m fastwan`` runs the CLI's main: its help, and a user error's one line with exit code 2."""
    env = {**os.environ, "FASTWAN_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-m", "fastwan", "--help"], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path, env=env)
    assert r.returncode == 0 and r.stdout.startswith("usage: fastwan "), (r.returncode, r.stdout, r.stderr)
    r = subprocess.run([sys.executable, "-m", "fastwan", "generate", "--prompt", "a kite", "--steps", "0"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert (r.returncode, r.stdout) == (2, ""), (r.returncode, r.stdout, r.stderr)
    assert_one_error_line(r.stderr, ["--steps", "0 must be >= 1"], "python -m fastwan")
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_a_hub_model_is_not_fetched_before_the_arguments_fail(monkeypatch, tmp_path, capsys):
    """For a Hub id the pre-load request check is skipped (resolving would download the checkpoint): argument
    errors that need no checkpoint still come first, a missing LoRA file among them."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    base = ["generate", "--prompt", "a kite", "--model", "some-org/some-wan-model", "--output", str(tmp_path / "o")]
    for extra, words in ((["--lora", str(tmp_path / "missing.safetensors")], ["missing.safetensors", "does not exist"]),
                         (["--cache", "teacache:threshhold=0.1"], ["threshhold"]),
                         (["--cfg-gate-step", "2"], ["--cfg-gate-step"])):
        capsys.readouterr()
        assert _exit_code(base + extra) == 2, extra
        assert_one_error_line(capsys.readouterr().err, words, extra)
