"""Lazy access to external attention kernels (FlashAttention 2/3/4, SageAttention, NVFP4 FA4).

Nothing here imports an external package at ``import fastwan`` time: presence is checked with
``importlib`` specs / distribution metadata, and the packages are imported on the first kernel call.
Every loader returns ``fn(q, k, v, scale) -> out or (out, ...)`` on ``[B, S, H, D]`` tensors.
The custom ops in :mod:`fastwan.attention.backends.ops` call these loaders; tests may monkeypatch them.
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import threading
from collections.abc import Callable

import torch

from fastwan.attention.backends import fa4_plan

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
            with fa4_lock():
                if tile_m:
                    return fa4_plan.fa4_sm90_tiled(q, k, v, scale, tile_m, out=out)
                return fa4(q, k, v, softmax_scale=scale, causal=False)
    else:
        raise ValueError(f"FlashAttention version {version!r} is not 2, 3 or 4.")
    return run


@functools.cache
def fa4_lock() -> threading.Lock:
    """Held around every FA4 call of this process. Rule: one thread at a time enters flash_attn.cute: its
    CuTe DSL compiles a kernel on a shape's first call, and two threads compiling at once abort the process (the
    server's workers, one per GPU, do that on their first jobs). A call only launches the kernel (the GPU runs it
    after the lock is released), so the lock costs the launch's host time, not the kernel's."""
    return threading.Lock()


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
    """[B, S, H, D] bf16 -> (float4_e2m1fn_x2 [B, S, H, D/2], MMA-layout scale factors). The layout follows
    NVIDIA's 128x4 scale atom; fastwan has not run it on an sm100 GPU (unverified on hardware)."""
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
        with fa4_lock():
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
