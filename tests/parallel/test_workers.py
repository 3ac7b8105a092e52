"""Parallel generators' worker processes on the CPU (gloo): a call interrupted before every rank answered ends the
workers (a late answer is never taken as the next request's); rank 0's user error after the other ranks finished
is raised as itself and the workers stay; a CUDA device index that is not the rank's own is refused before any
process starts or joins; a stale WORLD_SIZE without a launcher is a user error; the video equals the one-process
video under CFG parallelism with a step cache, and with one DiT token over two sequence ranks (one rank's shard
empty); NVLink multicast is off in spawned workers unless the user set it; a script that asks for workers without
``if __name__ == "__main__":`` gets a user error that says to add it."""
from __future__ import annotations

import _thread
import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist

from fastwan import VideoGenerator
from fastwan.cache import SkipSteps
from fastwan.envs import NO_MULTICAST
from fastwan.errors import InvalidArgument, VideoWriteError
from fastwan.parallel import launch
from fastwan.parallel.workers import ParallelError, ParallelGenerator
from fastwan.checkpoint.tiny import write_tiny_checkpoint

READY = ("ok", {"checkpoint": None, "preset": None, "memory_plan": None})


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "wan2.1", "wan2.1", seed=0)


def _slow_echo_worker(rank, world, store, loader, model, kwargs, device, conn):
    """Answers each request with its prompt (rank 0) after 10 s."""
    conn.send(READY)
    while (msg := conn.recv()) is not None:
        time.sleep(10)
        conn.send(("ok", msg[1][0] if rank == 0 else None))


def test_an_interrupted_call_ends_the_workers():
    par = ParallelGenerator(None, "unused", {}, 2, torch.device("cpu"), target=_slow_echo_worker)
    procs = list(par._procs)
    try:
        threading.Timer(1.0, _thread.interrupt_main).start()  # Ctrl-C while the ranks still compute
        with pytest.raises(KeyboardInterrupt):
            par.generate_video("first")
        # the ranks' answer to "first" must not come back as the answer to "second"
        with pytest.raises(ParallelError, match="have ended"):
            par.generate_video("second")
        assert not any(p.is_alive() for p in procs)
    finally:
        par.close(force=True)


def _rank0_write_fails_worker(rank, world, store, loader, model, kwargs, device, conn):
    """As the real worker when rank 0 cannot write the video it decoded: rank 1 has answered (it writes nothing),
    rank 0 sends the user error; both then wait for the next request."""
    conn.send(READY)
    calls = 0
    while (msg := conn.recv()) is not None:
        calls += 1
        if rank == 0 and calls == 1:
            time.sleep(1)  # rank 0 decodes while rank 1 is done
            exc = VideoWriteError("writing the video /x/v.mp4 failed: disk full; nothing at that path was changed.")
            conn.send(("error", rank, exc, f"Traceback ...\nVideoWriteError: {exc}"))
        else:
            conn.send(("ok", msg[1][0] if rank == 0 else None))


def test_rank0_user_error_after_the_others_finished_is_raised_as_itself():
    par = ParallelGenerator(None, "unused", {}, 2, torch.device("cpu"), target=_rank0_write_fails_worker)
    try:
        with pytest.raises(VideoWriteError, match="disk full"):  # a user error: the CLI prints one line, exits 2
            par.generate_video("first")
        assert par.generate_video("second") == "second"  # no rank waited in a collective: the workers stay
    finally:
        par.close(force=True)


def _fake_ckpt(heads: int = 2):
    return SimpleNamespace(transformer_config=SimpleNamespace(num_attention_heads=heads))


@pytest.fixture
def four_gpus(monkeypatch):
    """CUDA with 4 GPUs as far as the checks can tell; starting workers or a process group fails the test."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(ParallelGenerator, "__init__", lambda *a, **k: pytest.fail("workers were started"))
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: pytest.fail("a process group was started"))
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)


def test_spawned_workers_refuse_a_device_index(four_gpus):
    # the workers would run on cuda:0 and cuda:1 whatever the index says
    with pytest.raises(InvalidArgument, match=r"device='cuda:1' with num_gpus=2: .* pass device='cuda'"):
        launch.spawn(None, "m", {}, _fake_ckpt(), 2, False, None, torch.device("cuda:1"))


def test_a_launched_rank_refuses_another_ranks_gpu(four_gpus, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    # every rank on cuda:0: NCCL would fail at the first collective, after the weights loaded
    with pytest.raises(InvalidArgument, match=r"device='cuda:0', but this process is LOCAL_RANK=1"):
        launch.join(_fake_ckpt(), 2, False, None, torch.device("cuda:0"))


def test_a_stale_world_size_without_a_launcher_is_a_user_error(ckpt, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # left in the shell; no torchrun set RANK / MASTER_ADDR / MASTER_PORT
    for k in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(InvalidArgument, match=r"WORLD_SIZE is set.*Start it with torchrun, or unset WORLD_SIZE"):
        VideoGenerator.from_pretrained(ckpt, device="cpu", num_gpus=2)
    assert not dist.is_initialized()


@pytest.mark.parametrize("load,run", [
    (dict(num_gpus=2, cfg_parallel=True, cache="first_block:threshold=0.2"),
     dict(height=48, width=80, num_frames=9, num_inference_steps=6)),
    (dict(num_gpus=2), dict(height=16, width=16, num_frames=1, num_inference_steps=2)),  # 1 token, 2 ranks
], ids=["cfg2-step-cache", "sp2-one-token"])
def test_parallel_video_equals_one_process(ckpt, load, run):
    common = dict(device="cpu", dtype=torch.float32)
    kw = dict(**run, guidance_scale=5.0, seed=3, save_video=False)
    one = VideoGenerator.from_pretrained(ckpt, **common, cache=load.get("cache")).generate_video("a cat", **kw)
    with VideoGenerator.from_pretrained(ckpt, **common, **load) as par:
        got = par.generate_video("a cat", **kw)
    if "cache" in load:  # the cache skipped steps, as in one process; the report has both passes, each as it ran
        skipped = [i for i in range(run["num_inference_steps"]) if i not in one.cache["computed"]["cond"]]
        assert skipped and got.cache == one.cache
    assert got.frames.shape == one.frames.shape and one.frames.std() > 5
    assert np.abs(got.frames.astype(int) - one.frames.astype(int)).max() <= 1


class _EnvReporter:
    """A stand-in generator whose generate_video returns its process's multicast variables."""

    checkpoint = preset = memory_plan = None

    def generate_video(self, prompt):
        return {k: os.environ.get(k) for k in NO_MULTICAST}


def _env_loader(model, **kwargs):
    return _EnvReporter()


def test_spawned_workers_switch_nvlink_multicast_off(monkeypatch):
    for k in NO_MULTICAST:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")  # the user's own setting is kept
    with ParallelGenerator(_env_loader, "m", {}, 2, torch.device("cpu")) as par:  # the real worker function
        got = par.generate_video("x")
    assert got == {**NO_MULTICAST, "NCCL_NVLS_ENABLE": "1"}


def test_cfg_parallel_gated_steps_under_a_step_cache_equal_one_process(tmp_path):
    """Wan2.2 A14B, CFG gated after 20% of the steps, a step cache: on gated steps every rank runs the conditional
    pass, CFG group 1 with a cache state that never saw it; the prediction taken is group 0's, so the latents the
    ranks hold stay equal and full CFG after the expert switch uses the right unconditional pass: the same video as
    one process (bit for bit on the CPU), and the same cache report."""
    ckpt = write_tiny_checkpoint(tmp_path / "a14b", "wan2.2-a14b", seed=0)
    common = dict(device="cpu", dtype=torch.float32, cfg_gate_step=0.2, cache=SkipSteps((2,)))
    kw = dict(height=32, width=48, num_frames=5, num_inference_steps=10, guidance_scale=4.0, seed=5,
              save_video=False)
    one = VideoGenerator.from_pretrained(ckpt, **common).generate_video("a cat", **kw)
    with VideoGenerator.from_pretrained(ckpt, **common, num_gpus=2, cfg_parallel=True) as par:
        got = par.generate_video("a cat", **kw)
    assert got.cache == one.cache and 2 not in one.cache["computed"]["cond"]
    assert one.frames.std() > 5 and np.array_equal(got.frames, one.frames)


# A script as diffusers users write them: no ``if __name__ == "__main__":``, so each spawned worker re-runs it
UNGUARDED = """import torch
from fastwan import VideoGenerator
from fastwan.errors import UserError
try:
    VideoGenerator.from_pretrained({ckpt!r}, device="cpu", dtype=torch.float32, num_gpus=2)
except UserError as exc:
    print(type(exc).__name__ + ": " + str(exc))
"""


def test_workers_started_without_a_main_guard_raise_a_user_error_naming_the_guard(ckpt, tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED.format(ckpt=str(ckpt)))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    (line,) = r.stdout.splitlines()  # the parent's error, caught as a UserError
    assert line.startswith(f"MainGuardError: num_gpus=2: the worker processes died re-importing {script}"), line
    assert "under 'if __name__ == \"__main__\":'" in line, line
    # each worker said why it stopped, on one line
    lines = r.stderr.splitlines()
    assert len(lines) == 2 and all(ln.startswith("fastwan: error: from_pretrained(num_gpus=2) runs while this "
                                                 "spawned process re-imports its main module") for ln in lines), \
        r.stderr
