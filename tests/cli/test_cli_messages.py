"""What a user reads from the fastwan command: the step cache's CLI form takes lists as typed and shows its syntax
when it cannot read one; a run prints fastwan's own lines only (no third-party progress bars or warnings);
Ctrl-C ends a run with one line, exit code 130 and no partial video. The command line as users mistype it: every
usage error of every subcommand is one line starting 'fastwan: error:' with exit code 2; an empty --device is
refused, not taken as the default; a step cache that does not fit the request, and an output name that names no
file, fail before the model loads, leaving nothing behind."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fastwan import VideoGenerator, cli
from fastwan.cache import SkipSteps, parse_cache
from fastwan.pipelines.output import check_output_path
from tests.cli.helpers import assert_one_error_line


# ---- --cache lists ------------------------------------------------------------------------------------------------
def test_skip_steps_list_with_commas_runs_those_steps(tmp_path, capsys):
    out = tmp_path / "fox.mp4"
    args = ["generate", "--prompt", "a fox", "--model", "tiny", "--seed", "1", "--steps", "5", "--output", str(out),
            "--cache", "skip_steps:steps=2,4"]
    assert cli.main(args) == 0 and out.is_file()
    computed = [s for s in range(5) if s not in (2, 4)]
    assert f"skip_steps computed steps: cond 3/5 {computed}; uncond 3/5 {computed}" in capsys.readouterr().out


@pytest.mark.parametrize("text,expected", [
    ("skip_steps:steps=2,4", SkipSteps(steps=(2, 4))),
    ("skip_steps:steps=[2,4]", SkipSteps(steps=(2, 4))),
    ("skip_steps:steps=2/4", SkipSteps(steps=(2, 4))),
    ("skip_steps:steps=2,4-6,first_block=true", SkipSteps(steps=(2, 4, 5, 6), first_block=True)),
    ("skip_steps:first_block=true,steps=2,4", SkipSteps(steps=(2, 4), first_block=True)),
])
def test_cache_lists_take_commas_brackets_and_slashes(text, expected):
    assert parse_cache(text) == expected


@pytest.mark.parametrize("text", ["skip_steps:4", "skip_steps:stepz=2,4", "skip_steps:steps=2;4",
                                  "teacache:threshold=0.1,0.2"])
def test_an_unreadable_cache_shows_the_syntax_with_an_example_that_parses(text, capsys):
    assert cli.main(["generate", "--prompt", "x", "--model", "tiny", "--device", "cpu", "--cache", text]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastwan: error: ") and err.count("\n") == 1, err
    examples = re.findall(r"e\.g\. '([^']+)'", err)
    assert examples, err
    assert parse_cache(examples[-1]) is not None  # the example shown is a form the parser takes


# ---- an attention backend that cannot run here ---------------------------------------------------------------------
@pytest.mark.parametrize("extra,env,fix", [
    (["--attention-backend", "FLASH_ATTN"], {}, "Use TORCH_SDPA"),
    (["--attention-backend", "SLIDING_TILE_ATTN", "--attention-config", '{"kernel": "fa4"}'], {},
     "Drop the attention config (kernel)"),
    ([], {"FASTVIDEO_ATTENTION_BACKEND": "SAGE_ATTN"}, "Use TORCH_SDPA"),
])
def test_an_attention_backend_that_cannot_run_here_is_one_short_line(extra, env, fix, capsys, monkeypatch):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    name = (extra[1:2] or list(env.values()))[0]
    capsys.readouterr()
    assert cli.main(["generate", "--model", "tiny", "--prompt", "x", "--device", "cpu", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fastwan: error: Attention backend {name} ") and err.count("\n") == 1, err
    assert len(err) <= 300 and err.count(name) == 1 and fix in err, err  # the fix never names the backend refused


# ---- what a run prints --------------------------------------------------------------------------------------------
FASTWAN_BARS = ("denoising", "decoding")  # fastwan's own progress bars (stderr)
ROOT = Path(__file__).resolve().parents[2]


def hermetic_env(tmp_path) -> dict[str, str]:
    """The suite's environment (tests/conftest.py: no caller's Hugging Face or fastwan settings, such as
    HF_HUB_DISABLE_PROGRESS_BARS, which would hide what is tested) with a fresh cache (the tiny checkpoint is
    written, as on a first run), one thread, and this checkout's fastwan first on the path."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "FASTWAN_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1", "PYTHONPATH": path}


def fastwan(tmp_path, *args, **kw):
    return subprocess.run([sys.executable, "-m", "fastwan", *args], capture_output=True, text=True, timeout=600,
                          env=hermetic_env(tmp_path), cwd=tmp_path, **kw)


def shown(stderr: str) -> list[str]:
    """What a terminal shows of ``stderr``: each line as its last carriage return left it, blank ones dropped."""
    return [s for s in (line.rpartition("\r")[2].strip() for line in stderr.split("\n")) if s]


def foreign(stderr: str) -> list[str]:
    """Everything ``stderr`` held that is not a state of fastwan's own progress bars."""
    return [s.strip() for s in re.split(r"[\r\n]", stderr) if s.strip() and not s.strip().startswith(FASTWAN_BARS)]


def test_a_run_prints_only_fastwans_own_lines(tmp_path):
    # a first run of an image-to-video tiny model writes its checkpoint (transformers' shard bar), loads the text and
    # image encoders (transformers' weight bars) and its CLIP image processor (transformers' torchvision notice)
    image = tmp_path / "first.png"
    Image.fromarray(np.full((48, 64, 3), 200, dtype=np.uint8)).save(image)
    r = fastwan(tmp_path, "generate", "--model", "tiny-wan2.1-i2v", "--image", str(image), "--prompt", "x", "--seed",
                "0", "--steps", "2", "--output", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    assert foreign(r.stderr) == [], r.stderr
    assert "%|" not in r.stdout and [ln.split(":")[0] for ln in r.stdout.splitlines()] == [
        "making", "video", "seed", "attention", "time"], r.stdout
    q = fastwan(tmp_path, "quantize", "--model", "tiny", "--output", str(tmp_path / "q"))
    assert q.returncode == 0 and q.stderr == "" and q.stdout == f"wrote {tmp_path / 'q'}\n", (q.stdout, q.stderr)


# ---- Ctrl-C -------------------------------------------------------------------------------------------------------
STEPS = 300
STEPPED = re.compile(rb"denoising: +\d+%\|[^|\r\n]*\| *[1-9]\d*/" + str(STEPS).encode())  # a step done


@pytest.mark.parametrize("extra", [[], ["--sp", "2"]], ids=["one-process", "sp2"])
def test_ctrl_c_in_the_denoising_loop_is_one_line_exit_130_and_no_file(tmp_path, extra):
    out = tmp_path / "out"
    # a terminal's Ctrl-C goes to every process of the foreground group: the CLI's and the workers it started
    p = subprocess.Popen([sys.executable, "-m", "fastwan", "generate", "--model", "tiny", "--prompt", "x", "--seed",
                          "0", "--height", "48", "--width", "80", "--num-frames", "9", "--steps", str(STEPS),
                          "--device", "cpu", "--output", str(out), *extra],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=hermetic_env(tmp_path), cwd=tmp_path,
                         start_new_session=True)
    err = bytearray()
    reader = threading.Thread(target=lambda: [err.extend(b) for b in iter(lambda: p.stderr.read1(4096), b"")])
    reader.start()
    try:
        deadline = time.monotonic() + 400
        while not STEPPED.search(err) and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert STEPPED.search(err), err.decode(errors="replace")[-3000:]
        os.killpg(p.pid, signal.SIGINT)
        assert p.wait(timeout=120) == 130
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        reader.join()
        p.stdout.close()
        p.stderr.close()
    text = err.decode(errors="replace")
    assert shown(text) == ["fastwan: interrupted"], text[-3000:]
    assert "Traceback" not in text and "leaked semaphore" not in text, text[-3000:]
    assert not out.exists() or list(out.iterdir()) == []  # no video, and no partial file
    deadline = time.monotonic() + 30  # the workers ended with the run: nothing of its process group is left
    while time.monotonic() < deadline and _group_alive(p.pid):
        time.sleep(0.2)
    assert not _group_alive(p.pid)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_ctrl_c_while_the_video_is_written_leaves_no_partial_file(tmp_path, capsys, monkeypatch):
    from fastwan.pipelines import output

    def interrupted_writer(path, frames, fps, *, dest):
        Path(path).write_bytes(b"half a video")
        raise KeyboardInterrupt
    monkeypatch.setattr(output, "write_frames", interrupted_writer)
    out = tmp_path / "out"
    args = ["generate", "--prompt", "a fox", "--model", "tiny", "--seed", "1", "--steps", "2", "--output", str(out)]
    assert cli.main(args) == 130
    assert shown(capsys.readouterr().err) == ["fastwan: interrupted"]
    assert not out.exists() or list(out.iterdir()) == []


# ---- usage errors, each before the model loads --------------------------------------------------------------------
class Loaded(Exception):
    pass


@pytest.fixture
def no_loading(monkeypatch):
    """from_pretrained raises Loaded: a run that gets there passed every check made before the model loads."""
    def fake(model, **kw):
        raise Loaded
    monkeypatch.setattr(VideoGenerator, "load", lambda o: fake(o.model, **o.kwargs()))


def exit_code(argv) -> int:
    """cli.main's exit code, argparse's SystemExit included."""
    try:
        return cli.main(argv)
    except SystemExit as exc:
        return exc.code


def generate(model, tmp_path, *extra, output=None):
    return ["generate", "--prompt", "a kite", "--model", str(model), "--height", "32", "--width", "32",
            "--num-frames", "5", "--steps", "2", "--device", "cpu",
            "--output", str(tmp_path / "out") if output is None else output, *extra]


# ---- fastwan env ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv,words", [
    (["--bogus"], ["unrecognized arguments: --bogus"]),
    (["extra"], ["unrecognized arguments: extra"]),
    (["--head-dim", "0"], ["--head-dim 0", "positive"]),
    (["--head-dim", "abc"], ["'abc'"]),
    (["--dtype", "xx"], ["'xx'", "bf16"]),
    (["--json", "--dtype"], ["--dtype", "expected one argument"]),
])
def test_env_usage_errors_read_like_every_fastwan_error(capsys, argv, words):
    capsys.readouterr()
    assert exit_code(["env", *argv]) == 2
    assert_one_error_line(capsys.readouterr().err, words, argv)


@pytest.mark.parametrize("command", ["env", "generate"])
def test_an_empty_device_is_refused_not_taken_as_the_default(tiny_ckpts, tmp_path, capsys, command):
    argv = ["env", "--device", ""] if command == "env" else generate(tiny_ckpts["wan2.1"], tmp_path, "--device", "")
    capsys.readouterr()
    assert exit_code(argv) == 2
    err = capsys.readouterr().err
    assert_one_error_line(err, ["''", "not a torch device", "'cpu'"], command)
    assert not list(tmp_path.rglob("*.mp4"))


def run_module(*args):
    return subprocess.run([sys.executable, "-m", "fastwan", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ})


def test_python_m_fastwan_help_and_usage_errors():
    """As argparse users expect: --help prints usage and exits 0; no subcommand, an unknown one, or a bad option
    of `fastwan env` is one error line and exit 2."""
    for args in (["--help"], ["env", "--help"]):
        r = run_module(*args)
        assert r.returncode == 0 and r.stdout.startswith("usage: fastwan") and r.stderr == "", (args, r)
    for args, words in (([], ["required: command"]), (["bogus"], ["'bogus'", "generate"]),
                        (["env", "--bogus"], ["--bogus"])):
        r = run_module(*args)
        assert r.returncode == 2 and r.stdout == "", (args, r)
        assert_one_error_line(r.stderr, words, args)


# ---- the step cache against the request, before the model loads ---------------------------------------------
@pytest.mark.parametrize("extra,words", [
    (["--cache", "skip_steps:steps=5"], ["steps=[5]", "request of 2 step(s)"]),
    (["--cache", "first_block", "--steps", "1"], ["cannot skip any step", "request of 1 step(s)"]),
    (["--cache", "magcache:threshold=0.1,retention_ratio=0.9,mag_ratios=1/1/1"],
     ["cannot skip any step", "retention_ratio"]),
    (["--cache", "teacache:threshold=0.1", "--steps", "8"], ["no published coefficients", "coefficients="]),
])
def test_a_step_cache_that_does_not_fit_the_request_fails_before_loading(tiny_ckpts, tmp_path, capsys, no_loading,
                                                                         extra, words):
    capsys.readouterr()
    assert cli.main(generate(tiny_ckpts["wan2.1"], tmp_path, *extra)) == 2
    assert_one_error_line(capsys.readouterr().err, words, extra)


@pytest.mark.parametrize("cache", ["skip_steps:steps=1", "first_block", "none"])
def test_a_step_cache_that_fits_reaches_the_model(tiny_ckpts, tmp_path, no_loading, cache):
    with pytest.raises(Loaded):
        cli.main(generate(tiny_ckpts["wan2.1"], tmp_path, "--cache", cache))


# ---- output names that name no file -------------------------------------------------------------------------
@pytest.mark.parametrize("name,words", [
    (".mp4", ["nothing before its suffix", "video.mp4"]),
    (".MP4", ["nothing before its suffix"]),
    (".mov", ["nothing before its suffix"]),
    ("clip.mp4 ", ["blank space after '.mp4'", "clip.mp4'"]),
    ("clip.MP4\t", ["blank space after '.MP4'"]),
    ("clip.png ", ["blank space after '.png'"]),
    (".mp4 ", ["blank space after '.mp4'"]),
])
def test_an_output_name_that_names_no_file_is_refused_before_loading(tiny_ckpts, tmp_path, capsys, no_loading, name,
                                                                     words):
    out = tmp_path / "videos" / name
    capsys.readouterr()
    assert cli.main(generate(tiny_ckpts["wan2.1"], tmp_path, output=str(out))) == 2
    assert_one_error_line(capsys.readouterr().err, [repr(str(out)), *words], name)
    assert list(tmp_path.iterdir()) == []  # no folder made for it
    with pytest.raises(ValueError, match="output_path="):  # the Python API's rule too
        check_output_path(out, False)


@pytest.mark.parametrize("name,folder,file_name", [
    ("clip.mp4/", "clip.mp4", None),  # a trailing separator names a folder
    (".mp4/", ".mp4", None),
    ("my clip.mp4", "", "my clip.mp4"),
    (" clip.mp4", "", " clip.mp4"),
])
def test_names_that_stay_allowed(tmp_path, name, folder, file_name):
    target = check_output_path(f"{tmp_path}/{name}", False)
    assert target.folder == tmp_path / folder if folder else target.folder == tmp_path
    assert target.file_name == file_name


# ---- --attention-config JSON ----------------------------------------------------------------------------------
@pytest.mark.parametrize("config", ['{"sparsity": 0.5, "sparsity": 0.6}', '{"tile": [4, 4, 4], "tile": [2, 8, 8]}'])
def test_an_attention_config_key_given_twice_is_refused(tiny_ckpts, tmp_path, capsys, config):
    """JSON keeps the last of two equal keys; which one the user meant is unknown, so it is an error (before the
    model loads), as a setting given twice in --cache is."""
    key = config.split('"')[1]
    capsys.readouterr()
    assert cli.main(generate(tiny_ckpts["wan2.1"], tmp_path, "--attention-backend", "VIDEO_SPARSE_ATTN",
                             "--attention-config", config)) == 2
    assert_one_error_line(capsys.readouterr().err, [f"gives {key!r} twice", "once", "--attention-config"], config)
    assert not list(tmp_path.rglob("*.mp4"))


def test_a_duplicate_key_in_a_config_file_or_a_nested_object_is_refused(tmp_path):
    from fastwan.attention.sparse.config import load_attention_config

    path = tmp_path / "sta.json"
    path.write_text('{"strategy": {"0": [3, 3, 3], "0": [5, 3, 3]}}')
    with pytest.raises(ValueError, match=r"sta\.json.*gives '0' twice \(\[3, 3, 3\] and \[5, 3, 3\]\)"):
        load_attention_config(str(path))
    assert load_attention_config('{"tile": [2, 8, 8], "window": [3, 3, 3]}') == {"tile": [2, 8, 8],
                                                                                 "window": [3, 3, 3]}
