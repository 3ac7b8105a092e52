"""generate_video's step-count and seed rules (checked before any compute) and the VAE decode's progress bar.

The step limit is compared with an independent reference: diffusers' scheduler itself, stepped through the whole
schedule on a one-element sample, for each step count tried.
"""
from pathlib import Path

import diffusers
import numpy as np
import pytest
import torch


SMALL = dict(height=64, width=64, num_frames=5, num_inference_steps=2)


# ---- step counts ------------------------------------------------------------------------------------------------
def scheduler_completes(scheduler_cls, config, n: int) -> bool:
    """Reference: whether the scheduler steps through an ``n``-step schedule without raising."""
    s = scheduler_cls.from_config(config)
    s.set_timesteps(n)
    x = torch.ones(1, 1, 1, 1)
    try:
        for t in s.timesteps:
            x = s.step(torch.zeros_like(x), t, x, return_dict=False)[0]
    except Exception:
        return False
    return True


def largest_completing(scheduler_cls, config) -> int:
    """Reference: the largest step count <= num_train_timesteps the scheduler completes (bisection)."""
    lo, hi = 1, config["num_train_timesteps"]
    if scheduler_completes(scheduler_cls, config, hi):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if scheduler_completes(scheduler_cls, config, mid) else (lo, mid)
    return lo


@pytest.mark.parametrize("flow_shift", [3.0, 5.0])
def test_step_limit_is_the_schedulers_own(gen, monkeypatch, forbid_compute, flow_shift):
    cls = type(gen.scheduler)
    config = {**gen.scheduler.config, "flow_shift": flow_shift}
    monkeypatch.setattr(gen, "scheduler", cls.from_config(config))
    limit = largest_completing(cls, config)
    assert not scheduler_completes(cls, config, limit + 1)
    # the largest count the scheduler completes makes a whole video (one frame, no CFG: one forward per step)
    res = gen.generate_video("a cat", seed=0, save_video=False, height=32, width=32, num_frames=1,
                             guidance_scale=1.0, num_inference_steps=limit)
    assert res.frames.shape == (1, 32, 32, 3) and res.num_transformer_forwards == limit
    # the first count it cannot complete is refused before any compute, naming the value and the limit
    forbid_compute(gen)
    with pytest.raises(ValueError) as e:
        gen.generate_video("a cat", seed=0, save_video=False, **{**SMALL, "num_inference_steps": limit + 1})
    assert f"num_inference_steps={limit + 1}" in str(e.value) and f"at most {limit}" in str(e.value)


def test_huge_step_count_is_refused_at_once(gen, forbid_compute):
    forbid_compute(gen)
    with pytest.raises(ValueError) as e:
        gen.generate_video("a cat", seed=0, save_video=False, **{**SMALL, "num_inference_steps": 10**9})
    assert "num_inference_steps=1000000000" in str(e.value) and "1000" in str(e.value)


# ---- seeds --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed,exc", [(-1, ValueError), (2**64, ValueError), (-(2**63), ValueError),
                                      (np.int64(-5), ValueError), (True, TypeError), (1.0, TypeError)])
def test_bad_seed_is_refused_before_compute(gen, forbid_compute, seed, exc):
    forbid_compute(gen)
    with pytest.raises(exc) as e:
        gen.generate_video("a cat", seed=seed, save_video=False, **SMALL)
    assert f"seed={seed!r}" in str(e.value) or f"seed={seed}" in str(e.value)
    assert "2**64" in str(e.value)


def test_largest_seed_is_its_own_video(gen):
    """2**64 - 1 is accepted; -1 (the same torch generator state) is refused, so two names never alias."""
    res = gen.generate_video("a cat", seed=2**64 - 1, save_video=False, **SMALL)
    assert res.seed == 2**64 - 1
    with pytest.raises(ValueError):
        gen.generate_video("a cat", seed=-1, save_video=False, **SMALL)


def test_random_seed_is_reported_and_reproduces(gen, tmp_path):
    a = gen.generate_video("a cat", seed=None, output_path=tmp_path, **SMALL)
    b = gen.generate_video("a cat", output_path=tmp_path, **SMALL)  # None is the default
    assert isinstance(a.seed, int) and 0 <= a.seed < 2**32 and 0 <= b.seed < 2**32
    assert a.seed != b.seed  # fresh entropy each call (equal with probability 2**-32)
    assert f"_{a.seed}_" in Path(a.video_path).name
    again = gen.generate_video("a cat", seed=a.seed, save_video=False, **SMALL)
    assert np.array_equal(again.frames, a.frames)


# ---- decode progress ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("latent_frames,chunk", [(5, 2), (3, 1)])
def test_decode_shows_progress(tiny_ckpts, capsys, latent_frames, chunk):
    from fastwan.vae.decode import decode_latents

    vae = diffusers.AutoencoderKLWan.from_pretrained(Path(tiny_ckpts["wan2.1"]) / "vae").eval()
    z = torch.randn(1, vae.config.z_dim, latent_frames, 4, 4, generator=torch.Generator().manual_seed(0))
    capsys.readouterr()
    decode_latents(vae, z, chunk)
    err = capsys.readouterr().err
    calls = 1 + -(-(latent_frames - 1) // chunk)  # the first latent frame alone, then chunks
    assert "decoding" in err and f"0/{calls}" in err, err


# ---- video sizes ------------------------------------------------------------------------------------------------
def test_video_size_rules_follow_each_axis_patch():
    """The one size check (generate and the profiler): each spatial axis is a multiple of the VAE factor times that
    axis's own patch, and the grid is the patch-wise count, checked against a plain division."""
    from fastwan.errors import InvalidArgument, InvalidArgumentType
    from fastwan.pipelines.inputs import check_video_size

    kw = dict(vae_factors=(4, 8), patch=(1, 2, 4))
    assert check_video_size(64, 96, 9, **kw) == ((9 - 1) // 4 + 1, 64 // 16, 96 // 32)
    with pytest.raises(InvalidArgument, match=r"width=48 is not a multiple of 32 \(VAE factor 8 x patch 4\); use 32 "
                                              r"or 64"):
        check_video_size(64, 48, 9, **kw)
    with pytest.raises(InvalidArgument, match=r"height=40 is not a multiple of 16"):
        check_video_size(40, 96, 9, **kw)
    with pytest.raises(InvalidArgument, match="time patch 2"):
        check_video_size(64, 96, 9, vae_factors=(4, 8), patch=(2, 2, 2))  # 3 latent frames
    with pytest.raises(InvalidArgument, match="rope_max_seq_len=5"):
        check_video_size(64, 192, 9, max_grid=5, **kw)
    with pytest.raises(InvalidArgumentType, match="height=64.0"):
        check_video_size(64.0, 96, 9, **kw)


# ---- requests that would be lost or misread --------------------------------------------------------------------
def test_a_backend_context_around_a_call_must_name_the_built_backend(gen):
    from fastwan.attention.registry import attention_backend
    from fastwan.errors import InvalidArgument

    built = gen.attention.self_backend.name
    with attention_backend(built.lower()):  # the backend the generator runs: fine
        assert gen.generate_video("a cat", seed=1, save_video=False, **SMALL).frames is not None
    with attention_backend("SLIDING_TILE_ATTN"), pytest.raises(
            InvalidArgument, match=rf"attention_backend\('SLIDING_TILE_ATTN'\) context is active, but this generator "
                                   rf"was built with {built}"):
        gen.generate_video("a cat", seed=1, save_video=False, **SMALL)


def test_compile_kwargs_without_compile_are_refused(tiny_ckpts):
    from fastwan import VideoGenerator
    from fastwan.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match=r"torch_compile_kwargs=\{'mode': 'bogus'\} apply only when the DiT "
                                              r"is compiled; pass enable_torch_compile=True"):
        VideoGenerator.from_pretrained(tiny_ckpts["wan2.1"], device="cpu", torch_compile_kwargs={"mode": "bogus"})
    VideoGenerator.from_pretrained(tiny_ckpts["wan2.1"], device="cpu", torch_compile_kwargs={})  # nothing asked


def test_a_step_limit_set_by_the_flow_shift_names_it(gen):
    from fastwan.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match=r"can resolve at flow_shift=100: .* use at most \d+ steps, or a "
                                              r"smaller flow_shift\.$"):
        gen.generate_video("a cat", seed=1, save_video=False, flow_shift=100.0,
                           **{**SMALL, "num_inference_steps": 50})


@pytest.mark.parametrize("kw", [dict(fps="8"), dict(fps=8.0), dict(fps=True), dict(flow_shift="3"), dict(sampler=5)])
def test_a_wrong_type_is_a_type_error(gen, kw):
    from fastwan.errors import InvalidArgumentType

    with pytest.raises(InvalidArgumentType, match=f"{list(kw)[0]}="):
        gen.generate_video("a cat", seed=1, save_video=False, **{**SMALL, **kw})


@pytest.mark.parametrize("kw", [dict(dtype="float32"), dict(vae_dtype=16), dict(cfg_mode=None)])
def test_a_wrong_load_option_type_is_a_type_error(tiny_ckpts, kw):
    from fastwan import VideoGenerator
    from fastwan.errors import InvalidArgumentType

    with pytest.raises(InvalidArgumentType, match=f"{list(kw)[0]}="):
        VideoGenerator.from_pretrained(tiny_ckpts["wan2.1"], device="cpu", **kw)
