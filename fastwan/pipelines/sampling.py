"""Samplers: how the denoising loop turns the DiT's flow prediction into the next latents.

``sampler`` (``generate_video`` / ``--sampler``):

- ``"default"``: the checkpoint's own diffusers scheduler (``scheduler_config.json``; UniPC for the Wan
  releases), ``num_inference_steps`` steps, its ``flow_shift`` unless ``flow_shift`` is given.
- ``"euler"``: flow-matching Euler, as step-distilled models (lightx2v's 4-step LoRAs, CausVid) sample.
  ``timesteps`` are points of the 1000-step training grid, t_i = 1000, 750, 500, 250 by default for 4 steps
  (evenly spaced from 1000); each becomes sigma_i = shift * s / (1 + (shift - 1) * s) with s = t_i / 1000,
  the model sees 1000 * sigma_i, and x <- x + (sigma_{i+1} - sigma_i) * v with sigma_N = 0.
- ``"dmd"``: DMD sampling as FastVideo runs its FastWan models (``DmdDenoisingStage`` in
  fastvideo/pipelines/stages/denoising.py): the model sees t_i itself (1000, 757, 522 for FastWan); sigma_i is
  the sigma of the shifted 1000-step flow-matching grid nearest to t_i / 1000 (``pred_noise_to_pred_video`` and
  ``add_noise``: the argmin over the grid's timesteps); x0 = x - sigma_i * v; then
  x <- (1 - sigma_{i+1}) * x0 + sigma_{i+1} * noise with fresh Gaussian noise (from the request's seed), and the
  last step returns x0. The grid's shift is ``flow_shift`` when the call or the preset gives one, else FastVideo's
  DMD stage's own, 8 (it builds ``FlowMatchEulerDiscreteScheduler(shift=8.0)`` whatever the checkpoint's
  scheduler says). Timesteps are not warped; a whole-number t_i is what FastVideo passes (it reads them as
  ``torch.long``), a fractional one is taken as it is, the grid's nearest sigma with it (FastVideo's warped
  DMD schedules, e.g. 1000 * shift(t / 1000), are such timesteps).

``timesteps`` (euler and dmd only) are strictly decreasing numbers in (0, 1000] (a list, tuple or 1-d numpy array /
torch tensor; ints or floats) on the 1000-step training grid, not sigmas: a list within [0, 1], such as
[1.0, 0.75, 0.5, 0.25, 0.0], is refused as sigmas, naming the timesteps to pass; given, they set the step count.
euler and dmd run only where the checkpoint's scheduler has ``num_train_timesteps`` 1000 (every Wan release).
A checkpoint's preset may carry a sampler, timesteps and flow shift (FastWan: dmd, (1000, 757, 522), 8); a call
that asks for another step count without timesteps gets evenly spaced ones.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Set
from dataclasses import replace

import torch

from fastwan.checkpoint.components import SHIFT_KEYS
from fastwan.checkpoint.presets import DMD_SHIFT
from fastwan.errors import InvalidArgument, InvalidArgumentType
from fastwan.pipelines.inputs import as_float, finite_float
from fastwan.values import python_number

SAMPLERS = ("default", "euler", "dmd")
TRAIN_TIMESTEPS = 1000  # the Wan models' flow-matching training grid
NUMBER_FIELDS = ("height", "width", "num_frames", "num_inference_steps", "guidance_scale", "guidance_scale_2", "fps")


def check_sampling(preset, sampler=None, timesteps=None, flow_shift=None, num_inference_steps=None):
    """``preset`` (a :class:`~fastwan.checkpoint.presets.Preset`) with the call's sampling settled from its
    arguments (``None``: the preset's value): ``sampler``, ``num_inference_steps``, ``timesteps`` (None: the
    sampler's own) and ``flow_shift`` (None: the checkpoint scheduler's). Raises before any compute on an unknown
    sampler, timesteps that are not strictly decreasing in (0, 1000], timesteps with the default sampler, a step
    count that disagrees with the timesteps, or a flow shift that is not positive. Every number of the result is
    the Python number the call gave (:func:`~fastwan.values.python_number`: NumPy / torch scalars
    converted), so the settings, their digest and every size computed from them are plain ints and floats."""
    preset = replace(preset, **{k: python_number(getattr(preset, k)) for k in NUMBER_FIELDS})
    num_inference_steps, flow_shift = python_number(num_inference_steps), python_number(flow_shift)
    name = check_sampler(preset.sampler if sampler is None else sampler)
    steps = preset.num_inference_steps if num_inference_steps is None else num_inference_steps
    integral = isinstance(steps, numbers.Integral) and not isinstance(steps, bool)
    if not integral or steps < 1:  # a type error for a non-int, a value error for an int out of range
        raise (InvalidArgument if integral else InvalidArgumentType)(
            f"num_inference_steps={steps!r} must be an int >= 1 (e.g. 50; 3 or 4 for distilled models).",
            field="num_inference_steps")
    if timesteps is not None:
        ts = _check_timesteps(timesteps)
        if name == "default":
            raise InvalidArgument(f"timesteps={list(ts)!r} need sampler='euler' or 'dmd'; the default "
                                  "sampler takes its timesteps from the checkpoint's scheduler (num_inference_steps).",
                                  field="timesteps")
        if num_inference_steps is not None and num_inference_steps != len(ts):
            raise InvalidArgument(f"num_inference_steps={num_inference_steps!r} disagrees with the {len(ts)} "
                                  f"timesteps {list(ts)}; pass one of the two.", field="num_inference_steps")
        steps = len(ts)
    elif name == "default" or sampler is not None and sampler != preset.sampler:
        ts = None  # the sampler's own schedule
    else:  # the preset's timesteps hold for the preset's step count only
        ts = preset.timesteps if preset.timesteps is not None and len(preset.timesteps) == steps else None
    shift = check_flow_shift(preset.flow_shift if flow_shift is None else flow_shift)
    return replace(preset, sampler=name, num_inference_steps=int(steps), timesteps=ts, flow_shift=shift)


def check_sampler(name) -> str:
    """Rule: a sampler is one of :data:`SAMPLERS`."""
    if not isinstance(name, str) or name not in SAMPLERS:
        raise (InvalidArgument if isinstance(name, str) else InvalidArgumentType)(
            f"sampler={name!r} is not one of {SAMPLERS}: 'default' (the checkpoint's scheduler), "
            "'euler' (step-distilled models), 'dmd' (FastWan / DMD-distilled models).", field="sampler")
    return name


def check_flow_shift(value) -> float | None:
    """Rule: a flow shift is None (the sampler's own) or a finite number > 0 (a NumPy / torch scalar as its
    number); returned as a float."""
    value = python_number(value)
    if value is None:
        return None
    number = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not number or (finite_float(value) or 0) <= 0:
        raise (InvalidArgument if number else InvalidArgumentType)(
            f"flow_shift={value!r} must be > 0 (a finite number, e.g. 3.0 at 480p, 5.0 at 720p, 8.0 for FastWan).",
            field="flow_shift")
    return float(value)


def _check_timesteps(timesteps) -> tuple[float, ...]:
    """Rule: an ordered sequence of real numbers (a list, tuple, generator, or a 1-d numpy array / torch tensor);
    not a string, set or mapping (no order) and not a 0-d or n-d array."""
    ndim = getattr(timesteps, "ndim", None)  # numpy arrays and scalars, torch tensors
    if ndim is not None and ndim != 1:
        raise InvalidArgumentType(f"timesteps={timesteps!r} is {ndim}-dimensional; it must be one list of numbers, "
                                  "e.g. [1000, 757, 522].", field="timesteps")
    if isinstance(timesteps, (str, bytes, Set, Mapping)) or not hasattr(timesteps, "__iter__"):
        raise InvalidArgumentType(f"timesteps={timesteps!r} must be a list of numbers in order (from noise to "
                                  "clean), e.g. [1000, 757, 522].", field="timesteps")
    if isinstance(timesteps, torch.Tensor):
        if timesteps.is_meta:
            raise InvalidArgumentType(f"timesteps={timesteps!r} is a meta tensor, which holds no values; pass the "
                                      "timesteps themselves, e.g. [1000, 757, 522].",
                                      field="timesteps")
        timesteps = timesteps.tolist()
    ts = tuple(python_number(t) for t in timesteps)
    if not ts or any(isinstance(t, bool) or not isinstance(t, numbers.Real) for t in ts):
        raise InvalidArgumentType(f"timesteps={list(ts)!r} must be a non-empty list of numbers, e.g. [1000, 757, 522].",
                                  field="timesteps")
    ts = tuple(as_float(t) for t in ts)
    if all(0 <= t <= 1 for t in ts) and ts[0] > 0:  # sigmas, as diffusers' schedulers and ComfyUI take them
        grid = [float(f"{t * TRAIN_TIMESTEPS:.6g}") for t in ts if t > 0]
        raise InvalidArgument(
            f"timesteps={list(ts)!r} look like sigmas (all within [0, 1]); timesteps are points of the "
            f"{TRAIN_TIMESTEPS}-step training grid (sigma x {TRAIN_TIMESTEPS}; the final 0 is implied): pass "
            f"{grid!r}.", field="timesteps")
    bad = [t for t in ts if not (math.isfinite(t) and 0 < t <= TRAIN_TIMESTEPS)]
    head = ts[:-1]
    if bad == [0.0] and ts[-1] == 0 and head and all(b < a for a, b in zip(head, head[1:])):  # the end point 0
        raise InvalidArgument(f"timesteps={list(ts)!r}: 0.0 is outside (0, {TRAIN_TIMESTEPS}]; it is not a step, "
                              f"every sampler ends at 0 by itself: drop the final 0 and pass {list(head)!r}.",
                              field="timesteps")
    if bad:
        raise InvalidArgument(f"timesteps={list(ts)!r}: {bad[0]} is outside (0, {TRAIN_TIMESTEPS}]; timesteps are "
                              f"points of the {TRAIN_TIMESTEPS}-step training grid, e.g. [1000, 757, 522].",
                              field="timesteps")
    if any(b >= a for a, b in zip(ts, ts[1:])):
        raise InvalidArgument(f"timesteps={list(ts)!r} must be strictly decreasing (from noise to clean), "
                              "e.g. [1000, 757, 522].", field="timesteps")
    return ts


def evenly_spaced(n: int) -> tuple[float, ...]:
    """n training timesteps from 1000 down in equal strides: 4 -> (1000, 750, 500, 250)."""
    return tuple(TRAIN_TIMESTEPS * (1 - i / n) for i in range(n))


def shifted(s: torch.Tensor, shift: float) -> torch.Tensor:
    """The flow shift of sigmas s in [0, 1]: shift * s / (1 + (shift - 1) * s)."""
    return shift * s / (1 + (shift - 1) * s)


def grid_sigma(t: float, shift: float) -> float:
    """The sigma of the shifted 1000-step flow-matching grid (s = k / 1000, k = 1..1000) nearest t / 1000."""
    grid = shifted(torch.arange(1, TRAIN_TIMESTEPS + 1, dtype=torch.float64) / TRAIN_TIMESTEPS, shift)
    return float(grid[torch.argmin((grid * TRAIN_TIMESTEPS - t).abs())])


def check_training_grid(s, scheduler) -> None:
    """Rule: euler and dmd place their timesteps on the 1000-step training grid (sigma = t / 1000, the DiT sees
    t or 1000 sigma), so they run only where the checkpoint's scheduler counts that many training timesteps
    (diffusers' flow-matching schedulers take sigma = t / ``num_train_timesteps``); the default sampler runs on any."""
    n = scheduler.config.get("num_train_timesteps")
    if s.sampler == "default" or n is None or n == TRAIN_TIMESTEPS:
        return
    raise InvalidArgument(
        f"sampler={s.sampler!r} samples on the {TRAIN_TIMESTEPS}-step training grid (timesteps in (0, "
        f"{TRAIN_TIMESTEPS}]), but the checkpoint's {type(scheduler).__name__} has num_train_timesteps={n!r}, so its "
        "DiT reads timesteps on another scale; use sampler='default' (the checkpoint's scheduler).", field="sampler")


def sampler_shift(s, scheduler) -> float:
    """The flow shift an euler / dmd request ``s`` samples with: its own (the call's or the preset's), else for
    dmd FastVideo's DMD stage's (:data:`~fastwan.checkpoint.presets.DMD_SHIFT`) and for euler the checkpoint
    scheduler's; raises when an euler request has none."""
    if s.flow_shift is not None:
        return s.flow_shift
    if s.sampler == "dmd":
        return DMD_SHIFT
    cfg = scheduler.config
    for key in SHIFT_KEYS:
        if cfg.get(key) is not None:
            return float(cfg[key])
    raise InvalidArgument(f"sampler={s.sampler!r} needs a flow_shift: the checkpoint's {type(scheduler).__name__} "
                          "has none; pass flow_shift (e.g. 5.0).", field="sampler")


def fresh_scheduler(scheduler, flow_shift: float | None = None):
    """A new diffusers scheduler of ``scheduler``'s config (its own step state), with ``flow_shift`` set when
    given; raises if that scheduler has no flow shift."""
    kw = {}
    if flow_shift is not None:
        key = next((k for k in SHIFT_KEYS if k in scheduler.config), None)
        if key is None:
            raise InvalidArgument(f"flow_shift={flow_shift} cannot be set on the checkpoint's "
                                  f"{type(scheduler).__name__}, which has no flow shift; use sampler='euler'.",
                                  field="flow_shift")
        kw[key] = flow_shift
    return type(scheduler).from_config(scheduler.config, **kw)


class Schedule:
    """One request's steps: ``timesteps`` [n] (what the model sees, fp32 on the device) and :meth:`step`.
    ``s``: the request's settings, sampling settled by :func:`check_sampling`."""

    def __init__(self, s, scheduler, device: torch.device, generator: torch.Generator | None = None):
        self.sampler, self.generator = s.sampler, generator
        self.scheduler = None
        if s.sampler == "default":
            self.scheduler = fresh_scheduler(scheduler, s.flow_shift)
            self.scheduler.set_timesteps(s.num_inference_steps, device=device)
            self.timesteps = self.scheduler.timesteps
            return
        shift = sampler_shift(s, scheduler)
        ts = s.timesteps or evenly_spaced(s.num_inference_steps)
        if s.sampler == "euler":
            sig = shifted(torch.tensor(ts, dtype=torch.float64) / TRAIN_TIMESTEPS, shift)
            self.sigmas = sig.tolist() + [0.0]
            self.timesteps = (sig * TRAIN_TIMESTEPS).to(torch.float32).to(device)
        else:
            self.sigmas = [grid_sigma(t, shift) for t in ts] + [0.0]
            self.timesteps = torch.tensor(ts, dtype=torch.float32, device=device)

    def start_from(self, clean: torch.Tensor, noise: torch.Tensor, first: int) -> torch.Tensor:
        """Drop the first ``first`` steps; the latents at the new first step: ``clean`` noised to its level by
        ``noise`` (the scheduler's ``add_noise``, else its ``scale_noise``; (1 - sigma) x + sigma noise for
        fastwan's own samplers)."""
        t = self.timesteps[first:first + 1]
        if self.scheduler is not None:
            if hasattr(self.scheduler, "add_noise"):
                noised = self.scheduler.add_noise(clean, noise, t)
            else:
                noised = self.scheduler.scale_noise(clean, t, noise)
        else:
            sigma = self.sigmas[first]
            noised = (1 - sigma) * clean + sigma * noise
            self.sigmas = self.sigmas[first:]
        self.timesteps = self.timesteps[first:]
        return noised

    def step(self, pred: torch.Tensor, i: int, latents: torch.Tensor) -> torch.Tensor:
        """The latents after step i from the flow prediction ``pred`` (v = noise - x0) at ``latents`` (fp32)."""
        if self.scheduler is not None:
            return self.scheduler.step(pred, self.timesteps[i], latents, return_dict=False)[0]
        sigma, nxt = self.sigmas[i], self.sigmas[i + 1]
        v = pred.to(latents.dtype)
        if self.sampler == "euler":
            return latents + (nxt - sigma) * v
        x0 = latents - sigma * v
        if nxt == 0.0:
            return x0
        noise = torch.randn(latents.shape, generator=self.generator, device=latents.device, dtype=latents.dtype)
        return (1 - nxt) * x0 + nxt * noise

