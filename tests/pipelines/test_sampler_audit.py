"""Samplers against independent references, and the forms ``timesteps`` may take.

References: diffusers' FlowMatchEulerDiscreteScheduler for the euler rule (its sigmas set to t_i / 1000 with the
same shift: sigma_i = shift * s / (1 + (shift - 1) * s), x <- x + (sigma_{i+1} - sigma_i) * v, sigma_N = 0), and
the DMD rule written here in float64 (x0 = x - sigma_i * v, then (1 - sigma_{i+1}) * x0 + sigma_{i+1} * noise
with fresh noise from the request's generator; the last step gives x0).
"""
import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from fastwan.errors import InvalidArgumentType
from fastwan.checkpoint.presets import Preset
from fastwan.pipelines.sampling import Schedule, check_sampling

PRESET = Preset(64, 64, 9, 8, 5.0, None, 8)
SIZE = dict(height=64, width=64, num_frames=9)


def schedule(**kw) -> Schedule:
    return Schedule(check_sampling(PRESET, **kw), None, torch.device("cpu"), torch.Generator().manual_seed(3))


@pytest.mark.parametrize("shift", [0.5, 1.0, 3.0, 8.0])
@pytest.mark.parametrize("timesteps", [[1000, 757, 522, 13], [1000], [640.5, 2.25]])
def test_euler_steps_match_diffusers_flow_match_euler(shift, timesteps):
    ours = schedule(sampler="euler", timesteps=timesteps, flow_shift=shift)
    ref = FlowMatchEulerDiscreteScheduler(shift=shift)
    ref.set_timesteps(sigmas=[t / 1000 for t in timesteps])
    torch.testing.assert_close(ours.timesteps, ref.timesteps.float(), rtol=1e-6, atol=1e-4)
    g = torch.Generator().manual_seed(0)
    x = want = torch.randn(1, 4, 2, 4, 4, generator=g)
    for i, t in enumerate(ref.timesteps):
        v = torch.randn(x.shape, generator=g)
        x = ours.step(v, i, x)
        want = ref.step(v, t, want, return_dict=False)[0]
        torch.testing.assert_close(x, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("timesteps,shift", [([1000, 757, 522], 8.0), ([999.5], 3.0), ([700, 30, 1], 5.0)])
def test_dmd_steps_match_the_float64_rule(timesteps, shift):
    ours = schedule(sampler="dmd", timesteps=timesteps, flow_shift=shift)
    grid = [shift * (k / 1000) / (1 + (shift - 1) * (k / 1000)) for k in range(1, 1001)]
    sig = [min(grid, key=lambda s: abs(1000 * s - t)) for t in timesteps] + [0.0]
    noise = torch.Generator().manual_seed(3)  # the schedule's generator, drawn in the same order
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, 2, 4, 4, generator=g)
    want = x.double()
    for i in range(len(timesteps)):
        v = torch.randn(x.shape, generator=g)
        x = ours.step(v, i, x)
        x0 = want - sig[i] * v.double()
        nxt = sig[i + 1]
        want = x0 if nxt == 0 else (1 - nxt) * x0 + nxt * torch.randn(x.shape, generator=noise).double()
        torch.testing.assert_close(x.double(), want, rtol=1e-5, atol=1e-5)
    assert ours.timesteps.tolist() == [float(t) for t in timesteps]  # the model sees t_i itself


ARRAYS = {  # made per test: a generator is used up once read
    "np-int": lambda: np.array([1000, 757, 522]),
    "np-f32": lambda: np.array([1000.0, 757.0, 522.0], dtype=np.float32),
    "torch-int": lambda: torch.tensor([1000, 757, 522]),
    "torch-f64": lambda: torch.tensor([1000.0, 757.0, 522.0], dtype=torch.float64),
    "generator": lambda: (t for t in (1000, 757, 522)),
}


@pytest.mark.parametrize("form", sorted(ARRAYS))
@pytest.mark.parametrize("sampler", ["euler", "dmd"])
def test_timesteps_as_arrays_and_tensors_equal_the_list(form, sampler):
    s = check_sampling(PRESET, sampler=sampler, timesteps=ARRAYS[form]())
    want = check_sampling(PRESET, sampler=sampler, timesteps=[1000, 757, 522])
    assert s == want and all(type(t) is float for t in s.timesteps)


BAD_FORMS = [
    (torch.tensor(1000.0), "is 0-dimensional"),
    (np.array(1000.0), "is 0-dimensional"),
    (np.float64(1000.0), "is 0-dimensional"),
    (np.array([[1000, 500]]), "is 2-dimensional"),
    (torch.tensor([[1000.0], [500.0]]), "is 2-dimensional"),
    ({1000, 500, 250}, "in order"),  # a set has no order (this one iterates as 1000, 250, 500)
    ({1000: 1, 500: 2}, "in order"),
    (torch.tensor([True, False]), "non-empty list of numbers"),
]


@pytest.mark.parametrize("timesteps,msg", BAD_FORMS)
def test_timesteps_of_the_wrong_form_raise_before_compute(no_compute, timesteps, msg):
    with pytest.raises(InvalidArgumentType, match=msg):
        no_compute.generate_video("a fox", seed=0, save_video=False, sampler="euler", timesteps=timesteps)


def test_timesteps_from_a_generator_are_named_in_the_error(no_compute):
    """The default sampler refuses timesteps; the message shows them even when they came from a generator."""
    with pytest.raises(Exception, match=r"timesteps=\[1000.0, 500.0\] need sampler"):
        no_compute.generate_video("a fox", seed=0, save_video=False, timesteps=(t for t in (1000, 500)))


def test_one_step_euler_and_dmd_both_return_x0(gen):
    """At t = 1000 both rules give x0 = x - v in one step (euler: x + (0 - 1) v; dmd: sigma 1 and no re-noise),
    so their videos are identical; the default sampler runs one step too."""
    kw = dict(seed=4, save_video=False, guidance_scale=1.0, num_inference_steps=1, **SIZE)
    euler = gen.generate_video("a fox", sampler="euler", **kw)
    dmd = gen.generate_video("a fox", sampler="dmd", **kw)
    default = gen.generate_video("a fox", sampler="default", **kw)
    assert euler.num_transformer_forwards == dmd.num_transformer_forwards == default.num_transformer_forwards == 1
    assert np.array_equal(euler.frames, dmd.frames) and euler.frames.std() > 5
