"""FlexAttention (``torch.nn.attention.flex_attention``) as the block-sparse kernel of the sparse backends.

A :class:`~fastwan.attention.sparse.plan.BlockPlan`'s compact tables become a ``BlockMask`` through
``BlockMask.from_kv_blocks`` (partial blocks -> ``kv_*``, full blocks -> ``full_kv_*``). Two modes:

* compiled (CUDA): :func:`compiled_flex` runs; its ``mask_mod`` is only evaluated inside partial blocks, so it
  only encodes what the block tables cannot (dummy key slots, NA token neighborhoods): :func:`key_mask_mod`;
* eager (CPU): inductor does not compile these block-sparse masks on CPU (torch 2.13 rejects the tables), and
  eager flex ignores the block tables and evaluates ``mask_mod`` everywhere, so the ``mask_mod`` there encodes
  the complete pattern (``BlockPlan.exact_mask_mod``).

Kernel inputs and outputs are [B, S, H, D] (layout order).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator

import torch

from fastwan.attention.sparse.layout import TokenLayout

# Compilations the compiled flex function may keep (one per static shape: grid, batch, heads, kv-index width).
# The sparse backends need a few per grid; dynamo's default limit of 8 per function is reached by a process
# serving several grids, and past it dynamo silently runs the unfused eager kernel instead.
FLEX_RECOMPILE_LIMIT = 64


@functools.lru_cache(maxsize=1)
def _flex_module():
    try:
        from torch.nn.attention import flex_attention as fa
    except ImportError as exc:  # torch < 2.5
        raise RuntimeError(
            f"torch {torch.__version__} has no torch.nn.attention.flex_attention (needs torch >= 2.5): {exc}"
        ) from None
    return fa


@functools.cache
def compiled_flex(backend: str = "inductor") -> Callable:
    """``torch.compile(flex_attention, dynamic=False, backend=backend)``, one per backend and process.

    Each new static shape compiles once, up to :data:`FLEX_RECOMPILE_LIMIT` compilations for this function
    alone: through ``torch.compile(recompile_limit=..., isolate_recompiles=True)`` where torch takes them, else
    by raising dynamo's limit around each call (:func:`recompile_limit_at_least`). No process-wide setting
    changes.
    """
    fn = _flex_module().flex_attention
    params = inspect.signature(torch.compile).parameters
    if "recompile_limit" in params:
        isolate = {"isolate_recompiles": True} if "isolate_recompiles" in params else {}
        return torch.compile(fn, dynamic=False, backend=backend, recompile_limit=FLEX_RECOMPILE_LIMIT, **isolate)
    compiled = torch.compile(fn, dynamic=False, backend=backend)

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with recompile_limit_at_least(FLEX_RECOMPILE_LIMIT):
            return compiled(*args, **kwargs)

    return run


@contextlib.contextmanager
def recompile_limit_at_least(limit: int) -> Iterator[None]:
    """Dynamo's per-function recompile limit is at least ``limit`` inside the block and restored on exit.

    For calls made outside a compiled region (the sparse backends run there: the dispatch keeps them out of
    torch.compile graphs); inside one the block changes nothing.
    """
    import torch._dynamo.config as dcfg

    name = "recompile_limit" if hasattr(dcfg, "recompile_limit") else "cache_size_limit"
    if torch.compiler.is_compiling() or getattr(dcfg, name) >= limit:
        yield
        return
    with dcfg.patch(**{name: limit}):
        yield


def default_kernel_options(block_size: int) -> dict | None:
    """Flex kernel tiles must divide the sparse block: 128-multiples keep the defaults, else smaller tiles."""
    if block_size % 128 == 0:
        return None
    for b in (64, 32, 16):
        if block_size % b == 0:
            return {"BLOCK_M": b, "BLOCK_N": b}
    raise ValueError(f"block_size={block_size} is not a multiple of 16; the Flex kernel cannot tile it.")


def run_flex(q, k, v, block_mask, *, scale: float, compiled: bool, kernel_options: dict | None = None):
    """q, k, v: [B, S, H, D] -> [B, S, H, D] with a FlexAttention BlockMask."""
    fn = compiled_flex() if compiled else _flex_module().flex_attention
    kwargs = {"block_mask": block_mask, "scale": scale}
    if kernel_options:
        kwargs["kernel_options"] = kernel_options
    out = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kwargs)
    return out.transpose(1, 2)


@functools.lru_cache(maxsize=1)
def _from_kv_blocks_params() -> frozenset:
    return frozenset(inspect.signature(_flex_module().BlockMask.from_kv_blocks).parameters)


def block_mask_from_tables(layout: TokenLayout, full_num, full_idx, part_num, part_idx, mask_mod, q_blocks: bool):
    """A ``BlockMask`` over ``layout`` from compact tables (count int32 [Bm, Hm, nQ], indices [Bm, Hm, nQ, W]).

    ``q_blocks`` also builds the transposed (q-major) tables that the backward pass needs."""
    params = _from_kv_blocks_params()
    kwargs = {}
    if "seq_lengths" in params:
        kwargs["seq_lengths"] = (layout.padded_tokens, layout.padded_tokens)
    if "compute_q_blocks" in params:
        kwargs["compute_q_blocks"] = q_blocks
    return _flex_module().BlockMask.from_kv_blocks(
        part_num, part_idx, full_num, full_idx, BLOCK_SIZE=layout.block_size, mask_mod=mask_mod, **kwargs
    )


def key_mask_mod(layout: TokenLayout, token_pred=None, name: str = "keys"):
    """The mask_mod for partial blocks on the compiled path, cached on the layout (one object per layout and
    ``name``, so compiled flex sees the same function on every call)."""
    cache = layout.__dict__.setdefault("_mask_mods", {})
    if name not in cache:
        valid = layout.key_valid
        if token_pred is None:
            def mask_mod(b, h, q_idx, kv_idx):
                return valid[kv_idx]
        else:
            def mask_mod(b, h, q_idx, kv_idx):
                return valid[kv_idx] & token_pred(q_idx, kv_idx)
        cache[name] = mask_mod
    return cache[name]
