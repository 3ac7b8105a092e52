"""The offload planner: phase peaks against hand-computed numbers, the lever ladder as the budget shrinks, the
too-small error (the budget as the user gave it, with the budget the job needs, checked against the planner
itself; a budget the allocator's reserve eats is refused by that rule), and parse_memory (unit-less sizes that are
no size at all)."""
import dataclasses
import math
import re

import pytest

from fastwan.errors import InvalidArgument
from fastwan.offload import Footprint, OffloadPlan, parse_memory, plan_offload
from fastwan.offload.placement import usable
from fastwan.offload.plan import GiB, gib, phase_peaks

MiB = 2**20

# Small numbers for the hand-computed formulas; two experts of different sizes.
SMALL = Footprint(text_encoder=1000, text_encoder_layer=30, text_encoder_layers=20, text_activations=70,
                  image_encoder=200, vae=50, dit=(900, 800), dit_block=20, dit_blocks=30, dit_activations=300,
                  vae_decode=400, vae_decode_tiled=90)


def test_phase_formulas_by_hand():
    assert phase_peaks(SMALL, "resident", "resident", False, False, 0) == {
        "encode": 1000 + 200 + 50 + 70 + 1700,            # 3020
        "denoise": 1700 + 50 + 300 + 1000 + 200,          # 3250
        "decode": 50 + 400 + 1700 + 1000 + 200}           # 3350
    assert phase_peaks(SMALL, "stream", "swap", False, True, 5) == {
        "encode": (1000 - 20 * 30 + 2 * 30) + 200 + 50 + 70 + 900,   # the first expert: 1680
        "denoise": (900 - 5 * 20 + 2 * 20) + 50 + 300,                # the larger expert, two slots: 1190
        "decode": 50 + 90 + 800}                                      # the last expert: 940
    assert phase_peaks(SMALL, "offload", "resident", True, False, 3) == {
        "encode": 1000 + 200 + 50 + 70,                                       # 1320
        "denoise": (900 - 60 + 40) + (800 - 60 + 40) + 50 + 300,              # each expert streams: 2010
        "decode": 50 + 400}                                                   # 450
    plan = plan_offload(SMALL, None)
    assert plan.peaks == phase_peaks(SMALL, "resident", "resident", False, False, 0) and plan.peak == 3350


# In MiB, chosen so that each lever in turn is the one that lowers the binding phase.
FP = Footprint(text_encoder=11000 * MiB, text_encoder_layer=420 * MiB, text_encoder_layers=24,
               text_activations=5000 * MiB, image_encoder=1200 * MiB, vae=250 * MiB, dit=(14000 * MiB,) * 2,
               dit_block=330 * MiB, dit_blocks=40, dit_activations=2000 * MiB, vae_decode=19000 * MiB,
               vae_decode_tiled=1000 * MiB)
# (plan peak in MiB, levers) from everything resident to the text encoder streamed; the budget ladder below them.
LADDER = [
    (59450, []),
    (47250, ["text_encoder=offload"]),
    (33250, ["text_encoder=offload", "experts=swap"]),
    (19250, ["text_encoder=offload", "experts=swap", "dit_offload"]),
    (17450, ["text_encoder=offload", "experts=swap", "dit_offload", "vae_tiling"]),
    (16250, ["text_encoder=stream", "experts=swap", "dit_offload", "vae_tiling"]),
]


@pytest.mark.parametrize("step", range(len(LADDER)))
def test_levers_switch_on_in_order(step):
    peak, levers = LADDER[step]
    above = LADDER[step - 1][0] if step else 2 * peak  # the previous plan's peak: a budget below it needs this plan
    for budget in (peak * MiB, (peak + above) // 2 * MiB, above * MiB - 1):
        plan = plan_offload(FP, budget)
        assert plan.levers() == levers, budget
        assert plan.peak == peak * MiB and plan.streamed_blocks == 0
    assert plan_offload(FP, peak * MiB - 1).levers() != levers  # one byte less needs the next lever


def smallest_k(fp: Footprint, base: OffloadPlan, budget: int) -> int:
    """Brute force: the first k whose denoise peak fits."""
    for k in range(1, fp.dit_blocks + 1):
        if phase_peaks(fp, base.text_encoder, base.experts, base.dit_offload, base.vae_tiling, k)["denoise"] <= budget:
            return k
    raise AssertionError("no k fits")


def test_streamed_blocks_smallest_k_grows_as_budget_shrinks():
    base = plan_offload(FP, 16250 * MiB)
    ks = []
    for budget in range(16249 * MiB, 8210 * MiB, -97 * MiB):
        plan = plan_offload(FP, budget)
        assert plan.levers()[:4] == base.levers() and plan.streamed_blocks == smallest_k(FP, base, budget)
        assert plan.peaks["denoise"] <= budget < phase_peaks(FP, "stream", "swap", True, True,
                                                             plan.streamed_blocks - 1)["denoise"]
        ks.append(plan.streamed_blocks)
    assert ks == sorted(ks) and ks[0] == 3 and ks[-1] == 27  # 1 or 2 slots cost at least what they save


def test_lever_only_when_it_lowers_an_over_budget_phase():
    fp = dataclasses.replace(FP, vae_decode=100 * MiB, vae_decode_tiled=50 * MiB, text_activations=100 * MiB)
    plan = plan_offload(fp, 15000 * MiB)  # only denoise is over once the DiT leaves during encode and decode
    assert plan.levers() == ["text_encoder=offload", "experts=swap", "dit_offload", "streamed_blocks=6"]
    assert plan.peaks["denoise"] == (14000 - 6 * 330 + 2 * 330 + 250 + 2000) * MiB


def test_one_expert_never_swaps():
    fp = dataclasses.replace(FP, dit=(14000 * MiB,))
    plans = []
    for budget in range(60000 * MiB, 4000 * MiB, -500 * MiB):
        try:
            plans.append(plan_offload(fp, budget))
        except InvalidArgument:
            break
    assert {p.experts for p in plans} == {"resident"}
    assert plans[-1].streamed_blocks > 0 and plans[-1].dit_offload


@pytest.mark.parametrize("budget, over, k", [(8000, "encode", 27), (3000, "encode, denoise", 40)])
def test_too_small_budget_raises(budget, over, k):
    with pytest.raises(InvalidArgument) as err:
        plan_offload(FP, budget * MiB)
    msg = str(err.value)
    assert f"max_gpu_memory={gib(budget * MiB)}" in msg and f"{gib(8210 * MiB)} in the encode phase" in msg
    assert f"over the budget: {over})" in msg and f"streamed_blocks={k};" in msg  # k: the fitting or the best one
    assert "quantization='fp8'" in msg and "smaller video" in msg and "larger max_gpu_memory" in msg


@pytest.mark.parametrize("budget", [0, -5, 1.5, "24GiB", True])
def test_bad_budget(budget):
    with pytest.raises(InvalidArgument, match=re.escape(f"max_gpu_memory={budget!r} is not a positive int")):
        plan_offload(FP, budget)


@pytest.mark.parametrize("change", [dict(dit=(1, 2, 3)), dict(dit=()), dict(vae=-1), dict(dit_blocks=1.0),
                                    dict(text_encoder_layers=True), dict(dit_block=400 * MiB),
                                    dict(text_encoder_layer=500 * MiB)])
def test_bad_footprint(change):
    with pytest.raises(InvalidArgument):
        dataclasses.replace(FP, **change)


def test_describe_names_levers_and_peaks():
    plan = plan_offload(FP, 12000 * MiB)
    text = plan.describe()
    for phrase in ("streamed layer by layer", "swapped", "off the GPU while encoding and decoding", "tiled",
                   f"{plan.streamed_blocks} blocks per expert streamed"):
        assert phrase in text
    for phase in ("encode", "denoise", "decode"):
        assert f"{phase} {plan.peaks[phase] / GiB:.2f} GiB" in text
    plain = plan_offload(FP, None).describe()
    assert "no offloading" in plain and "swapped" not in plain and "tiled" not in plain
    assert "offloaded (on the GPU only while encoding)" in plan_offload(FP, 50000 * MiB).describe()


@pytest.mark.parametrize("value, want", [("24GiB", 24 * GiB), ("24 GiB", 24 * GiB), ("24GB", 24 * GiB),
                                         ("8g", 8 * GiB), ("512MiB", 512 * MiB), (" 1.5 gib ", 3 * GiB // 2),
                                         ("2TiB", 2 * 2**40), ("64KB", 65536), ("100b", 100), (12345, 12345),
                                         (None, None)])
def test_parse_memory(value, want):
    assert parse_memory(value) == want


@pytest.mark.parametrize("value, match", [("24", "no unit"), (-1, "positive"), (0, "positive"),
                                          ("0GiB", "positive"), ("-3GiB", "positive"), ("nanGiB", "finite"),
                                          ("infGiB", "finite"), (math.nan, "float"), (1.5, "float"),
                                          (True, "bool"), ("24XB", "unknown unit 'XB'"), ("abc", "not a number"),
                                          ("0.1B", "less than one byte"), ("", "not a number")])
def test_parse_memory_rejects(value, match):
    with pytest.raises(InvalidArgument, match=match):
        parse_memory(value)


# ---- budgets at their edges ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("given, fp", [(3 * GiB, FP), (8000 * MiB, FP),
                                       (24 * GiB, dataclasses.replace(FP, dit_activations=30000 * MiB))],
                         ids=["3GiB", "8000MiB", "24GiB-reserve-1/16"])
def test_too_small_names_the_budget_given_and_the_budget_needed(given, fp):
    with pytest.raises(InvalidArgument) as err:
        plan_offload(fp, usable(given))  # as from_pretrained plans
    msg = str(err.value)
    assert f"max_gpu_memory={given / GiB:.2f} GiB is too small" in msg
    need = float(re.search(r"need max_gpu_memory of at least (\d+\.\d\d) GiB", msg).group(1))
    plan_offload(fp, usable(int(need * GiB)))  # the budget named fits ...
    with pytest.raises(InvalidArgument):  # ... and is the smallest, to the hundredth of a GiB shown
        plan_offload(fp, usable(int((need - 0.01) * GiB)))


@pytest.mark.parametrize("given", [512 * MiB, GiB, 1])
def test_a_budget_the_allocator_reserve_takes_whole_is_refused_by_that_rule(given):
    with pytest.raises(InvalidArgument, match=rf"max_gpu_memory={given / GiB:.2f} GiB leaves nothing to plan with: "
                                              r"1\.00 GiB of a budget stays free .*at least 1 GiB"):
        usable(given)


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan", "-inf", "0.0"])
def test_unitless_non_sizes_are_refused_as_non_sizes(value):
    with pytest.raises(InvalidArgument, match=re.escape(f"max_gpu_memory={value!r} must be a finite positive size")):
        parse_memory(value)
