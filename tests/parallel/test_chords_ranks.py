"""CHORDS over processes (fastwan.parallel.chords_ranks): each core's part of the rule, run core after core in one
process with the messages handed over, equals the batched solver bit for bit, and runs only the rounds the returned
core needs; on 2 and 4 gloo processes (a core a process, and 2 cores of 2 sequence-parallel processes) the tiny
Wan2.1 video equals the one-process CHORDS video within 1 (fp32), with one core the sequence-parallel sequential
video; layouts that cannot run are refused before any model loads or any compute, naming those that can."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from types import SimpleNamespace

from fastwan import GenerationRequest, VideoGenerator
from fastwan.errors import InvalidArgument
from fastwan.parallel.chords import chords, default_init
from fastwan.parallel.chords_ranks import ChordsPlan, check_layout, run_core

RUN = dict(height=48, width=80, num_frames=9, sampler="euler", flow_shift=5.0, seed=3, save_video=False)


def _sigmas(steps: int, shift: float = 3.0) -> list[float]:
    s = [1 - i / steps for i in range(steps)]
    return [shift * x / (1 + (shift - 1) * x) for x in s] + [0.0]


def _f(x, i):
    return torch.sin(1.3 * x + 0.1 * i) - 0.2 * x


def _cores_in_turn(x0, sig, init):
    """Every core's part of the rule, core 0 first (values flow only upward), the messages through a mailbox ->
    (the returned latents, the plan, the (core, step) of every velocity call)."""
    plan, box, calls, out = ChordsPlan.of(init, len(sig) - 1), {}, [], None
    for k in range(len(init)):
        def velocity(x, i, k=k):
            calls.append((k, i))
            return _f(x, i)

        def send(r, v, k=k):
            assert plan.sends(k, r) and (k + 1, r) not in box
            box[k + 1, r] = v

        got = run_core(velocity, x0 if k == 0 else None, sig, plan, k, send, lambda r, k=k: box.pop((k, r)))
        out = got if got is not None else out
    assert not box  # every value sent was used
    return out, plan, calls


@pytest.mark.parametrize("steps,init", [(20, default_init(8, 20)), (20, (0, 4, 8, 12)), (8, (0, 1, 2, 3)),
                                        (8, (0, 2, 4, 6)), (12, (0, 1, 5)), (10, (0, 3, 4, 9)), (6, (0,))])
def test_cores_in_turn_equal_the_batched_solver(steps, init):
    x0 = torch.randn(2, 3, generator=torch.Generator().manual_seed(0))
    sig = _sigmas(steps)
    want = chords(lambda xs, st: torch.stack([_f(x, i) for x, i in zip(xs, st)]), x0, sig, len(init), init)
    got, plan, calls = _cores_in_turn(x0, sig, init)
    assert torch.equal(got, want.latents) and plan.result == want.core and plan.rounds == len(want.rounds)
    # each call is one the batched solver made (the same core at the same step), none above the returned core
    batched = {(k, i) for rnd in want.rounds for k, i in enumerate(rnd)}
    assert set(calls) <= batched and all(k <= want.core for k, _ in calls)
    assert len(calls) == len(set(calls)) and max(plan.last) == plan.rounds - 1


@pytest.mark.parametrize("cores,num_gpus,cfg,msg", [
    (3, 4, False, r"chords_cores=3 \(CHORDS\) cannot run on num_gpus=4 processes: .* on 4 processes use "
                  r"chords_cores in \[1, 2, 4\], or load 3 cores with num_gpus in \[3, 6, 12\]"),
    (4, 2, False, r"num_gpus must be a multiple of chords_cores; on 2 processes use chords_cores in \[1, 2\]"),
    (2, 4, True, r"cannot run with cfg_parallel=True .* num_gpus=2 x S .* \(e.g. num_gpus=2 or 4\)"),
])
def test_layouts_that_cannot_run(cores, num_gpus, cfg, msg):
    with pytest.raises(InvalidArgument, match=msg):
        check_layout(cores, num_gpus, cfg)
    for n in (None, 1, cores, 2 * cores):
        check_layout(cores, n)  # these run


def test_a_generator_of_processes_refuses_before_compute(no_compute, monkeypatch):
    monkeypatch.setattr(no_compute, "parallel", SimpleNamespace(world=4, cfg_size=1, writes=True, rank=0,
                                                                check_cache=lambda c: None))
    with pytest.raises(InvalidArgument, match="chords_cores=3 .* cannot run on num_gpus=4 processes"):
        no_compute.generate_video("a cat", num_inference_steps=8, chords_cores=3, **RUN)


def test_cli_refuses_before_loading(tmp_path, capsys, monkeypatch):
    from fastwan import cli

    monkeypatch.setattr(VideoGenerator, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    out = tmp_path / "v.mp4"
    code = cli.main(["generate", "--prompt", "a fox", "--model", "tiny", "--steps", "8", "--sampler", "euler",
                     "--chords", "3", "--sp", "2", "--output", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "--chords 3 (CHORDS) cannot run on num_gpus=2 processes" in err and not out.exists(), err


def _close(a, b) -> None:
    assert a.shape == b.shape and b.std() > 5
    assert np.abs(a.astype(int) - b.astype(int)).max() <= 1


@pytest.fixture(scope="module")
def one(tiny_ckpts):
    return VideoGenerator.from_pretrained(tiny_ckpts["wan2.1"], device="cpu", dtype=torch.float32)


class Stop(Exception):
    pass


def stop_at_2(done, total):
    if done == 2:
        raise Stop(done)


@pytest.mark.parametrize("num_gpus,runs", [
    (2, [dict(chords_init=[0, 4], guidance_scale=5.0), dict(chords_cores=1, guidance_scale=1.0)]),
    (4, [dict(chords_init=[0, 2, 4, 6], guidance_scale=5.0),  # 4 cores of a process each
         dict(chords_init=[0, 3], guidance_scale=1.0)]),  # 2 cores of 2 sequence-parallel processes each
])
def test_video_over_processes_equals_one_process(tiny_ckpts, one, num_gpus, runs):
    requests = [GenerationRequest("a cat", num_inference_steps=8, **RUN, **kw) for kw in runs]
    wants = [one.generate(r) for r in requests]
    par = VideoGenerator.from_pretrained(tiny_ckpts["wan2.1"], device="cpu", dtype=torch.float32, num_gpus=num_gpus)
    got, raised, again = [], [], []

    def calls():
        try:
            for r in requests:
                steps = []
                got.append((par.generate(r, on_step=lambda done, total, steps=steps: steps.append((done, total))),
                            steps))
            with pytest.raises(Stop):  # a stop at round 2, then the first request again: no message left over
                par.generate(requests[0], on_step=stop_at_2)
            again.append(par.generate(requests[0]))
            for r in (r for r in requests if r.chords_cores == 1):  # one core: sequential sampling over the ranks
                got.append((par.generate(r.replace(chords_cores=None, parallel_sampling=None)), None))
        except BaseException as exc:  # noqa: BLE001
            raised.append(exc)

    t = threading.Thread(target=calls, daemon=True)
    t.start()
    t.join(120)
    hung = t.is_alive()
    par.close(force=hung)  # a rank waiting for a message that never comes is ended, not waited for
    if hung or raised:
        raise AssertionError("the ranks did not finish in 120 s" if hung else raised[0])
    assert np.array_equal(again[0].frames, got[0][0].frames)
    for kw, want, (res, steps) in zip(runs, wants, got):
        _close(res.frames, want.frames)
        assert res.num_transformer_forwards == want.num_transformer_forwards
        rounds = want.num_transformer_forwards // (2 if kw["guidance_scale"] > 1 else 1)
        assert steps == [(k, rounds) for k in range(1, rounds + 1)]
        if kw.get("chords_cores") == 1:
            assert np.array_equal(res.frames, got[-1][0].frames)
