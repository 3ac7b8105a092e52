"""The scripts in examples/, run as a user runs them (``python examples/X.py``, in a subprocess, with the tiny
default models): each writes an mp4 under ``outputs/`` of its working folder (a tmp folder here, so nothing lands
in the repository) that imageio reads back with the frames and size the tiny presets give, and prints its path; a
mistake ends with one line, ``fastwan: error: ...``, and exit code 2, before any model loads."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import imageio.v3 as iio
import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

T2V = (17, 128, 128)  # the tiny Wan2.1 presets (README: 128x128, 17 frames); FastWan's tiny keeps them
# the tiny I2V preset is 9 frames at 64 x 64 pixels: a 2:1 picture at that area has sides sqrt(4096 / 2) and
# sqrt(4096 * 2), each rounded down to a multiple of 16
I2V_21 = (9, int(np.sqrt(4096 / 2)) // 16 * 16, int(np.sqrt(4096 * 2)) // 16 * 16)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The scripts' environment: this checkout's fastwan first on the import path, tiny checkpoints in a tmp cache
    shared by the module, no launcher variables."""
    env = {**os.environ, "FASTWAN_CACHE": str(tmp_path_factory.mktemp("examples-cache")),
           "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def run(script: str, *args: str, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def written_video(r: subprocess.CompletedProcess, cwd: Path) -> np.ndarray:
    """The frames of the one mp4 the run wrote: the printed path, under ``cwd``/outputs."""
    assert r.returncode == 0, r.stderr
    videos = list((cwd / "outputs").glob("*.mp4"))
    assert len(videos) == 1, videos
    printed = re.findall(r"^(\S+\.mp4)  \(seed \d+", r.stdout, re.M)
    assert printed == [str(videos[0].relative_to(cwd))], r.stdout
    return iio.imread(videos[0])


VIDEO_RUNS = {  # script, its arguments, the video's (frames, height, width)
    "text_to_video": ("text_to_video.py", ["--prompt", "a kite over a beach"], T2V),
    "image_to_video": ("image_to_video.py", [], I2V_21),  # the generated 2:1 gradient
    "distilled": ("distilled.py", ["--seed", "3"], T2V),
    "small_gpu": ("small_gpu.py", ["--fp8", "--height", "48", "--width", "64"], (17, 48, 64)),
}


@pytest.mark.parametrize("case", list(VIDEO_RUNS))
def test_example_writes_its_video(case, tmp_path, env):
    script, args, shape = VIDEO_RUNS[case]
    frames = written_video(run(script, *args, cwd=tmp_path, env=env), tmp_path)
    assert frames.shape == (*shape, 3) and frames.dtype == np.uint8


def test_multi_gpu_on_two_cpu_processes(tmp_path, env):
    """The docstring's CPU line (fastwan starts 2 gloo workers), with its size options."""
    r = run("multi_gpu.py", "--gpus", "2", "--cpu", "--height", "32", "--width", "48", cwd=tmp_path,
            env={**env, "OMP_NUM_THREADS": "1"})
    assert written_video(r, tmp_path).shape == (17, 32, 48, 3)


# A launcher's rank (torchrun's variables, world size 1) running the script as ``python`` would, then saying whether
# its process group is still up: the script must end it (a group alive at interpreter exit can abort a rank while
# rank 0 still decodes, as fastwan.parallel.launch.leave says)
AS_RANK = """import runpy, sys
import torch.distributed as dist
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
print("process group after the script: " + ("up" if dist.is_initialized() else "down"))
"""


def test_multi_gpu_as_a_launchers_rank_ends_its_process_group(tmp_path, env):
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    r = subprocess.run([sys.executable, "-c", AS_RANK, str(EXAMPLES / "multi_gpu.py"), "--gpus", "1", "--cpu",
                        "--height", "32", "--width", "32"], cwd=tmp_path, env={**env, **launcher},
                       capture_output=True, text=True, timeout=600)
    assert written_video(r, tmp_path).shape == (17, 32, 32, 3)
    assert r.stdout.splitlines()[-1] == "process group after the script: down", r.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiling on a CPU takes a minute")
def test_compile_ab_prints_both_times(tmp_path, env):
    r = run("compile_ab.py", "--steps", "1", "--runs", "1", cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    assert re.search(r"^eager +: denoise [\d.]+s", r.stdout, re.M), r.stdout
    assert re.search(r"^compiled : denoise [\d.]+s .* speedup [\d.]+x$", r.stdout, re.M), r.stdout
    assert list(tmp_path.iterdir()) == []  # it writes nothing


BAD = [  # script, a mistake, words the one line must hold
    ("text_to_video.py", ["--model", "no-such-model"], ["'no-such-model'", "Check the path or the model id"]),
    ("image_to_video.py", ["--image", "missing.png"], ["--image path 'missing.png' is not a file"]),
    ("distilled.py", ["--lora", "missing.safetensors"], ["'missing.safetensors'", "does not exist"]),
    ("small_gpu.py", ["--budget", "24"], ["'24' has no unit", "'24GiB'"]),
    ("multi_gpu.py", ["--gpus", "0"], ["num_gpus=0", ">= 1"]),
    ("compile_ab.py", ["--runs", "0"], ["--runs 0", ">= 1"]),
] + [  # an argument the script's parser refuses: the same one line, not argparse's usage and '<script>: error:'
    (script, [flag, "abc"], [f"argument {flag}: invalid int value: 'abc'", f"'{script} --help'"])
    for script, flag in (("text_to_video.py", "--seed"), ("image_to_video.py", "--seed"), ("distilled.py", "--seed"),
                         ("small_gpu.py", "--height"), ("multi_gpu.py", "--gpus"), ("compile_ab.py", "--runs"))
]


@pytest.mark.parametrize("script,args,words", BAD, ids=[f"{s[:-3]}{''.join(a)}" for s, a, _ in BAD])
def test_a_mistake_is_one_line_and_exit_2(script, args, words, tmp_path, env):
    cache = tmp_path.with_name(f"{tmp_path.name}-cache")  # an empty cache: no tiny checkpoint to build comes first
    r = run(script, *args, cwd=tmp_path, env={**env, "FASTWAN_CACHE": str(cache)})
    assert (r.returncode, r.stdout) == (2, ""), (r.returncode, r.stdout, r.stderr)
    assert r.stderr.startswith("fastwan: error: ") and r.stderr.count("\n") == 1, r.stderr  # no traceback
    for w in words:
        assert w in r.stderr, (w, r.stderr)
    assert list(tmp_path.iterdir()) == [] and not cache.exists()  # nothing written, nothing built

