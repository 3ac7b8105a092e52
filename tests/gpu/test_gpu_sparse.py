"""FA4 block-sparse kernels (every partial-block rule) vs an fp32 masked dense reference (skipped without CUDA).

Run: ``pytest -q -s tests/gpu/test_gpu_sparse.py``. Each case runs a sparse backend with ``kernel="fa4"`` on a
small odd grid in bf16 and compares it with fp32 attention under the exact boolean token mask of the same
pattern (``BlockPlan.dense_mask``, itself checked against NATTEN/STA/VSA definitions on CPU). The case also
checks that the reference differs from dense attention by far more than the tolerance, so a kernel that ignored
the mask would fail.

VSA's coarse stage on CUDA (the Triton pooling and top-k kernels of ``vsa_kernels``) is compared with the
PyTorch path it replaces at the Wan2.1 1.3B 480p shape and at odd grids: pooled means, the block tables (as sets,
with exact counts), ``select()`` end to end, and the coarse output.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastwan.attention.base import AttentionMetadata
from fastwan.attention.registry import create_backend
from fastwan.attention.sparse import fa4
from fastwan.attention.sparse.vsa import tile_pool, topk_count
from fastwan.kernels import reference_kernels
from fastwan.kernels import vsa as vsa_kernels
from tests.kernels import test_vsa_kernels as checks  # check_tables_as_sets, check_order, torch_path_tables

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOL = 2e-2  # max abs error of bf16 FA4 vs the fp32 reference (inputs are the same bf16 values)

CASES = [  # (id, backend, config, grid, expected partial-block rule)
    ("sta-threshold", "SLIDING_TILE_ATTN", {"tile": [2, 8, 8], "window": [3, 1, 3]}, (5, 12, 20), "threshold"),
    ("sta-prefix", "SLIDING_TILE_ATTN", {"tile": [3, 5, 8], "window": [1, 3, 1]}, (6, 10, 16), "prefix"),
    ("gna-aligned", "NEIGHBORHOOD_ATTN", {"tile": "auto", "kernel_size": [3, 5, 24], "stride": [3, 5, 8]},
     (9, 15, 24), "prefix"),
    ("na-stride1", "NEIGHBORHOOD_ATTN", {"tile": [2, 8, 8], "kernel_size": [3, 5, 7]}, (5, 12, 20), "na"),
    ("na-dilated-causal", "NEIGHBORHOOD_ATTN",
     {"tile": [2, 8, 8], "kernel_size": [2, 3, 5], "stride": [1, 2, 1], "dilation": [2, 2, 1],
      "is_causal": [True, False, False]}, (5, 12, 20), "na"),
    ("gna-border", "NEIGHBORHOOD_ATTN", {"tile": [2, 8, 8], "kernel_size": [2, 8, 24], "stride": [2, 8, 8]},
     (5, 12, 28), "na"),
]


def fa4_or_skip():
    reasons = fa4.fa4_reasons("cuda", torch.bfloat16)
    if reasons:
        pytest.skip("; ".join(reasons))


def inputs(layout, heads=4, dim=128, seed=0):
    g = torch.Generator("cuda").manual_seed(seed)
    n = layout.num_tokens
    # scaled q/k: peaked attention, so a wrong mask changes the output by far more than TOL
    q, k, v = (torch.randn(1, n, heads, dim, device="cuda", generator=g) for _ in range(3))
    q, k = q * 2.0, k * 2.0
    return [layout.permute(t.to(torch.bfloat16), dim=1) for t in (q, k, v)]


def reference(q, k, v, mask):
    """fp32 attention of the bf16 inputs under a bool mask [Bm, Hm, P, P] -> [B, P, H, D]."""
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask).transpose(1, 2)


def check(out, ref, q, k, v, layout):
    real = layout.key_valid
    err = (out.float() - ref)[:, real].abs().max().item()
    dense = reference(q, k, v, layout.key_valid[None, None, None, :])
    gap = (dense - ref)[:, real].abs().max().item()
    print(f"max abs err {err:.2e} (tolerance {TOL}); masked vs unmasked reference differ by {gap:.2e}")
    assert gap > 10 * TOL
    assert err <= TOL


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_fa4_block_sparse_matches_masked_reference(case):
    fa4_or_skip()
    _, name, conf, grid, rule = case
    b = create_backend(name, {**conf, "kernel": "fa4"})
    layout = b.layout(grid, "cuda")
    meta = AttentionMetadata(grid=grid, step_index=0, num_steps=1, layer_index=0, layout=layout)
    q, k, v = inputs(layout)
    plan = b.plan(layout, meta, heads=q.shape[2]) if name == "SLIDING_TILE_ATTN" else b.plan(layout)
    assert plan.fa4_tensors()["mask"][0] == rule
    out = b(q, k, v, meta=meta)
    check(out, reference(q, k, v, plan.dense_mask()), q, k, v, layout)


@pytest.mark.parametrize("kernel", ["fa4", "flex"])
@pytest.mark.parametrize("grid", [(5, 12, 20), (6, 10, 16)])
def test_vsa_matches_masked_reference(grid, kernel):
    """The whole call (CUDA coarse-stage kernels, then the block-sparse kernel) vs fp32 attention under the mask
    of the selection the call makes (``select`` is deterministic on the same inputs)."""
    if kernel == "fa4":
        fa4_or_skip()
    b = create_backend("VIDEO_SPARSE_ATTN", {"tile": [2, 8, 8] if grid[1] == 12 else [3, 5, 8],
                                             "sparsity": 0.7, "kernel": kernel})
    layout = b.layout(grid, "cuda")
    meta = AttentionMetadata(grid=grid, step_index=0, num_steps=1, layer_index=0, layout=layout)
    q, k, v = inputs(layout, seed=1)
    scale = q.shape[-1] ** -0.5
    plan, _ = b.select(q, k, v, layout, scale, 0.7)
    assert "compact" in plan._cache  # the tables came from the top-k kernel
    out = b(q, k, v, meta=meta)
    check(out, reference(q, k, v, plan.dense_mask()), q, k, v, layout)


# ------------------------------------------------------------------------------------------ VSA coarse stage
VSA_SHAPES = [  # (id, grid, heads, tile): the 1.3B 480p call, then odd grids (dummy slots inside tiles)
    ("wan1.3b-480p", (21, 30, 52), 12, "auto"),
    ("odd-mixed", (5, 12, 20), 4, [2, 8, 8]),
    ("odd-partial", (7, 11, 17), 3, [3, 5, 8]),
]


@pytest.mark.parametrize("shape", VSA_SHAPES, ids=[s[0] for s in VSA_SHAPES])
def test_vsa_kernels_match_torch_path(shape):
    _, grid, heads, tile = shape
    sparsity = 0.85
    b = create_backend("VIDEO_SPARSE_ATTN", {"tile": tile, "sparsity": sparsity})
    layout = b.layout(grid, "cuda")
    n = layout.num_tiles
    kk = topk_count(sparsity, n)
    g = torch.Generator("cuda").manual_seed(0)
    # q, k, v as chunks of one fused-QKV output (strided views), dummy slots poisoned
    base = torch.randn(1, layout.padded_tokens, 3, heads, 128, device="cuda", generator=g).to(torch.bfloat16)
    base[:, ~layout.key_valid] = 100.0
    q, k, v = base.unbind(2)
    assert vsa_kernels.pool_usable(q, k, v)

    # pooling: the kernel vs tile_pool in fp32 (the same bf16 values)
    pooled = vsa_kernels.pool_tiles(q, k, v, layout)
    for out, x in zip(pooled, (q, k, v)):
        torch.testing.assert_close(out, tile_pool(x.float(), layout), rtol=1e-5, atol=1e-6)

    # tables from the same scores: the kernel vs torch.topk + split_selected
    scores = torch.matmul(pooled[0].transpose(1, 2), pooled[1].transpose(1, 2).transpose(-1, -2))
    assert vsa_kernels.tables_usable(scores)
    got = vsa_kernels.topk_tables(scores, kk, layout)
    cpu = [t.cpu() for t in got]
    checks.check_tables_as_sets(cpu, [t.cpu() for t in checks.torch_path_tables(scores, layout, kk)], n)
    checks.check_order(scores.cpu(), cpu)
    ref = vsa_kernels.topk_tables_reference(scores, layout.tile_full, kk)
    assert all(torch.equal(a, b_) for a, b_ in zip(got, ref))
    if layout.all_tiles_partial is None:
        assert bool(((got[0] > 0) & (got[2] > 0)).any())

    # select() end to end: the same tiles as the PyTorch path, except at near ties of the k-th score
    scale = 128 ** -0.5
    plan, coarse = b.select(q, k, v, layout, scale, sparsity, with_output=True)
    with reference_kernels():  # the PyTorch path the backend takes where the kernels do not run
        plan_t, coarse_t = b.select(q, k, v, layout, scale, sparsity, with_output=True)
    assert "compact" in plan._cache and "compact" not in plan_t._cache  # kernel path vs PyTorch path
    scores_t, _ = b.coarse(q, k, v, layout, scale, with_output=False)
    kth = scores_t.topk(kk, dim=-1).values[..., -1:]
    # bf16 inputs are ranked on bf16 scores (as FastVideo ranks them): the two paths pool in another order, so a
    # score may round to the neighbouring bf16 value; a near tie is within two units in the last place of the k-th
    ulp = torch.finfo(scores_t.dtype).eps
    near = (scores_t.float() - kth.float()).abs() <= 2 * ulp * kth.float().abs() + 1e-5 * float(scores_t.abs().max())
    diff = plan.any != plan_t.any
    print(f"{shape[0]}: {int(diff.sum())} of {diff.numel()} (query, key) tile pairs differ (near ties only)")
    assert bool((~diff | near).all()), "a tile pair differs that is no near tie of the k-th score"
    assert float(diff.any(-1).float().mean()) < 0.05  # few rows have a near tie at the k-th place
    assert torch.equal(plan.any.sum(-1), torch.full_like(plan.any.sum(-1), kk))
    torch.testing.assert_close(coarse.float(), coarse_t.float(), rtol=1e-2, atol=1e-3)
