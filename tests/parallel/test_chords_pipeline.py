"""CHORDS in the generator (parallel_sampling='chords', chords_cores=K): one core makes the sequential euler video
bit for bit; K cores run min_k (k + T - s_k) batched rounds, each core's velocity the DiT's on that latent alone,
and their video's PSNR against the sequential one is reported; what CHORDS cannot run with is refused before
compute."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fastwan.errors import InvalidArgument, InvalidArgumentType
from fastwan.fields import from_json, to_json
from fastwan.parallel.chords import chords, default_init, rounds_needed
from fastwan.pipelines.params import GenerationRequest
from fastwan.pipelines.sampling import Schedule

PROMPT = "a red fox runs through snow"
SIZE = dict(height=32, width=32, num_frames=5)
EULER = dict(sampler="euler", flow_shift=5.0, seed=7, save_video=False, **SIZE)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)


def test_one_core_is_the_sequential_video(gen):
    seq = gen.generate_video(PROMPT, num_inference_steps=6, guidance_scale=1.0, **EULER)
    one = gen.generate_video(PROMPT, num_inference_steps=6, guidance_scale=1.0, chords_cores=1, **EULER)
    assert np.array_equal(one.frames, seq.frames)
    assert one.num_transformer_forwards == seq.num_transformer_forwards == 6
    assert one.settings["chords"] == [0] and "chords" not in seq.settings


def test_one_core_is_the_sequential_video_with_per_token_timesteps(tiny_ckpts):
    from fastwan import VideoGenerator

    ti2v = VideoGenerator.from_pretrained(tiny_ckpts["wan2.2-ti2v"], device="cpu", dtype=torch.float32)
    kw = dict(num_inference_steps=4, guidance_scale=2.0, **EULER)
    seq, one = ti2v.generate_video(PROMPT, **kw), ti2v.generate_video(PROMPT, chords_cores=1, **kw)
    assert seq.frames.std() > 1 and np.abs(one.frames.astype(int) - seq.frames.astype(int)).max() <= 1
    two = ti2v.generate_video(PROMPT, chords_init=[0, 2], **kw)  # 3 rounds instead of 4
    assert two.num_transformer_forwards == 6 and not np.array_equal(two.frames, seq.frames)


def test_cores_follow_the_rule_with_per_latent_velocities(gen):
    steps, cores = 12, 3
    resolved = gen.resolve(GenerationRequest(PROMPT, num_inference_steps=steps, guidance_scale=3.0, chords_cores=cores,
                                             **EULER))
    init = resolved.chords
    assert init == default_init(cores, steps)
    s = resolved.settings
    emb = torch.randn(2, 8, gen.checkpoint.transformer_config.text_dim)
    done = []
    got, forwards = gen._denoise(emb, s, 7, True, None, None, lambda d, n: done.append((d, n)), None, init)
    rounds = rounds_needed(init, steps)
    assert forwards == 2 * rounds and done[-1] == (rounds, rounds)

    # the reference: the same rule, each core's velocity one unbatched CFG pass of the DiT
    schedule = Schedule(s, gen.scheduler, gen.device)
    model = gen.transformers[0]
    x0 = torch.randn((1, 16, 2, 4, 4), generator=torch.Generator().manual_seed(7))
    assert x0.shape == got.shape

    def one(x, i):
        t = schedule.timesteps[i:i + 1]
        pos, neg = model(x, t, emb[:1]), model(x, t, emb[1:2])
        return neg + 3.0 * (pos - neg)

    want = chords(lambda xs, st: torch.stack([one(x, i) for x, i in zip(xs, st)]), x0, schedule.sigmas, cores, init)
    torch.testing.assert_close(got, want.latents, rtol=1e-4, atol=1e-4)


def test_psnr_against_the_sequential_video(gen, capsys):
    seq = gen.generate_video(PROMPT, num_inference_steps=20, guidance_scale=3.0, **EULER)
    for init in (default_init(8, 20), (0, 4, 8, 12)):  # 11 rounds each (the default 8-core: 0, 1, 2, 3, 6, ...)
        par = gen.generate_video(PROMPT, num_inference_steps=20, guidance_scale=3.0, chords_init=init, **EULER)
        rounds, cores = rounds_needed(init, 20), len(init)
        assert par.num_transformer_forwards == 2 * rounds < seq.num_transformer_forwards
        with capsys.disabled():
            print(f"\nCHORDS {cores} cores, 20 steps: {rounds} rounds, PSNR {psnr(par.frames, seq.frames):.1f} dB "
                  "against the sequential video")
        assert psnr(par.frames, seq.frames) > 15  # the same video, not noise


@pytest.mark.parametrize("kw,exc,msg", [
    (dict(chords_cores=2), InvalidArgument, "sampler='default' cannot run with it: pass sampler='euler'"),
    (dict(chords_cores=2, sampler="dmd"), InvalidArgument, "sampler='dmd' cannot run with it"),
    (dict(chords_cores=5, sampler="euler", num_inference_steps=4), InvalidArgument, "exceeds the 4 steps"),
    (dict(chords_cores=0, sampler="euler"), InvalidArgument, "chords_cores=0 must be >= 1"),
    (dict(chords_cores=2.5, sampler="euler"), InvalidArgumentType, "must be an int >= 1"),
    (dict(parallel_sampling="chords", sampler="euler"), InvalidArgument, "needs chords_cores=K"),
    (dict(parallel_sampling="picard", chords_cores=2), InvalidArgument, "parallel_sampling='picard' is not one of"),
    (dict(chords_cores=2, sampler="euler", cache="first_block"), InvalidArgument, "cannot run with a step cache"),
    (dict(chords_cores=3, chords_init=[0, 2], sampler="euler"), InvalidArgument,
     "chords_init=[0, 2] must be 3 strictly increasing steps from 0"),
    (dict(chords_init=[0, 2, 2], sampler="euler"), InvalidArgument, "strictly increasing"),
    (dict(chords_init="0,2", sampler="euler"), InvalidArgumentType, "must be a list of steps"),
])
def test_refused_before_compute(no_compute, kw, exc, msg):
    with pytest.raises(exc, match=msg.replace("(", r"\(").replace("[", r"\[")):
        no_compute.generate_video(PROMPT, seed=0, save_video=False, **SIZE, **kw)


def test_generator_settings_refused_before_compute(no_compute, monkeypatch):
    monkeypatch.setattr(no_compute, "cfg_gate_step", 0.5)
    with pytest.raises(InvalidArgument, match="cannot run with cfg_gate_step"):
        no_compute.generate_video(PROMPT, chords_cores=2, num_inference_steps=8, **EULER)


def test_request_json_and_flag():
    r = GenerationRequest(PROMPT, chords_init=[0, 2, 5], sampler="euler")
    assert r.parallel_sampling == "chords" and r.chords_cores == 3 and r.chords_init == (0, 2, 5)
    assert from_json(GenerationRequest, to_json(r)) == r


def test_cli_chords(tmp_path, capsys):
    from fastwan import cli

    out = tmp_path / "v.mp4"
    args = ["generate", "--prompt", "a fox", "--model", "tiny", "--seed", "1", "--steps", "6", "--output", str(out)]
    capsys.readouterr()
    assert cli.main([*args, "--chords", "2"]) == 2 and not out.exists()  # the default scheduler
    err = capsys.readouterr().err
    errors = [ln for ln in err.split("\n") if "error" in ln]
    assert "Traceback" not in err and len(errors) == 1 and "--chords 2 (CHORDS)" in errors[0], err
    assert "pass --sampler 'euler'" in errors[0]
    assert cli.main([*args, "--sampler", "euler", "--chords-init", "0,2,3"]) == 0 and out.is_file()
