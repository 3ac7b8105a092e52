"""FA4's sm90 wave planner (query tile and split) and how FLASH_ATTN hands its plan to the op. GPUs are faked
(conftest.py): what is tested is the time model and the backend's choices, never a kernel."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fastwan.attention.backends import fa4_plan
from fastwan.attention.backends.flash import FlashAttnBackend

BF16 = torch.bfloat16


def test_fa4_tile_model_follows_waves_and_row_cost():
    """The model is whole waves x tile_m x per-row cost, 192 only for a gain above FA4_SM90_MIN_GAIN: check it
    against that arithmetic directly."""
    sms = 132
    # both tiles fill whole waves (S = 3 * 128 * 44 = 2 * 192 * 44 rows per head, 132 heads): 192's cheaper rows win
    assert fa4_plan.fa4_sm90_tile_m(1, 3 * 128 * 44, 132, sms) == 192
    # one full wave of 128-row tiles against one 88-tile wave of 192-row tiles: 128 x 1.0 < 192 x 0.974
    assert fa4_plan.fa4_sm90_tile_m(1, 128 * sms, 1, sms) == 128

    def brute(b, s, h):
        cost = {}
        for tm, rel in fa4_plan.FA4_SM90_ROW_COST.items():
            waves = -(-(b * h * -(-s // tm)) // sms)
            cost[tm] = waves * tm * rel
        return 192 if cost[192] / cost[128] < 1 - fa4_plan.FA4_SM90_MIN_GAIN else 128

    cases = [(1, 32760, 12), (2, 32760, 12), (1, 75600, 40), (2, 75600, 40), (1, 109120, 24), (3, 999, 5),
             (2, 75600, 12), (2, 27280, 24), (2, 32760, 40)]
    for b, s, h in cases:
        assert fa4_plan.fa4_sm90_tile_m(b, s, h, sms) == brute(b, s, h)
    # the measured Wan shapes: 192 for B=1 at both Wan grids, 128 for the 1.3B model's batched CFG
    assert [fa4_plan.fa4_sm90_tile_m(*c, sms) for c in cases[:3]] == [192, 128, 192]
    # the backend calls it inside compiled blocks: it must trace into a constant without a graph break
    x = torch.ones(1, 75600, 40, 8)
    fn = torch.compile(lambda t: t * fa4_plan.fa4_sm90_tile_m(t.shape[0], t.shape[1], t.shape[2], sms),
                       fullgraph=True, backend="eager")
    assert torch.equal(fn(x), x * brute(1, 75600, 40))


@pytest.mark.parametrize("bad", [96, 0, True, "big", 192.5])
def test_fa4_tile_m_rejects_values_outside_the_table(bad):
    with pytest.raises(ValueError, match=r"fa4_tile_m=.*must be 'auto' or one of \[128, 192\]"):
        FlashAttnBackend(fa4_tile_m=bad)


def test_explicit_fa4_tile_is_a_reason_off_sm90_or_off_head_dim_128(fake_gpu):
    fake_gpu(cc=(10, 0), fa={4})
    text = "\n".join(FlashAttnBackend(fa4_tile_m=192).reasons(device="cuda", dtype=BF16, head_dim=128))
    assert "fa4_tile_m=192 sets FA4's sm90 query tile for head dim 128; this device is sm100" in text
    fake_gpu(cc=(9, 0), fa={4})
    text = "\n".join(FlashAttnBackend(fa4_tile_m="192").reasons(device="cuda", dtype=BF16, head_dim=64))
    assert "the head dim is 64" in text
    text = "\n".join(FlashAttnBackend(version=2, fa4_tile_m=128).reasons(device="cuda", dtype=BF16, head_dim=128))
    assert "but version=2" in text
    fake_gpu(cc=(9, 0), fa={3})  # FA3 would be picked on sm90: the tile needs FA4 pinned
    text = "\n".join(FlashAttnBackend(fa4_tile_m=128).reasons(device="cuda", dtype=BF16, head_dim=128))
    assert "FA3 was picked here (pin version=4)" in text
    # auto never adds a reason
    assert FlashAttnBackend().reasons(device="cuda", dtype=BF16, head_dim=64) == []


def test_auto_fa4_tile_by_shape_on_sm90(fake_gpu, monkeypatch):
    monkeypatch.setattr(fa4_plan, "fa4_accepts_tiles", lambda: (True, "ok"))
    fake_gpu(cc=(9, 0), fa={4})
    b = FlashAttnBackend()
    assert b.reasons(device="cuda", dtype=BF16, head_dim=128) == []

    def q(*shape):
        return SimpleNamespace(shape=shape, device=torch.device("cuda", 0))

    def plan(backend, shape, ver=4, skv=None):
        x = q(*shape)
        return backend.plan_for(x, q(shape[0], skv or shape[1], *shape[2:]), ver)

    want = fa4_plan.fa4_sm90_tile_m(1, 75600, 40, 132)
    assert fa4_plan.fa4_sm90_plan(1, 75600, 75600, 40, 132)[1] == 0  # one launch at this shape
    assert plan(b, (1, 75600, 40, 128)) == (want, -1, 0)  # planned in the op (one launch at this shape)
    one = FlashAttnBackend(fa4_split=False)
    assert one.reasons(device="cuda", dtype=BF16, head_dim=128) == []
    assert plan(one, (1, 75600, 40, 128)) == (0 if want == 128 else want, 0, 0)
    assert plan(one, (1, 128 * 132, 1, 128)) == (0, 0, 0)  # 128 = FA4's default: public entry point
    assert plan(b, (1, 75600, 40, 64)) == (0, 0, 0)  # not head dim 128: FA4's own choice
    assert plan(b, (1, 75600, 40, 128), ver=2) == (0, 0, 0)  # not FA4
    # auto: the op plans the launches at run time (split=-1: fa4_sm90_plan), one launch with fa4_split=False
    assert plan(b, (1, 32760, 12, 128)) == (192, -1, 0)
    assert fa4_plan.fa4_sm90_plan(1, 32760, 32760, 12, 132) == (192, 31680, 128)
    assert plan(one, (1, 32760, 12, 128)) == (192, 0, 0)
    pinned = FlashAttnBackend(version=4, fa4_tile_m=192)
    assert pinned.reasons(device="cuda", dtype=BF16, head_dim=128) == []
    assert plan(pinned, (1, 128 * 132, 1, 128)) == (192, 0, 0)
    assert plan(pinned, (1, 32760, 12, 128)) == (192, 0, 0)  # an explicit tile: one launch, as asked


def test_fa4_split_plan_against_a_brute_force_search(monkeypatch):
    """fa4_sm90_plan against a separate search over every split point and tile pair with the same time model:
    the same (lowest) modelled cost, and a split only where it beats one launch by FA4_SM90_MIN_GAIN."""
    sms = 132

    def cost(b, h, rows, skv, tm):
        return -(-(b * h * -(-rows // tm)) // sms) * tm * fa4_plan.FA4_SM90_ROW_COST[tm] * skv

    def brute(b, s, skv, h):
        one = fa4_plan.fa4_sm90_tile_m(b, s, h, sms)
        single = cost(b, h, s, skv, one)
        best = min(cost(b, h, split, skv, tm) + fa4_plan.FA4_SM90_LAUNCH_ROW_KEYS + cost(b, h, s - split, skv, tt)
                   for tm in fa4_plan.FA4_SM90_TILES for tt in fa4_plan.FA4_SM90_TILES
                   for split in range(tm, s, tm))
        return single, best

    cases = [(1, 32760, 32760, 12), (2, 32760, 32760, 12), (1, 75600, 75600, 40), (1, 75600, 75600, 12),
             (1, 32760, 512, 12), (2, 32760, 512, 12), (1, 27280, 27280, 24), (3, 9999, 9999, 5),
             (1, 109120, 109120, 24), (2, 20000, 20000, 7), (1, 32760, 32760, 40)]
    splits = 0
    for b, s, skv, h in cases:
        tm, split, tail = fa4_plan.fa4_sm90_plan(b, s, skv, h, sms)
        single, best = brute(b, s, skv, h)
        if split:
            splits += 1
            assert 0 < split < s and split % tm == 0
            got = cost(b, h, split, skv, tm) + fa4_plan.FA4_SM90_LAUNCH_ROW_KEYS + cost(b, h, s - split, skv, tail)
            assert got == pytest.approx(best) and got < single * (1 - fa4_plan.FA4_SM90_MIN_GAIN)
        else:
            assert (tm, tail) == (fa4_plan.fa4_sm90_tile_m(b, s, h, sms), 0)
            assert best >= single * (1 - fa4_plan.FA4_SM90_MIN_GAIN)
    assert splits >= 2
    # the 1.3B 480p self-attention: 15 whole waves of 192-row tiles, the last 1,080 rows as 108 tiles of 128
    assert fa4_plan.fa4_sm90_plan(1, 32760, 32760, 12, sms) == (192, 31680, 128)
    # short keys (the cross-attention over 512 text rows): the launch cost keeps one launch
    assert fa4_plan.fa4_sm90_plan(1, 32760, 512, 12, sms)[1] == 0
    # the backend's part is traced inside compiled blocks, also with dynamic shapes: no graph break
    b = FlashAttnBackend(version=4)
    monkeypatch.setattr(b, "_sm_count", lambda device: sms)  # the traced tensors are on a faked 132-SM sm90 GPU
    x = torch.ones(1, 32760, 12, 128)
    for dynamic in (False, True):
        torch._dynamo.reset()
        fn = torch.compile(lambda t: t * sum(b.plan_for(t, t, 4)), fullgraph=True, backend="eager", dynamic=dynamic)
        assert torch.equal(fn(x), x * (192 - 1))
    torch._dynamo.reset()


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_fa4_split_must_be_a_bool(bad):
    with pytest.raises(TypeError, match=r"fa4_split=.* must be True or False"):
        FlashAttnBackend(fa4_split=bad)
