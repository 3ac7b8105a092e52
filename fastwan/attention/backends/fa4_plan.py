"""FA4's sm90 forward at head dim 128: which query tile, and whether to cover the query in two launches.

FA4's sm90 forward runs one CTA per (query tile, head, batch) on one SM at a time, so its time is about whole
waves (``ceil(tiles / SMs)``) times the time of one tile. :func:`fa4_sm90_tile_m` picks the query tile of one
launch by that model; :func:`fa4_sm90_plan` also considers two launches over disjoint query rows, which leave
no part-empty last wave. :func:`fa4_sm90_tiled` runs one launch with an explicit tile. Everything here is plain
integer arithmetic (traced into constants by torch.compile) except the two functions that import
``flash_attn.cute``.
"""
from __future__ import annotations

import functools
import inspect

# FA4's sm90 forward tiles for head dim 128: tile_m -> (tile_m, tile_n, mma_pv_is_rs, intra_wg_overlap).
# flash_attn.cute's own choice is 128 x 128 (two consumer warpgroups, P in registers). 192 x 128 (three consumer
# warpgroups of 64 rows, P through shared memory) costs ~2.6% less per query row at the Wan shapes on an H100
# (benchmarks/fa4_tiles.py), but its 1.5x larger tiles leave a different last wave.
FA4_SM90_TILES: dict[int, tuple[int, int, bool, bool]] = {128: (128, 128, True, True), 192: (192, 128, False, True)}
FA4_SM90_ROW_COST: dict[int, float] = {128: 1.0, 192: 0.974}  # per query row, relative, measured on an H100
FA4_SM90_MIN_GAIN = 0.01  # switch away from FA4's default only for a modelled gain above run-to-run noise

# The fixed cost of one more kernel launch (launch gap, ramp-up), as query rows x keys of one tile stream at FA4's
# sm90 rate (~0.1 ns each on an H100: ~5 us). It keeps short-key calls (cross-attention) in one launch, where a
# split's modelled gain is a few microseconds.
FA4_SM90_LAUNCH_ROW_KEYS = 50_000


def fa4_sm90_tile_m(batch: int, seqlen_q: int, heads: int, num_sms: int) -> int:
    """The sm90 tile_m (128 or 192) for a ``[batch, seqlen_q, heads, 128]`` query.

    Time model: ``ceil(tiles / num_sms) * tile_m * row_cost``, whole waves times the per-tile time. 192 is picked
    when that model puts it at least ``FA4_SM90_MIN_GAIN`` below 128 (e.g. B=1 at both Wan grids); otherwise FA4's
    default 128 stays (e.g. the 1.3B model's batched-CFG shape, B=2 x 32,760 tokens x 12 heads, where the model
    gives 0.5% and measurements scatter around zero).
    """
    def cost(tm: int) -> float:  # plain arithmetic: torch.compile traces it into a constant
        tiles = batch * heads * -(-seqlen_q // tm)
        return -(-tiles // num_sms) * tm * FA4_SM90_ROW_COST[tm]

    return 192 if cost(192) < cost(128) * (1.0 - FA4_SM90_MIN_GAIN) else 128


def fa4_sm90_plan(batch: int, seqlen_q: int, seqlen_k: int, heads: int, num_sms: int) -> tuple[int, int, int]:
    """How FA4's sm90 forward covers a ``[batch, seqlen_q, heads, 128]`` query: ``(tile_m, split, tail_tile_m)``.

    ``split == 0``: one launch with ``tile_m`` (:func:`fa4_sm90_tile_m`). Otherwise two launches over the query
    rows, ``[0, split)`` with ``tile_m`` and ``[split, seqlen_q)`` with ``tail_tile_m``; a query row's output
    depends on its own row and all keys only, so they compute the same values as one launch. One launch often
    leaves its last wave part-empty (B=1, 32,760 tokens, 12 heads: 2,052 tiles of 192 rows = 15.5 waves on 132
    SMs); the plan there runs 15 full waves of 192-row tiles and the last 1,080 rows as one wave of 108 tiles of
    128 rows.

    Time model (as :func:`fa4_sm90_tile_m`): per launch, whole waves x tile_m x row cost x seqlen_k, plus
    ``FA4_SM90_LAUNCH_ROW_KEYS`` for the second launch. Every split at a tile boundary and every tile pair is
    tried; a split is taken only for a modelled gain of at least ``FA4_SM90_MIN_GAIN`` over one launch. Cached per
    shape (the op ``fastwan::flash_attn`` calls it at run time with ``split=-1``).
    """
    return _fa4_sm90_plan(int(batch), int(seqlen_q), int(seqlen_k), int(heads), int(num_sms))


@functools.cache
def _fa4_sm90_plan(batch: int, seqlen_q: int, seqlen_k: int, heads: int, num_sms: int) -> tuple[int, int, int]:
    def cost(rows: int, tm: int) -> float:
        tiles = batch * heads * -(-rows // tm)
        return -(-tiles // num_sms) * tm * FA4_SM90_ROW_COST[tm] * seqlen_k

    one = fa4_sm90_tile_m(batch, seqlen_q, heads, num_sms)
    limit = cost(seqlen_q, one) * (1.0 - FA4_SM90_MIN_GAIN)
    best, plan = None, (one, 0, 0)
    for tm in FA4_SM90_TILES:
        for split in range(tm, seqlen_q, tm):
            main = cost(split, tm) + FA4_SM90_LAUNCH_ROW_KEYS
            for tail in FA4_SM90_TILES:
                c = main + cost(seqlen_q - split, tail)
                # ties (same waves): the plan with less row work (more rows in the cheaper tile)
                work = split * FA4_SM90_ROW_COST[tm] + (seqlen_q - split) * FA4_SM90_ROW_COST[tail]
                key = (round(c / seqlen_k, 3), work)
                if c < limit and (best is None or key < best):
                    best, plan = key, (tm, split, tail)
    return plan


def fa4_sm90_tiled(q, k, v, scale: float, tile_m: int, out=None):
    """FA4 forward with the sm90 tile configuration ``FA4_SM90_TILES[tile_m]`` (flash_attn.cute's
    ``_flash_attn_fwd``; the public ``flash_attn_func`` does not take tile sizes). q, k, v: [B, S, H, D];
    ``out``: optional [B, S, H, D] destination (any layout with a contiguous last dim, e.g. a slice)."""
    from flash_attn.cute.interface import _flash_attn_fwd

    tm, tn, rs, overlap = FA4_SM90_TILES[tile_m]
    return _flash_attn_fwd(q, k, v, softmax_scale=scale, causal=False, tile_mn=(tm, tn), mma_pv_is_rs=rs,
                           intra_wg_overlap=overlap, out=out)


@functools.cache
def fa4_accepts_tiles() -> tuple[bool, str]:
    """Whether the installed flash_attn.cute forward takes explicit sm90 tiles (``_flash_attn_fwd(tile_mn=,
    mma_pv_is_rs=, intra_wg_overlap=)``). Imports flash_attn.cute."""
    try:
        from flash_attn.cute.interface import _flash_attn_fwd
    except Exception as exc:
        return False, f"flash_attn.cute.interface._flash_attn_fwd does not import ({type(exc).__name__}: {exc})"
    params = inspect.signature(_flash_attn_fwd).parameters
    missing = [p for p in ("tile_mn", "mma_pv_is_rs", "intra_wg_overlap") if p not in params]
    if missing:
        return False, f"flash_attn.cute's _flash_attn_fwd has no {'/'.join(missing)} argument"
    return True, "ok"
