"""Image-conditioned Wan DiTs (Wan2.1 I2V, FLF2V): CLIP image tokens through the image embedder and the blocks'
added key/value projections, against diffusers' WanTransformer3DModel on the same tiny random weights, in fp32 on
the CPU, for the reference build and the fast one (every cross-attention route: backend over all text keys,
collapsed padding, folded projection), forward and both CFG modes."""
from __future__ import annotations

import json

import pytest
import torch

from fastwan.attention import AttentionDispatch
from fastwan.errors import CheckpointError, InvalidArgument
from fastwan.models import WanConfig, load_transformer
from fastwan.models.wan.cross import PromptCache
from fastwan.options import DiTOptions
from tests.models.test_fast_block import op_calls

TINY_I2V = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=36, out_channels=16,
                text_dim=32, freq_dim=16, ffn_dim=48, num_layers=2, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=20, added_kv_proj_dim=24, rope_max_seq_len=64)
TOKENS = 5  # image tokens per frame (CLIP gives 257)


@pytest.fixture(scope="module", params=["i2v", "flf2v"])
def checkpoint(request, tmp_path_factory):
    """(diffusers model, folder with its safetensors, variant)."""
    from diffusers import WanTransformer3DModel

    cfg = dict(TINY_I2V, pos_embed_seq_len=2 * TOKENS if request.param == "flf2v" else None)
    torch.manual_seed(0)
    ref = WanTransformer3DModel(**cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in ref.parameters():  # diffusers zero-initialises some (pos_embed); random everywhere tests more
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    folder = tmp_path_factory.mktemp(request.param) / "transformer"
    ref.save_pretrained(folder, safe_serialization=True)
    return ref, folder, request.param


def inputs(variant: str, batch: int = 1, prompt: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 36, 3, 4, 6, generator=g)
    text = torch.zeros(batch, 512, 32)  # diffusers splits the image tokens off by the text's length, 512
    text[:, :prompt] = torch.randn(batch, prompt, 32, generator=g)
    frames = 2 if variant == "flf2v" else 1
    image = torch.randn(frames * batch, TOKENS, 20, generator=g)
    return x, text, image


def build(folder, block: str, fold: bool = False):
    attn = AttentionDispatch.resolve("TORCH_SDPA", device="cpu", dtype=torch.float32, head_dim=12)
    model = load_transformer(folder, dtype=torch.float32, device="cpu", attention=attn,
                             options=DiTOptions(block=block))
    if fold:
        model.prompts = PromptCache(fold_max_width=2.0)  # head dim 12: the short prompt folds
    return model


def diffusers_out(ref, x, t, text, image):
    with torch.no_grad():
        return ref(x, t, text, encoder_hidden_states_image=image, return_dict=False)[0]


@pytest.mark.parametrize("block,fold,prompt", [("reference", False, 6), ("fast", False, 6), ("fast", False, 512),
                                               ("fast", True, 6)])
@pytest.mark.parametrize("batch", [1, 2])
def test_forward_matches_diffusers(checkpoint, block, fold, prompt, batch):
    ref, folder, variant = checkpoint
    model = build(folder, block, fold)
    x, text, image = inputs(variant, batch, prompt)
    t = torch.tensor([700.0, 300.0][:batch])
    want = diffusers_out(ref, x, t, text, image)
    with torch.no_grad():
        got, calls = op_calls(lambda: model(x, t, text, image=image))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    n = model.config.num_layers
    if block == "fast":  # the route the prompt picks
        assert ("fastwan::text_cross_probs_normq" in calls) == fold
        assert ("fastwan::text_cross_attention_normq" in calls) == (not fold and prompt < 512)
        if fold and batch == 1:  # the image part adds inside the output GEMM, the text part through P @ u
            assert calls["fastwan::residual_bmm_"] == n and calls["fastwan::residual_linear_"] == 3 * n


@pytest.mark.parametrize("block,fold", [("reference", False), ("fast", False), ("fast", True)])
def test_cfg_passes_share_the_image(checkpoint, block, fold):
    ref, folder, variant = checkpoint
    model = build(folder, block, fold)
    x, text, image = inputs(variant)
    _, uncond, _ = inputs(variant, prompt=3, seed=1)
    t = torch.tensor([500.0])
    want = diffusers_out(ref, x, t, text, image), diffusers_out(ref, x, t, uncond, image)
    for batched in (True, False):
        with torch.no_grad():
            got = model.forward_cfg(x, t, text, uncond, image=image, batched=batched)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_image_tokens_are_required_exactly_where_the_dit_reads_them(checkpoint, tiny_ckpts):
    _, folder, variant = checkpoint
    model = build(folder, "reference")
    x, text, image = inputs(variant)
    t = torch.tensor([500.0])
    with pytest.raises(InvalidArgument, match="pass image="):
        model(x, t, text)
    with pytest.raises(InvalidArgument, match="image tokens for 3 samples, but the batch has 2"):
        model._contexts((torch.cat([text, text]),), image=torch.randn(3 * (2 if variant == "flf2v" else 1),
                                                                      TOKENS, 20))
    t2v = load_transformer(tiny_ckpts["wan2.1"] / "transformer", dtype=torch.float32, device="cpu",
                           attention=model.attention)
    with pytest.raises(InvalidArgument, match="has no image embedder"):
        t2v(torch.randn(1, 16, 3, 4, 6), t, torch.randn(1, 9, 32), image=image)


def test_image_config_rule(tmp_path):
    raw = {"_class_name": "WanTransformer3DModel", **{k: list(v) if isinstance(v, tuple) else v
                                                        for k, v in TINY_I2V.items()}}
    assert WanConfig.from_dict(raw).image_dim == 20
    for bad in ({"added_kv_proj_dim": None}, {"image_dim": None}, {"added_kv_proj_dim": 16}):
        with pytest.raises(CheckpointError, match="added_kv_proj_dim"):
            WanConfig.from_dict({**raw, **bad})
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert WanConfig.from_file(tmp_path / "config.json").added_kv_proj_dim == 24


def test_compiled_fast_build_with_image_tokens(checkpoint):
    """fullgraph-compiled fast blocks take the image tokens (no graph break) and keep diffusers' output."""
    ref, folder, variant = checkpoint
    torch._dynamo.reset()
    model = build(folder, "fast")
    model.compile_blocks(fullgraph=True)
    x, text, image = inputs(variant)
    t = torch.tensor([400.0])
    with torch.no_grad():
        torch.testing.assert_close(model(x, t, text, image=image), diffusers_out(ref, x, t, text, image),
                                   rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
