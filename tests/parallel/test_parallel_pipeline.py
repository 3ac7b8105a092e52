"""Parallel generators on the CPU (gloo): ``from_pretrained(num_gpus=N, cfg_parallel=...)`` starts N worker
processes whose video equals the one-process video (fp32, uint8 frames within 1) for Wan2.1, Wan2.2-A14B (across
the expert switch), TI2V and Wan2.1-I2V with an image, at token counts neither 2 nor 4 divide (45), with sequence
parallelism, CFG parallelism, both (4 processes), ring attention (3 processes on the tiny DiT's 2 heads; a pinned
ring of 2 in each CFG group), CFG gating, sparse backends and compiled blocks; only rank 0
writes; a failing rank ends the job with its rank named, a user error raised alike on every rank is raised as
itself; the checks before any process starts."""
from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from PIL import Image

from fastwan import VideoGenerator
from fastwan.attention.registry import attention_backend
from fastwan.errors import InvalidArgument, OutputExistsError
from fastwan.parallel.workers import ParallelError, ParallelGenerator
from fastwan.checkpoint.tiny import write_tiny_checkpoint

SIZES = {"wan2.2-ti2v": dict(height=96, width=160)}  # token grid 3 x 3 x 5 = 45 for every variant
RUN = dict(height=48, width=80, num_frames=9, num_inference_steps=4, guidance_scale=5.0, seed=3, save_video=False)


def image():
    return Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 56, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {v: write_tiny_checkpoint(root / v, v, seed=i) for i, v in
            enumerate(("wan2.1", "wan2.2-a14b", "wan2.2-ti2v", "wan2.1-i2v"))}


def video(gen, variant, **kw):
    return gen.generate_video("a cat", **{**RUN, **SIZES.get(variant, {}), **kw}).frames


CASES = [
    ("wan2.1", dict(num_gpus=2), {}),
    ("wan2.2-a14b", dict(num_gpus=2, cfg_parallel=True), {}),
    ("wan2.2-a14b", dict(num_gpus=4, cfg_parallel=True, cfg_gate_step=0.5), {}),
    ("wan2.2-ti2v", dict(num_gpus=4, cfg_parallel=True), dict(image=True)),
    ("wan2.1-i2v", dict(num_gpus=2), dict(image=True)),
    ("wan2.1", dict(num_gpus=2, attention_backend="SLIDING_TILE_ATTN", attention_config={"tile": [1, 2, 2]}), {}),
    ("wan2.1", dict(num_gpus=4, cfg_parallel=True, attention_backend="VIDEO_SPARSE_ATTN",
                    attention_config={"tile": [1, 2, 2], "sparsity": 0.5}), {}),
    ("wan2.1", dict(num_gpus=2, enable_torch_compile=True), {}),  # blocks compiled fullgraph around the all-to-alls
    ("wan2.1", dict(num_gpus=3), {}),  # 2 heads on 3 processes: a ring of 3 (Ulysses cannot split 2 heads 3 ways)
    ("wan2.2-a14b", dict(num_gpus=3), dict(cfg_only=True)),
    # each CFG group a ring of 2 (pinned)
    ("wan2.1", dict(num_gpus=4, cfg_parallel=True, ring_degree=2), dict(cfg_only=True)),
]


@pytest.mark.parametrize("variant,load,req", CASES, ids=[
    "sp2", "a14b-cfg2", "a14b-cfg2xsp2-gated", "ti2v-image-cfg2xsp2", "i2v-sp2", "sliding-tile-sp2", "vsa-cfg2xsp2",
    "compiled-sp2", "ring3", "a14b-ring3", "cfg2xring2"])
def test_parallel_video_equals_one_process(ckpts, variant, load, req):
    kws = ({}, {"guidance_scale": 1.0, "negative_prompt": "x"})[:1 if req.get("cfg_only") else 2]
    req = {"image": image()} if req.get("image") else {}
    common = dict(device="cpu", dtype=torch.float32)
    one = VideoGenerator.from_pretrained(ckpts[variant], **common, **{k: v for k, v in load.items() if k not in (
        "num_gpus", "cfg_parallel", "enable_torch_compile", "ring_degree")})
    with VideoGenerator.from_pretrained(ckpts[variant], **common, **load) as par:
        assert isinstance(par, ParallelGenerator) and par.preset == one.preset
        for kw in kws:  # with CFG, and without (no uncond pass)
            want, got = video(one, variant, **req, **kw), video(par, variant, **req, **kw)
            assert got.shape == want.shape and want.std() > 5
            assert np.abs(got.astype(int) - want.astype(int)).max() <= 1


def test_only_rank_0_writes_and_user_errors_keep_the_workers(ckpts, tmp_path):
    with VideoGenerator.from_pretrained(ckpts["wan2.1"], device="cpu", dtype=torch.float32, num_gpus=2) as par:
        out = tmp_path / "v.mp4"
        res = par.generate_video("a cat", **{**RUN, "save_video": True}, output_path=out)
        assert res.video_path == str(out) and out.exists()
        assert sorted(os.listdir(tmp_path)) == ["v.mp4"]
        with pytest.raises(OutputExistsError, match="v.mp4"):  # every rank checks the same path before compute
            par.generate_video("a cat", **{**RUN, "save_video": True}, output_path=out)
        with pytest.raises(InvalidArgument, match="num_frames"):
            par.generate_video("a cat", **{**RUN, "num_frames": 8})
        assert par.generate_video("a cat", **RUN).frames.shape == (9, 48, 80, 3)  # the workers are still there


def _failing_worker(rank, world, store, loader, model, kwargs, device, conn):
    """As the real worker does after an error, rank 1 reports it and waits for the next request, while rank 0
    waits for rank 1 in a collective that never completes."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    conn.send(("ok", {"checkpoint": None, "preset": None, "memory_plan": None}))
    conn.recv()
    if rank == 1:
        exc = RuntimeError("CUDA out of memory on this rank")
        conn.send(("error", rank, exc, f"Traceback ...\nRuntimeError: {exc}"))
        conn.recv()
    else:
        dist.barrier()


def test_a_failing_rank_ends_the_job_naming_it():
    par = ParallelGenerator(None, "unused", {}, 2, torch.device("cpu"), target=_failing_worker)
    procs = list(par._procs)
    raised = []

    def call():
        try:
            par.generate_video("a cat")
        except BaseException as exc:  # noqa: BLE001
            raised.append(exc)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(60)
    if t.is_alive():  # the call hangs on the failed rank: end the workers so the test itself ends
        par.close(force=True)
        pytest.fail("generate_video still waits 60 s after rank 1 failed")
    assert len(raised) == 1 and isinstance(raised[0], ParallelError)
    assert "rank 1 of 2 failed: RuntimeError: CUDA out of memory on this rank" in str(raised[0])
    assert not any(p.is_alive() for p in procs)  # rank 0, stuck in its barrier, was stopped
    with pytest.raises(ParallelError, match="have ended"):
        par.generate_video("a cat")


@pytest.mark.parametrize("load,match", [
    (dict(num_gpus=3, cfg_parallel=True), "num_gpus must be even, not 3; use 2 or 4 GPUs"),
    (dict(num_gpus=1, cfg_parallel=True), "must be even, not 1; use 2 GPUs"),
    (dict(cfg_parallel=True), "give num_gpus too"),
    (dict(num_gpus=2.0), "num_gpus=2.0 must be a whole number"),
    (dict(num_gpus=4, ring_degree=1), r"ring_degree=1 cannot split 4 .* use one of ring_degree=2 \(Ulysses 2 x "
                                      r"Ring 2\), ring_degree=4 \(Ulysses 1 x Ring 4\)"),
    (dict(num_gpus=6, ring_degree=4), "ring_degree=4 cannot split 6"),
    (dict(ring_degree=2), "ring_degree=2 splits the sequence .* num_gpus is not given"),
    (dict(num_gpus=3, attention_backend="SLIDING_TILE_ATTN", attention_config={"tile": [1, 2, 2]}),
     "SLIDING_TILE_ATTN cannot run under ring attention"),
    (dict(num_gpus=3, enable_torch_compile=True, torch_compile_kwargs={"fullgraph": True}),
     "fullgraph=True cannot be used with ring attention"),
    (dict(num_gpus=0), "num_gpus=0 must be a whole number >= 1"),
    (dict(num_gpus=2, cfg_parallel="yes"), "cfg_parallel='yes' must be True or False"),
    (dict(num_gpus=2, cache="first_block:threshold=0.1"), "step caches do not run with sequence parallelism"),
    (dict(num_gpus=2, device="cuda"), "CUDA is not available|needs 2 GPUs"),
])
def test_bad_parallel_arguments_raise_before_any_process_starts(ckpts, load, match, monkeypatch):
    monkeypatch.setattr(ParallelGenerator, "__init__", lambda *a, **k: pytest.fail("workers were started"))
    with pytest.raises(InvalidArgument, match=match):
        VideoGenerator.from_pretrained(ckpts["wan2.1"], **{"device": "cpu", **load})


def test_launcher_world_size_must_match(ckpts, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(InvalidArgument, match="num_gpus=2 but this job was launched with 4 processes"):
        VideoGenerator.from_pretrained(ckpts["wan2.1"], device="cpu", num_gpus=2)


def test_a_backend_context_reaches_the_workers(ckpts):
    """An ``attention_backend()`` context around from_pretrained(num_gpus=N) is what every worker builds with
    (contexts do not cross processes: the request travels with the call)."""
    with attention_backend("SLIDING_TILE_ATTN"):
        with VideoGenerator.from_pretrained(ckpts["wan2.1"], device="cpu", dtype=torch.float32, num_gpus=2,
                                            attention_config={"tile": [1, 2, 2]}) as par:
            assert par.generate_video("a cat", **RUN).attention_backend.startswith("SLIDING_TILE_ATTN")


class Stop(Exception):
    pass


def test_step_reports_and_a_stop_at_a_step_keep_the_workers(ckpts, tmp_path):
    """generate(request, on_step=...): rank 0's steps reach the caller one by one; a callback that raises stops every
    rank at the step it was called for, however long it took (no video is written), raises its exception here,
    and the workers make the next video as before."""
    from fastwan import GenerationRequest

    request = GenerationRequest(prompt="a cat", **RUN)
    with VideoGenerator.from_pretrained(ckpts["wan2.1"], device="cpu", dtype=torch.float32, num_gpus=2) as par:
        steps = []
        want = par.generate(request, on_step=lambda done, total: steps.append((done, total))).frames
        assert steps == [(k, RUN["num_inference_steps"]) for k in range(1, RUN["num_inference_steps"] + 1)]

        def stop_at_2(done, total):
            if done == 2:
                time.sleep(1.0)  # a slow callback: the ranks wait for its verdict on step 2, none runs step 3
                raise Stop(done)

        stopped = request.replace(save_video=True, output_path=str(tmp_path / "stopped.mp4"))
        with pytest.raises(Stop):
            par.generate(stopped, on_step=stop_at_2)
        assert not (tmp_path / "stopped.mp4").exists()
        assert (par.generate(request).frames == want).all()  # in step again, no stale stop
        assert (par.generate(request, on_step=lambda d, t: None).frames == want).all()
