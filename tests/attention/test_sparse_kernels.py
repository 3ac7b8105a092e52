"""What the compiled/FA4 kernels receive: BlockMask / block tables checked against the exact token mask.

The compiled flex path only evaluates its mask_mod (dummy keys, NA neighborhoods) inside *partial* blocks and
skips unlisted blocks, so the block lists must (a) cover every attended token pair and (b) mark as full only
blocks where every real query attends every key slot. Both are checked here on CPU.
"""
import pytest
import torch

from fastwan.attention import base
from fastwan.attention.base import AttentionMetadata
from fastwan.attention.registry import create_backend
from fastwan.attention.sparse import fa4, flex
from fastwan.attention.sparse.plan import BlockPlan
from fastwan.kernels.tables import compact, split_selected


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
    assert flex.default_kernel_options(128) is None and flex.default_kernel_options(384) is None
    assert flex.default_kernel_options(64) == {"BLOCK_M": 64, "BLOCK_N": 64}
    assert flex.default_kernel_options(48) == {"BLOCK_M": 16, "BLOCK_N": 16}


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


def fa4_token_mask(plan: BlockPlan) -> torch.Tensor:
    """What FA4 computes from plan.fa4_tensors(): full blocks unmasked, partial blocks through the mask rule."""
    layout = plan.layout
    t = plan.fa4_tensors()
    n, bs, p = layout.num_tiles, layout.block_size, layout.padded_tokens
    full = blocks_from_lists(t["full_num"], t["full_idx"], n)
    partial = blocks_from_lists(t["partial_num"], t["partial_idx"], n)
    assert not bool((full & partial).any())
    tile = torch.arange(p) // bs
    i = torch.arange(p)
    rule = fa4.fa4_mask_reference(t, i[:, None], i[None, :])
    return full[:, :, tile][:, :, :, tile] | (partial[:, :, tile][:, :, :, tile] & rule)


def assert_fa4_matches_exact(plan: BlockPlan):
    real_q = plan.layout.key_valid  # dummy query rows are dropped by unpermute
    got = fa4_token_mask(plan)[:, :, real_q]
    want = plan.dense_mask()[:, :, real_q]
    assert torch.equal(got, want.expand_as(got))


@pytest.mark.parametrize("grid,tile,expect", [
    ((5, 7, 9), [2, 3, 4], "threshold"),   # grid padding: dummies inside border tiles
    ((4, 6, 8), [2, 3, 4], "prefix"),      # tile divides the grid: 24 real + 40 slot-padding keys per tile
    ((4, 8, 8), [2, 4, 8], None),          # 64-token tiles, no dummies at all
])
def test_fa4_rules_sta(grid, tile, expect):
    b = create_backend("SLIDING_TILE_ATTN", {"tile": tile, "window": [1, 3, 1]})
    plan = b.plan(b.layout(grid, "cpu"), AttentionMetadata(grid=grid, step_index=0, num_steps=1), heads=1)
    assert plan.fa4_tensors()["mask"][0] == expect
    assert_fa4_matches_exact(plan)


@pytest.mark.parametrize("conf", [
    {"kernel_size": [3, 5, 5]},
    {"kernel_size": [2, 4, 6], "stride": [2, 2, 3], "is_causal": [True, False, False]},
    {"kernel_size": [2, 3, 3], "dilation": [2, 2, 2]},
    {"kernel_size": [3, 3, 5], "stride": [1, 3, 1], "dilation": [1, 2, 1], "is_causal": [False, True, True]},
])
@pytest.mark.parametrize("grid", [(5, 7, 9), (4, 6, 8)])
def test_fa4_rules_neighborhood(conf, grid):
    """The NA mask_mod's window/coordinate encoding reproduces NATTEN's exact token mask."""
    b = create_backend("NEIGHBORHOOD_ATTN", {"tile": [2, 3, 4], **conf})
    plan = b.plan(b.layout(grid, "cpu"))
    assert plan.token_pred is not None and plan.fa4_tensors()["mask"][0] == "na"
    assert_fa4_matches_exact(plan)


def test_fa4_rules_gna_aligned_needs_no_token_rule():
    """stride = tile, kernel = odd multiples of the tile, tile divides the grid: every block full or empty."""
    b = create_backend("NEIGHBORHOOD_ATTN", {"tile": [2, 3, 4], "kernel_size": [2, 9, 12], "stride": [2, 3, 4]})
    plan = b.plan(b.layout((6, 9, 16), "cpu"))
    assert plan.token_pred is None and plan.fa4_tensors()["mask"][0] == "prefix"
    assert_fa4_matches_exact(plan)


@pytest.mark.parametrize("grid", [(5, 7, 9), (4, 6, 8), (4, 8, 8)])
def test_fa4_rules_vsa(grid):
    tile = [2, 4, 8] if grid == (4, 8, 8) else [2, 3, 4]
    b = create_backend("VIDEO_SPARSE_ATTN", {"tile": tile, "sparsity": 0.5})
    layout = b.layout(grid, "cpu")
    n = layout.num_tiles
    g = torch.Generator().manual_seed(1)
    sel = torch.stack([torch.randperm(n, generator=g)[: max(1, n // 3)] for _ in range(2 * n)]).view(1, 2, n, -1)
    assert_fa4_matches_exact(BlockPlan(layout, selected=sel))


# ------------------------------------------------------------------------------------------ compiled flex
def test_compiled_flex_keeps_compiling_past_dynamos_default_limit_and_leaves_its_config_alone():
    """Each static shape compiles once, beyond dynamo's default limit of 8 (past a limit dynamo would silently run
    the unfused eager kernel), and no process-wide dynamo setting changes. The "eager" compile backend keeps
    this cheap on CPU; the limit is the compiled function's, whatever the backend."""
    import torch._dynamo.config as dcfg
    from torch._dynamo.utils import counters

    before = {name: getattr(dcfg, name) for name in ("recompile_limit", "accumulated_recompile_limit")}
    fn = flex.compiled_flex("eager")
    b = create_backend("SLIDING_TILE_ATTN", {"tile": [1, 2, 2], "window": 1, "block_size": 16, "kernel": "flex"})
    shapes = dcfg.recompile_limit + 3
    compiled_before = counters["frames"]["ok"]
    for i in range(shapes):
        grid = (1, 2, 2 * (i + 1))
        layout = b.layout(grid, "cpu")
        plan = b.plan(layout, AttentionMetadata(grid=grid), heads=1)
        q = torch.randn(1, 1, layout.padded_tokens, 8)
        assert fn(q, q, q, block_mask=plan.flex_block_mask(exact=True), scale=0.5).shape == q.shape
    assert counters["frames"]["ok"] - compiled_before == shapes
    assert {name: getattr(dcfg, name) for name in before} == before


def test_recompile_limit_is_raised_only_inside_the_block():
    import torch._dynamo.config as dcfg

    before = dcfg.recompile_limit
    with flex.recompile_limit_at_least(before + 56):
        assert dcfg.recompile_limit == before + 56
    assert dcfg.recompile_limit == before
    with flex.recompile_limit_at_least(1):  # never lowered
        assert dcfg.recompile_limit == before


# ------------------------------------------------------------------------------------------ FA4 capabilities
@pytest.fixture
def fa4_probe_cleared():
    """FA4's reasons are cached per (device, dtype); a faked GPU needs them computed afresh."""
    fa4._fa4_reasons.cache_clear()
    yield
    fa4._fa4_reasons.cache_clear()


def test_fa4_reasons_come_from_declared_capabilities(fake_gpu, fa4_probe_cleared, monkeypatch):
    fake_gpu(cc=(8, 0))
    text = "\n".join(fa4.fa4_reasons("cuda", torch.float32))
    assert "compute capability sm80 is below the minimum sm90" in text and "dtype float32 is not supported" in text
    assert "package 'flash_attn' is not installed (flash_attn.cute, FA4: pip install flash-attn-4)" in text
    assert "cannot be imported" not in text  # the package is probed only where everything else allows FA4
    fa4._fa4_reasons.cache_clear()
    fake_gpu(cc=(12, 0))
    assert "compute capability sm120 is above the supported maximum sm103" in "\n".join(
        fa4.fa4_reasons("cuda", torch.bfloat16))
    assert fa4.fa4_reasons("cpu", torch.bfloat16)[0] == "device type 'cpu' is not supported (needs cuda)"
    fa4._fa4_reasons.cache_clear()
    fake_gpu(cc=(9, 0))
    monkeypatch.setattr(base, "package_available", lambda name: True)  # flash_attn "installed" but not importable
    assert fa4.fa4_reasons("cuda", torch.bfloat16) == [
        "flash_attn.cute block sparsity cannot be imported: ModuleNotFoundError: No module named 'flash_attn'"]


def test_sparse_backend_reasons_on_a_fake_gpu_list_each_reason_once(fake_gpu, fa4_probe_cleared):
    fake_gpu(cc=(8, 0))  # fake_gpu: no triton
    reasons = create_backend("SLIDING_TILE_ATTN", {"kernel": "fa4"}).reasons(
        device="cuda", dtype=torch.float32, head_dim=64)
    assert len(reasons) == len(set(reasons)) and "kernel 'fa4': compute capability sm80 is below the minimum sm90" \
        in reasons
    auto = create_backend("SLIDING_TILE_ATTN", {}).reasons(device="cuda", dtype=torch.bfloat16, head_dim=64)
    assert auto == ["package 'triton' is not installed (compiled flex_attention on CUDA: pip install triton)"]
