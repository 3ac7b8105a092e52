"""What composes with VACE: compiled blocks (fullgraph, the control blocks too) give the eager DiT's output; an FP8
DiT (the main blocks' linears in e4m3, the control blocks dense) runs with the control hints; a LoRA gives diffusers'
frames; sparse backends order the control tokens as the stream."""
from __future__ import annotations

import torch
import torch.nn as nn

from fastwan.kernels.fp8 import Fp8Linear
from fastwan.models.wan.vace import vace_control
from fastwan.options import DiTOptions
from tests.vace.test_vace_dit import inputs, load, rel_err


def test_compiled_blocks_match_eager(vace_ckpts):
    torch._dynamo.reset()
    model = load(vace_ckpts["wan2.1-vace"] / "transformer", "reference")
    x, control, (text, text_u) = inputs(model.config)
    t = torch.tensor([600.0])
    with torch.no_grad(), vace_control(model, control, [0.8, 1.3]):
        want = model(x, t, text), *model.forward_cfg(x, t, text, text_u)
        model.compile_blocks(fullgraph=True, backend="aot_eager")  # fullgraph: any graph break raises
        got = model(x, t, text), *model.forward_cfg(x, t, text, text_u)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert all(blk._compiled_call_impl is not None for blk in model.vace_blocks)


def test_fp8_dit_runs_the_hints(vace_ckpts):
    from fastwan.attention import AttentionDispatch
    from fastwan.models import load_transformer

    folder = vace_ckpts["wan2.2-vace-a14b"] / "transformer_2"
    attn = AttentionDispatch.resolve("TORCH_SDPA", device="cpu", dtype=torch.float32, head_dim=12)
    fp8 = load_transformer(folder, dtype=torch.float32, device="cpu", attention=attn,
                           options=DiTOptions(block="fast"), quantization="fp8")
    dense = load(folder, "fast")
    assert any(isinstance(m, Fp8Linear) for m in fp8.blocks.modules())
    assert not any(isinstance(m, Fp8Linear) for m in fp8.vace_blocks.modules())
    assert any(isinstance(m, nn.Linear) for m in fp8.vace_blocks.modules())
    x, control, (text, _) = inputs(dense.config)
    t = torch.tensor([300.0])
    with torch.no_grad():
        plain = dense(x, t, text)
        with vace_control(dense, control, 1.0), vace_control(fp8, control, 1.0):
            want, got = dense(x, t, text), fp8(x, t, text)
    assert rel_err(got, want) < 0.1 * rel_err(plain, want)  # e4m3 rounding, far below the hints' effect


def test_lora_on_the_wan_blocks_gives_diffusers_frames(vace_ckpts, tmp_path, monkeypatch):
    """A diffusers-format LoRA on every Wan block linear, merged by fastwan and loaded as an adapter by diffusers'
    WanVACEPipeline: frames within 1, final latents within 1e-4, and the LoRA changes the video."""
    import numpy as np
    from safetensors.torch import save_file

    from fastwan import GenerationRequest, VideoGenerator
    from tests.lora.helpers import random_lora
    from tests.vace.test_vace_pipeline import NEGATIVE, PROMPT, RUN, TASKS, reference

    path = vace_ckpts["wan2.1-vace"]
    gen = VideoGenerator.from_pretrained(path, device="cpu", dtype=torch.float32)
    gen.set_progress_bar_config(disable=True)
    lora = tmp_path / "style.safetensors"
    save_file(random_lora(gen.transformers[0], "diffusers"), str(lora))
    kw = TASKS["inpainting"]
    request = GenerationRequest(prompt=PROMPT, negative_prompt=NEGATIVE, seed=4, save_video=False, **RUN, **kw)
    base = gen.generate(request).frames
    gen.load_lora(lora)
    denoised, denoise = [], gen._denoise
    monkeypatch.setattr(gen, "_denoise", lambda *a, **k: denoised.append(denoise(*a, **k)) or denoised[-1])
    got = gen.generate(request).frames

    def with_lora(pipe):
        pipe.load_lora_weights(str(lora), adapter_name="x", low_cpu_mem_usage=False)

    want, latents = reference(path, 4, setup=with_lora, **kw)
    assert np.abs(got.astype(int) - base.astype(int)).max() > 3
    assert np.abs(got.astype(int) - want.astype(int)).max() <= 1
    assert ((denoised[0][0].double() - latents.double()).norm() / latents.double().norm()).item() <= 1e-4


def test_sparse_backends_put_the_control_tokens_in_the_stream_order(vace_ckpts):
    """Dense-equivalent configs of the sparse backends (their compact token order, the attention over all tokens)
    give the dense VACE DiT's output: the control tokens and hints are permuted as the stream is."""
    from fastwan.attention import AttentionDispatch, create_backend

    model = load(vace_ckpts["wan2.1-vace"] / "transformer", "reference")
    x, control, (text, _) = inputs(model.config)
    t = torch.tensor([800.0])
    kw = dict(step_index=3, num_steps=10)
    with torch.no_grad(), vace_control(model, control, [0.9, 1.2]):
        want = model(x, t, text, **kw)
        for name, conf in [("SLIDING_TILE_ATTN", {"tile": [2, 2, 4], "window": 99}),
                           ("NEIGHBORHOOD_ATTN", {"tile": [2, 2, 4], "kernel_size": -1})]:
            model.set_attention(AttentionDispatch(create_backend(name, conf), create_backend("TORCH_SDPA")))
            got = model(x, t, text, **kw)
            assert rel_err(got, want) <= 1e-5, name
