"""fastwan's DiT vs diffusers' WanTransformer3DModel on the same weights (fp32), also at configs and inputs the
plain parity test skips (the same random weights): checkpoints with the tensors diffusers skips when loading,
config.json values fastwan cannot reproduce, and inputs that do not fit the DiT, refused with a clear error before
any block runs."""
from __future__ import annotations

import pytest
import torch
from diffusers import WanTransformer3DModel
from safetensors.torch import load_file, save_file

from fastwan.attention import AttentionDispatch
from fastwan.errors import CheckpointError, InvalidArgument
from fastwan.models import WanConfig, WanTransformer, load_transformer
from fastwan.models.wan.loading import check_transformer_files
from fastwan.options import DiTOptions


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("variant,expert", [("wan2.1", "transformer"), ("wan2.2-a14b", "transformer"),
                                            ("wan2.2-a14b", "transformer_2"), ("wan2.2-ti2v", "transformer")])
def test_dit_matches_diffusers(tiny_ckpts, variant, expert):
    folder = tiny_ckpts[variant] / expert
    ref = WanTransformer3DModel.from_pretrained(folder, dtype=torch.float32).eval()
    attn = AttentionDispatch.resolve("TORCH_SDPA", device="cpu", dtype=torch.float32, head_dim=12)
    ours = load_transformer(folder, dtype=torch.float32, device="cpu", attention=attn)
    c = ref.config.in_channels
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, c, 3, 6, 10, generator=g)  # odd latent grid: 3 x 3 x 5 tokens
    text = torch.randn(2, 11, ref.config.text_dim, generator=g)
    if variant == "wan2.2-ti2v":  # per-token timesteps (expand_timesteps), different per sample
        t = torch.stack([torch.full((45,), 901.0), torch.full((45,), 17.0)])
    else:
        t = torch.tensor([999.0, 250.0])
    with torch.no_grad():
        want = ref(x, t, text, return_dict=False)[0]
        got = ours(x, t, text)
    assert got.shape == want.shape
    assert want.abs().mean() > 1e-3
    assert rel_err(got, want) <= 1e-5


def test_keep_in_fp32_and_dtype(tiny_ckpts):
    attn = AttentionDispatch.resolve("TORCH_SDPA", device="cpu", dtype=torch.bfloat16, head_dim=12)
    m = load_transformer(tiny_ckpts["wan2.1"] / "transformer", dtype=torch.bfloat16, device="cpu", attention=attn)
    assert m.condition_embedder.time_embedder.linear_1.weight.dtype == torch.float32
    assert m.blocks[0].scale_shift_table.dtype == torch.float32
    assert m.blocks[0].norm2.weight.dtype == torch.float32
    assert m.blocks[0].attn1.to_q.weight.dtype == torch.bfloat16
    assert m.proj_out.weight.dtype == torch.bfloat16
    assert not any(p.is_meta for p in m.parameters())


# ---- configs and inputs beyond the plain parity -------------------------------------------------------------------
TINY = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
            text_dim=8, freq_dim=16, ffn_dim=20, num_layers=2, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=32)
I2V = dict(TINY, in_channels=12, image_dim=20, added_kv_proj_dim=24)


def diffusers_folder(folder, **cfg):
    """A diffusers WanTransformer3DModel of ``cfg`` with random weights, saved to ``folder`` -> (model, weights)."""
    from diffusers import WanTransformer3DModel

    ref = WanTransformer3DModel(**cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    ref.save_pretrained(folder, safe_serialization=True)
    return ref, folder / "diffusion_pytorch_model.safetensors"


def load(folder, block="reference"):
    attn = AttentionDispatch.resolve("TORCH_SDPA", device="cpu", dtype=torch.float32, head_dim=12)
    return load_transformer(folder, dtype=torch.float32, device="cpu", attention=attn, options=DiTOptions(block=block))


def test_published_i2v_layout_with_unused_norm_added_q_loads(tmp_path):
    """The published Wan2.1 I2V / FLF2V checkpoints carry an unused ``attn2.norm_added_q.weight`` per block, which
    diffusers skips: fastwan's header check and loader skip it too, and the DiT equals diffusers'."""
    from diffusers import WanTransformer3DModel

    _, weights = diffusers_folder(tmp_path, **I2V)
    state = load_file(weights)
    for i in range(I2V["num_layers"]):
        state[f"blocks.{i}.attn2.norm_added_q.weight"] = torch.zeros(24)
    save_file(state, weights, metadata={"format": "pt"})
    ref = WanTransformer3DModel.from_pretrained(tmp_path).eval()
    assert check_transformer_files([weights], WanConfig.from_file(tmp_path / "config.json"), str(tmp_path)) is False
    g = torch.Generator().manual_seed(2)
    x, t = torch.randn(1, 12, 2, 4, 6, generator=g), torch.tensor([600.0])
    text, image = torch.randn(1, 512, 8, generator=g), torch.randn(1, 5, 20, generator=g)
    with torch.no_grad():
        want = ref(x, t, text, encoder_hidden_states_image=image, return_dict=False)[0]
        for block in ("reference", "fast"):
            assert rel_err(load(tmp_path, block)(x, t, text, image=image), want) <= 1e-5
    # any other tensor the DiT does not hold is still refused
    save_file({**state, "blocks.0.attn2.norm_added_v.weight": torch.zeros(24)}, weights, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="unexpected 1 tensors.*norm_added_v"):
        check_transformer_files([weights], WanConfig.from_file(tmp_path / "config.json"), str(tmp_path))


# configs and token grids the parity tests skip: head dims other than 12, an FFN width of no particular multiple,
# no cross-attention norm, other eps / text_dim / freq_dim, patch sizes other than (1, 2, 2), out != in channels,
# one latent frame, a 1 x 1 x 1 grid, a grid exactly at rope_max_seq_len
SHAPE_CASES = {
    "hd16-ffn7-no-cross-norm": (dict(num_attention_heads=3, attention_head_dim=16, ffn_dim=7, cross_attn_norm=False,
                                     eps=1e-3, text_dim=13, freq_dim=6), (1, 6, 10)),
    "hd48-patch222-out3": (dict(num_attention_heads=1, attention_head_dim=48, patch_size=(2, 2, 2), in_channels=6,
                                out_channels=3), (4, 6, 14)),
    "hd96-patch133-rope-edge": (dict(num_attention_heads=1, attention_head_dim=96, patch_size=(1, 3, 3),
                                     rope_max_seq_len=5), (5, 6, 15)),
    "one-token": (dict(attention_head_dim=64), (1, 2, 2)),
}


@pytest.mark.parametrize("case", list(SHAPE_CASES))
def test_unusual_configs_and_grids_match_diffusers(tmp_path, case):
    """Both builds equal diffusers (batch 2 with two timesteps; and forward_cfg at batch 1, both modes)."""
    cfg, grid = SHAPE_CASES[case]
    ref, _ = diffusers_folder(tmp_path, **dict(TINY, **cfg))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, ref.config.in_channels, *grid, generator=g)
    text = torch.zeros(2, 7, ref.config.text_dim)
    text[0, :4], text[1] = torch.randn(4, ref.config.text_dim, generator=g), torch.randn(7, ref.config.text_dim,
                                                                                         generator=g)
    t = torch.tensor([900.0, 35.0])
    with torch.no_grad():
        want = ref(x, t, text, return_dict=False)[0]
        want1 = [ref(x[:1], t[:1], text[i:i + 1], return_dict=False)[0] for i in (0, 1)]
        assert want.abs().mean() > 1e-3
        for block in ("reference", "fast"):
            model = load(tmp_path, block)
            assert rel_err(model(x, t, text), want) <= 1e-5, block
            for batched in (True, False):
                got = model.forward_cfg(x[:1], t[:1], text[:1], text[1:], batched=batched)
                assert max(rel_err(a, b) for a, b in zip(got, want1)) <= 1e-5, (block, batched)


def test_quantized_diffusers_config_is_refused():
    """A config.json with diffusers' ``quantization_config`` describes weights stored quantized (bitsandbytes, ...),
    which fastwan does not read: refused naming the key and the method, before any weight is looked at."""
    raw = {"_class_name": "WanTransformer3DModel", "quantization_config": {"quant_method": "bitsandbytes",
                                                                           "load_in_4bit": True}}
    with pytest.raises(CheckpointError, match=r'"quantization_config" \(quant_method "bitsandbytes"\).*'
                                              r"quantization='fp8'"):
        WanConfig.from_dict(raw, source="t/config.json")


@pytest.fixture(scope="module")
def flf2v():
    """A first-last-frame DiT (image tokens, pos_embed over 2 x 5 tokens) whose patch embedding must never run."""
    torch.manual_seed(0)
    model = WanTransformer(WanConfig(**dict(I2V, pos_embed_seq_len=10)))
    model.set_attention(AttentionDispatch.resolve("TORCH_SDPA", device="cpu", dtype=torch.float32, head_dim=12))

    def boom(*a, **k):
        raise AssertionError("compute started before the checks finished")
    model.patch_embedding.forward = boom
    return model


X, T, TEXT, IMAGE = torch.randn(1, 12, 2, 4, 6), torch.tensor([500.0]), torch.randn(1, 6, 8), torch.randn(2, 5, 20)


@pytest.mark.parametrize("change,match", [
    ({"latents": torch.randn(1, 4, 2, 4, 6)}, r"latents \[1, 4, 2, 4, 6\] must be \[B, 12, F, H, W\]"),
    ({"latents": torch.randn(12, 2, 4, 6)}, r"latents \[12, 2, 4, 6\] must be \[B, 12"),
    ({"latents": torch.randn(1, 12, 2, 5, 6)}, r"latent grid 2x5x6 is not divisible by patch_size \(1, 2, 2\)"),
    ({"timestep": torch.tensor(500.0)}, r"timestep \[\] must be \[1\]"),
    ({"timestep": torch.tensor([500.0, 20.0, 3.0])}, r"timestep \[3\] must be \[1\]"),  # was: a batch of 3
    ({"timestep": torch.full((1, 7), 500.0)}, r"timestep \[1, 7\] must be \[1\], or per-token \[1, 12\]"),
    ({"text": torch.randn(2, 6, 8)}, r"text \[2, 6, 8\] must be \[1, L, 8\]"),  # was: a batch of 2
    ({"text": torch.randn(1, 6, 9)}, r"text_dim=8"),
    ({"image": torch.randn(2, 5, 16)}, r"image tokens \[2, 5, 16\] must be \[B, N, 20\]"),
    ({"image": torch.randn(2, 6, 20)}, r"2 N = pos_embed_seq_len = 10"),
    ({"image": torch.randn(3, 5, 20)}, r"2 N = pos_embed_seq_len = 10"),
])
def test_inputs_that_do_not_fit_the_dit_raise_before_it_runs(flf2v, change, match):
    """forward and forward_cfg refuse inputs that do not fit the DiT (which raised from deep inside, or silently
    broadcast to another batch) with an InvalidArgument naming the shape and the rule, before the patch embedding."""
    a = {"latents": X, "timestep": T, "text": TEXT, "image": IMAGE, **change}
    with torch.no_grad():
        with pytest.raises(InvalidArgument, match=match):
            flf2v(a["latents"], a["timestep"], a["text"], image=a["image"])
        if change.keys() != {"text"}:  # a text batch of 2: forward_cfg's own one-sample rule
            with pytest.raises(InvalidArgument, match=match):
                flf2v.forward_cfg(a["latents"], a["timestep"], a["text"], a["text"], image=a["image"])
