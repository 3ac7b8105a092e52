"""What a user reads from the fastwan command: the step cache's CLI form takes lists as typed and shows its syntax
when it cannot read one; a run prints fastwan's own lines only (no third-party progress bars or warnings);
Ctrl-C ends a run with one line, exit code 130 and no partial video."""
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

from fastwan import cli
from fastwan.cache import SkipSteps, parse_cache


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
ROOT = Path(__file__).resolve().parents[1]


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
