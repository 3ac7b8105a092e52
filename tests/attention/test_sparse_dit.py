"""Sparse backends inside the DiT (tiny checkpoints, CPU fp32): the once-per-forward permutation of tokens,
RoPE tables and per-token timestep embeddings is consistent with the raster-order model."""
import dataclasses

import pytest
import torch

from fastwan.attention import AttentionDispatch, AttentionMetadata, create_backend
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


class RasterCall:
    """A dense-looking self-attention backend (the DiT keeps raster order under it) that runs ``sparse`` on each
    call's q, k, v permuted into its layout's slots and unpermutes the output: the sparse pattern with no compact
    stream, no padding of the DiT's stream and no dispatch padding."""

    sparse = False
    name = "RASTER_CALL"

    def __init__(self, sparse, grid):
        self.inner, self.grid = sparse, grid

    def kernel_name(self, device=None):
        return "test"

    def __call__(self, q, k, v, meta=None, scale=None):
        layout = self.inner.layout(self.grid, q.device)
        q, k, v = (layout.permute(t, dim=1) for t in (q, k, v))
        return layout.unpermute(self.inner(q, k, v, meta=AttentionMetadata(grid=self.grid, layout=layout)), dim=1)


@pytest.mark.parametrize("name,conf", [
    ("SLIDING_TILE_ATTN", {"tile": [2, 2, 4], "window": 1}),
    ("NEIGHBORHOOD_ATTN", {"tile": [2, 2, 4], "kernel_size": [3, 3, 3]}),
    ("VIDEO_SPARSE_ATTN", {"tile": [2, 2, 4], "sparsity": 0.5}),
    ("VIDEO_SPARSE_ATTN", {"tile": [4, 4, 4], "sparsity": 0.5}),
])
@pytest.mark.parametrize("variant", ["wan2.1", "wan2.2-ti2v"])
def test_compact_stream_equals_the_sparse_pattern_per_call(tiny_ckpts, variant, name, conf):
    """The DiT under a sparse backend runs its blocks on the real tokens only (the compact order: 45 rows for a
    3 x 3 x 5 grid whose tiles pad it to 96 or 192 slots) and gives the output of the raster-order DiT whose every
    self-attention call runs the same backend on its own permuted q, k, v."""
    folder = tiny_ckpts[variant] / "transformer"
    model = load_transformer(folder, dtype=torch.float32, device="cpu", attention=dispatch("TORCH_SDPA"))
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, model.config.in_channels, 3, 6, 10, generator=g)
    text = torch.randn(2, 7, model.config.text_dim, generator=g)
    t = torch.stack([torch.linspace(0, 999, 45), torch.linspace(999, 0, 45)]) if variant == "wan2.2-ti2v" \
        else torch.tensor([999.0, 250.0])
    grid = (3, 3, 5)
    rows = []
    hook = model.blocks[1].register_forward_pre_hook(lambda m, args: rows.append(args[0].x.shape[1]))
    with torch.no_grad():
        model.set_attention(AttentionDispatch(RasterCall(create_backend(name, conf), grid),
                                              create_backend("TORCH_SDPA")))
        want = model(x, t, text)
        model.set_attention(dispatch(name, conf))
        layout = model.attention.layout_for(grid, torch.device("cpu"))
        got = model(x, t, text)
    hook.remove()
    assert layout.has_dummies and rows == [45, 45]
    assert rel_err(got, want) <= 1e-5


def test_dispatch_pads_compact_tokens_and_the_gate():
    """AttentionDispatch with meta.compact pads q, k, v and VSA's per-token gate to the layout's slots and drops
    the output's dummy rows: equal to the backend called on the slots directly."""
    backend = create_backend("VIDEO_SPARSE_ATTN", {"tile": [2, 2, 4], "sparsity": 0.5})
    grid = (3, 3, 5)
    layout = backend.layout(grid, torch.device("cpu"))
    g = torch.Generator().manual_seed(5)
    q, k, v, gate = (torch.randn(2, layout.num_tokens, 2, 12, generator=g) for _ in range(4))
    meta = AttentionMetadata(grid=grid, layout=layout, extra={"gate_compress": gate})
    slots = [layout.permute(t, dim=1) for t in (q, k, v)]
    want = layout.unpermute(backend(*slots, meta=AttentionMetadata(
        grid=grid, layout=layout, extra={"gate_compress": layout.permute(gate, dim=1)})), dim=1)
    compact = [layout.permute_compact(t, dim=1) for t in (q, k, v, gate)]
    got = AttentionDispatch(backend, create_backend("TORCH_SDPA")).self_attention(
        *compact[:3], dataclasses.replace(meta, extra={"gate_compress": compact[3]}, compact=True))
    assert torch.equal(layout.unpermute_compact(got, dim=1), want)
    with pytest.raises(ValueError, match="needs its layout"):
        AttentionDispatch(backend, create_backend("TORCH_SDPA")).self_attention(
            *compact[:3], AttentionMetadata(grid=grid, compact=True))
