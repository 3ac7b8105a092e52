"""benchmarks.cache_bench's untimed warm-up: each variant warms up with its own cache, made for the warm-up's step
count (a schedule made for the timed run names steps a shorter video lacks, which the step-cache check refuses)."""
import pytest

from benchmarks import cache_bench
from fastwan.cache import MagCache, SkipSteps, TeaCache, check_steps


@pytest.mark.parametrize("steps", [6, 50])
def test_each_warmup_cache_fits_its_step_count(steps):
    calibration = {"magcache-calibrate": {"cache": {"calibration": {"cond": [1.0] * steps}}}}
    table = cache_bench.variants(steps)
    for label, (_, timed) in table.items():
        n, cache = cache_bench.warmup(label, steps, calibration)
        check_steps(cache, n)  # what generate_video checks first
        timed = cache_bench.made(timed, calibration)
        assert type(cache) is type(timed)  # the variant's own method
        # the fewest steps at which the method can skip one: TeaCache's first 5 steps always compute
        assert n == (6 if isinstance(cache, TeaCache) else 2), label
    assert cache_bench.warmup("residual-half", steps, calibration) == (2, SkipSteps((1,)))
    assert table["residual-half"][1] == SkipSteps(range(1, steps, 2))  # the timed run's: 2 steps lack step 3
    assert isinstance(cache_bench.warmup("magcache@0.12", steps, calibration)[1], MagCache)


def test_warmup_never_runs_longer_than_the_timed_run():
    assert cache_bench.warmup("residual-half", 2, {}) == (2, SkipSteps((1,)))
    assert cache_bench.warmup("none", 50, {}) == (2, None)
