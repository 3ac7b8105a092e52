"""``fastwan serve``'s command line and its parts that need no running server: the flags documented in
docs/cli.md, start-up errors as one line, the loopback rule and the seconds rule."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from fastwan.serve.requests import frames_for
from fastwan.serve.server import is_loopback
from tests.serve.helpers import free_port, nearest_4k_plus_1

ROOT = Path(__file__).resolve().parents[2]


def test_help_lists_the_flags_docs_cli_md_documents(capsys):
    from fastwan import cli

    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    shown = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", " ".join(
        ln.strip().split("  ")[0] for ln in capsys.readouterr().out.splitlines() if ln.startswith("  -")))) - {"--help"}
    text = (ROOT / "docs" / "cli.md").read_text()
    start = text.index("## `fastwan serve`")
    section = text[start:text.index("\n## ", start + 1)]
    documented = {f for line in section.splitlines() if line.startswith("| `-")
                  for f in re.findall(r"--[a-z][a-z0-9-]*", line.split(" | ")[0])}
    assert shown == documented
    assert {"--model", "--host", "--port", "--data-dir", "--api-key-file", "--max-queue", "--device",
            "--compile", "--max-gpu-memory"} <= shown


@pytest.mark.parametrize("argv, says", [
    (["--api-key-file", "no-such-file"], "--api-key-file no-such-file: no such file"),
    (["--api-key-file", "empty-key"], "--api-key-file empty-key is empty"),
    (["--port", "70000"], "--port 70000 must be in [0, 65535]"),
    (["--max-queue", "0"], "--max-queue 0 must be >= 1"),
    (["--keep-days", "0"], "--keep-days 0.0 must be a positive number of days"),
    (["--keep-days", "nan"], "--keep-days nan must be a positive number of days"),
])
def test_start_up_errors_are_one_line_before_anything_starts(tmp_path, monkeypatch, capsys, argv, says):
    from fastwan import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty-key").write_text("  \n")
    assert cli.main(["serve", "--data-dir", str(tmp_path / "d"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastwan: error: ") and says in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "d").exists()  # refused before the store was opened


def test_loopback_rule():
    assert all(map(is_loopback, ["127.0.0.1", "127.0.0.2", "::1", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "192.168.1.4", "example.org"]))


@pytest.mark.parametrize("fps", [8, 16, 24])
def test_seconds_give_the_nearest_4k_plus_1_frames(fps):
    for tenths in range(1, 80):
        seconds = tenths / 10
        assert frames_for(seconds, fps, 4) == nearest_4k_plus_1(seconds * fps), (seconds, fps)


def test_a_model_that_fails_to_load_stops_the_server_with_one_line(tmp_path):
    run = subprocess.run([sys.executable, "-m", "fastwan", "serve", "--model", str(tmp_path / "no-model"), "--port",
                          str(free_port()), "--data-dir", str(tmp_path / "d")],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert run.returncode == 2, run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("fastwan: error: model ") and "is not a folder that exists" in last
