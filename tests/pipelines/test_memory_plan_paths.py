"""Memory plans with the rest of the generator (issue #21, scope 3): a plan that streams DiT blocks, offloads the
DiT outside denoising and swaps the A14B experts gives the frames of the same generator without a plan, bit for bit
in fp32 on the CPU, with compiled blocks, each CFG mode, sparse backends, the fast block build, FP8 weights and
LoRAs merged before or after the plan took the weights over (and unloaded again)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from fastwan import VideoGenerator
from fastwan.options import DiTOptions
from tests.pipelines.test_lora import random_lora
from tests.pipelines.test_memory_plan import RUN, placed, plan

ALL = plan("offload", "swap", True, False, 1)  # every DiT lever at once: swap, offload, one streamed block


def frames(gen, **kw):
    return gen.generate_video("a cat", **{**RUN, **kw}).frames


def streamed_calls(gen) -> list[int]:
    """Records the block indices the streamers bring onto the device."""
    calls = []
    for t in gen.transformers:
        before = t.streamer.before
        t.streamer.before = lambda i, b=before: calls.append(i) or b(i)
    return calls


@pytest.mark.parametrize("load", [
    dict(cfg_mode="batched"),
    dict(cfg_mode="sequential"),
    dict(dit_options=DiTOptions(block="fast")),
    dict(quantization="fp8"),
    dict(quantization="fp8", dit_options=DiTOptions(block="fast")),
    dict(attention_backend="SLIDING_TILE_ATTN", attention_config={"tile": [2, 2, 2]}),
    dict(attention_backend="VIDEO_SPARSE_ATTN", attention_config={"tile": [2, 2, 2], "sparsity": 0.5}),
    dict(enable_torch_compile=True, torch_compile_kwargs={"backend": "aot_eager", "fullgraph": True}),
], ids=["batched-cfg", "sequential-cfg", "fast-block", "fp8", "fp8-fast-block", "sliding-tile", "vsa", "compiled"])
def test_plan_with_generator_options_gives_the_same_frames(tiny_ckpts, load):
    torch._dynamo.reset()
    ckpt = tiny_ckpts["wan2.2-a14b"]
    want = frames(VideoGenerator.from_pretrained(ckpt, device="cpu", dtype=torch.float32, **load))
    gen = placed(ckpt, ALL, **load)
    calls = streamed_calls(gen)
    assert np.array_equal(frames(gen), want)
    assert calls  # the streamed block ran from its device copies
    assert np.array_equal(frames(gen), want)  # a second video after everything went home


@pytest.mark.parametrize("load", [{}, dict(quantization="fp8")], ids=["bf16-rule", "fp8"])
def test_lora_with_a_plan(tiny_ckpts, tmp_path, load):
    """A LoRA merged after the plan took the weights over reaches the offloaded and streamed copies (their host
    homes), one merged before it is carried along, and unloading restores the frames without it."""
    ckpt = tiny_ckpts["wan2.2-a14b"]
    path = tmp_path / "l.safetensors"
    plain = VideoGenerator.from_pretrained(ckpt, device="cpu", dtype=torch.float32, **load)
    save_file(random_lora(plain.transformers[0], "wan", alpha=4.0), str(path))
    without = frames(plain)
    plain.load_lora(path, 0.8)
    with_lora = frames(plain)
    assert np.abs(with_lora.astype(int) - without.astype(int)).max() > 10  # the LoRA changes the video

    after = placed(ckpt, ALL, **load)
    assert np.array_equal(frames(after), without)  # the prompt caches hold the weights before the LoRA ...
    after.load_lora(path, 0.8)
    assert np.array_equal(frames(after), with_lora)  # ... and see the merged ones
    after.unload_lora()
    assert np.array_equal(frames(after), without)

    before = placed(ckpt, ALL, lora=[(path, 0.8)], **load)
    assert np.array_equal(frames(before), with_lora)
    before.unload_lora()
    assert np.array_equal(frames(before), without)
