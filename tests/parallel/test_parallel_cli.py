"""``fastwan generate --sp N [--cfg-parallel]`` on the CPU (gloo): under torchrun (each process a rank) and on its
own (fastwan starts the processes). The video equals the one-process CLI's, rank 0 alone prints and writes, the
processes fastwan started end with the run (nothing of theirs leaks), and a user error under torchrun is printed with
the rank named (exit 2)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import imageio.v3 as iio
import numpy as np

ARGS = ["generate", "--prompt", "a red kite", "--height", "48", "--width", "80", "--num-frames", "9", "--steps", "2",
        "--seed", "4", "--device", "cpu"]


# Under torchrun each rank runs the CLI's main() and then says whether its process group is still up: the CLI
# must end it itself (a group alive at interpreter exit can abort a rank while rank 0 still decodes).
RANK_MAIN = """import sys
import torch.distributed as dist
from fastwan.cli import main
rc = main(sys.argv[1:])
print("process group after main: " + ("up" if dist.is_initialized() else "down"))
sys.exit(rc)
"""


def cli(tmp_path, *extra, torchrun: int | None = None):
    env = {**os.environ, "FASTWAN_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(k, None)
    script = tmp_path / "rank_main.py"
    script.write_text(RANK_MAIN)
    head = [sys.executable, "-m", "fastwan.cli"] if torchrun is None else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}", str(script)]
    return subprocess.run([*head, *ARGS, *extra], capture_output=True, text=True, timeout=600, env=env)


def test_torchrun_and_spawned_processes_make_the_one_process_video(tmp_path):
    one = cli(tmp_path, "--output", str(tmp_path / "one.mp4"))
    assert one.returncode == 0, one.stderr
    want = iio.imread(tmp_path / "one.mp4").astype(int)
    for name, extra, nproc in (("tr.mp4", ["--sp", "2", "--cfg-parallel"], 4), ("spawn.mp4", ["--sp", "2"], None)):
        r = cli(tmp_path, *extra, "--output", str(tmp_path / name), torchrun=nproc)
        assert r.returncode == 0, r.stderr
        assert r.stdout.count("video: ") == 1 and f"video: {tmp_path / name}" in r.stdout, r.stdout  # rank 0 only
        if nproc is not None:
            assert r.stdout.count("process group after main: down") == nproc, r.stdout
        else:  # the workers fastwan started are ended by the CLI: no semaphore of theirs outlives the run
            assert "leaked semaphore" not in r.stderr, r.stderr
        got = iio.imread(tmp_path / name).astype(int)
        assert got.shape == want.shape and np.abs(got - want).mean() < 0.5  # mp4 re-encoding of frames within 1
    assert sorted(p.name for p in tmp_path.glob("*.mp4")) == ["one.mp4", "spawn.mp4", "tr.mp4"]


def test_user_error_under_torchrun_names_each_rank(tmp_path):
    r = cli(tmp_path, "--sp", "2", "--cfg-parallel", "--output", str(tmp_path / "v.mp4"), torchrun=2)
    assert r.returncode != 0
    # every rank raises the error, but torchrun ends the other ranks once one exits: at least one line gets out
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("fastwan: error: ")]
    assert lines, r.stderr
    for ln in lines:
        assert re.fullmatch(r"fastwan: error: rank [01]: num_gpus=4 but this job was launched with 2 processes.*",
                            ln), r.stderr
    assert "fastwan/" not in r.stderr  # one line per rank, no traceback through fastwan (torchrun adds its own)
    assert not (tmp_path / "v.mp4").exists()


def test_ring_flag_pins_the_layout_and_one_that_cannot_run_is_refused(tmp_path, monkeypatch, capsys):
    """--ring R is LoadOptions.ring_degree: a ring degree that does not divide --sp is refused in one line, naming
    the degrees that run, before any process starts."""
    from fastwan.cli import main
    from fastwan.parallel.workers import ParallelGenerator

    monkeypatch.setenv("FASTWAN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(ParallelGenerator, "__init__", lambda *a, **k: (_ for _ in ()).throw(AssertionError("spawned")))
    assert main([*ARGS, "--sp", "4", "--ring", "3", "--output", str(tmp_path / "v.mp4")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastwan: error: ") and "cannot split 4" in err and "(Ulysses 2 x Ring 2)" in err, err
    assert not (tmp_path / "v.mp4").exists()
