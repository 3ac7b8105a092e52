"""VSA's coarse stage as two Triton kernels (CUDA), as ``torch.library`` custom ops.

:class:`~fastwan.attention.sparse.vsa.VideoSparseBackend` picks, per call, the key tiles every query tile
attends to. In PyTorch that is about a dozen small kernels (a pooling sum and a division for q and for k,
transposes, the tile scores, a scale, ``torch.topk``, then :func:`~fastwan.kernels.tables.split_selected`
for the FA4 block tables); on CUDA it becomes three launches:

1. ``fastwan::vsa_pool``: one kernel mean-pools q, k (and v when the coarse output is needed) over each tile's
   real tokens, fp32 accumulation, reading strided [B, P, H, D] views in place;
2. the tile scores: a plain fp32 ``torch.matmul`` (cuBLAS);
3. ``fastwan::vsa_topk_tables``: one kernel per (batch, head, query tile) row of scores selects the ``k`` best
   key tiles (descending score, ties to the lower tile index) and writes the FA4 tables directly.

Measured on an H200 (Triton 3.6, CUDA-graph replay, select() + FA4 tables, bf16 q/k/v): 0.110 ms instead of
0.154 ms for the 1.3B 480p call (12 heads, 273 tiles, k = 41), 0.91 instead of 1.42 ms for 14B 720p (40 heads,
630 tiles, k = 95); host time per eager call 171 instead of 273 us.

Each op runs its kernel where :func:`fastwan.kernels.triton_runs` holds for its inputs (:func:`pool_usable`,
:func:`tables_usable`: dtypes, at most :data:`N_MAX` tiles per row of scores, no autograd) and its PyTorch
reference elsewhere (:func:`pool_reference`, :func:`topk_tables_reference`); :func:`pool_triton` and
:func:`topk_tables_triton` are the kernel routes themselves (the tests run them on the CPU under
``TRITON_INTERPRET=1``).

Top-k design: a row of ``n`` fp32 scores is loaded padded to ``NP2 = next_pow2(n)``; each score is mapped to an
int32 whose signed order is the float order (negative floats get their magnitude bits flipped; -0.0 is made
+0.0 and every NaN one positive NaN, which ranks first as in ``torch.topk``), padding gets int32's minimum, and
``key << 32 | (NP2 - 1 - index)`` packs key and index into one int64 so that a descending sort of the packed
values is a descending sort by score with ties to the lower index. ``tl.topk`` (bitonic, registers only) keeps
the best ``next_pow2(k)``, sorted; the first ``k`` are the selection. The full / partial partition is a prefix
sum over the selection's "partial tile" flags: a tile's position in the full-first list is its rank among
the full tiles (or the full count plus its rank among the partial ones), likewise for the partial-first list;
both are written by scattered stores.
"""
from __future__ import annotations

import functools

import torch

from fastwan.kernels.tables import split_selected
from fastwan.kernels import triton_runs

# Longest row (key tiles) the top-k kernel takes; longer rows use torch.topk + split_selected. The kernel is
# correct up to 4,096 (checked on an H200) but slower than torch.topk past ~1,024: 0.28 ms for 2,000 rows of
# 1,500 tiles (torch.topk alone 0.13 ms). Wan's "auto" tiles give 273 (480p 1.3B) and 630 (720p 14B) tiles;
# 4x4x4 tiles at 720p give 1,440 (PyTorch path).
N_MAX = 1024
POOL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SCORE_DTYPES = (torch.float32,)


def pool_usable(*tensors: torch.Tensor | None) -> bool:
    """Whether :func:`pool_tiles` runs its kernel for these [B, P, H, D] inputs (q, k and v or None):
    :func:`~fastwan.kernels.triton_runs` in ``POOL_DTYPES``, one dtype, and no autograd (the ops have no backward;
    a call that needs gradients keeps the PyTorch path)."""
    given = [t for t in tensors if t is not None]
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in given)
    return triton_runs(*given, dtypes=POOL_DTYPES) and len({t.dtype for t in given}) == 1 and not grad


def tables_usable(scores: torch.Tensor) -> bool:
    """Whether :func:`topk_tables` runs its kernel for ``scores`` [B, H, n, n]: fp32 rows of at most ``N_MAX``."""
    return triton_runs(scores, dtypes=SCORE_DTYPES, max_last_dim=N_MAX)


# ---------------------------------------------------------------------------------------------- reference
def pool_reference(x: torch.Tensor, key_valid: torch.Tensor, counts: torch.Tensor, block_size: int,
                   tile_tokens: int, prefix: bool) -> torch.Tensor:
    """Mean over each tile's real tokens: x [B, P, H, D] (layout order, P = n * block_size) -> fp32 [B, n, H, D].

    The sum is accumulated in fp32 and rounded once, as the pooling kernel does (bf16 / fp16 callers round the
    means to their dtype next: a sum rounded to bf16 first would shift some means by one unit and the top-k with
    them). ``prefix``: every tile's real tokens are its first ``tile_tokens`` slots (a sum over them); otherwise
    the dummy slots are replaced by zeros first (whatever they hold, inf and nan included). ``counts``: real
    tokens per tile [n].
    """
    B, _, H, D = x.shape
    n = counts.numel()
    xs = x.reshape(B, n, block_size, H * D)
    if prefix:
        summed = xs[:, :, :tile_tokens].sum(2, dtype=torch.float32)
    else:
        real = key_valid.view(1, n, block_size, 1)
        summed = torch.where(real, xs, xs.new_zeros(())).sum(2, dtype=torch.float32)
    return (summed / counts.to(torch.float32)[None, :, None]).view(B, n, H, D)


def topk_tables_reference(scores: torch.Tensor, tile_full: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """The kernel's contract in PyTorch: a stable descending sort (ties to the lower index), the first ``k``,
    then :func:`~fastwan.kernels.tables.split_selected`."""
    selected = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    return split_selected(selected, tile_full)


# ---------------------------------------------------------------------------------------------- kernels
@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def pool_tiles_kernel(Q, q_sb, q_sp, q_sh, q_sd, K, k_sb, k_sp, k_sh, k_sd, V, v_sb, v_sp, v_sh, v_sd,
                          VALID, COUNTS, OUT_Q, OUT_K, OUT_V, H, n_tiles, BLOCK: tl.constexpr,
                          TILE_TOKENS: tl.constexpr, D: tl.constexpr, HAS_V: tl.constexpr, PREFIX: tl.constexpr,
                          BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
        # one program: one tile of one batch element, BLOCK_C channels (c = h * D + d) of q, k (and v), fp32
        # sums over the tile's real slots; OUT_* are contiguous fp32 [B, H, n_tiles, D]
        t = tl.program_id(0).to(tl.int64)
        b = tl.program_id(1).to(tl.int64)
        c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = c < H * D
        h = c // D
        d = c - h * D
        q_ptr = Q + b * q_sb + (h.to(tl.int64) * q_sh + d.to(tl.int64) * q_sd)[None, :]
        k_ptr = K + b * k_sb + (h.to(tl.int64) * k_sh + d.to(tl.int64) * k_sd)[None, :]
        v_ptr = V + b * v_sb + (h.to(tl.int64) * v_sh + d.to(tl.int64) * v_sd)[None, :]
        acc_q = tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.float32)
        acc_k = tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.float32)
        acc_v = tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.float32)
        for r0 in range(0, TILE_TOKENS, BLOCK_S):  # real slots are always among a tile's first TILE_TOKENS
            r = r0 + tl.arange(0, BLOCK_S)
            slot = t * BLOCK + r
            rmask = r < TILE_TOKENS
            if not PREFIX:
                rmask = rmask & (tl.load(VALID + slot, mask=rmask, other=0) != 0)
            m = rmask[:, None] & cmask[None, :]
            acc_q += tl.load(q_ptr + (slot * q_sp)[:, None], mask=m, other=0.0).to(tl.float32)
            acc_k += tl.load(k_ptr + (slot * k_sp)[:, None], mask=m, other=0.0).to(tl.float32)
            if HAS_V:
                acc_v += tl.load(v_ptr + (slot * v_sp)[:, None], mask=m, other=0.0).to(tl.float32)
        cnt = tl.load(COUNTS + t).to(tl.float32)
        out = ((b * H + h) * n_tiles + t) * D + d
        tl.store(OUT_Q + out, tl.sum(acc_q, axis=0) / cnt, mask=cmask)
        tl.store(OUT_K + out, tl.sum(acc_k, axis=0) / cnt, mask=cmask)
        if HAS_V:
            tl.store(OUT_V + out, tl.sum(acc_v, axis=0) / cnt, mask=cmask)

    @triton.jit
    def topk_tables_kernel(S, FULL, FN, FI, PN, PI, n_rows, n, k, ROWS: tl.constexpr, NP2: tl.constexpr,
                           KP2: tl.constexpr):
        # one program: ROWS rows of scores (n key tiles each) -> their k selected tiles, split full / partial
        r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        rmask = r < n_rows
        col = tl.arange(0, NP2)
        inside = col < n
        x = tl.load(S + r[:, None] * n + col[None, :], mask=rmask[:, None] & inside[None, :], other=0.0)
        x = tl.where(x == 0.0, 0.0, x)  # -0.0 ties with +0.0
        x = tl.where(x == x, x, float("nan"))  # one NaN, positive: above +inf, like torch.topk
        bits = x.to(tl.int32, bitcast=True)
        key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed-int order == float order
        pad = tl.full([ROWS, NP2], 1, tl.int32) << 31  # int32 min: below every real score
        key = tl.where(inside[None, :], key, pad)
        packed = (key.to(tl.int64) << 32) | (NP2 - 1 - col).to(tl.int64)[None, :]
        top = tl.topk(packed, KP2)  # [ROWS, KP2], descending along each row
        j = tl.arange(0, KP2)[None, :]
        sel = (j < k) & rmask[:, None]
        idx = (NP2 - 1) - top.to(tl.int32)  # the low word holds NP2 - 1 - index
        full = tl.load(FULL + idx, mask=sel, other=1)
        is_p = tl.where(sel & (full == 0), 1, 0)
        rank_p = tl.cumsum(is_p, axis=1) - is_p  # partial tiles before position j
        rank_f = j - rank_p  # full tiles before position j (j < k)
        n_p = tl.sum(is_p, axis=1)
        n_f = k - n_p
        pos_f = tl.where(is_p != 0, n_f[:, None] + rank_p, rank_f)
        pos_p = tl.where(is_p != 0, rank_p, n_p[:, None] + rank_f)
        out = r[:, None] * k
        tl.store(FI + out + pos_f, idx, mask=sel)
        tl.store(PI + out + pos_p, idx, mask=sel)
        tl.store(FN + r, n_f, mask=rmask)
        tl.store(PN + r, n_p, mask=rmask)

    return pool_tiles_kernel, topk_tables_kernel


# Launch configurations measured on an H200 (Triton 3.6, CUDA-graph replay): pooling q and k of the 1.3B 480p call
# (2 x 107 MB bf16) takes ~71 us (~3 TB/s, as fast as PyTorch's two strided sums) with 4 x 256 blocks and 2 warps,
# ~395 us at 720p 14B (4.2 TB/s); wider programs (32 x 128, 4-8 warps) were up to 1.5x slower. The top-k kernel
# is fastest with one warp per row up to 1,024 tiles (16-32 packed keys per thread; more warps exchange through
# shared memory): 22 us for 3,276 rows of 273 tiles (torch.topk alone: 52 us), 402 us for 25,200 rows of 630
# (torch.topk 628 us + split_selected 189 us); 2-4 warps per row were 2-3x slower.
def pool_triton(q, k, v, key_valid, counts, block_size, tile_tokens, prefix) -> torch.Tensor:
    """``fastwan::vsa_pool``'s kernel route."""
    import triton

    kernel = _kernels()[0]
    B, _, H, D = q.shape
    n = counts.numel()
    ins = [q, k] + ([v] if v is not None else [])
    out = torch.empty((len(ins), B, H, n, D), dtype=torch.float32, device=q.device)
    block_c = min(256, triton.next_power_of_2(H * D))
    args = []
    for t in (q, k, v if v is not None else q):
        args += [t, t.stride(0), t.stride(1), t.stride(2), t.stride(3)]
    kernel[(n, B, triton.cdiv(H * D, block_c))](
        *args, key_valid.view(torch.uint8), counts, out[0], out[1], out[-1], H, n,
        BLOCK=block_size, TILE_TOKENS=tile_tokens, D=D, HAS_V=v is not None, PREFIX=prefix, BLOCK_S=4,
        BLOCK_C=block_c, num_warps=2,
    )
    return out


def topk_tables_triton(scores, tile_full, k) -> tuple[torch.Tensor, ...]:
    """``fastwan::vsa_topk_tables``'s kernel route."""
    import triton

    kernel = _kernels()[1]
    scores = scores.contiguous()
    n = scores.shape[-1]
    rows = scores.shape[:-1]
    np2 = max(2, triton.next_power_of_2(n))
    kp2 = max(2, triton.next_power_of_2(k))  # Triton 3.6's tl.topk cannot keep 1 (it reshapes a scalar)
    full_num = torch.empty(rows, dtype=torch.int32, device=scores.device)
    partial_num = torch.empty_like(full_num)
    full_idx = torch.empty(rows + (k,), dtype=torch.int32, device=scores.device)
    partial_idx = torch.empty_like(full_idx)
    n_rows = full_num.numel()
    rows_per = max(1, 512 // np2)  # short rows: several per program
    if n_rows:
        kernel[(triton.cdiv(n_rows, rows_per),)](
            scores, tile_full.view(torch.uint8), full_num, full_idx, partial_num, partial_idx, n_rows, n, k,
            ROWS=rows_per, NP2=np2, KP2=kp2, num_warps=max(1, np2 // 1024),
        )
    return full_num, full_idx, partial_num, partial_idx


# ---------------------------------------------------------------------------------------------- ops
def _vsa_pool(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, key_valid: torch.Tensor,
             counts: torch.Tensor, block_size: int, tile_tokens: int, prefix: bool) -> torch.Tensor:
    """Per-tile means of q, k (and v): [B, P, H, D] each (any strides, P = n * block_size) -> fp32
    [T, B, H, n, D] (T = 2, or 3 with v; head-major, ready for the per-head score matmul).

    ``key_valid`` bool [P] marks the real slots, ``counts`` long [n] the real tokens per tile; ``prefix``: the
    real tokens of every tile are its first ``tile_tokens`` slots (the layout's ``real_prefix_tiles``).
    """
    B, P, H, D = q.shape
    n = counts.numel()
    if P != n * block_size or key_valid.numel() != P or k.shape != q.shape or (v is not None and v.shape != q.shape):
        raise ValueError(f"vsa_pool: q {tuple(q.shape)}, k {tuple(k.shape)}, v "
                         f"{None if v is None else tuple(v.shape)} do not fit {n} tiles of {block_size} slots")
    if triton_runs(q, k, v, dtypes=POOL_DTYPES) and k.dtype == q.dtype and (v is None or v.dtype == q.dtype):
        return pool_triton(q, k, v, key_valid, counts, block_size, tile_tokens, prefix)
    ins = [q, k] + ([v] if v is not None else [])
    return torch.stack([pool_reference(t, key_valid, counts, block_size, tile_tokens, prefix).transpose(1, 2)
                        for t in ins])


vsa_pool = torch.library.custom_op("fastwan::vsa_pool", _vsa_pool, mutates_args=())


@vsa_pool.register_fake
def _(q, k, v, key_valid, counts, block_size, tile_tokens, prefix):
    B, _, H, D = q.shape
    return q.new_empty((2 if v is None else 3, B, H, counts.shape[0], D), dtype=torch.float32)


def _vsa_topk_tables(scores: torch.Tensor, tile_full: torch.Tensor, k: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k key tiles of every row of ``scores`` fp32 [B, H, nQ, n] -> FA4 tables (full_num int32 [B, H, nQ],
    full_idx int32 [B, H, nQ, k], partial_num, partial_idx likewise); VSA has nQ = n query tiles.

    Same contract as ``split_selected(top-k indices, tile_full)``: ``full_idx`` lists the selected full tiles
    (``tile_full`` bool [n], no dummy slot) first, then the partial ones; ``partial_idx`` the partial ones
    first, then the full ones; within each kind in descending score order, ties to the lower tile index.
    """
    n = scores.shape[-1]
    if scores.dim() != 4 or tile_full.numel() != n or not 1 <= k <= n:
        raise ValueError(f"vsa_topk_tables: scores {tuple(scores.shape)}, {tile_full.numel()} tiles, k={k}")
    if tables_usable(scores):
        return topk_tables_triton(scores, tile_full, k)
    return tuple(t.contiguous() for t in topk_tables_reference(scores, tile_full, k))


vsa_topk_tables = torch.library.custom_op("fastwan::vsa_topk_tables", _vsa_topk_tables, mutates_args=())


@vsa_topk_tables.register_fake
def _(scores, tile_full, k):
    rows = scores.shape[:-1]
    num = scores.new_empty(rows, dtype=torch.int32)
    idx = scores.new_empty(tuple(rows) + (k,), dtype=torch.int32)
    return num, idx, torch.empty_like(num), torch.empty_like(idx)


# ---------------------------------------------------------------------------------------------- wrappers
# Eager calls (VSA's attention call is a graph break) run the ops' Python bodies directly: the custom-op
# dispatch costs more host time than the launch itself; under torch.compile they go through the ops.
def pool_tiles(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, layout) -> tuple[torch.Tensor, ...]:
    """Tile means of q, k (and v) on a TokenLayout: [B, P, H, D] each -> (fp32 [B, n_tiles, H, D], ...).

    The semantics of :func:`fastwan.attention.sparse.vsa.tile_pool` (mean over each tile's real tokens) in one
    launch on CUDA. The results are transposed views of head-major storage: ``.transpose(1, 2)`` of each is a
    contiguous [B, H, n_tiles, D].
    """
    op = torch.ops.fastwan.vsa_pool if torch.compiler.is_compiling() else _vsa_pool
    out = op(q, k, v, layout.key_valid, layout.tile_valid_counts, layout.block_size, layout.tile_tokens,
             bool(layout.real_prefix_tiles))
    return tuple(o.transpose(1, 2) for o in out.unbind(0))


def topk_tables(scores: torch.Tensor, k: int, layout) -> tuple[torch.Tensor, ...]:
    """scores fp32 [B, H, n, n] -> (full_num, full_idx, partial_num, partial_idx) for the layout's tiles (see
    ``fastwan::vsa_topk_tables``); the tables :class:`~fastwan.attention.sparse.plan.BlockPlan` takes as
    ``tables=``."""
    op = torch.ops.fastwan.vsa_topk_tables if torch.compiler.is_compiling() else _vsa_topk_tables
    return op(scores, layout.tile_full, k)


__all__ = ["N_MAX", "pool_reference", "pool_tiles", "pool_triton", "pool_usable", "tables_usable", "topk_tables",
           "topk_tables_reference", "topk_tables_triton"]
