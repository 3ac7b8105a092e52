"""Memory budgets and FP8 exports at their edges: a budget too small is reported as the user gave it, with the
budget the job needs (checked against the planner itself); a budget the allocator's reserve eats is refused by that
rule; unit-less sizes that are no size at all; an FP8 folder loaded without ``quantization=`` is planned at its FP8
size (the bytes its loaded DiT holds); ``export_fp8`` never deletes the source checkpoint or a folder that is not a
former export, checks its device and destination before reading a weight, and replaces a former export whatever
lies beside it."""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from fastwan.errors import InvalidArgument
from fastwan.models import load_transformer
from fastwan.offload import Footprint, parse_memory, plan_offload
from fastwan.offload.plan import GiB
from fastwan.checkpoint.resolver import resolve
from fastwan.models.wan.export import export_fp8
from fastwan.offload.placement import job_footprint, usable, weight_bytes

MiB = 2**20
FP = Footprint(text_encoder=11000 * MiB, text_encoder_layer=420 * MiB, text_encoder_layers=24,
               text_activations=5000 * MiB, image_encoder=1200 * MiB, vae=250 * MiB, dit=(14000 * MiB,) * 2,
               dit_block=330 * MiB, dit_blocks=40, dit_activations=2000 * MiB, vae_decode=19000 * MiB,
               vae_decode_tiled=1000 * MiB)


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


@pytest.mark.parametrize("variant, dtype", [("wan2.1", torch.bfloat16), ("wan2.2-a14b", torch.float32)])
def test_an_fp8_folder_is_planned_at_the_bytes_it_loads_to(tiny_ckpts, tmp_path, variant, dtype):
    out = export_fp8(tiny_ckpts[variant], tmp_path / "fp8", device="cpu")
    ckpt = resolve(out)
    loaded = []
    for e in ckpt.experts:
        dit = load_transformer(out / e, dtype=dtype, device="cpu")  # FP8 whatever quantization says
        loaded.append(sum(t.numel() * t.element_size()
                          for t in {id(t): t for t in [*dit.parameters(), *dit.buffers()]}.values()))
    weights = weight_bytes(ckpt, dtype=dtype, vae_dtype=torch.float32, quantization=None)
    assert list(weights["dit"]) == loaded
    src = resolve(tiny_ckpts[variant])
    fp8 = job_footprint(src, weight_bytes(src, dtype=dtype, vae_dtype=torch.float32, quantization="fp8"),
                        src.preset, dtype, "fp8", lambda tokens: True, "auto")
    assert job_footprint(ckpt, weights, ckpt.preset, dtype, None, lambda tokens: True, "auto") == fp8


@pytest.mark.parametrize("num_frames, chunk, calls", [(9, "auto", 2), (5, "auto", 1), (17, 2, 2), (81, 3, 3),
                                                      (1, 4, 1)])
def test_decode_is_sized_by_the_frames_a_call_can_hold(tiny_ckpts, num_frames, chunk, calls):
    """A decoder call after the first holds at most the video's remaining latent frames: a short video is not sized
    as a chunk the auto rule would give a long one (``calls``: latent frames of the largest call)."""
    from types import SimpleNamespace

    ckpt = resolve(tiny_ckpts["wan2.2-a14b"])
    weights = weight_bytes(ckpt, dtype=torch.float32, vae_dtype=torch.float32, quantization=None)
    s = SimpleNamespace(height=64, width=64, num_frames=num_frames, guidance_scale=5.0, guidance_scale_2=None)
    fp = job_footprint(ckpt, weights, s, torch.float32, None, lambda tokens: True, chunk)
    assert fp.vae_decode == 2800 * 64 * 64 * 4 * calls
    if num_frames == 9:  # the tiny model's video fits a 2100 MiB budget (it was refused as needing 9.34 GiB)
        assert plan_offload(fp, usable(2100 * MiB)).peak < 2100 * MiB
