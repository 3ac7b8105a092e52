"""Sparse backends inside the DiT (tiny checkpoints, CPU fp32): the once-per-forward permutation of tokens,
RoPE tables and per-token timestep embeddings is consistent with the raster-order model."""
import pytest
import torch

from fastwan.attention import AttentionDispatch, create_backend
from fastwan.models import load_transformer


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def dispatch(name, conf=None):
    if name == "TORCH_SDPA":
        return AttentionDispatch.resolve("TORCH_SDPA", device="cpu", dtype=torch.float32, head_dim=12)
    return AttentionDispatch(create_backend(name, conf), create_backend("TORCH_SDPA"))


@pytest.mark.parametrize("variant", ["wan2.1", "wan2.2-ti2v"])
def test_dense_equivalent_sparse_configs_match_dense_dit(tiny_ckpts, variant):
    folder = tiny_ckpts[variant] / "transformer"
    model = load_transformer(folder, dtype=torch.float32, device="cpu", attention=dispatch("TORCH_SDPA"))
    c = model.config.in_channels
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, c, 3, 6, 10, generator=g)  # 3 x 3 x 5 tokens: no tile below divides it
    text = torch.randn(2, 7, model.config.text_dim, generator=g)
    if variant == "wan2.2-ti2v":
        t = torch.stack([torch.linspace(0, 999, 45), torch.linspace(999, 0, 45)])
    else:
        t = torch.tensor([999.0, 250.0])
    with torch.no_grad():
        want = model(x, t, text, step_index=3, num_steps=10)
        dense_like = [
            ("SLIDING_TILE_ATTN", {"tile": [2, 2, 4], "window": 99}),
            ("SLIDING_TILE_ATTN", {"tile": [2, 2, 4], "window": 1, "dense_steps": 4}),
            ("NEIGHBORHOOD_ATTN", {"tile": [2, 2, 4], "kernel_size": -1}),
            ("VIDEO_SPARSE_ATTN", {"tile": [2, 2, 4], "sparsity": 0.0}),
        ]
        for name, conf in dense_like:
            model.set_attention(dispatch(name, conf))
            got = model(x, t, text, step_index=3, num_steps=10)
            assert rel_err(got, want) <= 1e-5, (name, conf)
        model.set_attention(dispatch("SLIDING_TILE_ATTN", {"tile": [2, 2, 4], "window": 1}))
        sparse = model(x, t, text, step_index=3, num_steps=10)
        assert torch.isfinite(sparse).all() and rel_err(sparse, want) > 1e-3


def test_vsa_gate_in_dit(tiny_ckpts):
    folder = tiny_ckpts["wan2.1"] / "transformer"
    model = load_transformer(folder, dtype=torch.float32, device="cpu", attention=dispatch("TORCH_SDPA"))
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, model.config.in_channels, 3, 6, 10, generator=g)
    text = torch.randn(1, 7, model.config.text_dim, generator=g)
    t = torch.tensor([500.0])
    with torch.no_grad():
        want = model(x, t, text)
        model.add_gate_compress()
        for blk in model.blocks:
            torch.nn.init.zeros_(blk.attn1.to_gate_compress.weight)
            torch.nn.init.zeros_(blk.attn1.to_gate_compress.bias)
        model.set_attention(dispatch("VIDEO_SPARSE_ATTN", {"tile": [2, 2, 4], "sparsity": 0.0}))
        assert rel_err(model(x, t, text), want) <= 1e-5  # zero gate: fine branch only == dense
        for blk in model.blocks:
            torch.nn.init.normal_(blk.attn1.to_gate_compress.bias, std=0.5)
        gated = model(x, t, text)
        assert torch.isfinite(gated).all() and rel_err(gated, want) > 1e-4
