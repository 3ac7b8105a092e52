"""LoRAs on parallel generators (CPU worker processes, gloo, fp32): ``from_pretrained(num_gpus=2, lora=...)`` with an
image gives the one-process video with the same LoRAs (uint8 frames within 1), per A14B expert too, under sequence
and CFG parallelism; ``unload_lora`` and ``load_lora`` run on every rank (the video without, then with them
again)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from fastwan import VideoGenerator
from fastwan.checkpoint.tiny import tiny_checkpoint
from tests.parallel.test_parallel_pipeline import image
from tests.lora.helpers import random_lora

pytest.importorskip("peft")
RUN = dict(height=48, width=80, num_frames=9, num_inference_steps=4, guidance_scale=5.0, seed=3, save_video=False)


def video(gen) -> np.ndarray:
    return gen.generate_video("a cat", negative_prompt="blurry", image=image(), **RUN).frames.astype(int)


@pytest.mark.parametrize("variant,load", [
    ("wan2.1-i2v", dict(num_gpus=2)),
    ("wan2.2-i2v-a14b", dict(num_gpus=2, cfg_parallel=True)),
], ids=["i2v-sp2", "a14b-i2v-cfg2"])
def test_parallel_lora_video_equals_one_process(variant, load, tmp_path):
    path = tiny_checkpoint(variant)
    one = VideoGenerator.from_pretrained(path, device="cpu", dtype=torch.float32)
    loras = []
    for i, model in enumerate(one.transformers):
        file = tmp_path / f"expert{i}.safetensors"
        save_file(random_lora(model, "wan", seed=i, alpha=4.0), str(file))
        loras.append((str(file), 0.8, i if len(one.transformers) > 1 else None))
    base = video(one)
    for lora in loras:
        one.load_lora(*lora)
    want = video(one)
    assert np.abs(want - base).max() > 10  # the LoRAs move the video well beyond the tolerance
    with VideoGenerator.from_pretrained(path, device="cpu", dtype=torch.float32, lora=loras, **load) as par:
        assert np.abs(video(par) - want).max() <= 1
        par.unload_lora()
        assert np.abs(video(par) - base).max() <= 1
        for lora in loras:
            par.load_lora(*lora)
        assert np.abs(video(par) - want).max() <= 1
