"""transformer/config.json and model_index.json values are checked (type and range) before any weights load;
each error names the file, the key and the value as written there. Valid edge values still load."""
import json
import math
import shutil

import pytest
import torch

from fastwan import VideoGenerator
from fastwan.checkpoint.tiny import write_tiny_checkpoint

DELETE = object()  # a mutation that removes the key


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """Tiny one-expert (Wan2.1) and two-expert (Wan2.2-A14B) checkpoints."""
    root = tmp_path_factory.mktemp("meta")
    return {v: write_tiny_checkpoint(root / v, v) for v in ("wan2.1", "wan2.2-a14b")}


@pytest.fixture
def no_weights(monkeypatch):
    """Loading a DiT fails the test: metadata errors must come before any weights load."""
    from fastwan.pipelines import generator

    def boom(*a, **k):
        raise AssertionError("weights were loaded before the checkpoint metadata was checked")

    monkeypatch.setattr(generator, "load_transformer", boom)


def mutated(base, tmp_path, variant, file, key, value):
    """A copy of ``base[variant]`` with ``key`` of JSON ``file`` set to ``value`` (or removed); (root, file path)."""
    root = shutil.copytree(base[variant], tmp_path / "ckpt")
    path = root / file
    data = json.loads(path.read_text())
    if value is DELETE:
        del data[key]
    else:
        data[key] = value
    path.write_text(json.dumps(data))
    return root, path


CONFIG = "transformer/config.json"
INDEX = "model_index.json"

BAD_CONFIG = [
    ("num_layers", "2"), ("num_layers", True), ("num_layers", 0), ("num_layers", -1), ("num_layers", 2.0),
    ("num_layers", None), ("patch_size", 2), ("patch_size", [1, 2]), ("patch_size", [1, 2, "2"]),
    ("patch_size", [1, 0, 2]), ("patch_size", [1, 2, 2.5]), ("eps", "x"), ("eps", 0), ("eps", -1e-6),
    ("eps", math.inf), ("eps", True), ("cross_attn_norm", "true"), ("cross_attn_norm", 1),
    ("cross_attn_norm", None), ("qk_norm", "layer_norm"), ("qk_norm", None), ("qk_norm", 5),
    ("text_dim", "32"), ("text_dim", 32.5), ("ffn_dim", 0), ("attention_head_dim", 13),
    ("attention_head_dim", "12"), ("num_attention_heads", 0), ("freq_dim", 255), ("in_channels", "16"),
    ("out_channels", 8), ("out_channels", "16"), ("rope_max_seq_len", 0), ("image_dim", "x"), ("image_dim", 32),
    ("added_kv_proj_dim", 32), ("pos_embed_seq_len", -1), ("_class_name", "FluxTransformer2DModel"),
    ("_class_name", None),
]


@pytest.mark.parametrize("key,value", BAD_CONFIG, ids=[f"{k}={v!r}" for k, v in BAD_CONFIG])
def test_bad_transformer_config(base, tmp_path, no_weights, key, value):
    root, path = mutated(base, tmp_path, "wan2.1", CONFIG, key, value)
    with pytest.raises((ValueError, TypeError)) as e:
        VideoGenerator.from_pretrained(root, device="cpu")
    msg = str(e.value)
    assert str(path) in msg and f'"{key}": {json.dumps(value)}' in msg, msg


BAD_INDEX = [
    ("wan2.1", "_class_name", "StableDiffusionPipeline", "not a Wan pipeline"),
    ("wan2.1", "_class_name", None, "not a Wan pipeline"),
    ("wan2.1", "_class_name", 5, "not a Wan pipeline"),
    ("wan2.1", "image_encoder", ["transformers", "CLIPVisionModel"], "named together"),
    ("wan2.1", "image_processor", "CLIPImageProcessor", "[library, class]"),
    ("wan2.1", "_class_name", "WanVideoToVideoPipeline", "fastwan runs text-to-video"),
    ("wan2.1", "_class_name", "WanSpeechToVideoPipeline", "fastwan runs text-to-video"),
    ("wan2.2-a14b", "boundary_ratio", "x", "(0, 1)"),
    ("wan2.2-a14b", "boundary_ratio", 0, "(0, 1)"),
    ("wan2.2-a14b", "boundary_ratio", 1, "(0, 1)"),
    ("wan2.2-a14b", "boundary_ratio", 1.5, "(0, 1)"),
    ("wan2.2-a14b", "boundary_ratio", -0.5, "(0, 1)"),
    ("wan2.2-a14b", "boundary_ratio", True, "(0, 1)"),
    ("wan2.2-a14b", "boundary_ratio", [0.5], "(0, 1)"),
    ("wan2.2-a14b", "boundary_ratio", None, "two experts"),
    ("wan2.1", "boundary_ratio", 0.875, "no second expert"),
    ("wan2.1", "expand_timesteps", "yes", "true or false"),
    ("wan2.1", "expand_timesteps", 1, "true or false"),
    ("wan2.1", "expand_timesteps", [], "true or false"),
    ("wan2.1", "transformer_2", "WanTransformer3DModel", "[null, null]"),
    ("wan2.1", "transformer_2", ["diffusers"], "[null, null]"),
    ("wan2.1", "transformer_2", [None, "WanTransformer3DModel"], "[null, null]"),
    ("wan2.1", "transformer_2", ["diffusers", 5], "[null, null]"),
    ("wan2.1", "transformer_2", {}, "[null, null]"),
    ("wan2.2-a14b", "transformer_2", ["", ""], "[null, null]"),
]


@pytest.mark.parametrize("variant,key,value,rule", BAD_INDEX,
                         ids=[f"{v}-{k}={x!r}" for v, k, x, _ in BAD_INDEX])
def test_bad_model_index(base, tmp_path, no_weights, variant, key, value, rule):
    root, path = mutated(base, tmp_path, variant, INDEX, key, value)
    if key.startswith("image_"):  # the CLIP entries are read for image-to-video pipelines
        path.write_text(json.dumps({**json.loads(path.read_text()), "_class_name": "WanImageToVideoPipeline"}))
    with pytest.raises((ValueError, TypeError)) as e:
        VideoGenerator.from_pretrained(root, device="cpu")
    msg = str(e.value)
    assert str(path) in msg and f'"{key}": {json.dumps(value)}' in msg and rule in msg, msg


def test_two_experts_need_boundary_ratio(base, tmp_path, no_weights):
    root, path = mutated(base, tmp_path, "wan2.2-a14b", INDEX, "boundary_ratio", DELETE)
    with pytest.raises(ValueError) as e:
        VideoGenerator.from_pretrained(root, device="cpu")
    assert str(path) in str(e.value) and '"boundary_ratio"' in str(e.value)


def test_experts_must_share_an_architecture(base, tmp_path, no_weights):
    root, path = mutated(base, tmp_path, "wan2.2-a14b", "transformer_2/config.json", "rope_max_seq_len", 128)
    with pytest.raises(ValueError) as e:
        VideoGenerator.from_pretrained(root, device="cpu")
    assert str(path) in str(e.value) and "rope_max_seq_len" in str(e.value)


GOOD = [
    ("wan2.1", CONFIG, "eps", 1), ("wan2.1", CONFIG, "eps", 1e-12), ("wan2.1", CONFIG, "out_channels", None),
    ("wan2.1", CONFIG, "image_dim", None), ("wan2.1", CONFIG, "pos_embed_seq_len", None),
    ("wan2.1", CONFIG, "rope_max_seq_len", 4096),
    ("wan2.1", CONFIG, "unknown_key", "ignored"),
    ("wan2.1", INDEX, "boundary_ratio", DELETE), ("wan2.1", INDEX, "transformer_2", DELETE),
    ("wan2.1", INDEX, "transformer_2", None), ("wan2.1", INDEX, "expand_timesteps", DELETE),
    ("wan2.1", INDEX, "expand_timesteps", None), ("wan2.1", INDEX, "expand_timesteps", False),
    ("wan2.2-a14b", INDEX, "boundary_ratio", 0.001), ("wan2.2-a14b", INDEX, "boundary_ratio", 0.999),
    ("wan2.2-a14b", INDEX, "boundary_ratio", 0.5),
]


@pytest.mark.parametrize("variant,file,key,value", GOOD,
                         ids=[f"{v}-{f.split('/')[0]}-{k}={'<deleted>' if x is DELETE else repr(x)}"
                              for v, f, k, x in GOOD])
def test_valid_edge_values_load(base, tmp_path, variant, file, key, value):
    root, _ = mutated(base, tmp_path, variant, file, key, value)
    gen = VideoGenerator.from_pretrained(root, device="cpu", dtype=torch.float32)
    cfg = gen.transformers[0].config
    if key == "eps":
        assert cfg.eps == value and isinstance(cfg.eps, float)
    if key == "out_channels":  # null: the same as in_channels (as in Diffusers)
        assert cfg.out_channels == cfg.in_channels
    if key == "boundary_ratio":
        assert gen.checkpoint.boundary_ratio == (None if value is DELETE else value)


@pytest.fixture(scope="module")
def clip_ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("clip")
    return {v: write_tiny_checkpoint(root / v, v) for v in ("wan2.1-i2v", "wan2.1-flf2v")}


@pytest.mark.parametrize("variant,key,value,named", [
    ("wan2.1-i2v", "hidden_size", 40, "image_dim"),
    ("wan2.1-flf2v", "hidden_size", 40, "image_dim"),
    ("wan2.1-flf2v", "image_size", 64, "pos_embed_seq_len"),
    ("wan2.1-flf2v", "patch_size", 4, "pos_embed_seq_len"),
    ("wan2.1-flf2v", "patch_size", "8", "patch_size"),
])
def test_clip_that_does_not_fit_the_dit_is_refused_before_weights(clip_ckpts, tmp_path, no_weights, variant, key,
                                                                   value, named):
    """The CLIP image encoder's width must be the DiT's image_dim; for FLF2V its token count per image (patches +
    class token) must be half the DiT's pos_embed_seq_len."""
    from fastwan.errors import CheckpointError

    root, path = mutated(clip_ckpts, tmp_path, variant, "image_encoder/config.json", key, value)
    with pytest.raises(CheckpointError) as e:
        VideoGenerator.from_pretrained(root, device="cpu")
    assert str(path) in str(e.value) and named in str(e.value)


def test_clip_encoder_of_the_tiny_image_checkpoints_fits(clip_ckpts):
    """The checks hold for the consistent layouts (the tokens are counted as the CLIP model counts them)."""
    from transformers import CLIPVisionModel

    for root in clip_ckpts.values():
        gen = VideoGenerator.from_pretrained(root, device="cpu", dtype=torch.float32)
        enc = CLIPVisionModel.from_pretrained(root / "image_encoder")
        c = enc.config
        tokens = enc(pixel_values=torch.zeros(1, 3, c.image_size, c.image_size)).last_hidden_state.shape[1]
        cfg = gen.transformers[0].config
        assert cfg.image_dim == c.hidden_size
        assert cfg.pos_embed_seq_len in (None, 2 * tokens)


def test_clip_config_keys_left_out_take_transformers_defaults(clip_ckpts, tmp_path):
    """A CLIP config.json without image_size (transformers' default 224 then applies) is judged with that default,
    as CLIPVisionModel.from_pretrained reads it: the FLF2V DiT's pos_embed_seq_len is checked against 224."""
    from transformers import CLIPVisionConfig

    from fastwan.errors import CheckpointError

    root, path = mutated(clip_ckpts, tmp_path, "wan2.1-flf2v", "image_encoder/config.json", "image_size", DELETE)
    default = CLIPVisionConfig().image_size
    with pytest.raises(CheckpointError, match=f"image_size {default} "):
        VideoGenerator.from_pretrained(root, device="cpu")
