"""The published Hub checkpoints' layouts in miniature: a tiny checkpoint rewritten where the published repos differ
from what ``fastwan.checkpoint.tiny`` writes. Each loads and gives the frames of the plain tiny checkpoint (the
differences change no number).

- FastVideo/FastWan2.1-T2V-*-Diffusers (``WanDMDPipeline``) carry VSA's gate projection under FastVideo's module
  path, ``blocks.N.to_gate_compress.{weight,bias}``: FastVideo's DiT defines it there (models/dits/wanvideo.py),
  its diffusers-name mapping (configs/models/dits/wanvideo.py) has no rule for it, and its saver keeps a name
  without a rule as it is (training_utils.custom_to_hf_state_dict).
- Wan-AI/Wan2.1-I2V-14B-*-Diffusers and FLF2V were written by diffusers 0.33 (scripts/convert_wan_to_diffusers.py):
  model_index.json names ``CLIPVisionModelWithProjection`` (tensors ``vision_model.*`` and
  ``visual_projection.weight``) and has no transformer_2 / boundary_ratio / expand_timesteps; the DiT holds an
  unused ``attn2.norm_added_q.weight`` per block; the VAE, scheduler and DiT configs hold only the keys diffusers
  0.33 wrote. The repos also hold README.md, .gitattributes, assets/ and examples/ at the root.
"""
import json
import re
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from fastwan import VideoGenerator
from fastwan.errors import CheckpointError
from fastwan.checkpoint.resolver import resolve
from fastwan.checkpoint.tiny import write_tiny_checkpoint

FASTWAN_SIZE = dict(height=64, width=64, num_frames=9)  # VSA's 4 x 4 x 4-token tiles fit it
GEN = dict(height=32, width=32, num_frames=5, num_inference_steps=2, save_video=False)
DIT_WEIGHTS = "transformer/diffusion_pytorch_model.safetensors"
# the keys diffusers 0.33 wrote into each config (what the published Wan2.1 repos hold)
DIFFUSERS_033_KEYS = {
    "vae/config.json": {"base_dim", "z_dim", "dim_mult", "num_res_blocks", "attn_scales", "temperal_downsample",
                        "dropout", "latents_mean", "latents_std"},
    "scheduler/scheduler_config.json": {
        "num_train_timesteps", "beta_start", "beta_end", "beta_schedule", "trained_betas", "solver_order",
        "prediction_type", "thresholding", "dynamic_thresholding_ratio", "sample_max_value", "predict_x0",
        "solver_type", "lower_order_final", "disable_corrector", "solver_p", "use_karras_sigmas",
        "use_exponential_sigmas", "use_beta_sigmas", "use_flow_sigmas", "flow_shift", "timestep_spacing",
        "steps_offset", "final_sigmas_type", "rescale_betas_zero_snr"},
    "transformer/config.json": {
        "patch_size", "num_attention_heads", "attention_head_dim", "in_channels", "out_channels", "text_dim",
        "freq_dim", "ffn_dim", "num_layers", "cross_attn_norm", "qk_norm", "eps", "image_dim", "added_kv_proj_dim",
        "rope_max_seq_len"},
}


def edit_json(path, edit):
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=2))


def edit_tensors(path, edit):
    tensors = load_file(path)
    save_file(edit(tensors), path, metadata={"format": "pt"})


def fastvideo_gate_names(tensors):
    return {re.sub(r"^(blocks\.\d+)\.attn1\.to_gate_compress\.", r"\1.to_gate_compress.", k): v
            for k, v in tensors.items()}


@pytest.fixture(scope="module")
def fastwan(tmp_path_factory):
    """(plain tiny FastWan checkpoint, the same with FastVideo's gate names)."""
    root = tmp_path_factory.mktemp("fastwan")
    plain = write_tiny_checkpoint(root / "plain", "fastwan2.1", seed=4)
    published = shutil.copytree(plain, root / "FastWan2.1-T2V-1.3B-Diffusers")
    edit_tensors(published / DIT_WEIGHTS, fastvideo_gate_names)
    return plain, published


def test_fastvideo_gate_names_load_as_vsa_gates(fastwan):
    """FastWan's ``blocks.N.to_gate_compress`` gates are the DiT's VSA gates: VSA is the default, each gate holds
    the file's tensor, and the video is the plain layout's."""
    plain, published = fastwan
    state = load_file(published / DIT_WEIGHTS)
    assert "blocks.1.to_gate_compress.weight" in state and not any(".attn1.to_gate" in k for k in state)
    assert resolve(published).vsa_gates
    gen = VideoGenerator.from_pretrained(published, device="cpu", dtype=torch.float32)
    assert gen.attention.self_backend.name == "VIDEO_SPARSE_ATTN"
    for i, blk in enumerate(gen.transformers[0].blocks):
        assert torch.equal(blk.attn1.to_gate_compress.weight, state[f"blocks.{i}.to_gate_compress.weight"])
        assert torch.equal(blk.attn1.to_gate_compress.bias, state[f"blocks.{i}.to_gate_compress.bias"])
    got = gen.generate_video("a red fox", seed=1, save_video=False, **FASTWAN_SIZE).frames
    want = VideoGenerator.from_pretrained(plain, device="cpu", dtype=torch.float32).generate_video(
        "a red fox", seed=1, save_video=False, **FASTWAN_SIZE).frames
    assert got.std() > 5 and np.array_equal(got, want)


def test_one_gate_under_both_names_is_refused_before_loading(fastwan, tmp_path):
    """A gate saved under both names is ambiguous: refused from the headers, naming both tensors."""
    from fastwan.models import load_transformer

    root = shutil.copytree(fastwan[1], tmp_path / "ckpt")
    extra = lambda t: {**t, "blocks.0.attn1.to_gate_compress.bias": t["blocks.0.to_gate_compress.bias"].clone()}  # noqa: E731
    edit_tensors(root / DIT_WEIGHTS, extra)
    match = r"'blocks.0.attn1.to_gate_compress.bias' and 'blocks.0.to_gate_compress.bias' are both the DiT's"
    with pytest.raises(CheckpointError, match=match):
        resolve(root)
    with pytest.raises(CheckpointError, match=match):
        load_transformer(root / "transformer", dtype=torch.float32, device="cpu")


def published_wan21(plain, root):
    """``plain`` (a tiny Wan2.1 checkpoint) rewritten as diffusers 0.33 wrote the published Wan2.1 repos."""
    root = shutil.copytree(plain, root)
    for name, keys in DIFFUSERS_033_KEYS.items():
        edit_json(root / name, lambda d, keys=keys: [d.pop(k) for k in list(d) if k not in keys and k[0] != "_"])

    def index(d):
        for key in ("transformer_2", "boundary_ratio", "expand_timesteps"):
            del d[key]
        d["_diffusers_version"] = "0.33.0.dev0"
    edit_json(root / "model_index.json", index)
    (root / "README.md").write_text("---\nlicense: apache-2.0\n---\n# Wan2.1\n")
    (root / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
    for extra in ("assets/logo.png", "examples/i2v_input.JPG"):
        (root / extra).parent.mkdir()
        (root / extra).write_bytes(b"\x89PNG not read")
    return root


def test_published_wan21_t2v_layout(tmp_path):
    plain = write_tiny_checkpoint(tmp_path / "plain", "wan2.1", seed=5)
    published = published_wan21(plain, tmp_path / "Wan2.1-T2V-1.3B-Diffusers")
    assert "scale_factor_spatial" not in json.loads((published / "vae/config.json").read_text())
    got = VideoGenerator.from_pretrained(published, device="cpu", dtype=torch.float32).generate_video("a kite", seed=2,
                                                                                                         **GEN)
    want = VideoGenerator.from_pretrained(plain, device="cpu", dtype=torch.float32).generate_video("a kite", seed=2,
                                                                                                     **GEN)
    assert got.frames.std() > 5 and np.array_equal(got.frames, want.frames)


def test_published_wan21_i2v_layout(tmp_path):
    """The CLIP saved as ``CLIPVisionModelWithProjection`` (its projection unused: the DiT reads the penultimate
    hidden states), ``norm_added_q`` in every block, diffusers 0.33's configs and index."""
    from transformers import CLIPVisionConfig, CLIPVisionModel, CLIPVisionModelWithProjection

    plain = write_tiny_checkpoint(tmp_path / "plain", "wan2.1-i2v", seed=6)
    published = published_wan21(plain, tmp_path / "Wan2.1-I2V-14B-480P-Diffusers")
    encoder = published / "image_encoder"
    config = CLIPVisionConfig.from_pretrained(encoder)
    config.projection_dim = 8
    clip = CLIPVisionModelWithProjection(config)
    clip.vision_model.load_state_dict(CLIPVisionModel.from_pretrained(encoder).state_dict())
    shutil.rmtree(encoder)
    clip.save_pretrained(encoder)
    names = set(load_file(encoder / "model.safetensors"))
    assert "visual_projection.weight" in names and "vision_model.embeddings.class_embedding" in names
    edit_json(published / "model_index.json",
              lambda d: d.update(image_encoder=["transformers", "CLIPVisionModelWithProjection"]))
    inner = resolve(plain).transformer_config.inner_dim
    edit_tensors(published / DIT_WEIGHTS, lambda t: {**t, **{f"blocks.{i}.attn2.norm_added_q.weight": torch.ones(inner)
                                                             for i in range(2)}})
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 40, 3), dtype=np.uint8))
    gens = [VideoGenerator.from_pretrained(root, device="cpu", dtype=torch.float32) for root in (published, plain)]
    for a, b in zip(*(g.transformers[0].state_dict().items() for g in gens)):
        assert a[0] == b[0] and torch.equal(a[1], b[1])
    for a, b in zip(*(g.image_encoder.state_dict().items() for g in gens)):
        assert a[0] == b[0] and torch.equal(a[1], b[1])
    frames = [g.generate_video("a fox", image=image, seed=3, **GEN).frames.astype(int) for g in gens]
    # within 1: on the CPU the weights stay in the safetensors file's memory map, where the extra tensors shift
    # the others' alignment, which the matmul kernels' rounding follows
    assert frames[0].std() > 5 and np.abs(frames[0] - frames[1]).max() <= 1
