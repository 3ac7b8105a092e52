"""Lazy access to external attention kernels (FlashAttention 2/3/4, SageAttention, NVFP4 FA4).

Nothing here imports an external package at ``import fastwan`` time: presence is checked with
``importlib`` specs / distribution metadata, and the packages are imported on the first kernel call.
Every loader returns ``fn(q, k, v, scale) -> out or (out, ...)`` on ``[B, S, H, D]`` tensors.
The custom ops in :mod:`fastwan.kernels.attention` call these loaders; tests may monkeypatch them.
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import os
from collections.abc import Callable

import torch

KernelFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def _spec(name: str):
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None


def dist_version(*names: str) -> str | None:
    """Installed version of the first distribution found among ``names`` (no import), else None."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


# ---- FlashAttention ------------------------------------------------------------------------------------

def flash_installed(version: int) -> bool:
    """Whether FlashAttention ``version`` (2, 3 or 4) is installed, checked without importing it."""
    if version == 2:  # the FA2 wheel ships the flash_attn package plus its compiled flash_attn_2_cuda
        return _spec("flash_attn_2_cuda") is not None
    if version == 3:  # built from the hopper/ directory: a top-level flash_attn_interface module
        return _spec("flash_attn_interface") is not None
    if version == 4:  # flash-attn-4 installs flash_attn/cute (flash_attn may be a namespace package)
        if dist_version("flash-attn-4", "flash_attn_4") is not None:
            return True
        spec = _spec("flash_attn")
        locations = list(spec.submodule_search_locations or []) if spec else []
        return any(os.path.isfile(os.path.join(p, "cute", "interface.py")) for p in locations)
    raise ValueError(f"FlashAttention version {version!r} is not 2, 3 or 4.")


def flash_package_version(version: int) -> str | None:
    names = {2: ("flash-attn", "flash_attn"), 3: ("flash_attn_3", "flash-attn-3"), 4: ("flash-attn-4",)}[version]
    return dist_version(*names)


@functools.cache
def flash_kernel(version: int) -> KernelFn:
    """``fn(q, k, v, scale)`` for FlashAttention ``version``; imports the package on first use. Depending on
    the release the result is ``out`` or ``(out, lse, ...)``; the custom op keeps ``out``."""
    if version == 2:
        from flash_attn import flash_attn_func as fa2

        def run(q, k, v, scale):
            return fa2(q, k, v, dropout_p=0.0, softmax_scale=scale, causal=False)
    elif version == 3:
        from flash_attn_interface import flash_attn_func as fa3

        def run(q, k, v, scale):
            return fa3(q, k, v, softmax_scale=scale, causal=False)
    elif version == 4:
        from flash_attn.cute import flash_attn_func as fa4

        def run(q, k, v, scale, tile_m=0, out=None):
            if tile_m:
                return fa4_sm90_tiled(q, k, v, scale, tile_m, out=out)
            return fa4(q, k, v, softmax_scale=scale, causal=False)
    else:
        raise ValueError(f"FlashAttention version {version!r} is not 2, 3 or 4.")
    return run


# FA4's sm90 forward tiles for head dim 128: tile_m -> (tile_m, tile_n, mma_pv_is_rs, intra_wg_overlap).
# flash_attn.cute's own choice is 128 x 128 (two consumer warpgroups, P in registers). 192 x 128 (three consumer
# warpgroups of 64 rows, P through shared memory) costs ~2.6% less per query row at the Wan shapes
# (benchmarks/fa4_tiles.py, RESULTS.md section 8), but its 1.5x larger tiles leave a different last wave.
FA4_SM90_TILES: dict[int, tuple[int, int, bool, bool]] = {128: (128, 128, True, True), 192: (192, 128, False, True)}
FA4_SM90_ROW_COST: dict[int, float] = {128: 1.0, 192: 0.974}  # per query row, relative, measured on an H100
FA4_SM90_MIN_GAIN = 0.01  # switch away from FA4's default only for a modelled gain above run-to-run noise


def fa4_sm90_tile_m(batch: int, seqlen_q: int, heads: int, num_sms: int) -> int:
    """The sm90 tile_m (128 or 192) for a ``[batch, seqlen_q, heads, 128]`` query.

    FA4's sm90 forward runs one CTA per (query tile, head, batch) on one SM at a time, so its time is about
    ``ceil(tiles / num_sms) * tile_m * row_cost``: whole waves times the per-tile time. 192 is picked when that
    model puts it at least ``FA4_SM90_MIN_GAIN`` below 128 (e.g. B=1 at both Wan grids); otherwise FA4's
    default 128 stays (e.g. the 1.3B model's batched-CFG shape, B=2 x 32,760 tokens x 12 heads, where the
    model gives 0.5% and measurements scatter around zero).
    """
    def cost(tm: int) -> float:  # plain arithmetic: torch.compile traces it into a constant
        tiles = batch * heads * -(-seqlen_q // tm)
        return -(-tiles // num_sms) * tm * FA4_SM90_ROW_COST[tm]

    return 192 if cost(192) < cost(128) * (1.0 - FA4_SM90_MIN_GAIN) else 128


# fa4_sm90_plan: the fixed cost of one more kernel launch (launch gap, ramp-up), as query rows x keys of one tile
# stream at FA4's sm90 rate (~0.1 ns each on an H100: ~5 us). It keeps short-key calls (cross-attention) in one
# launch, where a split's modelled gain is a few microseconds.
FA4_SM90_LAUNCH_ROW_KEYS = 50_000


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
    shape (the op calls it at run time: ``fastwan::flash_attn`` with ``split=-1``).
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


def import_error(loader: Callable[[], KernelFn]) -> str | None:
    """Why ``loader()`` (e.g. ``lambda: flash_kernel(3)``) fails to import its package, or None if it loads."""
    try:
        loader()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


@functools.cache
def flash_import_error(version: int) -> str | None:
    return import_error(lambda: flash_kernel(version))


@functools.cache
def sage_import_error() -> str | None:
    return import_error(sage_kernel)


def fa4_accepts_nvfp4() -> tuple[bool, str]:
    """Whether the installed ``flash_attn.cute.flash_attn_func`` takes NVFP4 Q/K (scale-factor arguments
    ``mSFQ``/``mSFK``, as in the FP4 branch of flash-attention). Imports flash_attn.cute; call it only on a
    device where the kernel could run. Returns (ok, detail)."""
    if not flash_installed(4):
        return False, "flash_attn.cute is not installed"
    if not hasattr(torch, "float4_e2m1fn_x2"):
        return False, f"torch {torch.__version__} has no torch.float4_e2m1fn_x2 dtype"
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as exc:  # report why, do not guess
        return False, f"import flash_attn.cute failed: {type(exc).__name__}: {exc}"
    params = inspect.signature(flash_attn_func).parameters
    missing = [p for p in ("mSFQ", "mSFK") if p not in params]
    if missing:
        return False, f"flash_attn.cute.flash_attn_func has no {'/'.join(missing)} parameter (no NVFP4 Q/K)"
    return True, "flash_attn.cute with NVFP4 Q/K"


def _nvfp4_for_fa4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, S, H, D] bf16 -> (float4_e2m1fn_x2 [B, S, H, D/2], MMA-layout scale factors). Unverified on
    hardware (no sm100 GPU was available to this project): layout follows NVIDIA's 128x4 scale atom."""
    from fastwan.kernels import fp4

    b, s, h, d = x.shape
    sp = -(-s // 128) * 128
    if sp != s:
        x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, sp - s))
    codes, scales = fp4.nvfp4_quantize(x, None, check_finite=False)
    packed = fp4.nvfp4_pack(codes)[:, :s].contiguous().view(torch.float4_e2m1fn_x2)
    return packed, fp4.nvfp4_scales_to_mma_layout(scales.view(torch.uint8))


@functools.cache
def nvfp4_flash_kernel() -> KernelFn:
    """FA4 with NVFP4 Q/K (E2M1 values, E4M3 scale per 16 elements along D) and bf16 V. sm100/sm103 only."""
    ok, detail = fa4_accepts_nvfp4()
    if not ok:
        raise RuntimeError(f"NVFP4 FlashAttention is not available: {detail}.")
    from flash_attn.cute import flash_attn_func

    def run(q, k, v, scale):
        q4, sfq = _nvfp4_for_fa4(q)
        k4, sfk = _nvfp4_for_fa4(k)
        return flash_attn_func(q4, k4, v, softmax_scale=scale, causal=False, mSFQ=sfq, mSFK=sfk)

    return run


# ---- SageAttention -------------------------------------------------------------------------------------

def sage_installed() -> bool:
    return _spec("sageattention") is not None


def sage_package_version() -> str | None:
    return dist_version("sageattention")


def sage_major() -> int | None:
    """1 for the Triton-only 1.x releases, 2 for 2.x (CUDA kernels), None if not installed."""
    if not sage_installed():
        return None
    v = sage_package_version()
    if v:
        return int(v.split(".")[0])
    spec = _spec("sageattention")  # source checkout without metadata: 2.x ships compiled _qattn_* modules
    for p in spec.submodule_search_locations or []:
        if any(f.startswith("_qattn") for f in os.listdir(p)):
            return 2
    return 1


@functools.cache
def sage_kernel() -> KernelFn:
    """``sageattn`` with layout NHD. K is mean-smoothed here, out of place: sageattention 1.x smooths K in
    place (``k -= mean``), which would silently modify the caller's tensor."""
    from sageattention import sageattn

    major = sage_major()

    def run(q, k, v, scale):
        if major == 1:
            k = k - k.mean(dim=1, keepdim=True)  # exact: a per-query constant shift of the logits
            return sageattn(q, k, v, tensor_layout="NHD", is_causal=False, sm_scale=scale, smooth_k=False)
        return sageattn(q, k, v, tensor_layout="NHD", is_causal=False, sm_scale=scale)

    return run
