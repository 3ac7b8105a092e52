"""Wan2.2-Animate's segment rules (:mod:`fastwan.pipelines.animate`) against diffusers' WanAnimatePipeline: the
segments' frames, the padded driving videos' frames and the conditioning mask."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from diffusers import WanAnimatePipeline

from fastwan.errors import InvalidArgument
from fastwan.pipelines.animate import conditioning_mask, pad_indices, plan_segments


@pytest.mark.parametrize("frames,segment,overlap,starts,target", [
    (100, 77, 1, (0, 76), 153),  # 99 frames after the first overlap: 76 + 23 (padded to 76)
    (77, 77, 1, (0,), 77),
    (78, 77, 1, (0, 76), 153),
    (153, 77, 1, (0, 76), 153),
    (154, 77, 5, (0, 72, 144), 221),
    (6, 13, 5, (0,), 13),
    (14, 13, 5, (0, 8), 21),
])
def test_segments_cover_the_driving_video(frames, segment, overlap, starts, target):
    plan = plan_segments(frames, segment, overlap)
    assert plan.starts == starts and plan.target_frames == target
    assert plan.latent_frames == (segment - 1) // 4 + 2


def test_segments_are_diffusers(monkeypatch):
    """diffusers' count: the driving frames padded so that (target - overlap) is a whole number of steps."""
    for frames in range(2, 400, 7):
        for segment, overlap in ((77, 1), (77, 5), (33, 1), (13, 5), (5, 1)):
            if frames <= overlap:
                continue
            step = segment - overlap
            rest = (frames - overlap) % step
            target = frames + (0 if rest == 0 else step - rest)
            plan = plan_segments(frames, segment, overlap)
            assert (plan.target_frames, len(plan.starts)) == (target, target // step), (frames, segment, overlap)


@pytest.mark.parametrize("frames,target", [(5, 10), (2, 7), (4, 4), (3, 20)])
def test_padding_is_diffusers(frames, target):
    want = WanAnimatePipeline.pad_video_frames(None, list(range(frames)), target)
    assert pad_indices(frames, target) == want
    assert pad_indices(1, 3) == [0, 0, 0]
    with pytest.raises(InvalidArgument, match="needs at least one"):
        pad_indices(0, 3)


@pytest.mark.parametrize("given,with_pixels", [(0, False), (1, False), (5, False), (1, True), (5, True)])
def test_mask_is_diffusers(given, with_pixels):
    pipe = SimpleNamespace(vae_scale_factor_temporal=4)
    g = torch.Generator().manual_seed(0)
    pixels = (torch.rand(2, 1, 13, 3, 5, generator=g) > 0.5).float() if with_pixels else None
    want = WanAnimatePipeline.get_i2v_mask(pipe, 2, 4, 3, 5, given, pixels, torch.float32, "cpu")
    got = conditioning_mask(2, 4, 3, 5, given, pixels)
    assert torch.equal(got, want) and got.shape == (2, 4, 4, 3, 5)


@pytest.mark.parametrize("args,words", [((100, 76, 1), "4 n \\+ 1"), ((100, 77, 2), "must be 1 or 5"),
                                        ((100, 9, 5), "more than twice overlap"), ((1, 77, 1), "more than overlap"),
                                        ((100, True, 1), "4 n \\+ 1")])
def test_bad_segments_are_refused(args, words):
    with pytest.raises(InvalidArgument, match=words):
        plan_segments(*args)
