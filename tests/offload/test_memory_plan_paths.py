"""Memory plans with the rest of the generator (issue #21, scope 3): a plan that streams DiT blocks, offloads the
DiT outside denoising and swaps the A14B experts gives the frames of the same generator without a plan, bit for bit
in fp32 on the CPU, with compiled blocks, each CFG mode, sparse backends, the fast block build, FP8 weights and
LoRAs merged before or after the plan took the weights over (and unloaded again)."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from fastwan import VideoGenerator
from fastwan.options import DiTOptions
from tests.lora.helpers import random_lora
from tests.offload.test_memory_plan import RUN, placed, plan

ALL = plan("offload", "swap", True, False, 1)  # every DiT lever at once: swap, offload, one streamed block


def frames(gen, **kw):
    return gen.generate_video("a cat", **{**RUN, **kw}).frames


def streamed_calls(gen) -> list[int]:
    """Records the block indices the streamers bring onto the device."""
    calls = []
    for s in gen.placement.streamers:
        before = s.before
        s.before = lambda i, b=before: calls.append(i) or b(i)
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


@pytest.mark.parametrize("load", [{}, dict(quantization="fp8")], ids=["model-dtype", "fp8"])
def test_lora_with_a_plan(tiny_ckpts, tmp_path, load):
    """A LoRA merged after the plan took the weights over reaches the offloaded and streamed copies (their host
    homes), one merged before it is carried along, and unloading restores the frames without it. Four blocks per
    expert, three streamed: a copy prefetched before the merge must not be used after it."""
    ckpt = deeper(tiny_ckpts["wan2.2-a14b"], tmp_path / "deep", 4)
    every = plan("offload", "swap", True, False, 3)
    path = tmp_path / "l.safetensors"
    plain = VideoGenerator.from_pretrained(ckpt, device="cpu", dtype=torch.float32, **load)
    save_file(random_lora(plain.transformers[0], "wan", alpha=4.0), str(path))
    without = frames(plain)
    plain.load_lora(path, 0.8)
    with_lora = frames(plain)
    assert np.abs(with_lora.astype(int) - without.astype(int)).max() > 10  # the LoRA changes the video

    after = placed(ckpt, every, **load)
    assert np.array_equal(frames(after), without)  # the prompt caches hold the weights before the LoRA ...
    after.load_lora(path, 0.8)
    assert np.array_equal(frames(after), with_lora)  # ... and see the merged ones
    after.unload_lora()
    assert np.array_equal(frames(after), without)

    before = placed(ckpt, every, lora=[(path, 0.8)], **load)
    assert np.array_equal(frames(before), with_lora)
    before.unload_lora()
    assert np.array_equal(frames(before), without)


def deeper(ckpt, root, layers: int):
    """A copy of the tiny checkpoint ``ckpt`` whose DiT(s) have ``layers`` blocks (block j a copy of block j % 2,
    scaled by 1 + j / 10 so each differs), so that several blocks stream and the streamer prefetches."""
    shutil.copytree(ckpt, root, symlinks=False)
    for name in ("transformer", "transformer_2"):
        d = root / name
        if not (d / "config.json").exists():
            continue
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, "num_layers": layers}))
        f = d / "diffusion_pytorch_model.safetensors"
        w = load_file(str(f))
        for j in range(cfg["num_layers"], layers):
            src = f"blocks.{j % cfg['num_layers']}."
            w.update({f"blocks.{j}." + k[len(src):]: v * (1 + j / 10) for k, v in w.items() if k.startswith(src)})
        save_file(w, str(f))
    return root


def test_the_expert_leaving_the_device_keeps_no_prefetched_block(tiny_ckpts, tmp_path):
    """Three of four blocks streamed per A14B expert: the streamers prefetch (wrap-around), and at the swap the
    outgoing expert's prefetched copy is dropped, so only one expert's blocks are ever on the device."""
    ckpt = deeper(tiny_ckpts["wan2.2-a14b"], tmp_path / "deep", 4)
    want = frames(VideoGenerator.from_pretrained(ckpt, device="cpu", dtype=torch.float32))
    gen = placed(ckpt, plan("offload", "swap", True, False, 3))
    held = []
    expert = gen.placement.expert

    def swap(i):
        expert(i)
        held.append([s._pending is not None for k, s in enumerate(gen.placement.streamers) if k != i])

    gen.placement.expert = swap
    calls = streamed_calls(gen)
    assert np.array_equal(frames(gen), want)
    assert sorted(set(calls)) == [1, 2, 3]
    assert held and not any(any(h) for h in held)
    assert all(s._pending is None for s in gen.placement.streamers)  # nothing left on the device after denoising
