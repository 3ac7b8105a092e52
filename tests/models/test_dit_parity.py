"""fastwan's DiT vs diffusers' WanTransformer3DModel on the same weights (fp32)."""
import pytest
import torch
from diffusers import WanTransformer3DModel

from fastwan.attention import AttentionDispatch
from fastwan.models import load_transformer


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
