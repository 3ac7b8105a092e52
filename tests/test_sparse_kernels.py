"""What the compiled/FA4 kernels receive: BlockMask / block tables checked against the exact token mask.

The compiled flex path only evaluates its mask_mod (dummy keys, NA neighborhoods) inside *partial* blocks and
skips unlisted blocks, so the block lists must (a) cover every attended token pair and (b) mark as full only
blocks where every real query attends every key slot. Both are checked here on CPU.
"""
import pytest
import torch

from fastwan.attention.base import AttentionMetadata
from fastwan.attention.registry import create_backend
from fastwan.attention.sparse import kernels
from fastwan.attention.sparse.kernels import BlockPlan, compact, split_selected


def blocks_from_lists(num, idx, n):
    """(count [..., nQ], indices [..., nQ, W]) -> bool [..., nQ, n]; entries past the count are ignored."""
    out = torch.zeros(*num.shape, n + 1, dtype=torch.bool)
    live = torch.arange(idx.shape[-1]) < num[..., None].long()
    out.scatter_(-1, torch.where(live, idx.long(), n), True)
    return out[..., :n]


def check_plan_against_tokens(plan: BlockPlan):
    layout = plan.layout
    bm = plan.flex_block_mask(exact=False)
    n, bs = layout.num_tiles, layout.block_size
    partial = blocks_from_lists(bm.kv_num_blocks, bm.kv_indices, n)
    full = blocks_from_lists(bm.full_kv_num_blocks, bm.full_kv_indices, n)
    assert not bool((partial & full).any())
    assert torch.equal(partial | full, plan.any) and torch.equal(full, plan.full)
    tokens = plan.dense_mask()  # exact [Bm, Hm, P, P]
    blocks = tokens.view(*tokens.shape[:2], n, bs, n, bs)
    real_q = layout.key_valid.view(n, bs)  # real query rows of each tile
    # (a) every attended pair lies in a listed block
    assert not bool((blocks.any(dim=(3, 5)) & ~(partial | full)).any())
    # (b) full blocks: all real queries attend all key slots
    rows_ok = (blocks | ~real_q[None, None, :, :, None, None]).all(dim=5).all(dim=3)
    assert bool(rows_ok[full].all())
    # the compiled path's mask_mod alone reproduces the exact mask inside listed partial blocks
    mm = bm.mask_mod
    i = torch.arange(layout.padded_tokens)
    mm_tokens = mm(0, 0, i[:, None], i[None, :])
    listed = (partial | full)[:, :, i // bs][:, :, :, i // bs]
    inside_partial = partial[:, :, i // bs][:, :, :, i // bs]
    assert torch.equal((mm_tokens & listed)[inside_partial], tokens.expand_as(listed)[inside_partial])


def test_sta_block_mask_per_head():
    b = create_backend("SLIDING_TILE_ATTN", {"tile": [2, 3, 4], "window": 3,
                                             "strategy": {"*": {"*": [[1, 3, 3], [3, 1, 1], [3, 3, 3]]}}})
    layout = b.layout((5, 7, 9), "cpu")
    plan = b.plan(layout, AttentionMetadata(grid=(5, 7, 9)), heads=3)
    assert plan.heads == 3 and plan.width == 27
    check_plan_against_tokens(plan)
    # plans are cached per (grid, windows): the same object every call
    assert b.plan(layout, AttentionMetadata(grid=(5, 7, 9), layer_index=7), heads=3) is plan


@pytest.mark.parametrize("conf", [
    {"kernel_size": [3, 5, 5]},
    {"kernel_size": [2, 4, 6], "stride": [2, 2, 3], "dilation": [1, 1, 1], "is_causal": [True, False, False]},
    {"kernel_size": [2, 3, 3], "dilation": [2, 2, 2]},
])
def test_na_block_mask(conf):
    b = create_backend("NEIGHBORHOOD_ATTN", {"tile": [2, 3, 4], **conf})
    check_plan_against_tokens(b.plan(b.layout((5, 7, 9), "cpu")))


def test_vsa_selected_split():
    b = create_backend("VIDEO_SPARSE_ATTN", {"tile": [2, 3, 4], "sparsity": 0.5})
    layout = b.layout((5, 7, 9), "cpu")
    n = layout.num_tiles
    g = torch.Generator().manual_seed(0)
    sel = torch.stack([torch.randperm(n, generator=g)[:9] for _ in range(2 * 3 * n)]).view(2, 3, n, 9)
    fn, fi, pn, pi = split_selected(sel, layout.tile_full)
    table = torch.zeros(2, 3, n, n, dtype=torch.bool).scatter_(-1, sel, True)
    assert torch.equal(blocks_from_lists(fn, fi, n), table & layout.tile_full)
    assert torch.equal(blocks_from_lists(pn, pi, n), table & ~layout.tile_full)
    check_plan_against_tokens(BlockPlan(layout, selected=sel))


def test_compact_orders_true_first():
    t = torch.tensor([[[[False, True, False, True], [True, True, True, True]]]])
    num, idx = compact(t, 4)
    assert num.tolist() == [[[2, 4]]] and idx[0, 0, 0, :2].tolist() == [1, 3]


def test_default_kernel_options():
    assert kernels.default_kernel_options(128) is None and kernels.default_kernel_options(384) is None
    assert kernels.default_kernel_options(64) == {"BLOCK_M": 64, "BLOCK_N": 64}
    assert kernels.default_kernel_options(48) == {"BLOCK_M": 16, "BLOCK_N": 16}


def test_kernel_resolution_cpu_and_fa4_errors():
    b = create_backend("SLIDING_TILE_ATTN", {})
    assert b.resolve_kernel("cpu") == "sdpa"
    assert "reference" in b.kernel_name("cpu")
    assert create_backend("SLIDING_TILE_ATTN", {"kernel": "flex"}).resolve_kernel("cpu") == "flex-eager"
    fa4 = create_backend("SLIDING_TILE_ATTN", {"kernel": "fa4"})
    reasons = fa4.reasons(device="cpu", dtype=torch.float32, head_dim=64)
    assert reasons and any("FA4" in r or "flash_attn" in r for r in reasons)
    layout = fa4.layout((4, 8, 8), "cpu")
    q = torch.zeros(1, layout.padded_tokens, 1, 8)
    with pytest.raises(RuntimeError, match="kernel='fa4' cannot run"):
        fa4(q, q, q, meta=AttentionMetadata(grid=(4, 8, 8), layout=layout))


def test_sparse_backends_refuse_wrong_calls():
    b = create_backend("SLIDING_TILE_ATTN", {"tile": [2, 4, 4]})
    layout = b.layout((3, 5, 7), "cpu")
    raw = torch.zeros(1, layout.num_tokens, 2, 8)
    with pytest.raises(ValueError, match="permute"):
        b(raw, raw, raw, meta=AttentionMetadata(grid=(3, 5, 7), layout=layout))
    with pytest.raises(ValueError, match="meta=AttentionMetadata"):
        b(raw, raw, raw)
    other = create_backend("SLIDING_TILE_ATTN", {"tile": [1, 4, 4]}).layout((3, 5, 7), "cpu")
    q = torch.zeros(1, other.padded_tokens, 2, 8)
    with pytest.raises(ValueError, match="tile"):
        b(q, q, q, meta=AttentionMetadata(grid=(3, 5, 7), layout=other))
    assert b.sparse and not b.capabilities.supports_cross_attention
    assert b.layout((3, 5, 7), "cpu") is layout  # cached per (grid, device)


def test_mask_rows_equals_dense_rows():
    b = create_backend("NEIGHBORHOOD_ATTN", {"tile": [2, 3, 4], "kernel_size": [3, 3, 5], "stride": [1, 2, 1]})
    plan = b.plan(b.layout((5, 7, 9), "cpu"))
    rows = torch.tensor([0, 5, 77, 300, plan.layout.padded_tokens - 1])
    assert torch.equal(plan.mask_rows(rows), plan.dense_mask()[:, :, rows])
