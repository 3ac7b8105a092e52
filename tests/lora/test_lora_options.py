"""LoRAs with the other options, fp32 on the CPU unless marked: load / unload cycles at several scales, two files
stacked, the fast and reference builds, FP8 weights: every tensor back bit for bit; compiled blocks take a LoRA
loaded after compiling without recompiling and give the eager generator's frames; step caches (MagCache,
TeaCache) after a load equal a fresh generator; FP8 load_lora equals from_pretrained(lora=). Merges are computed on
the generator's device, also when a memory plan keeps the weights in host memory (on CUDA the CPU's matmul sums in
another order, and an FP8 row's new scale follows its largest value), so a plan's video equals the one without it.
On FP8 weights the merged weights are the requantized sum, and unloading restores every tensor bit for bit, also
after the weights moved (as a memory plan on CUDA or ``module.to(dtype)`` moves them); LoRAs loaded after a video
(the per-prompt caches and step caches see the new weights) give the frames of a fresh generator with them."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from fastwan import VideoGenerator
from fastwan.cache import FirstBlockCache, MagCache, SkipSteps, TeaCache
from fastwan.kernels.fp8 import Fp8Linear
from fastwan.lora import LoraState
from fastwan.offload.stream import held_tensors
from fastwan.options import DiTOptions
from tests.lora.helpers import bits, changed, random_lora

RUN = dict(height=64, width=64, num_frames=5, num_inference_steps=4, guidance_scale=5.0, seed=3, save_video=False)
E4M3_MAX = 448.0


def load(model="tiny", **kw) -> VideoGenerator:
    return VideoGenerator.from_pretrained(model, device="cpu", dtype=torch.float32, **kw)


def frames(g, **kw) -> np.ndarray:
    return g.generate_video("a fox in the snow", negative_prompt="blurry", **{**RUN, **kw}).frames.astype(int)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> list:
    """Two LoRA files on the tiny DiT: original-Wan keys with alphas and a diff_b, and diffusers keys."""
    root = tmp_path_factory.mktemp("loras")
    model = load().transformers[0]
    out = []
    for i, (fmt, alpha) in enumerate((("wan", 4.0), ("diffusers", None))):
        out.append(root / f"l{i}.safetensors")
        save_file(random_lora(model, fmt, seed=i, alpha=alpha), str(out[-1]))
    return out


# -- exactness -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("q", [None, "fp8"])
@pytest.mark.parametrize("block", ["fast", "reference"])
def test_load_unload_cycles_restore_every_bit(files, q, block):
    g = load(quantization=q, dit_options=DiTOptions(block=block))
    before, base = bits(g), frames(g)
    for scale in (0.3, -1.0, 2.5, 0.0, 1e-3):
        g.load_lora(files[0], scale)
        g.load_lora(files[1], scale / 2)
        assert scale in (0.0, 1e-3) or changed(before, bits(g))
        g.unload_lora()
        assert changed(before, bits(g)) == [] and all(not s.loaded for s in g._loras)
    g.load_lora(files[0], 0.8)
    frames(g)  # the per-prompt caches filled from merged weights
    g.unload_lora()
    assert np.array_equal(frames(g), base)


def test_fp8_load_lora_equals_from_pretrained_with_it(files):
    """A LoRA loaded into an FP8 generator after a video gives the frames of a fresh FP8 generator given it."""
    used = load(quantization="fp8")
    frames(used)
    used.load_lora(files[0], 0.8)
    used.load_lora(files[1], -0.4)
    fresh = load(quantization="fp8", lora=[(files[0], 0.8), (files[1], -0.4)])
    assert changed(bits(used), bits(fresh)) == []
    assert np.array_equal(frames(used), frames(fresh))


# -- compiled blocks -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("q", [None, "fp8"])
def test_lora_after_compile_takes_effect_without_recompiling(files, q):
    """The merge writes into the tensors the compiled graphs read: no new graph, the eager generator's frames with
    the same LoRAs, and after unloading the first video again."""
    from torch._dynamo.utils import counters

    opts = dict(quantization=q, dit_options=DiTOptions(block="fast"))
    eager = load(**opts)
    want = [frames(eager)]
    eager.load_lora(files[0], 0.8)
    want.append(frames(eager))
    eager.load_lora(files[1], -0.5)
    want.append(frames(eager))
    torch._dynamo.reset()
    counters.clear()
    g = load(**opts, enable_torch_compile=True, torch_compile_kwargs={"backend": "aot_eager", "fullgraph": True})
    got = [frames(g)]
    graphs = counters["stats"]["unique_graphs"]
    g.load_lora(files[0], 0.8)
    got.append(frames(g))
    g.load_lora(files[1], -0.5)
    got.append(frames(g))
    g.unload_lora()
    got.append(frames(g))
    assert counters["stats"]["unique_graphs"] == graphs and not counters["recompiles"]
    assert all(np.array_equal(a, b) for a, b in zip(got, want + want[:1]))
    assert np.abs(want[1] - want[0]).max() > 10


# -- step caches -----------------------------------------------------------------------------------------------------
CACHES = {"magcache": lambda ratios: MagCache(threshold=0.5, mag_ratios=ratios, retention_ratio=0.2),
          "teacache": lambda ratios: TeaCache(0.3, coefficients=[0, 0, 0, 1, 0])}  # ratios: the model's curve


@pytest.mark.parametrize("model", ["tiny", "tiny-wan2.2-a14b"])
@pytest.mark.parametrize("kind", ["magcache", "teacache"])
def test_lora_between_videos_under_a_step_cache_equals_a_fresh_generator(files, model, kind):
    ratios = load(model).generate_video("a fox", **{**RUN, "num_inference_steps": 6},
                                        cache=MagCache(calibrate=True)).cache["calibration"]["cond"]
    cache = CACHES[kind](ratios)
    opts = dict(cache=cache, dit_options=DiTOptions(block="fast"))
    used = load(model, **opts)
    base = used.generate_video("a fox", **{**RUN, "num_inference_steps": 6})
    used.load_lora(files[0], 0.8)
    got = used.generate_video("a fox", **{**RUN, "num_inference_steps": 6})
    want = load(model, **opts, lora=[(files[0], 0.8)]).generate_video("a fox", **{**RUN, "num_inference_steps": 6})
    assert np.array_equal(got.frames, want.frames) and got.cache == want.cache
    assert np.abs(got.frames.astype(int) - base.frames.astype(int)).max() > 5
    used.unload_lora()
    again = used.generate_video("a fox", **{**RUN, "num_inference_steps": 6})
    assert np.array_equal(again.frames, base.frames) and again.cache == base.cache


# -- where merges are computed ------------------------------------------------------------------------------------
def test_merges_are_computed_on_the_generator_device(files, monkeypatch):
    """load_lora and from_pretrained(lora=) hand the generator's device to the merge (what keeps a memory plan's
    host-memory weights merging as the resident ones do)."""
    from fastwan.lora import merge

    seen = []
    real = merge._weight_delta
    monkeypatch.setattr(merge, "_weight_delta", lambda parts, shape, device: seen.append(device) or
                        real(parts, shape, device))
    g = load(lora=[(files[0], 0.5)])
    g.load_lora(files[1], 0.5)
    assert seen and set(seen) == {g.device}


def one_layer(device, q) -> torch.nn.Module:
    """A module holding one linear of a real Wan FFN's shape (1536 -> 8960): bf16, or FP8 (``q="fp8"``)."""
    lin = torch.nn.Linear(1536, 8960, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(8960, 1536, generator=torch.Generator().manual_seed(0)) * 0.02)
    return torch.nn.ModuleDict({"ffn": Fp8Linear.from_linear(lin) if q else lin.to(torch.bfloat16)}).to(device)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("q", [None, "fp8"])
def test_host_memory_weights_merge_to_the_bits_of_gpu_weights(q):
    """A memory plan keeps streamed / offloaded weights in host memory between videos; merged there with
    device="cuda" they hold the bits a GPU-resident weight merges to (an FP8 layer's scales too)."""
    g = torch.Generator().manual_seed(1)
    parts = {"A": torch.randn(32, 1536, generator=g) * 0.05, "B": torch.randn(8960, 32, generator=g) * 0.05,
             "alpha": torch.tensor(16.0)}
    models = {d: one_layer(d, q) for d in ("cpu", "cuda")}
    LoraState().merge(models["cuda"], {"ffn": parts}, 0.8)
    LoraState().merge(models["cpu"], {"ffn": parts}, 0.8, device="cuda")
    a, b = models["cuda"].state_dict(), models["cpu"].state_dict()
    for k in a:
        x, y = a[k].cpu(), b[k]
        assert y.device.type == "cpu"
        assert torch.equal(x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x,
                           y.view(torch.uint8) if y.dtype == torch.float8_e4m3fn else y), k


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("q", [None, "fp8"])
def test_cuda_plan_lora_video_equals_the_video_without_the_plan(files, q):
    from fastwan.offload import OffloadPlan
    from fastwan.offload.placement import Placement

    def gen(**kw):
        return VideoGenerator.from_pretrained("tiny-wan2.2-a14b", device="cuda", dtype=torch.bfloat16,
                                              quantization=q, **kw)
    plain = gen()
    plain.load_lora(files[0], 0.8)
    want = frames(plain)
    placed = gen()
    placed.placement = Placement(OffloadPlan("offload", "swap", True, False, 1, {"encode": 0, "denoise": 0,
                                                                                 "decode": 0}),
                                 torch.device("cuda"), transformers=placed.transformers,
                                 text_encoder=placed.text_encoder, image_encoder=None, vae=placed.vae)
    before = bits(placed)
    placed.load_lora(files[0], 0.8)
    assert np.array_equal(frames(placed), want)
    placed.unload_lora()
    assert changed(before, bits(placed)) == []


# -- LoRA on FP8 weights -------------------------------------------------------------------------------------------
def frames3(gen, **kw) -> np.ndarray:
    """``frames`` of a 3-step video."""
    return frames(gen, **{"num_inference_steps": 3, **kw})


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
    base32, base8 = frames3(fp32), frames3(fp8)
    for g in (fp32, fp8):
        g.load_lora(path, 0.8)
    got, want = frames3(fp8), frames3(fp32)
    fp8_error = np.abs(base8 - base32).max()
    assert np.abs(got - want).max() <= max(2 * fp8_error, 3)
    assert np.abs(want - base32).max() > 4 * max(fp8_error, 3)  # the LoRA moves frames well beyond that
    fp8.unload_lora()
    assert np.array_equal(frames3(fp8), base8)


@pytest.mark.parametrize("move", ["cuda-plan", "to-dtype"])
def test_fp8_lora_unloads_after_the_weights_moved(tmp_path, move):
    gen = load(quantization="fp8")
    model = gen.transformers[0]
    path = lora_files(gen, tmp_path)[0]
    before = state(model)
    base = frames3(gen)
    gen.load_lora(path, 0.8)
    if move == "cuda-plan":
        relocate_like_a_cuda_plan(model)
    else:
        model.to(torch.float32)  # FP8 weights stay e4m3 (Fp8Linear._apply), as new buffer tensors
    gen.unload_lora()
    assert same_state(before, state(model)) == []
    assert np.array_equal(frames3(gen), base)


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
    base = frames3(used)
    for i, path in enumerate(paths):
        used.load_lora(path, 0.8, expert=i)
        fresh.load_lora(path, 0.8, expert=i)
    got = frames3(used)
    assert np.array_equal(got, frames3(fresh))
    assert np.abs(got - base).max() > 10
    used.unload_lora()
    assert np.array_equal(frames3(used), base)
