import pytest
import torch
from diffusers import WanAnimateTransformer3DModel

# a tiny Wan2.2-Animate DiT: 4 blocks, a face adapter after blocks 0 and 2, face frames of 16 x 16
TINY_ANIMATE = dict(
    patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=36, latent_channels=16,
    out_channels=16, text_dim=32, freq_dim=16, ffn_dim=32, num_layers=4, image_dim=24, added_kv_proj_dim=24,
    motion_encoder_channel_sizes={"4": 8, "8": 6, "16": 5}, motion_encoder_size=16, motion_style_dim=8, motion_dim=4,
    motion_encoder_dim=7, face_encoder_hidden_dim=6, face_encoder_num_heads=2, inject_face_latents_blocks=2,
    motion_encoder_batch_size=5)


@pytest.fixture(scope="session")
def animate_dit(tmp_path_factory):
    """A tiny random WanAnimateTransformer3DModel saved by diffusers: every tensor drawn from a seeded normal (its
    init leaves biases and the face padding tokens zero, which would hide them)."""
    folder = tmp_path_factory.mktemp("tiny-animate") / "transformer"
    model = WanAnimateTransformer3DModel.from_config(TINY_ANIMATE)
    g = torch.Generator().manual_seed(45)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            # the motion encoder scales its weights by 1 / sqrt(fan_in) itself: unit ones keep the face's signal
            tensor.copy_(torch.randn(tensor.shape, generator=g) * (1.0 if name.startswith("motion_") else 0.3))
    model.save_pretrained(folder)
    return folder
