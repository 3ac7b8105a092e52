"""VSA's coarse-stage kernels (fastwan.kernels.vsa): the kernel routes (``pool_triton``, ``topk_tables_triton``)
under Triton's interpreter (TRITON_INTERPRET=1, in a subprocess) against the PyTorch path, and the ops' CPU
behaviour, fake implementations and the BlockPlan built from precomputed tables. (The backend's select() on the
kernel route runs on the GPU: tests/gpu/test_gpu_sparse.py.)

Pooling is compared in fp32 with dummy slots poisoned (a kernel that read them would be off by ~1e3); the tables
are compared with ``torch.topk`` + ``split_selected`` as sets per row with exact counts, and exactly with the
ops' stable-sort reference (descending score, ties to the lower tile index) -- also on scores full of ties,
signed zeros and -inf, where the opposite tie rule is checked to give different tables.
"""
from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastwan.attention.base import AttentionMetadata
from fastwan.attention.sparse.plan import BlockPlan
from fastwan.kernels.tables import split_selected
from fastwan.attention.sparse.vsa import VideoSparseBackend, tile_pool, topk_count
from fastwan.kernels import vsa as vk

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs the triton package")
REPO = Path(__file__).resolve().parents[2]

# ------------------------------------------------------------------------------------------ checks
# (the interpreter script below imports them from this module)
def segment_table(idx, num, n, first):
    """bool [..., n]: the indices of idx [..., k] in its first num [...] positions (first) or the others."""
    pos = torch.arange(idx.shape[-1])
    keep = pos < num[..., None] if first else pos >= num[..., None]
    return torch.zeros(idx.shape[:-1] + (n,), dtype=torch.bool).scatter_(-1, idx.long(), keep)


def check_tables_as_sets(got, want, n):
    """Same counts, same sets in every group of every row (orders may differ)."""
    fn, fi, pn, pi = got
    wfn, wfi, wpn, wpi = want
    assert fi.dtype == pi.dtype == fn.dtype == pn.dtype == torch.int32
    assert torch.equal(fn, wfn) and torch.equal(pn, wpn), "counts differ"
    assert torch.equal(fn + pn, torch.full_like(fn, fi.shape[-1]))
    for idx, num, widx in ((fi, fn, wfi), (pi, pn, wpi)):
        for first in (True, False):
            assert torch.equal(segment_table(idx, num, n, first), segment_table(widx, num, n, first)), "sets differ"


def check_order(scores, tables):
    """Each group of each list in descending score order, equal scores by increasing tile index."""
    fn, fi, pn, pi = tables
    for idx, num in ((fi, fn), (pi, pn)):
        vals = scores.gather(-1, idx.long())
        pos = torch.arange(idx.shape[-1] - 1)
        same_group = (pos[None] + 1 != num.reshape(-1, 1)).view(num.shape + (-1,))  # j, j+1 in one group
        ok = (vals[..., :-1] > vals[..., 1:]) | ((vals[..., :-1] == vals[..., 1:]) & (idx[..., :-1] < idx[..., 1:]))
        assert bool((ok | ~same_group).all()), "a group is not in descending-score / lower-index order"


def torch_path_tables(scores, layout, k):
    """What the backend's PyTorch path builds: torch.topk, then split_selected."""
    sel = scores.topk(k, dim=-1, sorted=False).indices
    return split_selected(sel, layout.tile_full, layout.all_tiles_partial)


SCRIPT = r'''
import torch
from tests.kernels.test_vsa_kernels import check_order, check_tables_as_sets, segment_table, torch_path_tables
from fastwan.attention.sparse.vsa import VideoSparseBackend, tile_pool, topk_count
from fastwan.kernels import vsa as vk


def pool_tiles(q, k, v, layout):  # vk.pool_tiles on the kernel route
    out = vk.pool_triton(q, k, v, layout.key_valid, layout.tile_valid_counts, layout.block_size,
                         layout.tile_tokens, bool(layout.real_prefix_tiles))
    return tuple(o.transpose(1, 2) for o in out.unbind(0))


def topk_tables(scores, k, layout):  # vk.topk_tables on the kernel route
    return vk.topk_tables_triton(scores, layout.tile_full, k)


g = torch.Generator().manual_seed(0)

# (grid, tile, block_size, real_prefix_tiles, all_tiles_partial)
LAYOUTS = [
    ((4, 8, 8), (2, 4, 4), 32, True, False),     # the tile divides the grid, no dummy slot: all tiles full
    ((4, 8, 12), (2, 4, 4), 64, True, True),     # divides, slot padding only: prefix rule, all partial
    ((5, 7, 9), (2, 4, 4), 32, False, None),     # grid padding: dummies inside tiles, full and partial tiles
    ((5, 7, 9), (2, 4, 4), 64, False, True),     # grid and slot padding: all partial, key_valid rule
    ((5, 7, 9), (3, 4, 4), 64, False, True),     # 48 tokens: two row chunks per tile
    ((6, 10, 16), (3, 5, 8), 128, True, True),   # 120 tokens in 128 slots (the 1.3B "auto" tile shape)
]
worst = 0.0
for li, (grid, tile, bs, prefix, uniform) in enumerate(LAYOUTS):
    layout = VideoSparseBackend(tile=list(tile), block_size=bs).layout(grid, "cpu")
    assert layout.real_prefix_tiles == prefix and layout.all_tiles_partial == uniform, (grid, tile, bs)
    n, P = layout.num_tiles, layout.padded_tokens
    dummy = ~layout.key_valid
    # ---- pooling: q, k, v as chunks of one [B, P, 3, H, D] tensor, and a [B, P, D, H] transposed view
    B, H, D = (2, 3, 24) if li % 2 == 0 else (1, 3, 64)  # H * D = 72 (one masked block) or 192 (two)
    base = torch.randn(B, P, 3, H, D, generator=g)
    base[:, dummy] = 1e4  # poison: any weight on a dummy slot shows
    q, k, v = base.unbind(2)
    odd = torch.randn(B, P, D, H, generator=g)
    odd[:, dummy] = -1e4
    odd = odd.transpose(-1, -2)  # [B, P, H, D] with head stride 1 and dim stride H
    for dtype in (torch.float32, torch.bfloat16):
        qq, kk_, vv = (t.to(dtype) if dtype != torch.float32 else t for t in (q, odd, v))
        got = pool_tiles(qq, kk_, vv, layout)
        assert len(got) == 3 and all(t.shape == (B, n, H, D) and t.dtype == torch.float32 for t in got)
        assert all(t.transpose(1, 2).is_contiguous() for t in got)
        for out, x in zip(got, (qq, kk_, vv)):
            want = tile_pool(x.float(), layout)
            worst = max(worst, float(((out - want).abs() / (want.abs() + 1)).max()))
            # not a wrong variant: the plain mean of every slot of the tile (dummies included) is far off
            naive = x.float().reshape(B, n, bs, H, D).mean(2)
            if layout.has_dummies:
                assert float((out - naive).abs().max()) > 1.0
        assert float((got[0] - got[2]).abs().max()) > 0.1  # q and v pooled separately
        assert worst <= 1e-5, (grid, tile, bs, dtype, worst)
    two = pool_tiles(q, k, None, layout)
    assert len(two) == 2 and torch.equal(two[1], pool_tiles(q, k, v, layout)[1])

    # ---- tables (rows are slow under the interpreter: few batch/head rows except on the mixed layout)
    if li in (0, 1, 2, 3):
        ks = [topk_count(0.7, n), 1, n] if li == 2 else [topk_count(0.6, n)]
        for k in ks:
            Bs, Hs = (2, 3) if li == 2 and k == ks[0] else (1, 2)
            scores = torch.randn(Bs, Hs, n, n, generator=g)
            got = topk_tables(scores, k, layout)
            assert got[1].shape == (Bs, Hs, n, k) and got[0].shape == (Bs, Hs, n)
            check_tables_as_sets(got, torch_path_tables(scores, layout, k), n)
            check_order(scores, got)
            ref = vk.topk_tables_reference(scores, layout.tile_full, k)
            assert all(torch.equal(a, b) for a, b in zip(got, ref))
            if k < n:  # not the ascending selection
                low = vk.topk_tables_reference(-scores, layout.tile_full, k)
                assert not torch.equal(segment_table(got[1], got[0] + got[2], n, True),
                                       segment_table(low[1], low[0] + low[2], n, True))
            if uniform is None and 1 < k < n:  # the partition is exercised: rows with both kinds
                assert bool(((got[0] > 0) & (got[2] > 0)).any())
                assert not torch.equal(got[1], got[3])

# ---- ties, signed zeros, -inf, an all -inf row; on the mixed layout
layout = VideoSparseBackend(tile=[2, 4, 4], block_size=32).layout((5, 7, 9), "cpu")
n = layout.num_tiles
scores = torch.randint(-2, 3, (1, 2, n, n), generator=g).float()
scores[scores == 0] = torch.where(torch.rand(int((scores == 0).sum()), generator=g) < 0.5, -0.0, 0.0)
scores[0, 0, 1, ::3] = float("-inf")
scores[0, 1, 2] = float("-inf")
for k in (topk_count(0.7, n), n - 1, n):
    got = topk_tables(scores, k, layout)
    ref = vk.topk_tables_reference(scores, layout.tile_full, k)
    assert all(torch.equal(a, b) for a, b in zip(got, ref)), k
    check_order(scores, got)
    assert int(got[1].min()) >= 0 and int(got[1].max()) < n
    # the opposite tie rule (higher index first) selects other tiles: the rule is really exercised
    flip = vk.topk_tables_reference(scores.flip(-1), layout.tile_full.flip(0), k)
    flip_sel = segment_table(n - 1 - flip[1], flip[0] + flip[2], n, True)
    if k < n:
        assert not torch.equal(segment_table(got[1], got[0] + got[2], n, True), flip_sel)

# ---- a long row: 300 tiles (NP2 = 512), mixed kinds, k = 41 (KP2 = 64) and k = 300
n = 300
tile_full = torch.rand(n, generator=g) < 0.5
scores = torch.randn(1, 1, 3, n, generator=g)
scores[0, 0, 2, 100:200] = 0.5  # ties across the selection boundary
for k in (41, n):
    got = vk.topk_tables_triton(scores, tile_full, k)
    ref = vk.topk_tables_reference(scores, tile_full, k)
    assert all(torch.equal(a, b) for a, b in zip(got, ref)), k
    check_order(scores, got)

print(f"WORST {worst:.3e}")
'''


@needs_triton
def test_kernels_match_torch_path_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=900,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr[-4000:]
    worst = float(out.stdout.split("WORST")[-1])
    assert worst <= 1e-5, out.stdout


# ------------------------------------------------------------------------------------------ in process (CPU)
def mixed_layout():
    layout = VideoSparseBackend(tile=[2, 4, 4], block_size=32).layout((5, 7, 9), "cpu")
    assert layout.all_tiles_partial is None
    return layout


def test_reference_tie_rule_and_split_by_hand():
    # 5 key tiles, tiles 1 and 3 partial; scores with ties: 3 (tiles 0, 2, 4), 2 (tile 3), 1 (tile 1)
    scores = torch.tensor([3.0, 1.0, 3.0, 2.0, 3.0]).view(1, 1, 1, 5).expand(1, 1, 5, 5).contiguous()
    tile_full = torch.tensor([True, False, True, False, True])
    fn, fi, pn, pi = vk.topk_tables_reference(scores, tile_full, 4)  # 0, 2, 4, 3
    assert fn[0, 0, 0] == 3 and pn[0, 0, 0] == 1
    assert fi[0, 0, 0].tolist() == [0, 2, 4, 3] and pi[0, 0, 0].tolist() == [3, 0, 2, 4]
    fn, fi, pn, pi = vk.topk_tables_reference(scores, tile_full, 2)  # ties: the two lower indices
    assert fi[0, 0, 0].tolist() == [0, 2] and pn[0, 0, 0] == 0


def test_ops_off_cuda_run_the_references():
    layout = mixed_layout()
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, layout.padded_tokens, 3, 8, generator=g) for _ in range(3))
    pooled = vk.pool_tiles(q, k, v, layout)
    for out, x in zip(pooled, (q, k, v)):
        assert torch.equal(out, tile_pool(x, layout))
    n = layout.num_tiles
    scores = torch.randn(2, 3, n, n, generator=g)
    got = vk.topk_tables(scores, 5, layout)
    assert all(torch.equal(a, b) for a, b in zip(got, vk.topk_tables_reference(scores, layout.tile_full, 5)))
    check_tables_as_sets(got, torch_path_tables(scores, layout, 5), n)
    check_order(scores, got)
    with pytest.raises(ValueError, match="vsa_topk_tables"):
        vk.topk_tables(scores, n + 1, layout)
    with pytest.raises(ValueError, match="vsa_pool"):
        vk.pool_tiles(q[:, 1:], k[:, 1:], None, layout)
    assert not vk.pool_usable(q, k, v) and not vk.tables_usable(scores)  # CPU: the PyTorch path


def test_ops_fake_implementations():
    layout = mixed_layout()
    q = torch.randn(1, layout.padded_tokens, 2, 8)
    n = layout.num_tiles
    scores = torch.randn(1, 2, n, n)
    torch.library.opcheck(torch.ops.fastwan.vsa_pool.default,
                          (q, q * 2, q * 3, layout.key_valid, layout.tile_valid_counts, layout.block_size,
                           layout.tile_tokens, False))
    torch.library.opcheck(torch.ops.fastwan.vsa_pool.default,
                          (q, q * 2, None, layout.key_valid, layout.tile_valid_counts, layout.block_size,
                           layout.tile_tokens, False))
    torch.library.opcheck(torch.ops.fastwan.vsa_topk_tables.default, (scores, layout.tile_full, 7))


def test_blockplan_takes_precomputed_tables():
    layout = mixed_layout()
    n = layout.num_tiles
    g = torch.Generator().manual_seed(2)
    sel = torch.stack([torch.randperm(n, generator=g)[:6] for _ in range(2 * 3 * n)]).view(2, 3, n, 6)
    tables = split_selected(sel, layout.tile_full)
    ref = BlockPlan(layout, selected=sel)
    for plan in (BlockPlan(layout, tables=tables), BlockPlan(layout, selected=sel, tables=tables)):
        assert plan.width == 6 and plan.density() == ref.density()
        assert torch.equal(plan.any, ref.any) and torch.equal(plan.full, ref.full)
        assert torch.equal(plan.dense_mask(), ref.dense_mask())
        fa4 = plan.fa4_tensors()
        assert fa4["full_idx"] is tables[1] and fa4["partial_num"] is tables[2]  # taken as given
        assert fa4["mask"][0] == "threshold"
    with pytest.raises(ValueError, match="compact tables"):
        BlockPlan(layout, tables=(tables[0], tables[1][..., :5], tables[2], tables[3]))


def test_select_on_cpu_is_the_torch_path():
    """Off CUDA, select() is coarse() + the top-k by a stable descending sort (ties to the lower tile index) +
    BlockPlan(selected=...), bit for bit."""
    b = VideoSparseBackend(tile=[2, 4, 4], sparsity=0.7)
    layout = b.layout((5, 7, 9), "cpu")
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, layout.padded_tokens, 3, 16, generator=g) for _ in range(3))
    for with_output in (False, True):
        plan, coarse = b.select(q, k, v, layout, 0.25, 0.7, with_output=with_output)
        scores, coarse_ref = b.coarse(q, k, v, layout, 0.25, with_output=with_output)
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
        sel = order[..., :topk_count(0.7, layout.num_tiles)]
        assert torch.equal(plan._selected, sel) and "compact" not in plan._cache
        assert (coarse is None) == (not with_output)
        if with_output:
            assert torch.equal(coarse, coarse_ref)
    meta = AttentionMetadata(grid=(5, 7, 9), layout=layout)
    assert torch.isfinite(b(q, k, v, meta=meta)).all()
    assert math.isclose(plan.density(), topk_count(0.7, layout.num_tiles) / layout.num_tiles)


def test_ops_trace_under_torch_compile():
    """Under torch.compile the wrappers go through the custom ops (fake implementations), in one graph."""
    layout = mixed_layout()
    g = torch.Generator().manual_seed(4)
    q, k = (torch.randn(1, layout.padded_tokens, 2, 8, generator=g) for _ in range(2))

    def coarse_tables(q, k):
        qc, kc = (t.transpose(1, 2) for t in vk.pool_tiles(q, k, None, layout))
        return vk.topk_tables(torch.matmul(qc, kc.transpose(-1, -2)), 5, layout)

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    torch._dynamo.reset()
    got = torch.compile(coarse_tables, fullgraph=True, backend=backend)(q, k)
    want = coarse_tables(q, k)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert len(graphs) == 1 and "fastwan.vsa_pool" in graphs[0] and "fastwan.vsa_topk_tables" in graphs[0]


def test_low_precision_ranking_follows_fastvideo():
    """bf16 inputs rank tiles as FastVideo's video_sparse_attn: bf16 tile means, their bf16 product divided by
    sqrt(D), the top-k with ties to the lower index -- written here from that rule and compared tile by tile."""
    b = VideoSparseBackend(tile=[2, 2, 2], sparsity=0.75)
    layout = b.layout((4, 4, 6), "cpu")
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, layout.padded_tokens, 2, 16, generator=g).to(torch.bfloat16) for _ in range(3))
    bs = layout.block_size
    k[:, :bs] = k[:, bs:2 * bs]  # key tiles 0 and 1 identical: an exact tie in every row's scores
    plan, _ = b.select(q, k, v, layout, 16 ** -0.5, 0.75)
    kk = topk_count(0.75, layout.num_tiles)
    qc, kc = (tile_pool(t, layout).transpose(1, 2).to(torch.bfloat16) for t in (q, k))
    scores = (qc @ kc.transpose(-1, -2)) / 16 ** 0.5
    used = b.coarse(q, k, v, layout, 16 ** -0.5, with_output=False)[0]
    assert used.dtype == torch.bfloat16 and torch.equal(used, scores)
    want = []
    for row in scores.float().reshape(-1, layout.num_tiles).tolist():  # lower index first among equal scores
        want.append(sorted(range(len(row)), key=lambda i: (-row[i], i))[:kk])
    got = plan._selected.reshape(-1, kk)
    assert [sorted(r) for r in got.tolist()] == [sorted(r) for r in want]
    assert any((0 in r) != (1 in r) for r in want)  # the tie decides some rows


@pytest.mark.parametrize("poison", [float("inf"), float("nan"), 1e4])
def test_torch_path_pools_bf16_with_one_rounding(poison):
    """The PyTorch pooling (CPU, or CUDA without Triton) of bf16 inputs on tiles with dummy slots inside: the fp64
    mean of each tile's real tokens to fp32 precision (as the kernel accumulates; a sum rounded to bf16 first is
    ~1e-3 off and moves the top-k), whatever the dummy slots hold."""
    b = VideoSparseBackend(tile=[3, 5, 8], sparsity=0.8)
    layout = b.layout((7, 11, 17), "cpu")
    assert not layout.real_prefix_tiles and layout.has_dummies
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(1, layout.padded_tokens, 2, 16, generator=g) * 3 + 1).to(torch.bfloat16)
    x[:, ~layout.key_valid] = poison
    n, bs = layout.num_tiles, layout.block_size
    real = layout.key_valid.view(n, bs, 1, 1)
    xd = x.double().view(1, n, bs, 2, 16)
    want = torch.where(real, xd, torch.zeros((), dtype=torch.float64)).sum(2) / real.sum(1).double()
    got = tile_pool(x, layout)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
