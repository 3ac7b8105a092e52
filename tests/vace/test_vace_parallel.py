"""VACE on several CPU processes (gloo, fp32): a whole VACE video (a control video, an inpainting mask and a
reference image, with CFG) from ``from_pretrained(num_gpus=N, ...)`` equals the one-process video within 1 level of
255: CFG parallelism on 2 processes (each runs one pass, its hints at ``run_blocks``), Ulysses on 2, a ring of 3
(the tiny DiT's 2 heads), and Ulysses on 2 under a sparse backend (the control tokens in its compact order). The
token grid, 5 x 5 x 5 = 125 (the reference image's latent frame in front), is divided by neither 2 nor 3: the
shards are uneven."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fastwan import GenerationRequest, VideoGenerator
from fastwan.parallel.workers import ParallelGenerator
from tests.vace.test_vace_pipeline import box_mask, clip, references

SIZE, FRAMES = 80, 13
REQUEST = dict(prompt="a cat walks on the grass", negative_prompt="blurry", seed=5, num_inference_steps=3,
               guidance_scale=5.0, save_video=False, video=clip(FRAMES, SIZE, SIZE), mask=box_mask(True, FRAMES, SIZE),
               reference_images=references()[:1])
SPARSE = dict(attention_backend="SLIDING_TILE_ATTN", attention_config={"tile": [1, 2, 2]})
CASES = {
    "cfg2": dict(num_gpus=2, cfg_parallel=True),
    "ulysses2": dict(num_gpus=2),
    "ring3": dict(num_gpus=3),
    "sparse-ulysses2": dict(num_gpus=2, **SPARSE),
}


def frames(gen) -> np.ndarray:
    return gen.generate(GenerationRequest(**REQUEST)).frames


@pytest.fixture(scope="module")
def one_process(vace_ckpts):
    """The one-process videos, dense and sparse, by backend."""
    path = vace_ckpts["wan2.1-vace"]
    out = {}
    for name, kw in (("dense", {}), ("sparse", SPARSE)):
        gen = VideoGenerator.from_pretrained(path, device="cpu", dtype=torch.float32, **kw)
        gen.set_progress_bar_config(disable=True)
        out[name] = frames(gen)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_vace_video_on_several_processes_equals_one(vace_ckpts, one_process, case):
    load = CASES[case]
    want = one_process["sparse" if "attention_backend" in load else "dense"]
    with VideoGenerator.from_pretrained(vace_ckpts["wan2.1-vace"], device="cpu", dtype=torch.float32,
                                        **load) as par:
        assert isinstance(par, ParallelGenerator)
        got = frames(par)
    assert got.shape == want.shape == (FRAMES, SIZE, SIZE, 3) and want.std() > 5
    assert np.abs(got.astype(int) - want.astype(int)).max() <= 1
