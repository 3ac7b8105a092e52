"""benchmarks.cache_bench's untimed warm-up: each variant warms up with its own cache, made for the warm-up's step
count (a schedule made for the timed run names steps a shorter video lacks, which the step-cache check refuses)."""
import pytest

from benchmarks import cache_bench
from fastwan.cache import MagCache, SkipSteps, TaylorSeer, TeaCache, check_steps
from fastwan.cache.taylorseer import TaylorState


@pytest.mark.parametrize("steps", [6, 50])
def test_each_warmup_cache_fits_its_step_count(steps):
    calibration = {"magcache-calibrate": {"cache": {"calibration": {"cond": [1.0] * steps}}}}
    table = cache_bench.variants(steps)
    for label, (_, timed) in table.items():
        n, cache = cache_bench.warmup(label, steps, calibration)
        check_steps(cache, n)  # what generate_video checks first
        timed = cache_bench.made(timed, calibration)
        assert type(cache) is type(timed)  # the variant's own method
        # the fewest steps at which the method can skip one: TeaCache's first 5 steps always compute, TaylorSeer's
        # warm-up steps (disable_cache_before_step) too
        fewest = (6 if isinstance(cache, TeaCache) else cache.disable_cache_before_step + 1
                  if isinstance(cache, TaylorSeer) else 2)
        assert n == fewest, label
    assert cache_bench.warmup("residual-half", steps, calibration) == (2, SkipSteps((1,)))
    assert table["residual-half"][1] == SkipSteps(range(1, steps, 2))  # the timed run's: 2 steps lack step 3
    assert isinstance(cache_bench.warmup("magcache@0.12", steps, calibration)[1], MagCache)


def test_warmup_never_runs_longer_than_the_timed_run():
    assert cache_bench.warmup("residual-half", 2, {}) == (2, SkipSteps((1,)))
    assert cache_bench.warmup("none", 50, {}) == (2, None)


def computed_steps(cache: TaylorSeer, steps: int) -> list[int]:
    """The steps one pass of ``cache`` computes (its decision at each step, fed a computed stream)."""
    import torch

    state, out = TaylorState(cache), []
    for s in range(steps):
        if state.computes(s):
            state.update(torch.zeros(1))
            out.append(s)
    return out


@pytest.mark.parametrize("steps", [4, 50])
def test_taylorseer_variants(steps):
    table = cache_bench.variants(steps)
    assert table["taylorseer"][1] == TaylorSeer()  # fastwan's defaults, nothing set
    # the half schedule: the steps residual-half computes (those it does not skip)
    assert computed_steps(table["taylorseer-half"][1], steps) == [
        s for s in range(steps) if s not in table["residual-half"][1].steps]
    assert computed_steps(table["taylorseer-half"][1], steps) == list(range(0, steps, 2))
    assert "taylorseer" in cache_bench.SMOKE_VARIANTS.split(",")  # CI runs it (it can predict a step of 4)
