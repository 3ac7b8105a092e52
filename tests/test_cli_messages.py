"""What a user reads from the fastwan command: the step cache's CLI form takes lists as typed and shows its syntax
when it cannot read one; a run prints fastwan's own lines only (no third-party progress bars or warnings);
Ctrl-C ends a run with one line, exit code 130 and no partial video."""
from __future__ import annotations

import re

import pytest

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
