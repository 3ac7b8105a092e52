"""Shared machinery of the sparse video backends: layouts, kernel choice, call checks, plan execution."""
from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from fastwan.errors import InvalidArgument
from fastwan.attention.base import AttentionBackend, AttentionMetadata, Capabilities, check_qkv, reasons_cannot_run
from fastwan.attention.sparse.layout import TokenLayout, choose_tile, default_block_size
from fastwan.attention.sparse import config as cfg
from fastwan.attention.sparse import fa4, flex, masks
from fastwan.attention.sparse.plan import BlockPlan, PlanCache

_KERNEL_NAMES = {
    "flex-compiled": "flex_attention (torch.compile, block-sparse BlockMask)",
    "flex-eager": "flex_attention (eager: unfused, materialises the scores)",
    "sdpa": "sdpa + boolean token mask (dense reference)",
    "fa4": "flash_attn.cute block-sparse (FA4)",
}

# What compiled flex_attention (kernel "auto" or "flex" on CUDA) needs.
COMPILED_FLEX_CAPABILITIES = Capabilities(
    device_types=("cuda",), packages=(("triton", "compiled flex_attention on CUDA: pip install triton"),)
)


def _device_key(device: torch.device | str) -> torch.device:
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


class SparseVideoBackend(AttentionBackend):
    """Base of STA / NA / VSA. Subclasses implement :meth:`plan` (or override :meth:`forward`).

    Common config keys: ``tile`` ([t, h, w] tokens, clamped per dimension to the grid; or "auto" where
    allowed), ``block_size`` (slots per tile; default: the clamped tile's tokens rounded up to a multiple of
    64, 128 for "auto"), ``dense_steps`` (the first
    denoising steps use full attention), ``kernel`` (auto | flex | sdpa | fa4) and ``kernel_options`` (extra
    FlexAttention kernel options, e.g. {"num_stages": 2}).
    """

    sparse: ClassVar[bool] = True
    capabilities: ClassVar[Capabilities] = Capabilities(supports_cross_attention=False)
    allow_auto_tile: ClassVar[bool] = True
    COMMON_KEYS: ClassVar[tuple[str, ...]] = ("tile", "block_size", "dense_steps", "kernel", "kernel_options")

    def __init__(self, *, tile, block_size, dense_steps, kernel, kernel_options):
        self.tile = cfg.tile_option(tile, allow_auto=self.allow_auto_tile)
        self.block_size = cfg.block_size_option(block_size)
        if self.block_size is not None and self.tile != "auto" and self.block_size < _prod(self.tile):
            raise InvalidArgument(
                f"block_size={self.block_size} is smaller than the tile {list(self.tile)} "
                f"({_prod(self.tile)} tokens); use block_size >= {_prod(self.tile)} or leave it unset."
            )
        self.dense_steps = cfg.dense_steps_option(dense_steps)
        self.kernel = cfg.kernel_option(kernel)
        self.kernel_options = cfg.kernel_options_option(kernel_options)
        self._layouts: dict = {}
        self._plans = PlanCache(64)

    # ------------------------------------------------------------------ layout
    def tile_for(self, grid) -> tuple[int, int, int]:
        """The tile used on ``grid``: an explicit tile clamped per dimension to the grid. A tile entry >= the
        grid size already covers that whole dimension with one tile, so clamping keeps the tile grid (STA
        windows, VSA tiles and their pooling are unchanged) and only drops the dummy slots past the grid."""
        if self.tile == "auto":
            return choose_tile(grid, self.block_size or 128)
        return tuple(min(t, g) for t, g in zip(self.tile, grid))

    def layout(self, grid, device: torch.device | str) -> TokenLayout:
        """The TokenLayout for ``grid`` on ``device`` (built once, cached)."""
        grid = cfg.triple(tuple(grid) if not isinstance(grid, int) else grid, "grid")
        dev = _device_key(device)
        key = (grid, str(dev))
        if key not in self._layouts:
            tile = self.tile_for(grid)
            bs = self.block_size or (128 if self.tile == "auto" else default_block_size(tile))
            layout = TokenLayout(grid, tile, bs, dev)
            self.validate_grid(layout)  # a grid the config refuses is never cached: every call raises
            self._layouts[key] = layout
        return self._layouts[key]

    def validate_grid(self, layout: TokenLayout) -> None:
        """Subclass hook: grid-dependent config checks (raise ValueError)."""

    def check_model(self, num_heads: int, num_layers: int) -> None:
        """Subclass hook: config checks against a DiT's head and layer counts (raise before any compute)."""

    # ------------------------------------------------------------------ kernels
    def reasons(self, *, device, dtype, head_dim, seq_q=None, seq_kv=None):
        reasons = super().reasons(device=device, dtype=dtype, head_dim=head_dim, seq_q=seq_q, seq_kv=seq_kv)
        dev = torch.device(device)
        extra = []
        if self.kernel == "fa4":
            extra += [f"kernel 'fa4': {r}" for r in fa4.fa4_reasons(dev, dtype)]
            extra += [f"kernel 'fa4': {r}" for r in [fa4.head_dim_reason(dev, head_dim)] if r]
        if dev.type == "cuda" and self.kernel in ("auto", "flex"):
            extra += reasons_cannot_run(COMPILED_FLEX_CAPABILITIES, device=dev, dtype=dtype, head_dim=head_dim)
        return reasons + [r for r in dict.fromkeys(extra) if r not in reasons]

    def _fa4_ok(self, plan: BlockPlan | None, device, dtype, head_dim: int | None = None) -> bool:
        if plan is not None and ((plan.token_pred is not None and plan.fa4_mask is None)
                                 or plan.layout.block_size % fa4.fa4_block_multiple()):
            return False
        return not fa4.fa4_reasons(device, dtype) and fa4.head_dim_reason(device, head_dim) is None

    def resolve_kernel(self, device, dtype=torch.bfloat16, plan: BlockPlan | None = None,
                       head_dim: int | None = None) -> str:
        """The concrete kernel: 'flex-compiled' | 'flex-eager' | 'sdpa' | 'fa4' (automatic: FA4 where it runs the
        plan's block size and ``head_dim``)."""
        dev = torch.device(device)
        k = self.kernel
        if k == "auto":
            if dev.type != "cuda":
                return "sdpa"
            return "fa4" if self._fa4_ok(plan, dev, dtype, head_dim) else "flex-compiled"
        if k == "flex":
            return "flex-compiled" if dev.type == "cuda" else "flex-eager"
        if k == "fa4":
            reasons = fa4.fa4_reasons(dev, dtype)
            if reasons:
                raise RuntimeError(f"{self.name}: kernel='fa4' cannot run: " + "; ".join(reasons))
        return k

    def kernel_name(self, device=None) -> str:
        if device is None:
            return f"kernel={self.kernel}"
        dev = torch.device(device)
        if self.kernel == "auto" and dev.type == "cuda" and self._fa4_ok(None, dev, torch.bfloat16):
            return (f"{_KERNEL_NAMES['fa4']} for {fa4.fa4_block_multiple()}-slot tiles, else "
                    f"{_KERNEL_NAMES['flex-compiled']}")
        return _KERNEL_NAMES[self.resolve_kernel(dev)]

    def run_plan(self, plan: BlockPlan, q, k, v, scale: float | None) -> torch.Tensor:
        """q, k, v: [B, P, H, D] in layout order -> [B, P, H, D]."""
        B, _, H, D = q.shape
        if plan.batch not in (1, B) or plan.heads not in (1, H):
            raise ValueError(f"block plan for batch {plan.batch} / heads {plan.heads} used with "
                             f"batch {B} / heads {H}")
        scale = D ** -0.5 if scale is None else scale
        kind = self.resolve_kernel(q.device, q.dtype, plan, D)
        need = 16 if kind != "fa4" else fa4.fa4_block_multiple()
        if kind in ("flex-compiled", "fa4") and plan.layout.block_size % need:
            raise InvalidArgument(
                f"{self.name}: block_size={plan.layout.block_size} (tile {list(plan.layout.tile)}) is not a "
                f"multiple of {need}, which the {_KERNEL_NAMES[kind]} kernel needs; set block_size to a "
                f"multiple of {need} (>= the tile's {plan.layout.tile_tokens} tokens) or leave it unset."
            )
        if kind == "sdpa":
            mask = plan._cache.get("dense")
            if mask is None:
                mask = plan._cache["dense"] = plan.dense_mask()
            return run_sdpa_masked(q, k, v, mask, scale=scale)
        if kind == "fa4":
            return fa4.run_fa4(q, k, v, plan.fa4_tensors(), scale=scale)
        compiled = kind == "flex-compiled"
        grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        block_mask = plan.flex_block_mask(exact=not compiled, q_blocks=grad)
        options = None
        if compiled:
            options = dict(flex.default_kernel_options(plan.layout.block_size) or {})
            options.update(self.kernel_options or {})
        return flex.run_flex(q, k, v, block_mask, scale=scale, compiled=compiled, kernel_options=options)

    # ------------------------------------------------------------------ calls
    def check_call(self, q, k, v, meta: AttentionMetadata | None) -> TokenLayout:
        """Validate a self-attention call; returns the layout the tokens are in."""
        check_qkv(q, k, v)
        if meta is None or meta.grid is None:
            raise ValueError(
                f"{self.name} is a sparse video backend: call it with meta=AttentionMetadata(grid=(T, H, W), "
                "layout=backend.layout(grid, device), ...) and q/k/v permuted with layout.permute."
            )
        grid = tuple(int(g) for g in meta.grid)
        layout = meta.layout if meta.layout is not None else self.layout(grid, q.device)
        if tuple(layout.grid) != grid:
            raise ValueError(f"meta.grid {list(grid)} != layout grid {list(layout.grid)}")
        mine = self.layout(grid, q.device)
        if layout is not mine and (layout.tile != mine.tile or layout.block_size != mine.block_size):
            raise ValueError(
                f"{self.name}: the tokens were permuted with tile {list(layout.tile)} / block {layout.block_size} "
                f"but this backend uses tile {list(mine.tile)} / block {mine.block_size}; permute with "
                "backend.layout(grid, device)."
            )
        if q.shape[1] != layout.padded_tokens or k.shape[1] != layout.padded_tokens:
            raise ValueError(
                f"{self.name}: q has {q.shape[1]} and k {k.shape[1]} tokens but the layout of grid {list(grid)} "
                f"has {layout.padded_tokens} slots ({layout.num_tokens} real); permute q/k/v (or the hidden "
                "states) with layout.permute(x, dim=1) first. Sparse backends serve self-attention only."
            )
        if layout.device != q.device:
            raise ValueError(f"layout is on {layout.device} but q is on {q.device}")
        return mine if layout is not mine else layout

    def is_dense_step(self, meta: AttentionMetadata) -> bool:
        return meta.step_index is not None and meta.step_index < self.dense_steps

    def dense_plan(self, layout: TokenLayout) -> BlockPlan:
        key = ("dense", layout.grid, str(layout.device))
        return self._plans.get_or(key, lambda: BlockPlan(layout, *masks.full_tables(layout), name="keys"))

    def plan(self, layout: TokenLayout, meta: AttentionMetadata, heads: int) -> BlockPlan:
        raise NotImplementedError

    def dense_mask(self, grid, *, step_index: int | None = None, layer_index: int = 0, heads: int = 1,
                   device: torch.device | str = "cpu") -> torch.Tensor:
        """The exact token pattern in layout order: bool [Hm, P, P] (Hm = 1 when shared by all heads).

        Row = query slot, column = key slot, True = attend; dummy key slots are False. For tests and
        debugging (O(P^2) memory).
        """
        layout = self.layout(grid, device)
        meta = AttentionMetadata(grid=layout.grid, step_index=step_index, layer_index=layer_index, layout=layout)
        plan = self.dense_plan(layout) if self.is_dense_step(meta) else self.plan(layout, meta, heads)
        return plan.dense_mask()[0]

    def forward(self, q, k, v, *, scale=None, meta: AttentionMetadata | None = None):
        """q, k, v: [B, P, H, D] in layout order (P = layout.padded_tokens) -> [B, P, H, D]."""
        layout = self.check_call(q, k, v, meta)
        plan = self.dense_plan(layout) if self.is_dense_step(meta) else self.plan(layout, meta, q.shape[2])
        return self.run_plan(plan, q, k, v, scale)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config_repr()})"

    def config_repr(self) -> str:
        return f"tile={self.tile}, dense_steps={self.dense_steps}, kernel={self.kernel!r}"


def run_sdpa_masked(q, k, v, mask: torch.Tensor, *, scale: float):
    """Reference kernel: q, k, v [B, S, H, D], mask bool [Bm, Hm, S, S] (True = attend) -> [B, S, H, D]."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale
    )
    return out.transpose(1, 2)


def _prod(t) -> int:
    n = 1
    for x in t:
        n *= x
    return n
