"""Sparse backends == dense attention with an independently built token mask (raster order, fp64 reference), also
at grid shapes their tiles and windows do not divide, batch 2 and one head, and STA's per-head windows on a call
that holds only some of the layer's heads (sequence parallelism).

The references below are written from the definitions (token coordinates in raster order, explicit window
rules), never from the backends' block tables or layouts. Backend outputs are brought back to raster order
with ``layout.unpermute``. Dummy key slots are poisoned (huge k and v) so any weight on them would show.
"""
import math

import pytest
import torch

from fastwan.attention.base import AttentionMetadata
from fastwan.attention.sparse.layout import choose_tile, default_block_size
from fastwan.attention.registry import create_backend
from fastwan.attention.sparse.masks import na_mask_1d
from fastwan.attention.sparse.vsa import topk_count

GRID = (5, 7, 9)  # 315 tokens; tile (2, 3, 4) divides none of the dimensions


# ------------------------------------------------------------------------------------------ references
def raster_coords(grid):
    T, H, W = grid
    i = torch.arange(T * H * W)
    return torch.stack([i // (H * W), (i // W) % H, i % W], dim=1)


def ref_attention(q, k, v, mask):
    """q, k, v: [B, N, H, D]; mask: bool broadcastable to [B, H, N, N] -> [B, N, H, D] (fp64 math)."""
    q, k, v = (t.double() for t in (q, k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), v)


def sta_ref_mask(grid, tile, window):
    """[N, N]: key tile inside the query tile's window, clamped to stay within the tile grid."""
    c = raster_coords(grid)
    ok = torch.ones(c.shape[0], c.shape[0], dtype=torch.bool)
    for d in range(3):
        n = math.ceil(grid[d] / tile[d])
        w = min(window[d], n)
        qt, kt = c[:, d] // tile[d], c[:, d] // tile[d]
        start = (qt - w // 2).clamp(min=0).clamp(max=n - w)
        ok &= (kt[None, :] >= start[:, None]) & (kt[None, :] < start[:, None] + w)
    return ok


def natten_neighbors_1d(L, k, s, d, causal):
    """NATTEN's window per query coordinate, scalar code following its reference kernel."""
    out = []
    for x in range(L):
        g, xi = x % d, x // d
        lg = len(range(g, L, d))
        left, right = k // 2, k // 2 + (k % 2) - 1
        if causal:
            leader = min((xi // s) * s + s - 1, lg - 1)
            start, end = max(leader - left - right, 0), min(xi + 1, lg)
        else:
            leader = min((xi // s) * s + s // 2, lg - 1)
            start = max(leader - left, 0)
            if leader + right >= lg:
                start += lg - right - leader - 1
            end = start + k
        out.append({g + d * yi for yi in range(start, end)})
    return out


def na_ref_mask(grid, kernel_size, stride, dilation, causal):
    c = raster_coords(grid).tolist()
    per_dim = [natten_neighbors_1d(grid[i], kernel_size[i], stride[i], dilation[i], causal[i]) for i in range(3)]
    n = len(c)
    m = torch.zeros(n, n, dtype=torch.bool)
    for qi, qc in enumerate(c):
        for ki, kc in enumerate(c):
            m[qi, ki] = all(kc[d] in per_dim[d][qc[d]] for d in range(3))
    return m


def vsa_reference(q, k, v, grid, tile, sparsity, gate=None):
    """Raster-order VSA: pool real tokens per tile, top-k key tiles per query tile, masked fine + gated coarse."""
    c = raster_coords(grid)
    n = [math.ceil(g / t) for g, t in zip(grid, tile)]
    tile_id = ((c[:, 0] // tile[0]) * n[1] + c[:, 1] // tile[1]) * n[2] + c[:, 2] // tile[2]
    nt = n[0] * n[1] * n[2]
    onehot = torch.nn.functional.one_hot(tile_id, nt).double()  # [N, nt]

    def pool(x):
        return torch.einsum("bnhd,nt->bthd", x.double(), onehot) / onehot.sum(0)[None, :, None, None]

    qc, kc, vc = pool(q), pool(k), pool(v)
    scores = torch.einsum("bqhd,bkhd->bhqk", qc, kc) / math.sqrt(q.shape[-1])
    kk = max(1, min(nt, math.ceil((1 - sparsity) * nt)))  # FastVideo's rule, float error included
    sel = scores.topk(kk, dim=-1).indices  # [B, H, nt, kk]
    chosen = torch.zeros(scores.shape, dtype=torch.bool).scatter_(-1, sel, True)  # [B, H, nt, nt]
    mask = chosen[:, :, tile_id][:, :, :, tile_id]  # [B, H, N, N]
    out = ref_attention(q, k, v, mask)
    if gate is not None:
        coarse = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, -1), vc)  # [B, nt, H, D]
        out = out + coarse[:, tile_id] * gate.double()
    return out


# ------------------------------------------------------------------------------------------ harness
def qkv(grid, heads=3, dim=16, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = math.prod(grid)
    return [torch.randn(batch, n, heads, dim, generator=g) for _ in range(3)]


def run(backend, grid, q, k, v, *, step=None, layer=0, gate=None):
    layout = backend.layout(grid, "cpu")
    qp, kp, vp = (layout.permute(t, dim=1) for t in (q, k, v))
    dummy = ~layout.key_valid
    kp[:, dummy] = 30.0  # would dominate every softmax if a dummy key were ever attended
    vp[:, dummy] = 1e4
    extra = {} if gate is None else {"gate_compress": layout.permute(gate, dim=1)}
    meta = AttentionMetadata(grid=grid, step_index=step, num_steps=4, layer_index=layer, layout=layout,
                             extra=extra)
    out = backend(qp, kp, vp, meta=meta)
    assert out.shape == qp.shape and bool(torch.isfinite(out).all())
    return layout.unpermute(out, dim=1)


def close(out, ref):
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------ STA
@pytest.mark.parametrize("block", [None, 24])
@pytest.mark.parametrize("window", [(3, 1, 3), (1, 3, 1), (5, 5, 5)])
def test_sta_uniform_window(window, block):
    tile = (2, 3, 4)
    b = create_backend("SLIDING_TILE_ATTN", {"tile": list(tile), "window": list(window), "block_size": block})
    q, k, v = qkv(GRID)
    close(run(b, GRID, q, k, v), ref_attention(q, k, v, sta_ref_mask(GRID, tile, window)))


def test_sta_per_head_strategy_nested_and_flat():
    tile = (2, 3, 4)
    heads = [(1, 1, 1), (3, 3, 3), (1, 3, 1)]
    strategy = {"1": {"2": [list(w) for w in heads]}, "*": {"*": [1, 1, 3]}}
    b = create_backend("SLIDING_TILE_ATTN", {"tile": tile, "window": [3, 3, 3], "strategy": strategy,
                                             "block_size": 24})
    q, k, v = qkv(GRID)
    per_head = torch.stack([sta_ref_mask(GRID, tile, w) for w in heads])[None]
    close(run(b, GRID, q, k, v, step=1, layer=2), ref_attention(q, k, v, per_head))
    # other (step, layer) -> the "*" rule; the default window is never used here
    close(run(b, GRID, q, k, v, step=0, layer=2), ref_attention(q, k, v, sta_ref_mask(GRID, tile, (1, 1, 3))))
    # FastVideo's flat form: unlisted heads fall back to "window"
    flat = {"0_5_0": [1, 1, 1], "0_5_2": [3, 1, 3]}
    b2 = create_backend("SLIDING_TILE_ATTN", {"tile": tile, "window": [3, 3, 3], "strategy": flat})
    want = torch.stack([sta_ref_mask(GRID, tile, w) for w in [(1, 1, 1), (3, 3, 3), (3, 1, 3)]])[None]
    close(run(b2, GRID, q, k, v, step=0, layer=5), ref_attention(q, k, v, want))
    close(run(b2, GRID, q, k, v, step=1, layer=5), ref_attention(q, k, v, sta_ref_mask(GRID, tile, (3, 3, 3))))


def test_sta_dense_steps():
    b = create_backend("SLIDING_TILE_ATTN", {"tile": [2, 3, 4], "window": 1, "dense_steps": 2})
    q, k, v = qkv(GRID)
    dense = torch.ones(1, dtype=torch.bool)
    sparse = sta_ref_mask(GRID, (2, 3, 4), (1, 1, 1))
    close(run(b, GRID, q, k, v, step=0), ref_attention(q, k, v, dense))
    close(run(b, GRID, q, k, v, step=1), ref_attention(q, k, v, dense))
    close(run(b, GRID, q, k, v, step=2), ref_attention(q, k, v, sparse))
    close(run(b, GRID, q, k, v, step=None), ref_attention(q, k, v, sparse))


def test_sta_window_larger_than_grid_is_dense():
    b = create_backend("SLIDING_TILE_ATTN", {"tile": [2, 3, 4], "window": 99})
    q, k, v = qkv(GRID)
    close(run(b, GRID, q, k, v), ref_attention(q, k, v, torch.ones(1, dtype=torch.bool)))


def test_sta_dense_mask_matches_reference():
    tile = (2, 3, 4)
    b = create_backend("SLIDING_TILE_ATTN", {"tile": tile, "window": [3, 1, 3]})
    layout = b.layout(GRID, "cpu")
    m = b.dense_mask(GRID)[0]  # layout order [P, P]
    back = m[layout.slot_of_token][:, layout.slot_of_token]
    assert torch.equal(back, sta_ref_mask(GRID, tile, (3, 1, 3)))
    assert not bool(m[:, ~layout.key_valid].any())


# ------------------------------------------------------------------------------------------ NA
def test_natten_1d_hand_checked():
    """Windows worked out by hand from NATTEN's definition (and the scalar reference agrees)."""
    cases = [
        ((7, 3, 1, 1, False), {0: {0, 1, 2}, 3: {2, 3, 4}, 6: {4, 5, 6}}),
        ((8, 4, 1, 1, False), {0: {0, 1, 2, 3}, 3: {1, 2, 3, 4}, 7: {4, 5, 6, 7}}),
        ((8, 3, 2, 1, False), {0: {0, 1, 2}, 1: {0, 1, 2}, 2: {2, 3, 4}, 3: {2, 3, 4}, 7: {5, 6, 7}}),
        ((9, 3, 1, 2, False), {0: {0, 2, 4}, 1: {1, 3, 5}, 7: {3, 5, 7}, 8: {4, 6, 8}}),
        ((6, 3, 1, 1, True), {0: {0}, 1: {0, 1}, 4: {2, 3, 4}}),
        ((8, 3, 2, 1, True), {4: {3, 4}, 5: {3, 4, 5}}),
    ]
    for (L, k, s, d, c), expect in cases:
        ref = natten_neighbors_1d(L, k, s, d, c)
        m = na_mask_1d(L, k, s, d, c)
        for x, keys in expect.items():
            assert ref[x] == keys, (L, k, s, d, c, x)
            assert set(torch.nonzero(m[x]).flatten().tolist()) == keys, (L, k, s, d, c, x)


def test_natten_1d_exhaustive_small():
    for L in range(2, 12):
        for k in range(1, L + 1):
            for d in range(1, L // k + 1):
                for s in range(1, k + 1):
                    for c in (False, True):
                        ref = natten_neighbors_1d(L, k, s, d, c)
                        m = na_mask_1d(L, k, s, d, c)
                        got = [set(torch.nonzero(m[x]).flatten().tolist()) for x in range(L)]
                        assert got == ref, (L, k, s, d, c)


NA_CASES = [
    dict(kernel_size=[3, 5, 5]),
    dict(kernel_size=[2, 4, 3], stride=[1, 2, 3]),
    dict(kernel_size=[2, 3, 4], dilation=[2, 2, 2]),
    dict(kernel_size=[3, 3, 3], stride=[2, 1, 2], dilation=[1, 2, 1], is_causal=[True, False, False]),
    dict(kernel_size=[5, 7, 9], is_causal=[True, True, False]),
    dict(kernel_size=[-1, 3, 5], stride=[1, 3, 1]),
]


@pytest.mark.parametrize("case", NA_CASES)
def test_na_matches_natten_definition(case):
    b = create_backend("NEIGHBORHOOD_ATTN", {"tile": [2, 3, 4], "block_size": 24, **case})
    full = {"stride": [1, 1, 1], "dilation": [1, 1, 1], "is_causal": [False] * 3, **case}
    ks = [GRID[i] if x == -1 else x for i, x in enumerate(full["kernel_size"])]
    mask = na_ref_mask(GRID, ks, full["stride"], full["dilation"], full["is_causal"])
    q, k, v = qkv(GRID, batch=1)
    close(run(b, GRID, q, k, v), ref_attention(q, k, v, mask))


def test_na_tile_aligned_gna_needs_no_token_mask():
    grid, tile = (4, 6, 8), (2, 3, 4)
    case = dict(kernel_size=[2, 3, 4], stride=[2, 3, 4])  # stride = tile, odd multiples -> block aligned
    b = create_backend("NEIGHBORHOOD_ATTN", {"tile": list(tile), **case})
    layout = b.layout(grid, "cpu")
    plan = b.plan(layout)
    assert plan.token_pred is None
    q, k, v = qkv(grid, batch=1)
    close(run(b, grid, q, k, v), ref_attention(q, k, v, na_ref_mask(grid, [2, 3, 4], [2, 3, 4], [1] * 3, [False] * 3)))
    # the unaligned default needs the token predicate
    b2 = create_backend("NEIGHBORHOOD_ATTN", {"tile": list(tile), "kernel_size": [3, 3, 3]})
    assert b2.plan(b2.layout(grid, "cpu")).token_pred is not None


def test_na_full_kernel_is_dense_and_causal_t_is_block_causal():
    b = create_backend("NEIGHBORHOOD_ATTN", {"kernel_size": -1, "tile": [2, 3, 4]})
    q, k, v = qkv(GRID, batch=1)
    close(run(b, GRID, q, k, v), ref_attention(q, k, v, torch.ones(1, dtype=torch.bool)))
    b = create_backend("NEIGHBORHOOD_ATTN", {"kernel_size": -1, "is_causal": [True, False, False],
                                             "tile": [2, 3, 4]})
    c = raster_coords(GRID)
    causal_t = c[:, 0][None, :] <= c[:, 0][:, None]
    close(run(b, GRID, q, k, v), ref_attention(q, k, v, causal_t))


def test_na_auto_tile_and_dense_steps():
    b = create_backend("NEIGHBORHOOD_ATTN", {"kernel_size": [3, 5, 5], "dense_steps": 1})
    q, k, v = qkv(GRID, batch=1)
    close(run(b, GRID, q, k, v, step=0), ref_attention(q, k, v, torch.ones(1, dtype=torch.bool)))
    close(run(b, GRID, q, k, v, step=1), ref_attention(q, k, v, na_ref_mask(GRID, [3, 5, 5], [1] * 3, [1] * 3,
                                                                              [False] * 3)))


# ------------------------------------------------------------------------------------------ VSA
def test_topk_count():
    assert topk_count(0.85, 100) == 16  # FastVideo's float ceil: (1 - 0.85) * 100 = 15.000000000000002
    assert topk_count(0.9, 7) == 1
    assert topk_count(0.0, 27) == 27
    assert topk_count(0.5, 27) == 14


@pytest.mark.parametrize("with_gate", [False, True])
@pytest.mark.parametrize("tile,block,sparsity", [((2, 3, 4), None, 0.6), ((2, 2, 2), 8, 0.85)])
def test_vsa_matches_reference(tile, block, sparsity, with_gate):
    b = create_backend("VIDEO_SPARSE_ATTN", {"tile": list(tile), "block_size": block, "sparsity": sparsity})
    q, k, v = qkv(GRID, seed=3)
    gate = torch.randn_like(q) if with_gate else None
    close(run(b, GRID, q, k, v, gate=gate), vsa_reference(q, k, v, GRID, tile, sparsity, gate))


def test_vsa_dense_steps_keep_every_tile():
    b = create_backend("VIDEO_SPARSE_ATTN", {"tile": [2, 3, 4], "sparsity": 0.9, "dense_steps": 1})
    q, k, v = qkv(GRID, seed=4)
    gate = torch.randn_like(q)
    close(run(b, GRID, q, k, v, step=0, gate=gate), vsa_reference(q, k, v, GRID, (2, 3, 4), 0.0, gate))
    close(run(b, GRID, q, k, v, step=1, gate=gate), vsa_reference(q, k, v, GRID, (2, 3, 4), 0.9, gate))


# ------------------------------------------------------------------------------------------ flex (eager, CPU)
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize(
    "name,conf",
    [
        ("SLIDING_TILE_ATTN", {"tile": [2, 3, 4], "block_size": 24, "strategy": {"*": {"*": [[3, 1, 3], [1, 3, 1]]}}}),
        ("NEIGHBORHOOD_ATTN", {"tile": [2, 3, 4], "block_size": 24, "kernel_size": [3, 3, 5], "stride": [1, 2, 1]}),
        ("VIDEO_SPARSE_ATTN", {"tile": [2, 3, 4], "block_size": 24, "sparsity": 0.7}),
    ],
)
def test_flex_kernel_equals_sdpa_kernel(name, conf):
    grid = (3, 5, 7)
    q, k, v = qkv(grid, heads=2, dim=8, batch=1, seed=5)
    gate = torch.randn_like(q) if name == "VIDEO_SPARSE_ATTN" else None
    ref = run(create_backend(name, {**conf, "kernel": "sdpa"}), grid, q, k, v, gate=gate)
    out = run(create_backend(name, {**conf, "kernel": "flex"}), grid, q, k, v, gate=gate)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("with_gate", [False, True])
def test_vsa_matches_reference_tile_divides_grid(with_gate):
    """Tiles that divide the grid, with slot padding: pooling reads only each tile's real prefix."""
    grid, tile = (4, 6, 8), (2, 3, 4)
    b = create_backend("VIDEO_SPARSE_ATTN", {"tile": list(tile), "block_size": 32, "sparsity": 0.6})
    q, k, v = qkv(grid, seed=5)
    gate = torch.randn_like(q) if with_gate else None
    close(run(b, grid, q, k, v, gate=gate), vsa_reference(q, k, v, grid, tile, 0.6, gate))


def test_na_auto_tile_follows_a_block_sized_stride():
    b = create_backend("NEIGHBORHOOD_ATTN", {"kernel_size": [15, 10, 36], "stride": [3, 10, 4]})
    assert b.tile_for((21, 30, 52)) == (3, 10, 4)
    plan = b.plan(b.layout((21, 30, 52), "cpu"))
    assert plan.token_pred is None  # windows on tile boundaries: blocks are full or empty
    small = create_backend("NEIGHBORHOOD_ATTN", {"kernel_size": [3, 3, 3], "stride": [1, 2, 2]})
    assert small.tile_for((21, 30, 52)) == choose_tile((21, 30, 52))  # a 4-token stride is no tile


# ------------------------------------------------------------------------------------------ tiles larger than the grid
BIG_TILE_GRID, BIG_TILE, CLAMPED = (3, 5, 7), (4, 2, 9), (3, 2, 7)  # T and W tiles exceed the grid, H does not


@pytest.mark.parametrize(
    "name,conf,reference",
    [
        ("SLIDING_TILE_ATTN", {"window": [1, 3, 1]}, lambda q, k, v, tile: ref_attention(
            q, k, v, sta_ref_mask(BIG_TILE_GRID, tile, (1, 3, 1)))),
        ("VIDEO_SPARSE_ATTN", {"sparsity": 0.5}, lambda q, k, v, tile: vsa_reference(
            q, k, v, BIG_TILE_GRID, tile, 0.5)),
        ("NEIGHBORHOOD_ATTN", {"kernel_size": [3, 3, 5]}, lambda q, k, v, tile: ref_attention(
            q, k, v, na_ref_mask(BIG_TILE_GRID, (3, 3, 5), (1, 1, 1), (1, 1, 1), (False,) * 3))),
    ],
)
def test_tile_larger_than_grid_is_clamped(name, conf, reference):
    """The tile is clamped per dimension to the grid: the same output as the clamped tile (and as the reference
    with the tile as given), in no more slots than the clamped tiles need."""
    big = create_backend(name, {**conf, "tile": list(BIG_TILE)})
    small = create_backend(name, {**conf, "tile": list(CLAMPED)})
    layout = big.layout(BIG_TILE_GRID, "cpu")
    assert layout.tile == CLAMPED and layout.tile_grid == (1, 3, 1)
    assert layout.padded_tokens == 3 * default_block_size(CLAMPED) == 3 * 64  # not 3 * 128 for the 72-token tile
    q, k, v = qkv(BIG_TILE_GRID, seed=7)
    out = run(big, BIG_TILE_GRID, q, k, v)
    torch.testing.assert_close(out, run(small, BIG_TILE_GRID, q, k, v), atol=1e-6, rtol=1e-6)
    close(out, reference(q, k, v, BIG_TILE))


def test_tile_larger_than_the_whole_grid_needs_no_padding():
    grid = (5, 8, 8)
    b = create_backend("SLIDING_TILE_ATTN", {"tile": [16, 32, 32]})
    layout = b.layout(grid, "cpu")
    assert layout.tile == grid and layout.padded_tokens == math.prod(grid)  # was 16384 slots for 320 tokens
    q, k, v = qkv(grid, heads=2, batch=1, seed=8)
    close(run(b, grid, q, k, v), ref_attention(q, k, v, torch.ones(1, dtype=torch.bool)))


# ------------------------------------------------------------------------------------------ odd grids and head slices
GRIDS = [(3, 5, 7), (1, 4, 6), (2, 1, 1), (1, 1, 1)]  # odd sizes, a single frame, fewer tokens than one tile


def clamp(tile, grid):
    return tuple(min(t, g) for t, g in zip(tile, grid))


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("tile,window", [((2, 3, 4), (3, 1, 5)), ((4, 4, 4), (9, 9, 9))])
def test_sta_at_odd_grids(grid, tile, window):
    q, k, v = qkv(grid, heads=1, dim=8, batch=2)
    b = create_backend("SLIDING_TILE_ATTN", {"tile": list(tile), "window": list(window), "kernel": "sdpa"})
    close(run(b, grid, q, k, v), ref_attention(q, k, v, sta_ref_mask(grid, clamp(tile, grid), window)))


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("conf", [dict(kernel_size=[1, 1, 1]), dict(kernel_size=[-1, 1, 1], is_causal=True),
                                  dict(tile=[2, 3, 4]), dict(stride=[1, 1, 1], is_causal=[True, False, False])])
def test_na_at_odd_grids(grid, conf):
    q, k, v = qkv(grid, heads=1, dim=8, batch=2)
    b = create_backend("NEIGHBORHOOD_ATTN", {**conf, "kernel": "sdpa"})
    spec = b.spec(grid)  # the default kernel size fitted to the grid, or the explicit one (-1: whole axis)
    want = ref_attention(q, k, v, na_ref_mask(grid, spec.kernel_size, spec.stride, spec.dilation, spec.is_causal))
    close(run(b, grid, q, k, v), want)


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("tile,sparsity", [((4, 4, 4), 0.0), ((1, 2, 2), 0.5), ((2, 3, 4), 0.999)])
def test_vsa_at_odd_grids(grid, tile, sparsity):
    q, k, v = qkv(grid, heads=1, dim=8, batch=2)
    gate = torch.randn_like(q)
    b = create_backend("VIDEO_SPARSE_ATTN", {"tile": list(tile), "sparsity": sparsity, "kernel": "sdpa"})
    close(run(b, grid, q, k, v, gate=gate), vsa_reference(q, k, v, grid, clamp(tile, grid), sparsity, gate))


PER_HEAD = [  # four heads, each its own window; the flat form leaves heads 0 and 2 at "window"
    ({"*": {"*": [[1, 1, 1], [3, 3, 3], [1, 3, 1], [3, 1, 3]]}}, [(1, 1, 1), (3, 3, 3), (1, 3, 1), (3, 1, 3)]),
    ({"0_0_1": [3, 3, 3], "0_0_3": [1, 3, 1]}, [(1, 1, 1), (3, 3, 3), (1, 1, 1), (1, 3, 1)]),
]


@pytest.mark.parametrize("strategy,windows", PER_HEAD)
def test_sta_per_head_windows_on_a_slice_of_the_heads(strategy, windows):
    """A call that holds heads first .. first + H - 1 of the layer (meta.extra["head_range"], as Ulysses sequence
    parallelism splits them) applies those heads' windows; without it, the call's heads are the layer's."""
    grid, tile = (3, 5, 7), (1, 2, 2)
    b = create_backend("SLIDING_TILE_ATTN", {"tile": list(tile), "window": 1, "strategy": strategy, "kernel": "sdpa"})
    q, k, v = qkv(grid, heads=4, dim=8, batch=2)
    want = torch.cat([ref_attention(q[:, :, h:h + 1], k[:, :, h:h + 1], v[:, :, h:h + 1],
                                    sta_ref_mask(grid, tile, windows[h])) for h in range(4)], dim=2)
    layout = b.layout(grid, "cpu")
    for first, n in [(0, 4), (0, 2), (2, 2), (1, 1), (3, 1)]:
        qp, kp, vp = (layout.permute(t[:, :, first:first + n], dim=1) for t in (q, k, v))
        extra = {} if n == 4 else {"head_range": (first, 4)}
        meta = AttentionMetadata(grid=grid, step_index=0, layer_index=0, layout=layout, extra=extra)
        close(layout.unpermute(b(qp, kp, vp, meta=meta), dim=1), want[:, :, first:first + n])


def test_sta_head_range_that_does_not_hold_the_call_is_refused():
    b = create_backend("SLIDING_TILE_ATTN", {"tile": [1, 2, 2], "strategy": {"*": {"*": [[1, 1, 1]] * 4}}})
    layout = b.layout((2, 4, 4), "cpu")
    q = torch.zeros(1, layout.padded_tokens, 2, 8)
    meta = AttentionMetadata(grid=(2, 4, 4), layout=layout, extra={"head_range": (3, 4)})
    with pytest.raises(ValueError, match=r"head_range.*\(3, 4\).*2 heads"):
        b(q, q, q, meta=meta)
