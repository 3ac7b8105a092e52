"""FA4 block-sparse kernels (every partial-block rule) vs an fp32 masked dense reference (skipped without CUDA).

Run: ``pytest -q -s tests/gpu/test_gpu_sparse.py``. Each case runs a sparse backend with ``kernel="fa4"`` on a
small odd grid in bf16 and compares it with fp32 attention under the exact boolean token mask of the same
pattern (``BlockPlan.dense_mask``, itself checked against NATTEN/STA/VSA definitions on CPU). The case also
checks that the reference differs from dense attention by far more than the tolerance, so a kernel that ignored
the mask would fail.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastwan.attention.base import AttentionMetadata
from fastwan.attention.registry import create_backend
from fastwan.attention.sparse import kernels
from fastwan.attention.sparse.kernels import BlockPlan
from fastwan.attention.sparse.vsa import topk_count

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
    reasons = kernels.fa4_reasons("cuda", torch.bfloat16)
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


@pytest.mark.parametrize("grid", [(5, 12, 20), (6, 10, 16)])
def test_fa4_vsa_matches_masked_reference(grid):
    fa4_or_skip()
    b = create_backend("VIDEO_SPARSE_ATTN", {"tile": [2, 8, 8] if grid[1] == 12 else [3, 5, 8],
                                             "sparsity": 0.7, "kernel": "fa4"})
    layout = b.layout(grid, "cuda")
    meta = AttentionMetadata(grid=grid, step_index=0, num_steps=1, layer_index=0, layout=layout)
    q, k, v = inputs(layout, seed=1)
    scale = q.shape[-1] ** -0.5
    scores, _ = b.coarse(q, k, v, layout, scale, with_output=False)
    sel = scores.topk(topk_count(0.7, layout.num_tiles), dim=-1, sorted=False).indices
    out = b(q, k, v, meta=meta)
    check(out, reference(q, k, v, BlockPlan(layout, selected=sel).dense_mask()), q, k, v, layout)
