"""The rules a checkpoint sets for a video, checked before any compute: sizes against the VAE factors, patch and
RoPE range, the step count against the scheduler's own limit, a second guidance scale against the expert count. Each
failure names the value, the rule and the fix. (The rules that need no checkpoint are the request's:
:mod:`fastwan.pipelines.params`.)
"""
from __future__ import annotations

import math
import secrets

import numpy as np
import torch

from fastwan.checkpoint.components import SHIFT_KEYS
from fastwan.errors import InvalidArgument, InvalidArgumentType

SEED_LIMIT = 2**64  # seeds are ints in [0, SEED_LIMIT): torch.Generator.manual_seed's range, without wrap-around
RANDOM_SEED_BITS = 32  # seed=None draws a seed in [0, 2**RANDOM_SEED_BITS) from the OS's entropy
MAX_FPS = 1000  # the mp4 writer (ffmpeg) clamps or refuses far larger frame rates, and only after the compute


def check_inputs(s, *, vae_factors: tuple[int, int], patch: tuple[int, int, int], scheduler,
                 max_grid: int | None = None, experts: int = 1) -> tuple[int, int, int]:
    """The rules of a checkpoint for the settings ``s`` (a Preset: the request's fields, each already checked by
    :class:`~fastwan.pipelines.params.GenerationRequest`, with the preset's filling the unset ones): a VAE of
    (temporal, spatial) ``vae_factors``, ``experts`` DiTs of ``patch`` size whose RoPE covers ``max_grid`` tokens
    per axis, and ``scheduler`` (the diffusers scheduler that will run the steps; None for fastwan's own samplers,
    whose timesteps were checked); raises InvalidArgument. Returns the DiT's token grid (frames, height, width)."""
    grid = check_video_size(s.height, s.width, s.num_frames, vae_factors=vae_factors, patch=patch,
                            max_grid=max_grid)
    if s.guidance_scale_2 is not None and experts == 1:
        raise InvalidArgument(
            f"guidance_scale_2={s.guidance_scale_2!r} sets the low-noise expert's guidance of a two-expert "
            "(Wan2.2 A14B) checkpoint, but this checkpoint has one DiT; use guidance_scale alone.",
            field="guidance_scale_2")
    if scheduler is not None:  # the default sampler: the checkpoint's scheduler, with the call's flow shift
        _check_num_steps(scheduler, int(s.num_inference_steps))
    return grid


def expert_guidance(preset, guidance_scale, guidance_scale_2) -> tuple:
    """The call's (guidance_scale, guidance_scale_2) before the preset fills what is None. Rule (diffusers'): on a
    two-expert checkpoint a guidance_scale given without guidance_scale_2 sets both experts' scales; neither
    given: the preset's pair."""
    if guidance_scale_2 is None and guidance_scale is not None and preset.guidance_scale_2 is not None:
        return guidance_scale, guidance_scale
    return guidance_scale, guidance_scale_2


def check_frame_size(height, width, *, spatial: int, patch: tuple[int, int, int]) -> None:
    """The frame size rule for a VAE of ``spatial`` factor and a DiT of ``patch`` (time, height, width): height and
    width positive int multiples of the factor times their patch; raises InvalidArgumentType for a non-int,
    InvalidArgument for an int that breaks the rule."""
    for name, v, p in (("height", height, patch[1]), ("width", width, patch[2])):
        step = spatial * p
        if not is_int(v) or v <= 0:  # a type error for a non-int, a value error for an int out of range
            raise (InvalidArgument if is_int(v) else InvalidArgumentType)(
                f"{name}={v!r} must be a positive int (a multiple of {step}).", field=name)
        if v % step:
            lo = max(step, v // step * step)
            raise InvalidArgument(f"{name}={v} is not a multiple of {step} (VAE factor {spatial} x patch {p}); use "
                                  f"{lo} or {lo + step}.", field=name)


def check_video_size(height, width, num_frames, *, vae_factors: tuple[int, int], patch: tuple[int, int, int],
                     max_grid: int | None = None) -> tuple[int, int, int]:
    """The size rules of a video for a VAE of (temporal, spatial) ``vae_factors`` and a DiT of ``patch`` (time,
    height, width) whose RoPE covers ``max_grid`` tokens per axis (None: not checked): the frame size
    (:func:`check_frame_size`), num_frames a positive int ``vt``k+1 whose latent frames
    divide by the time patch, and every token axis within ``max_grid``. Returns the DiT's token grid (frames,
    height, width); raises InvalidArgumentType for a non-int, InvalidArgument for an int that breaks a rule."""
    vt, vs = vae_factors
    check_frame_size(height, width, spatial=vs, patch=patch)
    if not is_int(num_frames) or num_frames < 1:
        raise (InvalidArgument if is_int(num_frames) else InvalidArgumentType)(
            f"num_frames={num_frames!r} must be a positive int of the form {vt}k+1 (e.g. {vt * 20 + 1}).",
            field="num_frames")
    if (num_frames - 1) % vt:
        lo = (num_frames - 1) // vt * vt + 1
        raise InvalidArgument(
            f"num_frames={num_frames} is not {vt}k+1 (the VAE compresses time by {vt}); use {lo} or {lo + vt}.",
            field="num_frames")
    frames = (num_frames - 1) // vt + 1
    if frames % patch[0]:
        raise InvalidArgument(f"num_frames={num_frames} gives {frames} latent frames, not a multiple of the DiT's "
                              f"time patch {patch[0]}; use a num_frames of the form {vt * patch[0]}k+1.",
                              field="num_frames")
    grid = (frames // patch[0], height // (vs * patch[1]), width // (vs * patch[2]))
    for name, v, n in zip(("num_frames", "height", "width"), (num_frames, height, width), grid):
        if max_grid is not None and n > max_grid:
            raise InvalidArgument(
                f"{name}={v} gives {n} DiT tokens along that axis, more than this checkpoint's "
                f"rope_max_seq_len={max_grid}; make the video smaller along it.", field=name)
    return grid


def as_float(value) -> float:
    """A real number as a float; an int beyond the float range as the infinity of its sign."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def finite_float(value) -> float | None:
    """A real number as a finite float, or None when it is NaN, infinite or too large for a float."""
    value = as_float(value)
    return value if math.isfinite(value) else None


def is_int(x) -> bool:
    """An int (Python or NumPy), not a bool."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def random_seed() -> int:
    """A fresh seed from the OS's entropy, in [0, 2**RANDOM_SEED_BITS)."""
    return secrets.randbits(RANDOM_SEED_BITS)


def _check_num_steps(scheduler, n: int) -> None:
    """Refuse a step count the scheduler cannot run, before any compute: at most ``num_train_timesteps``, and a
    strictly decreasing schedule (a dry run of ``set_timesteps`` on CPU). Integer timesteps repeat once steps are
    finer than one timestep where flow_shift packs them (UniPC, shift 3: 999 twice from 334 steps; the larger the
    shift, the fewer steps); a repeated first timestep starts the step counter at its second occurrence, so the last
    ``step`` runs past the schedule."""
    limit = getattr(scheduler.config, "num_train_timesteps", None)
    name = type(scheduler).__name__
    probe = type(scheduler).from_config(scheduler.config)  # the generator's own scheduler keeps its state
    if limit is not None and n > limit:
        most = _largest_distinct_steps(probe, limit)
        raise InvalidArgument(f"num_inference_steps={n} exceeds the {name}'s {limit} training timesteps; "
                              f"use at most {most}{' (e.g. 50)' if most >= 50 else ''}.", field="num_inference_steps")
    if not _distinct_timesteps(probe, n):
        shift = next((getattr(scheduler.config, k) for k in SHIFT_KEYS
                      if getattr(scheduler.config, k, None) is not None), None)
        at = f" at flow_shift={shift:g}" if isinstance(shift, (int, float)) else ""
        most = _largest_distinct_steps(probe, n - 1)
        raise InvalidArgument(
            f"num_inference_steps={n} is more than the {name} can resolve{at}: its timesteps (whole numbers) "
            f"repeat at that count, and it cannot step through a repeated timestep; use at most {most} steps"
            f"{' (e.g. 50)' if most >= 50 else ''}{', or a smaller flow_shift' if at else ''}.",
            field="num_inference_steps")


def _distinct_timesteps(probe, n: int) -> bool:
    """Whether ``n`` steps give a strictly decreasing schedule (``probe``: a scheduler for dry runs, on CPU)."""
    probe.set_timesteps(n, device="cpu")
    t = probe.timesteps.to(torch.float64)
    return bool((t[1:] < t[:-1]).all())


def _largest_distinct_steps(probe, upper: int) -> int:
    """The largest step count <= ``upper`` with a strictly decreasing schedule (1 always is)."""
    for n in range(upper, 1, -1):
        if _distinct_timesteps(probe, n):
            return n
    return 1
