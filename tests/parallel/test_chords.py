"""CHORDS step-parallel sampling (fastwan.parallel.chords): one core is sequential Euler sampling bit for bit; K
cores equal an independent fp64 reference of the published update rule on a linear ODE and a small random MLP
velocity; the run takes min_k (k + T - s_k) rounds; bad settings are refused before any model call."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fastwan.errors import InvalidArgument, InvalidArgumentType
from fastwan.parallel.chords import check_chords, chords, default_init, rounds_needed
from fastwan.pipelines.sampling import Schedule


def _sigmas(steps: int, shift: float = 3.0) -> list[float]:
    s = [1 - i / steps for i in range(steps)]
    return [shift * x / (1 + (shift - 1) * x) for x in s] + [0.0]


def _batched(f):
    return lambda xs, steps: torch.stack([f(x, i) for x, i in zip(xs, steps)])


def reference(f, x0, sig, init):
    """The published rule with explicit loops over rounds and cores: core k at round r sits at step
    init[k] + r - k; X[k][p] / V[k][p] its latents and velocity at step p; anchor[k] its last start or correction."""
    K, T = len(init), len(sig) - 1
    X, V = [dict() for _ in range(K)], [dict() for _ in range(K)]
    anchor = list(init)
    X[0][0] = x0
    for r in range(T + K):
        live = range(min(r, K - 1) + 1)
        pos = {k: init[k] + r - k for k in live}
        for k in live:
            V[k][pos[k]] = f(X[k][pos[k]], pos[k])
        for k in live:
            p = pos[k]
            if k == r and k + 1 < K:
                X[k + 1][init[k + 1]] = X[k][p] + (sig[init[k + 1]] - sig[p]) * V[k][p]
            fine = X[k][p] + (sig[p + 1] - sig[p]) * V[k][p]
            a = anchor[k]
            if k > 0 and pos[k - 1] == a:
                own = X[k][a] + (sig[p + 1] - sig[a]) * V[k][a]
                slower = X[k - 1][a] + (sig[p + 1] - sig[a]) * V[k - 1][a]
                X[k][p + 1] = fine - own + slower
                anchor[k] = p + 1
            else:
                X[k][p + 1] = fine
        finished = [k for k in live if pos[k] + 1 == T]
        if finished:
            return X[finished[-1]][T], r + 1
    raise AssertionError("no core finished")


def _linear(dim=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(dim, dim, generator=g, dtype=torch.float64) * 0.5
    return lambda x, i: x @ a.T, torch.randn(dim, generator=g, dtype=torch.float64), a


def _mlp(dim=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(dim + 1, 16, generator=g, dtype=torch.float64) / 3
    w2 = torch.randn(16, dim, generator=g, dtype=torch.float64) / 4
    sig = _sigmas(20)
    return lambda x, i: torch.tanh(torch.cat([x, x.new_tensor([sig[i]])]) @ w1) @ w2


def test_one_core_is_sequential_euler_bit_for_bit():
    s = SimpleNamespace(sampler="euler", flow_shift=5.0, timesteps=None, num_inference_steps=12)
    schedule = Schedule(s, None, torch.device("cpu"))
    w = torch.randn(4, 4)
    f = lambda x, i: torch.sin(x @ w) * schedule.timesteps[i] / 1000  # noqa: E731
    x0 = torch.randn(1, 4, 4)
    x = x0
    for i in range(12):
        x = schedule.step(f(x, i), i, x)
    res = chords(_batched(f), x0, schedule.sigmas, 1)
    assert torch.equal(res.latents, x)
    assert res.rounds == tuple((i,) for i in range(12)) and res.core == 0


@pytest.mark.parametrize("cores,init", [(2, None), (3, (0, 2, 5)), (4, None), (5, (0, 1, 3, 6, 10)), (8, None)])
def test_linear_ode_matches_fp64_reference(cores, init):
    f, x0, a = _linear()
    sig = _sigmas(50)
    res = chords(_batched(f), x0, sig, cores, init)
    want, rounds = reference(f, x0, sig, list(init or default_init(cores, 50)))
    torch.testing.assert_close(res.latents, want, rtol=1e-12, atol=1e-12)
    assert len(res.rounds) == rounds
    exact = torch.linalg.matrix_exp(-a * sig[0]) @ x0  # dx/dsigma = A x from sigma_0 to 0
    seq = chords(_batched(f), x0, sig, 1).latents
    # the cores approach the fine (sequential) solution, itself near the exact one
    assert (res.latents - seq).norm() < 0.5 * (seq - exact).norm() + 1e-2 * exact.norm()


@pytest.mark.parametrize("cores,init", [(3, None), (4, (0, 3, 6, 12)), (6, (0, 1, 2, 4, 8, 12))])
def test_mlp_velocity_matches_fp64_reference(cores, init):
    f = _mlp()
    x0 = torch.randn(8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    sig = _sigmas(20)
    res = chords(_batched(f), x0, sig, cores, init)
    want, rounds = reference(f, x0, sig, list(init or default_init(cores, 20)))
    torch.testing.assert_close(res.latents, want, rtol=1e-12, atol=1e-12)
    assert len(res.rounds) == rounds


def test_rounds_are_the_papers_count():
    # the published 8-core schedule over 50 steps: 17 rounds (core 7 runs steps 40..49 from round 7)
    assert default_init(8, 50) == (0, 2, 4, 8, 16, 24, 32, 40)
    f, x0, _ = _linear()
    res = chords(_batched(f), x0, _sigmas(50), 8)
    assert len(res.rounds) == rounds_needed(default_init(8, 50), 50) == 17 and res.core == 7
    assert [len(r) for r in res.rounds] == [min(r + 1, 8) for r in range(17)]
    assert res.calls == sum(min(r + 1, 8) for r in range(17))
    for r, here in enumerate(res.rounds):  # core k evaluates step s_k + r - k
        assert here == tuple(s + r - k for k, s in enumerate(default_init(8, 50)[:r + 1]))
    for cores, init, steps in [(2, (0, 5), 10), (3, (0, 1, 2), 8), (4, (0, 2, 3, 9), 12)]:
        res = chords(_batched(f), x0, _sigmas(steps), cores, init)
        assert len(res.rounds) == min(k + steps - s for k, s in enumerate(init))


def _never(xs, steps):
    raise AssertionError("the model ran")


@pytest.mark.parametrize("cores,init,sigmas,match", [
    (0, None, _sigmas(4), "chords_cores=0 must be >= 1"),
    (5, None, _sigmas(4), "exceeds the 4 steps"),
    (3, (0, 2), _sigmas(8), "must be 3 strictly increasing steps from 0"),
    (2, (1, 3), _sigmas(8), "strictly increasing steps from 0"),
    (2, (0, 8), _sigmas(8), "the last below 8"),
    (2, (0, 0), _sigmas(8), "strictly increasing"),
    (2, None, [1.0, 0.5, 0.6, 0.0], "must strictly decrease to 0"),
    (2, None, [1.0, 0.5], "must strictly decrease to 0"),
])
def test_bad_settings_refused_before_compute(cores, init, sigmas, match):
    with pytest.raises(InvalidArgument, match=match):
        chords(_never, torch.zeros(2), sigmas, cores, init)


def test_bad_types_and_samplers_refused():
    for bad in (True, 2.0, "2"):
        with pytest.raises(InvalidArgumentType, match="must be an int >= 1"):
            check_chords(bad, 10)
    for sampler in ("default", "dmd"):
        with pytest.raises(InvalidArgument, match=f"sampler='{sampler}' cannot run with it: pass sampler='euler'"):
            check_chords(2, 10, sampler=sampler)
    with pytest.raises(InvalidArgument, match="cannot start at distinct steps"):
        check_chords(9, 9)  # the published points scaled to 9 steps run past step 8
