"""The tiny image-to-video checkpoints (Wan2.1 I2V, FLF2V, Wan2.2 I2V-A14B layouts) are what diffusers'
WanImageToVideoPipeline loads and runs; fastwan's DiT reads their transformers with the image tokens of
fastwan.pipelines.image as diffusers' does; fastwan's pipeline refuses them until it runs image-to-video."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from fastwan import VideoGenerator
from fastwan.attention import AttentionDispatch
from fastwan.errors import CheckpointError
from fastwan.models import load_transformer
from fastwan.options import DiTOptions
from fastwan.pipelines.image import clip_tokens, condition_latents, pixels
from fastwan.tiny import IMAGE_VARIANTS, write_tiny_checkpoint


@pytest.fixture(scope="module", params=IMAGE_VARIANTS)
def image_ckpt(request, tmp_path_factory):
    return request.param, write_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


def frames(seed):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8))


def test_diffusers_runs_the_tiny_image_checkpoints(image_ckpt):
    from diffusers import WanImageToVideoPipeline

    variant, path = image_ckpt
    pipe = WanImageToVideoPipeline.from_pretrained(path)
    extra = {"last_image": frames(1)} if variant == "wan2.1-flf2v" else {}
    out = pipe(image=frames(0), prompt="a fox", height=32, width=32, num_frames=5, num_inference_steps=2,
               output_type="np", generator=torch.Generator().manual_seed(0), **extra).frames[0]
    assert out.shape == (5, 32, 32, 3) and np.isfinite(out).all()


@pytest.mark.parametrize("block", ["reference", "fast"])
def test_fastwan_dit_reads_the_tiny_image_transformers(image_ckpt, block):
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import CLIPImageProcessor, CLIPVisionModel

    variant, path = image_ckpt
    ref = WanTransformer3DModel.from_pretrained(path / "transformer").eval()
    attn = AttentionDispatch.resolve("TORCH_SDPA", device="cpu", dtype=torch.float32, head_dim=12)
    model = load_transformer(path / "transformer", dtype=torch.float32, device="cpu", attention=attn,
                             options=DiTOptions(block=block))
    vae = AutoencoderKLWan.from_pretrained(path / "vae").eval()
    last = pixels(frames(1), 32, 32, 8) if variant == "wan2.1-flf2v" else None
    cond = condition_latents(vae, pixels(frames(0), 32, 32, 8), last, 5)
    x = torch.cat([torch.randn(1, 16, *cond.shape[2:], generator=torch.Generator().manual_seed(0)), cond], dim=1)
    text = torch.zeros(1, 512, 32)
    text[:, :4] = torch.randn(1, 4, 32)
    image = None
    if variant != "wan2.2-i2v-a14b":  # Wan2.2 I2V reads no CLIP tokens
        images = [frames(0)] + ([frames(1)] if variant == "wan2.1-flf2v" else [])
        image = clip_tokens(CLIPVisionModel.from_pretrained(path / "image_encoder").eval(),
                            CLIPImageProcessor.from_pretrained(path / "image_processor"), images)
    t = torch.tensor([600.0])
    with torch.no_grad():
        want = ref(x, t, text, encoder_hidden_states_image=image, return_dict=False)[0]
        got = model(x, t, text, image=image)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fastwan_pipeline_refuses_them_for_now(image_ckpt):
    _, path = image_ckpt
    with pytest.raises(CheckpointError, match="image-to-video is not supported yet"):
        VideoGenerator.from_pretrained(path, device="cpu", dtype=torch.float32)
