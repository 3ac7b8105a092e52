"""LoRA files (fastwan.lora) on tiny checkpoints, fp32 on the CPU: merged LoRAs give diffusers' frames
(``load_lora_weights``, within 1) in the diffusers, original-Wan and kohya / musubi-tuner key formats (the last
on the Wan2.1 I2V checkpoint too, image cross-attention included); A14B per expert; unloading
restores the weights bit for bit; the fast build with a LoRA equals the reference build with it; bad files and
arguments raise before any weight changes."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from fastwan import VideoGenerator
from fastwan.errors import InvalidArgument, InvalidArgumentType, MissingFileError
from fastwan.checkpoint.tiny import tiny_checkpoint
from tests.lora.helpers import BLOCK_MODULES, IMAGE_MODULES, random_lora

pytest.importorskip("peft")
SIZE = dict(height=64, width=64, num_frames=9, num_inference_steps=4, guidance_scale=5.0)
PROMPT, NEG = "a fox in the snow", "blurry"


def diffusers_frames(variant, lora_path, scale=1.0, image=None, **load):
    from diffusers import WanImageToVideoPipeline, WanPipeline

    cls, extra = (WanPipeline, {}) if image is None else (WanImageToVideoPipeline, {"image": image})
    pipe = cls.from_pretrained(tiny_checkpoint(variant), torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(lora_path), adapter_name="x", low_cpu_mem_usage=False, **load)
    if scale != 1.0:
        pipe.set_adapters(["x"], [scale])
    out = pipe(prompt=PROMPT, negative_prompt=NEG, output_type="np", generator=torch.Generator().manual_seed(3),
               **extra, **SIZE).frames[0]
    return (out * 255).round().astype(np.uint8)


def ours(gen, **kw):
    return gen.generate_video(PROMPT, negative_prompt=NEG, seed=3, save_video=False, **SIZE, **kw).frames


def max_diff(a, b):
    return int(np.abs(a.astype(int) - b.astype(int)).max())


@pytest.fixture(scope="module")
def gen():
    return VideoGenerator.from_pretrained("tiny", device="cpu", dtype=torch.float32)


@pytest.mark.parametrize("fmt,alpha,scale", [("diffusers", None, 1.0), ("wan", 2.0, 1.0), ("wan", None, 0.5),
                                               ("kohya", 2.0, 1.0), ("kohya", 6.0, 0.5)])
def test_merged_lora_gives_diffusers_frames(gen, tmp_path, fmt, alpha, scale):
    path = tmp_path / f"{fmt}.safetensors"
    save_file(random_lora(gen.transformers[0], fmt, alpha=alpha), str(path))
    base = ours(gen)
    gen.load_lora(path, scale)
    try:
        got = ours(gen)
    finally:
        gen.unload_lora()
    want = diffusers_frames("wan2.1", path, scale)
    assert max_diff(got, base) > 10  # the LoRA changes the video
    assert max_diff(got, want) <= 1
    assert np.array_equal(ours(gen), base)  # unloaded


def test_kohya_lora_on_i2v_gives_diffusers_frames(tmp_path):
    """A kohya / musubi-tuner LoRA on the Wan2.1 I2V checkpoint, its image cross-attention (k_img, v_img) too."""
    from PIL import Image

    from fastwan.lora import lora_updates

    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 40, 3), dtype=np.uint8))
    g = VideoGenerator.from_pretrained("tiny-wan2.1-i2v", device="cpu", dtype=torch.float32)
    model = g.transformers[0]
    lora = random_lora(model, "kohya", alpha=3.0)
    updates = lora_updates(lora, model)
    n = len(model.blocks)
    assert len(updates) == n * (len(BLOCK_MODULES) + len(IMAGE_MODULES))
    assert all(set(updates[f"blocks.{i}.attn2.{p}"]) == {"A", "B", "alpha"} for i in range(n)
               for p in ("add_k_proj", "add_v_proj"))
    path = tmp_path / "i2v.safetensors"
    save_file(lora, str(path))
    kw = dict(image=image, negative_prompt=NEG, seed=3, save_video=False, **SIZE)
    base = g.generate_video(PROMPT, **kw).frames
    g.load_lora(path)
    got = g.generate_video(PROMPT, **kw).frames
    want = diffusers_frames("wan2.1-i2v", path, image=image)
    assert max_diff(got, base) > 10
    assert max_diff(got, want) <= 1


def test_unload_restores_weights_bit_for_bit(gen, tmp_path):
    before = {k: v.clone() for k, v in gen.transformers[0].state_dict().items()}
    for seed in (0, 1):
        path = tmp_path / f"l{seed}.safetensors"
        save_file(random_lora(gen.transformers[0], "wan", seed=seed, alpha=4.0), str(path))
        gen.load_lora(path, 0.7)  # two LoRAs stacked
    assert any(not torch.equal(before[k], v) for k, v in gen.transformers[0].state_dict().items())
    gen.unload_lora()
    assert all(torch.equal(before[k], v) for k, v in gen.transformers[0].state_dict().items())


def test_safetensors_lora_under_any_other_name_merges_the_same(gen, tmp_path):
    """The content decides, as in diffusers: a safetensors LoRA named .SAFETENSORS or with no extension merges as
    under its usual name (pickle names are refused, see below)."""
    lora = random_lora(gen.transformers[0], "wan", seed=3, alpha=4.0)
    merged = []
    for name in ("l.safetensors", "l.SAFETENSORS", "lora_file"):
        save_file(lora, str(tmp_path / name))
        gen.load_lora(tmp_path / name, 0.5)
        merged.append({k: v.clone() for k, v in gen.transformers[0].state_dict().items()})
        gen.unload_lora()
    assert all(torch.equal(merged[0][k], m[k]) for m in merged[1:] for k in merged[0])


@pytest.mark.parametrize("route", ["load_lora", "from_pretrained"])
def test_a14b_lora_per_expert(tmp_path, route):
    """A paired high- / low-noise LoRA, each merged into its expert only (``load_lora(expert=)`` or
    ``from_pretrained(lora=[(path, scale, expert)])``, the CLI's ``PATH:high``), against diffusers' per-expert
    adapters."""
    g = VideoGenerator.from_pretrained("tiny-wan2.2-a14b", device="cpu", dtype=torch.float32)
    high, low = tmp_path / "high.safetensors", tmp_path / "low.safetensors"
    save_file(random_lora(g.transformers[0], "diffusers", seed=1), str(high))
    save_file(random_lora(g.transformers[1], "diffusers", seed=2), str(low))
    if route == "load_lora":
        g.load_lora(high, expert=0)
        g.load_lora(low, expert=1)
    else:
        g = VideoGenerator.from_pretrained("tiny-wan2.2-a14b", device="cpu", dtype=torch.float32,
                                           lora=[(high, 1.0, 0), (str(low), np.float32(1.0), np.int64(1))])
    got = g.generate_video(PROMPT, negative_prompt=NEG, seed=3, save_video=False, **SIZE).frames

    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(tiny_checkpoint("wan2.2-a14b"), torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(high), adapter_name="high", low_cpu_mem_usage=False)
    pipe.load_lora_weights(str(low), adapter_name="low", load_into_transformer_2=True, low_cpu_mem_usage=False)
    pipe.transformer.set_adapters(["high"])
    pipe.transformer_2.set_adapters(["low"])
    want = pipe(PROMPT, negative_prompt=NEG, output_type="np", generator=torch.Generator().manual_seed(3),
                **{**SIZE, "guidance_scale": g.preset.guidance_scale,
                   "guidance_scale_2": g.preset.guidance_scale_2}).frames[0]
    assert max_diff(got, (want * 255).round().astype(np.uint8)) <= 1


def test_fast_build_with_lora_equals_reference_with_it(tmp_path):
    from fastwan.options import DiTOptions

    path = tmp_path / "l.safetensors"
    ref = VideoGenerator.from_pretrained("tiny", device="cpu", dtype=torch.float32, lora=None)
    save_file(random_lora(ref.transformers[0], "wan", alpha=4.0), str(path))
    frames = {}
    for block in ("reference", "fast"):
        g = VideoGenerator.from_pretrained("tiny", device="cpu", dtype=torch.float32, lora=[(path, 0.8)],
                                           dit_options=DiTOptions(block=block))
        ours(g)  # the per-prompt caches filled with the merged weights ...
        frames[block] = ours(g)
        g.unload_lora()
        frames[block + " unloaded"] = ours(g)  # ... and refreshed after unloading
    assert max_diff(frames["fast"], frames["reference"]) <= 1
    assert max_diff(frames["fast unloaded"], frames["reference unloaded"]) <= 1
    assert max_diff(frames["fast"], frames["fast unloaded"]) > 10


def test_bad_loras_raise_before_any_change(gen, tmp_path):
    before = {k: v.clone() for k, v in gen.transformers[0].state_dict().items()}
    other = tmp_path / "other.safetensors"
    save_file({"unet.down_blocks.0.proj.lora_A.weight": torch.zeros(2, 3),
               "unet.down_blocks.0.proj.lora_B.weight": torch.zeros(3, 2)}, str(other))
    with pytest.raises(InvalidArgument, match="none of its 2 keys.*unet.down_blocks.*blocks.0"):
        gen.load_lora(other)
    kohya = tmp_path / "kohya.safetensors"  # names of no module of this model: a typo, a block it lacks
    save_file({"lora_unet_blocks_0_self_attn_qk.lora_down.weight": torch.zeros(2, 24),
               "lora_unet_blocks_0_self_attn_qk.lora_up.weight": torch.zeros(24, 2),
               "lora_unet_blocks_99_ffn_0.alpha": torch.tensor(2.0)}, str(kohya))
    with pytest.raises(InvalidArgument, match=r"none of its 3 keys.*lora_unet_blocks_0_self_attn_qk\.lora_down"
                                              r".*blocks\.0\..*'lora_unet_'"):
        gen.load_lora(kohya)
    norms = tmp_path / "norms.safetensors"  # keys that name layers, but only norms: nothing would change
    save_file({"diffusion_model.blocks.0.norm3.diff": torch.ones(24),
               "diffusion_model.blocks.1.norm3.diff_b": torch.zeros(24)}, str(norms))
    with pytest.raises(InvalidArgument, match=r"its 2 keys are all norm deltas.*norm3\.diff.*does not merge"):
        gen.load_lora(norms)
    bad_shape = tmp_path / "shape.safetensors"
    lora = random_lora(gen.transformers[0], "diffusers")
    lora["transformer.blocks.1.attn1.to_q.lora_A.weight"] = torch.zeros(4, 7)
    save_file(lora, str(bad_shape))
    with pytest.raises(InvalidArgument, match=r"blocks\.1\.attn1\.to_q\.lora_A\.weight \(4, 7\)"):
        gen.load_lora(bad_shape)
    half = tmp_path / "half.safetensors"
    save_file({"transformer.blocks.0.attn1.to_q.lora_A.weight": torch.zeros(4, 24)}, str(half))
    with pytest.raises(InvalidArgument, match="no matching lora_B"):
        gen.load_lora(half)
    for name in ("lora.pt", "lora.BIN"):
        pickle = tmp_path / name
        torch.save({}, pickle)
        with pytest.raises(InvalidArgument, match="is a PyTorch pickle file.*safetensors only"):
            gen.load_lora(pickle)
    with pytest.raises(MissingFileError):
        gen.load_lora(tmp_path / "missing.safetensors")
    good = tmp_path / "good.safetensors"
    save_file(random_lora(gen.transformers[0], "diffusers"), str(good))
    with pytest.raises(InvalidArgument, match="expert=1"):
        gen.load_lora(good, expert=1)
    with pytest.raises(InvalidArgumentType, match="scale="):
        gen.load_lora(good, scale="strong")
    with pytest.raises(InvalidArgument, match="expert=2, but this checkpoint has 1 expert"):
        VideoGenerator.from_pretrained("tiny", device="cpu", dtype=torch.float32, lora=[(good, 1.0, 2)])
    for bad in [(good, 1.0, 0, 1), (good, 1.0, 0.5), (good, 1.0, True), (good, 1.0, "high")]:
        with pytest.raises(InvalidArgumentType, match="lora="):
            VideoGenerator.from_pretrained("tiny", device="cpu", dtype=torch.float32, lora=[bad])
    assert all(torch.equal(before[k], v) for k, v in gen.transformers[0].state_dict().items())
