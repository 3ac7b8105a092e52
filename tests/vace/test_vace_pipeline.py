"""VACE through the generator against diffusers' WanVACEPipeline on the same tiny checkpoint, inputs and seed (fp32):
frames within 1 for each task (reference images, a control video, mask inpainting, mask outpainting, all at once
with per-layer scales) on a Wan2.1-VACE and a two-expert Wan2.2-VACE-Fun-A14B checkpoint."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import WanVACEPipeline
from PIL import Image

from fastwan import GenerationRequest, VideoGenerator

PROMPT, NEGATIVE = "a cat walks on the grass", "blurry"
SIZE, FRAMES = 64, 9


def clip(frames: int = FRAMES, height: int = SIZE, width: int = SIZE, seed: int = 0) -> list:
    """A moving picture: smooth colour fields that drift, as PIL frames."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (height // 8 + 2, width // 8 + 2, 3), dtype=np.uint8)
    big = np.asarray(Image.fromarray(base).resize((width + 16, height + 16), Image.BILINEAR))
    return [Image.fromarray(np.ascontiguousarray(big[k:k + height, k:k + width])) for k in range(frames)]


def box_mask(inside: bool, frames: int = FRAMES, size: int = SIZE) -> list:
    """White (generated) inside a centred box (inpainting) or outside it (outpainting), as RGB frames."""
    m = np.zeros((size, size, 3), np.uint8)
    m[16:48, 16:48] = 255
    m = m if inside else 255 - m
    return [Image.fromarray(m) for _ in range(frames)]


def grey_mask(frames: int = FRAMES, size: int = SIZE) -> list:
    """A mask of grey levels (a ramp across the frame): diffusers splits the video at half and feeds the levels."""
    ramp = np.linspace(0, 255, size).round().astype(np.uint8)
    m = np.repeat(np.repeat(ramp[None, :, None], size, 0), 3, 2)
    return [Image.fromarray(np.ascontiguousarray(m)) for _ in range(frames)]


def references() -> list:
    """Two reference images of other sizes and aspects than the video (fitted onto a white canvas)."""
    rng = np.random.default_rng(9)
    return [Image.fromarray(rng.integers(0, 256, (40, 72, 3), dtype=np.uint8)),
            Image.fromarray(rng.integers(0, 256, (96, 48, 3), dtype=np.uint8))]


TASKS = {
    "references": dict(reference_images=references()),
    "control-video": dict(video=clip()),
    "inpainting": dict(video=clip(), mask=box_mask(True)),
    "outpainting": dict(video=clip(seed=1), mask=box_mask(False)),
    "grey-mask": dict(video=clip(), mask=grey_mask()),
    "all-with-scales": dict(video=clip(), mask=box_mask(True), reference_images=references()[:1],
                            conditioning_scale=[0.5, 1.5]),
}
RUN = dict(num_inference_steps=6, guidance_scale=5.0)


def reference(path, seed, setup=None, **kw):
    """diffusers' frames (uint8) and final latents (the reference images' latent frames first); ``setup(pipe)``
    runs on the pipeline first (e.g. to load a LoRA)."""
    pipe = WanVACEPipeline.from_pretrained(path, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    if setup is not None:
        setup(pipe)
    final = {}

    def keep(pipe, i, t, tensors):
        final["latents"] = tensors["latents"]
        return tensors

    out = pipe(prompt=PROMPT, negative_prompt=NEGATIVE, height=SIZE, width=SIZE, num_frames=FRAMES,
               generator=torch.Generator("cpu").manual_seed(seed), output_type="np", callback_on_step_end=keep,
               callback_on_step_end_tensor_inputs=["latents"], **RUN, **kw).frames[0]
    return (out * 255).round().astype(np.uint8), final["latents"]


@pytest.fixture(scope="module", params=["wan2.1-vace", "wan2.2-vace-a14b"])
def case(request, vace_ckpts):
    path = vace_ckpts[request.param]
    gen = VideoGenerator.from_pretrained(path, device="cpu", dtype=torch.float32)
    gen.set_progress_bar_config(disable=True)
    return path, gen


@pytest.mark.parametrize("task", list(TASKS))
def test_vace_matches_diffusers(case, task, monkeypatch):
    """Frames within 1 of diffusers', and the final latents (the reference images' frames included) within 1e-4
    relative: the tiny VAE's frames change little with the control inputs, the latents show them."""
    path, gen = case
    kw = TASKS[task]
    size = {} if "video" in kw else dict(height=SIZE, width=SIZE, num_frames=FRAMES)
    denoised, denoise = [], gen._denoise
    monkeypatch.setattr(gen, "_denoise", lambda *a, **k: denoised.append(denoise(*a, **k)) or denoised[-1])
    got = gen.generate(GenerationRequest(prompt=PROMPT, negative_prompt=NEGATIVE, seed=4, save_video=False, **size,
                                         **RUN, **kw)).frames
    want, latents = reference(path, 4, **kw)
    assert got.shape == want.shape == (FRAMES, SIZE, SIZE, 3) and want.std() > 5
    assert np.abs(got.astype(int) - want.astype(int)).max() <= 1
    ours = denoised[0][0]
    assert ours.shape == latents.shape
    assert ((ours.double() - latents.double()).norm() / latents.double().norm()).item() <= 1e-4
