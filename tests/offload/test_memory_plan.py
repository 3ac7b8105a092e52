"""Memory budgets (fastwan.offload.placement) on the CPU: every offload plan carried out on a tiny generator gives the
frames of the generator without one, bit for bit in fp32 (text encoder offloaded or streamed layer by layer, A14B
experts swapped at the boundary, the DiT offloaded outside denoising, DiT blocks streamed); the planner's choices
at the real Wan2.1-14B / A14B shapes for given budgets (bf16 and FP8); budgets that cannot fit raise before any
loading, and so does a budget off CUDA. What a job is planned at: an FP8 folder loaded without ``quantization=`` at
its FP8 size (the bytes its loaded DiT holds), a decode at the frames a decoder call can hold."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fastwan import VideoGenerator
from fastwan.errors import InvalidArgument
from fastwan.hooks import HookRegistry
from fastwan.offload import OffloadPlan, plan_offload
from fastwan.offload.plan import GiB
from fastwan.checkpoint.resolver import resolve
from fastwan.models import load_transformer
from fastwan.models.wan.export import export_fp8
from fastwan.offload.placement import Placement, estimate_footprint, job_footprint, usable, weight_bytes

MiB = 2**20
RUN = dict(height=64, width=64, num_frames=9, num_inference_steps=4, guidance_scale=5.0, seed=3, save_video=False)


def plan(text_encoder="resident", experts="resident", dit_offload=False, vae_tiling=False, streamed_blocks=0):
    return OffloadPlan(text_encoder, experts, dit_offload, vae_tiling, streamed_blocks,
                       {"encode": 0, "denoise": 0, "decode": 0})


def placed(ckpt, p, **load):
    """A tiny fp32 CPU generator (``load``: more from_pretrained arguments) carrying out plan ``p``."""
    gen = VideoGenerator.from_pretrained(ckpt, device="cpu", dtype=torch.float32, **load)
    gen.placement = Placement(p, torch.device("cpu"), transformers=gen.transformers, text_encoder=gen.text_encoder,
                              image_encoder=gen.image_encoder, vae=gen.vae)
    return gen


@pytest.mark.parametrize("p", [
    plan("offload", "swap", True),
    plan("stream", "resident", False, False, 1),
    plan("offload", "swap", True, False, 1),
], ids=["offload-swap", "stream-te-blocks", "all"])
def test_every_plan_gives_the_same_frames(tiny_ckpts, p):
    ckpt = tiny_ckpts["wan2.2-a14b"]
    want = VideoGenerator.from_pretrained(ckpt, device="cpu", dtype=torch.float32).generate_video("a cat", **RUN)
    gen = placed(ckpt, p)
    calls = []
    for s in gen.placement.streamers:
        if s is not None:
            before = s.before
            s.before = lambda i, b=before: calls.append(i) or b(i)
    swaps = []
    expert = gen.placement.expert
    gen.placement.expert = lambda i: swaps.append(i) or expert(i)
    got = gen.generate_video("a cat", **RUN)
    assert np.array_equal(got.frames, want.frames)
    n = len(gen.transformers[0].blocks)
    if p.streamed_blocks:  # the last k blocks of each expert went through the streamer on every forward
        assert set(calls) == set(range(n - p.streamed_blocks, n)) and len(calls) > 0
    assert swaps == [0, 0, 1, 1]  # 4 steps split 2 / 2 across the boundary
    again = gen.generate_video("a cat", **RUN)  # a second video: everything went home and comes back
    assert np.array_equal(again.frames, want.frames)


def test_block_0_is_never_streamed(tiny_ckpts):
    with pytest.raises(InvalidArgument, match="streamed_blocks=2: a DiT of 2 blocks streams at most 1"):
        placed(tiny_ckpts["wan2.1"], plan(streamed_blocks=2))


def write_configs(root, experts=1):
    """A checkpoint of configs only, at the real Wan2.1-14B shapes (UMT5-XXL, Wan VAE)."""
    from diffusers import AutoencoderKLWan
    from transformers import UMT5Config

    from fastwan.checkpoint.presets import Preset
    from fastwan.checkpoint.resolver import Checkpoint

    dit = dict(_class_name="WanTransformer3DModel", patch_size=[1, 2, 2], num_attention_heads=40,
               attention_head_dim=128, in_channels=16, out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824,
               num_layers=40, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6)
    names = ("transformer", "transformer_2")[:experts]
    for name in names:
        (root / name).mkdir(parents=True)
        (root / name / "config.json").write_text(json.dumps(dit))
    UMT5Config(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
               feed_forward_proj="gated-gelu").save_pretrained(root / "text_encoder")
    with torch.device("meta"):
        AutoencoderKLWan().save_config(root / "vae")  # the Wan2.1 VAE's default shape
    from fastwan.models import WanConfig

    preset = Preset(height=720, width=1280, num_frames=81, num_inference_steps=40, guidance_scale=5.0,
                    guidance_scale_2=None, fps=16, flow_shift=5.0)
    return Checkpoint(root=root, variant="wan2.1", preset=preset, index={}, experts=names,
                      transformer_config=WanConfig.from_dict(dit), boundary_ratio=0.9 if experts == 2 else None,
                      expand_timesteps=False)


def footprint(ckpt, quantization=None):
    weights = weight_bytes(ckpt, dtype=torch.bfloat16, vae_dtype=torch.bfloat16, quantization=quantization)
    return estimate_footprint(ckpt, weights, dtype=torch.bfloat16, quantization=quantization,
                              height=720, width=1280, num_frames=81, cfg_batch=1, prompts=2, vae_chunk=1)


def test_planner_choices_at_the_14b_shapes(tmp_path):
    one = write_configs(tmp_path / "14b")
    fp = footprint(one)
    assert 28e9 < fp.dit[0] < 29.5e9 and 11e9 < fp.text_encoder < 12e9  # 14B bf16, UMT5-XXL bf16
    assert plan_offload(fp, 80 * GiB).levers() == []  # 28.6 + 11.4 GB of weights + 11 GB of activations
    assert plan_offload(fp, 40 * GiB).levers() == ["text_encoder=offload"]
    p24 = plan_offload(fp, 24 * GiB)
    assert p24.text_encoder == "offload" and p24.dit_offload and p24.streamed_blocks > 0 and p24.peak <= 24 * GiB
    f8 = plan_offload(footprint(one, "fp8"), 24 * GiB)  # FP8 halves the DiT: fewer blocks streamed
    assert 0 < f8.streamed_blocks < p24.streamed_blocks and f8.peak <= 24 * GiB
    assert footprint(one, "fp8").dit[0] < 0.52 * fp.dit[0]
    two = footprint(write_configs(tmp_path / "a14b", experts=2))
    pa = plan_offload(two, 24 * GiB)
    assert pa.experts == "swap" and pa.streamed_blocks == p24.streamed_blocks
    with pytest.raises(InvalidArgument, match="max_gpu_memory|budget"):
        plan_offload(fp, 8 * GiB)


def test_budget_errors_before_loading(tiny_ckpts, monkeypatch):
    from fastwan.pipelines import generator

    def boom(*a, **k):
        raise AssertionError("loading started before the checks finished")

    monkeypatch.setattr(generator, "load_transformer", boom)
    with pytest.raises(InvalidArgument, match="budgets CUDA memory, but device=cpu"):
        VideoGenerator.from_pretrained(tiny_ckpts["wan2.1"], device="cpu", max_gpu_memory="24GiB")
    with pytest.raises(InvalidArgument):
        VideoGenerator.from_pretrained(tiny_ckpts["wan2.1"], device="cpu", max_gpu_memory="lots")


def test_each_video_gets_the_planners_plan_before_compute(tiny_ckpts, monkeypatch):
    """A video whose plan (the planner's for it) differs from the current one gets it before any compute: here
    a plan with every lever on, under a budget that needs none."""
    from fastwan.pipelines import generator

    ckpt = tiny_ckpts["wan2.2-a14b"]
    want = VideoGenerator.from_pretrained(ckpt, device="cpu", dtype=torch.float32).generate_video("a cat", **RUN)
    gen = placed(ckpt, plan("offload", "swap", True, False, 1))
    old = gen.placement
    gen.memory_plan, gen.max_gpu_memory = old.plan, 80 * GiB
    gen._weight_bytes = weight_bytes(gen.checkpoint, dtype=torch.float32, vae_dtype=torch.float32, quantization=None)
    got = gen.generate_video("a cat", **RUN)
    assert gen.placement is not old and gen.memory_plan.levers() == []  # 80 GiB: the tiny model needs no lever
    assert all(HookRegistry.of(t).names() == [] for t in gen.transformers)  # the old plan's streaming is gone
    assert np.array_equal(got.frames, want.frames)
    monkeypatch.setattr(generator, "plan_offload", lambda fp, budget: (_ for _ in ()).throw(
        InvalidArgument("nothing fits")))
    gen._denoise = lambda *a, **k: pytest.fail("compute started before the plan was settled")
    with pytest.raises(InvalidArgument, match="nothing fits"):
        gen.generate_video("a cat", **RUN)


# ---- what a job is planned at -------------------------------------------------------------------------------------
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
