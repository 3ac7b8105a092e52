"""The per-chunk rule of a causal stream (fastwan.pipelines.stream.sample_chunk and write_chunk,
CausalRecipe.schedule) against a float64 transcription of Self-Forcing's inference loop
(pipeline/causal_inference.py with its FlowMatchScheduler): the warped timesteps, x0 from the flow prediction at each
step's sigma, the re-noising to the next step's level, and the clean chunk run once more at context_noise with a
cache write."""
from __future__ import annotations

import pytest
import torch

from fastwan.checkpoint.causal import CausalRecipe
from fastwan.errors import InvalidArgument
from fastwan.pipelines.stream import chunk_plan, sample_chunk, write_chunk


def self_forcing_table(shift: float) -> torch.Tensor:
    """Self-Forcing's FlowMatchScheduler(shift, sigma_min=0, extra_one_step=True).set_timesteps(1000), fp64: the
    1000 timesteps (sigma x 1000) from 1000 down."""
    sigmas = torch.linspace(1.0, 0.0, 1001, dtype=torch.float64)[:-1]
    sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
    return sigmas * 1000


def reference_chunk(denoiser, noise, recipe: CausalRecipe, noises):
    """The loop of CausalInferencePipeline.inference for one block, in fp64: returns (denoised chunk, the calls
    as (input, timestep, write))."""
    table = self_forcing_table(recipe.shift)
    steps = torch.tensor(recipe.timesteps, dtype=torch.float64)
    if recipe.warp:
        steps = torch.cat([table, torch.zeros(1, dtype=torch.float64)])[1000 - steps.long()]

    def sigma(t):  # _convert_flow_pred_to_x0 / add_noise: the table's nearest timestep's sigma
        return table[(table - t).abs().argmin()] / 1000

    calls, x = [], noise.double()
    for i, t in enumerate(steps):
        calls.append((x, float(t), False))
        x0 = x - sigma(t) * denoiser(x, float(t))
        if i < len(steps) - 1:
            s = sigma(steps[i + 1])
            x = (1 - s) * x0 + s * next(noises).double()
    calls.append((x0, recipe.context_noise, True))
    return x0, calls


class Recording:
    """A stand-in for CausalRun: a fixed smooth denoiser that records its calls."""

    def __init__(self, denoiser):
        self.denoiser, self.calls = denoiser, []
        self.model = torch.nn.Linear(1, 1)  # its parameters' dtype: fp32

    def forward(self, latents, timestep, text, *, write=False):
        self.calls.append((latents.double(), float(timestep.item()), write))
        return self.denoiser(latents.double(), float(timestep.item())).float()


def denoiser(x, t):
    return torch.tanh(0.7 * x + t / 1000.0) - 0.2 * x


@pytest.mark.parametrize("recipe", [
    CausalRecipe(),  # Self-Forcing: 1000/750/500/250 warped at shift 5, context at 0
    CausalRecipe(timesteps=(1000.0, 757.0, 522.0), warp=False, shift=8.0, context_noise=20.0),
], ids=["self-forcing", "unwarped"])
def test_a_chunk_follows_self_forcings_inference_loop(recipe):
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(1, 4, 3, 2, 4, generator=g)
    seeded = torch.Generator().manual_seed(5)
    got = sample_chunk(run := Recording(denoiser), noise, None, recipe, seeded)
    write_chunk(run, got, None, recipe)
    again = torch.Generator().manual_seed(5)  # the same draws, in the same order
    noises = iter([torch.randn(noise.shape, generator=again) for _ in recipe.timesteps])
    expected, calls = reference_chunk(denoiser, noise, recipe, noises)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    assert [w for _, _, w in run.calls] == [w for _, _, w in calls] == [False] * len(recipe.timesteps) + [True]
    assert [t for _, t, _ in run.calls] == pytest.approx([t for _, t, _ in calls], rel=1e-6)
    for (a, _, _), (b, _, _) in zip(run.calls, calls):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_the_warp_gives_self_forcings_steps():
    table = self_forcing_table(5.0)
    expected = torch.cat([table, torch.zeros(1, dtype=torch.float64)])[1000 - torch.tensor([1000, 750, 500, 250])]
    assert CausalRecipe().schedule() == pytest.approx(expected.tolist(), rel=1e-12)
    assert CausalRecipe(timesteps=(1000.0, 500.0), warp=False).schedule() == (1000.0, 500.0)


def test_bad_recipes_and_lengths_are_refused():
    with pytest.raises(InvalidArgument, match="frames_per_chunk=0"):
        CausalRecipe(frames_per_chunk=0)
    with pytest.raises(InvalidArgument, match="timesteps=.*whole number"):
        CausalRecipe(timesteps=(1000.0, 937.5))
    with pytest.raises(InvalidArgument, match="window_frames=4 must be"):
        CausalRecipe(window_frames=4)
    with pytest.raises(InvalidArgument, match="sink_frames=1 needs a window_frames"):
        CausalRecipe(sink_frames=1)
    assert chunk_plan(81, CausalRecipe(), 4) == 7 and chunk_plan(None, CausalRecipe(), 4) is None
    with pytest.raises(InvalidArgument, match="num_frames=50: .* use 45 or 57"):
        chunk_plan(50, CausalRecipe(), 4)
