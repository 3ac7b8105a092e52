"""State carried across calls on one VideoGenerator (tiny checkpoints, fp32 on the CPU): a request made after
other requests -- other sizes, step counts, guidance (CFG on, off, on), seeds, negative prompts, samplers, flow
shifts, step caches, images, LoRAs, a refused argument, an interrupted call -- gives the frames the same request
gives on a fresh generator (``from_pretrained`` again), bit for bit; a refused request stays refused before any
compute when it is repeated."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

import fastwan.pipelines.denoise as denoise_module
import fastwan.pipelines.generator as generator_module
from fastwan import VideoGenerator
from fastwan.cache import FirstBlockCache, MagCache
from fastwan.errors import CheckpointError, InvalidArgument
from fastwan.offload.plan import GiB, plan_offload
from fastwan.options import DiTOptions
from fastwan.offload.placement import Placement, job_footprint, usable, weight_bytes
from fastwan.vae.decode import tiling_state

RUN = dict(height=64, width=64, num_frames=5, num_inference_steps=3, guidance_scale=5.0, seed=3, save_video=False)
PROMPT, NEG = "a fox in the snow", "blurry"
T2V = ["tiny", "tiny-wan2.2-a14b", "tiny-wan2.2-ti2v"]


def load(model="tiny", **kw) -> VideoGenerator:
    return VideoGenerator.from_pretrained(model, device="cpu", dtype=torch.float32, **kw)


def frames(gen, prompt=PROMPT, **kw) -> np.ndarray:
    kw = {**RUN, "negative_prompt": NEG, **kw}
    return gen.generate_video(prompt, **kw).frames.astype(int)


# -- settings changed between calls ---------------------------------------------------------------------------------
OTHER_REQUESTS = [dict(height=32, width=96, num_frames=9, num_inference_steps=2, seed=5, negative_prompt="ugly"),
                  dict(guidance_scale=1.0, sampler="euler", flow_shift=7.0), dict(sampler="dmd"),
                  dict(cache=FirstBlockCache(0.5))]


@pytest.mark.parametrize("model", T2V)
def test_request_after_other_requests_equals_a_fresh_generator(model):
    """Each other request (and a refused one) between two equal requests changes nothing the second one reads; a
    CFG-off request after CFG-on ones (the negative prompt then not encoded, no uncond pass) is a fresh one's."""
    used = load(model)
    first = frames(used)
    for kw in OTHER_REQUESTS:
        frames(used, **kw)
    with pytest.raises(InvalidArgument, match="height=65"):
        frames(used, height=65)
    no_cfg = frames(used, guidance_scale=1.0)
    again = frames(used)
    fresh = load(model)
    assert np.array_equal(again, frames(fresh))
    assert np.array_equal(first, again)
    assert np.array_equal(no_cfg, frames(load(model), guidance_scale=1.0))
    assert not np.array_equal(no_cfg, again)  # the guidance mattered


def test_fast_block_prompt_cache_follows_the_prompts():
    """The fast block caches each prompt's cross-attention keys and values: another negative prompt, then CFG off,
    then the first request again equal a fresh generator's; prompts equal once cleaned give equal frames."""
    opts = dict(dit_options=DiTOptions(block="fast"))
    used = load(**opts)
    other_negative = frames(used, negative_prompt="ugly")
    frames(used, guidance_scale=1.0)
    again = frames(used, prompt="a  fox in the\tsnow ")  # cleaned: "a fox in the snow"
    assert np.array_equal(again, frames(load(**opts)))
    assert not np.array_equal(again, other_negative)


# -- interrupted calls ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model,cache", [("tiny", None), ("tiny-wan2.2-a14b", FirstBlockCache(0.5))],
                         ids=["wan2.1", "a14b-first-block-cache"])
def test_interrupted_call_leaves_the_generator_as_fresh(model, cache, monkeypatch):
    """A KeyboardInterrupt inside the denoising loop (after a step ran) leaves the generator usable, and its next
    request gives a fresh generator's frames."""
    used = load(model, cache=cache)
    step = denoise_module.Schedule.step

    def interrupted(self, pred, i, latents):
        if i == 1:
            raise KeyboardInterrupt
        return step(self, pred, i, latents)

    monkeypatch.setattr(denoise_module.Schedule, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        frames(used)
    monkeypatch.setattr(denoise_module.Schedule, "step", step)
    assert np.array_equal(frames(used), frames(load(model, cache=cache)))


# -- step caches ----------------------------------------------------------------------------------------------------
def test_step_cache_state_is_per_call():
    """A generator's default step cache starts fresh each call: after calls with the cache off and at other sizes and
    step counts, a request gives a fresh generator's frames and computed-step report."""
    cache = MagCache(threshold=0.5, mag_ratios=(1.0, 0.9, 1.1, 0.95), retention_ratio=0.25)
    used = load(cache=cache)
    first = used.generate_video(PROMPT, negative_prompt=NEG, **{**RUN, "num_inference_steps": 4})
    frames(used, cache="none")
    frames(used, height=32, width=96, num_inference_steps=5)
    again = used.generate_video(PROMPT, negative_prompt=NEG, **{**RUN, "num_inference_steps": 4})
    fresh = load(cache=cache).generate_video(PROMPT, negative_prompt=NEG, **{**RUN, "num_inference_steps": 4})
    assert np.array_equal(again.frames, fresh.frames)
    assert again.cache == fresh.cache == first.cache
    assert len(again.cache["computed"]["cond"]) < 4  # the cache skipped something


# -- images ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model", ["tiny-wan2.1-i2v", "tiny-wan2.2-ti2v", "tiny-wan2.2-i2v-a14b"])
def test_changed_image_is_read_again(model, tmp_path):
    """Image to video: a file rewritten at the same path, a PIL image and an array changed in place between calls
    give a fresh generator's frames for the new pixels."""
    rng = np.random.default_rng(0)
    a, b = (rng.integers(0, 256, (48, 48, 3), dtype=np.uint8) for _ in range(2))
    path = tmp_path / "frame.png"
    used, fresh = load(model), load(model)
    want = frames(fresh, image=b)
    Image.fromarray(a).save(path)
    first = frames(used, image=path)
    Image.fromarray(b).save(path)
    assert np.array_equal(frames(used, image=path), want)
    pil = Image.fromarray(a)
    frames(used, image=pil)
    pil.paste(Image.fromarray(b))
    assert np.array_equal(frames(used, image=pil), want)
    array = a.copy()
    frames(used, image=array)
    array[:] = b
    assert np.array_equal(frames(used, image=array), want)
    assert not np.array_equal(first, want)


def images(n: int) -> list:
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (48, 48, 3), dtype=np.uint8)) for _ in range(n)]


@pytest.mark.parametrize("model", ["tiny-wan2.1-flf2v", "tiny-wan2.2-ti2v"])
def test_second_image_on_one_generator_equals_a_fresh_generator(model):
    one, two = images(2)
    kw = (lambda a, b: dict(image=a, last_image=b)) if "flf2v" in model else (lambda a, b: dict(image=a))
    used = load(model, dit_options=DiTOptions(block="fast"))
    first = frames(used, **kw(one, two))
    second = frames(used, **kw(two, one))
    assert np.array_equal(second, frames(load(model, dit_options=DiTOptions(block="fast")), **kw(two, one)))
    assert not np.array_equal(first, second)


# -- LoRAs ----------------------------------------------------------------------------------------------------------
def random_lora(model, seed: int) -> dict[str, torch.Tensor]:
    """A rank-2 diffusers-format LoRA on every block's self-attention value and output and FFN output."""
    g = torch.Generator().manual_seed(seed)
    mods = dict(model.named_modules())
    out = {}
    for i in range(len(model.blocks)):
        for name in ("attn1.to_v", "attn1.to_out.0", "ffn.net.2"):
            w = mods[f"blocks.{i}.{name}"].weight
            out[f"transformer.blocks.{i}.{name}.lora_A.weight"] = torch.randn(2, w.shape[1], generator=g)
            out[f"transformer.blocks.{i}.{name}.lora_B.weight"] = torch.randn(w.shape[0], 2, generator=g)
    return out


def test_lora_history_equals_a_fresh_generator(tmp_path):
    """load -> video -> failed loads (corrupt file, wrong shapes) -> load again -> video equals a fresh generator
    with the two loads; unload -> video equals a fresh generator's video."""
    used = load()
    good, corrupt, wrong = (tmp_path / f"{name}.safetensors" for name in ("good", "corrupt", "wrong"))
    lora = random_lora(used.transformers[0], seed=0)
    save_file(lora, str(good))
    corrupt.write_bytes(good.read_bytes()[:100])
    save_file({k: v[:, :3].contiguous() if k.endswith("lora_A.weight") else v for k, v in lora.items()}, str(wrong))
    base = frames(used)
    used.load_lora(good, 0.7)
    frames(used)
    with pytest.raises(CheckpointError, match="corrupt.safetensors"):
        used.load_lora(corrupt)
    with pytest.raises(InvalidArgument, match="do not fit"):
        used.load_lora(wrong)
    used.load_lora(good, 0.5)
    twice = frames(used)
    fresh = load()
    fresh.load_lora(good, 0.7)
    fresh.load_lora(good, 0.5)
    assert np.array_equal(twice, frames(fresh))
    assert np.abs(twice - base).max() > 10
    used.unload_lora()
    assert np.array_equal(frames(used), base)


def test_lora_with_non_finite_values_is_refused_before_any_change(tmp_path):
    used = load()
    lora = random_lora(used.transformers[0], seed=0)
    key = "transformer.blocks.1.ffn.net.2.lora_B.weight"
    lora[key][3, 1] = float("nan")
    path = tmp_path / "nan.safetensors"
    save_file(lora, str(path))
    before = {k: v.clone() for k, v in used.transformers[0].state_dict().items()}
    try:
        with pytest.raises(InvalidArgument, match=r"blocks\.1\.ffn\.net\.2\.lora_B\.weight"):
            used.load_lora(path)
    finally:
        unchanged = all(torch.equal(before[k], v) for k, v in used.transformers[0].state_dict().items())
        used.unload_lora()
    assert unchanged


# -- per-shape plans ------------------------------------------------------------------------------------------------
def test_repeated_bad_grid_is_refused_before_compute(forbid_compute):
    """A neighborhood kernel larger than the request's token grid is refused before compute, the second time too."""
    used = load(attention_backend="NEIGHBORHOOD_ATTN", attention_config={"kernel_size": [3, 3, 3]})
    for _ in range(2):
        with pytest.raises(InvalidArgument, match=r"kernel_size\[0\] \* dilation\[0\] = 3 \* 1 = 3 exceeds"):
            frames(forbid_compute(used))


@pytest.mark.parametrize("backend,config", [("SLIDING_TILE_ATTN", {"tile": [2, 2, 2]}),
                                            ("VIDEO_SPARSE_ATTN", {"tile": [2, 2, 2], "sparsity": 0.5}),
                                            ("NEIGHBORHOOD_ATTN", {"kernel_size": [1, 3, 3], "stride": [1, 2, 2]})])
def test_sparse_layouts_after_another_shape(backend, config):
    """Sparse layouts and block plans are kept per token grid: a size, another, the first again: a fresh
    generator's frames."""
    kw = dict(attention_backend=backend, attention_config=config)
    used = load(**kw)
    frames(used, height=96, width=128, num_frames=9)
    assert np.array_equal(frames(used), frames(load(**kw)))


REAL_SIZES = {64: (480, 832), 128: (720, 1280)}  # the tiny request's height -> the size its memory footprint is of


def test_memory_plan_after_a_larger_video_is_a_fresh_generators(monkeypatch):
    """Under a budget, a request after a larger one decodes as on a fresh generator: VAE tiling (which changes the
    decoded values, and the automatic file name's digest) is what a fresh generator's plan gives the request. The
    plan is carried out on the CPU here, with the footprints of real sizes (the planner's bytes of a 480x832 and a
    720x1280 video of the tiny model): a 6 GiB budget fits the first untiled and needs tiling for the second."""
    footprint = job_footprint

    def real_size(ckpt, weights, s, *args):
        height, width = REAL_SIZES[s.height]
        return footprint(ckpt, weights, dataclasses.replace(s, height=height, width=width), *args)

    monkeypatch.setattr(generator_module, "job_footprint", real_size)

    def planned() -> VideoGenerator:  # what from_pretrained(max_gpu_memory=...) sets up on CUDA
        g = load()
        budget = 6 * GiB
        w = weight_bytes(g.checkpoint, dtype=g.dtype, vae_dtype=g.vae_dtype, quantization=None)
        s = dataclasses.replace(g.preset, height=64, width=64, num_frames=5)
        plan = plan_offload(real_size(g.checkpoint, w, s, g.dtype, None, g._cfg_batched, "auto"), usable(budget))
        g.memory_plan, g.max_gpu_memory, g._weight_bytes = plan, budget, w
        g.placement = Placement(plan, g.device, transformers=g.transformers, text_encoder=g.text_encoder,
                                image_encoder=None, vae=g.vae)
        return g

    used, fresh = planned(), planned()
    assert not used.memory_plan.vae_tiling
    frames(used, height=128, width=128, num_inference_steps=2)
    assert used.memory_plan.vae_tiling  # the larger video needed it
    frames(used, num_inference_steps=2)
    frames(fresh, num_inference_steps=2)
    assert tiling_state(used.vae) == tiling_state(fresh.vae) is None  # what decodes the video: as a fresh one
