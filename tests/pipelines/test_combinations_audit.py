"""Feature pairs on tiny checkpoints, fp32 on the CPU, each against the plain path: LoRAs on FP8 weights (the merged
weights are the requantized sum, unloading restores every tensor bit for bit, also after the weights moved, as a
memory plan on CUDA or ``module.to(dtype)`` moves them), LoRAs loaded after a video (the per-prompt caches and step
caches see the new weights: a fresh generator with the LoRA gives the same frames), image-to-video with sparse
backends under both CFG modes, and a second image on one generator."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from fastwan import VideoGenerator
from fastwan.cache import FirstBlockCache, SkipSteps
from fastwan.kernels.fp8 import Fp8Linear
from fastwan.offload.stream import held_tensors
from fastwan.options import DiTOptions
from tests.pipelines.test_lora import random_lora

pytest.importorskip("peft")
RUN = dict(height=64, width=64, num_frames=5, num_inference_steps=3, guidance_scale=5.0, seed=3, save_video=False)
E4M3_MAX = 448.0


def frames(gen, **kw) -> np.ndarray:
    return gen.generate_video("a fox in the snow", negative_prompt="blurry", **{**RUN, **kw}).frames.astype(int)


def load(model="tiny", **kw) -> VideoGenerator:
    return VideoGenerator.from_pretrained(model, device="cpu", dtype=torch.float32, **kw)


def lora_files(gen, tmp_path, alpha=4.0) -> list:
    """One random original-Wan-format LoRA file per expert of ``gen``."""
    paths = []
    for i, model in enumerate(gen.transformers):
        path = tmp_path / f"expert{i}.safetensors"
        save_file(random_lora(model, "wan", seed=i, alpha=alpha), str(path))
        paths.append(path)
    return paths


def state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same_state(a: dict, b: dict) -> list[str]:
    """Names whose tensors differ in bits (FP8 weights compared as their bytes)."""
    def bits(t):
        return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
    return [k for k in a if not torch.equal(bits(a[k]), bits(b[k]))]


def relocate_like_a_cuda_plan(model) -> None:
    """What a memory plan's offloading does to the DiT on CUDA: every tensor slot (parameter data and buffer) points
    at a new copy with equal values (the pinned host copy); on the CPU the plan would reuse the storage."""
    for tensor, _, hold in held_tensors(model):
        held = hold(tensor.detach().clone())
        held.point(held.host)


# -- LoRA on FP8 weights -------------------------------------------------------------------------------------------
def test_fp8_lora_merges_as_requantized_sum_and_unloads_bit_for_bit(tmp_path):
    gen = load(quantization="fp8")
    path = lora_files(gen, tmp_path)[0]
    model = gen.transformers[0]
    lin = model.blocks[1].attn1.to_q
    assert isinstance(lin, Fp8Linear)
    before = state(model)
    w = lin.weight.double() * lin.weight_scale.double()[:, None]  # the dequantized FP8 weight, in float64
    lora = load_file(str(path))
    a = lora["diffusion_model.blocks.1.self_attn.q.lora_down.weight"].double()
    b = lora["diffusion_model.blocks.1.self_attn.q.lora_up.weight"].double()
    alpha = float(lora["diffusion_model.blocks.1.self_attn.q.alpha"])
    want = w + 0.8 * alpha / a.shape[0] * (b @ a)  # then per-row e4m3 with scale amax / 448
    gen.load_lora(path, 0.8)
    scale = want.abs().amax(dim=1) / E4M3_MAX
    torch.testing.assert_close(lin.weight_scale.double(), scale, rtol=1e-6, atol=0)
    w8 = (want / lin.weight_scale.double()[:, None]).float().to(torch.float8_e4m3fn)
    assert torch.equal(lin.weight.view(torch.uint8), w8.view(torch.uint8))
    gen.unload_lora()
    assert same_state(before, state(model)) == []


def test_fp8_lora_frames_are_the_fp32_lora_frames_within_fp8_error(tmp_path):
    fp32, fp8 = load(), load(quantization="fp8")
    path = lora_files(fp32, tmp_path)[0]
    base32, base8 = frames(fp32), frames(fp8)
    for g in (fp32, fp8):
        g.load_lora(path, 0.8)
    got, want = frames(fp8), frames(fp32)
    fp8_error = np.abs(base8 - base32).max()
    assert np.abs(got - want).max() <= max(2 * fp8_error, 3)
    assert np.abs(want - base32).max() > 4 * max(fp8_error, 3)  # the LoRA moves frames well beyond that
    fp8.unload_lora()
    assert np.array_equal(frames(fp8), base8)


@pytest.mark.parametrize("move", ["cuda-plan", "to-dtype"])
def test_fp8_lora_unloads_after_the_weights_moved(tmp_path, move):
    gen = load(quantization="fp8")
    model = gen.transformers[0]
    path = lora_files(gen, tmp_path)[0]
    before = state(model)
    base = frames(gen)
    gen.load_lora(path, 0.8)
    if move == "cuda-plan":
        relocate_like_a_cuda_plan(model)
    else:
        model.to(torch.float32)  # FP8 weights stay e4m3 (Fp8Linear._apply), as new buffer tensors
    gen.unload_lora()
    assert same_state(before, state(model)) == []
    assert np.array_equal(frames(gen), base)


def test_lora_unloads_after_a_cuda_plan_moved_model_dtype_weights(tmp_path):
    """The same move on model-dtype weights: parameters keep their objects (only ``.data`` changes)."""
    gen = load()
    model = gen.transformers[0]
    before = state(model)
    gen.load_lora(lora_files(gen, tmp_path)[0], 0.8)
    relocate_like_a_cuda_plan(model)
    gen.unload_lora()
    assert same_state(before, state(model)) == []


# -- LoRA loaded after a video: caches see the new weights ----------------------------------------------------------
@pytest.mark.parametrize("model,cache", [
    ("tiny", FirstBlockCache(0.5)),
    ("tiny-wan2.2-a14b", None),
    ("tiny-wan2.2-a14b", SkipSteps((1,), first_block=True)),
], ids=["wan2.1-first-block-cache", "a14b-per-expert", "a14b-skip-steps"])
def test_lora_after_a_video_equals_a_fresh_generator_with_it(tmp_path, model, cache):
    """Per-expert LoRAs loaded into a generator that already made a video (fast block: the per-prompt text keys,
    values and folded projections were cached from the old weights; a step cache ran) give the frames of a fresh
    generator with the same LoRAs; unloading gives the first video again."""
    opts = dict(dit_options=DiTOptions(block="fast"), cache=cache)
    used, fresh = load(model, **opts), load(model, **opts)
    paths = lora_files(used, tmp_path)
    base = frames(used)
    for i, path in enumerate(paths):
        used.load_lora(path, 0.8, expert=i)
        fresh.load_lora(path, 0.8, expert=i)
    got = frames(used)
    assert np.array_equal(got, frames(fresh))
    assert np.abs(got - base).max() > 10
    used.unload_lora()
    assert np.array_equal(frames(used), base)


# -- image-to-video -------------------------------------------------------------------------------------------------
def images(n: int) -> list:
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (48, 48, 3), dtype=np.uint8)) for _ in range(n)]


@pytest.mark.parametrize("model,backend,config", [
    ("tiny-wan2.1-flf2v", "SLIDING_TILE_ATTN", {"tile": [2, 2, 2]}),
    ("tiny-wan2.2-i2v-a14b", "VIDEO_SPARSE_ATTN", {"tile": [2, 2, 2], "sparsity": 0.5}),
    ("tiny-wan2.2-ti2v", "VIDEO_SPARSE_ATTN", {"tile": [2, 2, 2], "sparsity": 0.5}),
])
def test_image_to_video_with_a_sparse_backend_same_in_both_cfg_modes(model, backend, config):
    first, last = images(2)
    kw = dict(image=first, last_image=last) if "flf2v" in model else dict(image=first)
    out = {mode: frames(load(model, attention_backend=backend, attention_config=config, cfg_mode=mode), **kw)
           for mode in ("batched", "sequential")}
    assert np.array_equal(out["batched"], out["sequential"])


@pytest.mark.parametrize("model", ["tiny-wan2.1-flf2v", "tiny-wan2.2-ti2v"])
def test_second_image_on_one_generator_equals_a_fresh_generator(model):
    one, two = images(2)
    kw = (lambda a, b: dict(image=a, last_image=b)) if "flf2v" in model else (lambda a, b: dict(image=a))
    used = load(model, dit_options=DiTOptions(block="fast"))
    first = frames(used, **kw(one, two))
    second = frames(used, **kw(two, one))
    assert np.array_equal(second, frames(load(model, dit_options=DiTOptions(block="fast")), **kw(two, one)))
    assert not np.array_equal(first, second)
