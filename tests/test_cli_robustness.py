"""The command line as users mistype it: every usage error of every subcommand is one line starting
'fastwan: error:' with exit code 2; an empty --device is refused, not taken as the default; a step cache that does
not fit the request, and an output name that names no file, fail before the model loads, leaving nothing behind."""
import os
import subprocess
import sys

import pytest

from fastwan import VideoGenerator, cli
from fastwan.pipelines.output import check_output_path
from tests.test_cli import assert_one_error_line


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
