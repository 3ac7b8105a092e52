"""SLIDING_TILE_ATTN: sliding tile attention (STA) at any resolution.

The token grid is cut into tiles (see :mod:`fastwan.attention.sparse.layout`). A query tile attends to every real
token of the key tiles inside its window: per dimension, the ``window`` (odd, in tiles) is centered on the
query tile and shifted to stay inside the tile grid at the borders (so it always covers ``window`` tiles; a
window larger than the tile grid covers the whole dimension). Windows may differ per denoising step, DiT
layer and head; the first ``dense_steps`` steps may use full attention, as in the STA paper.

Config (constructor kwargs, or a JSON object via ``attention_config=`` / ``FASTWAN_ATTENTION_CONFIG``)::

    {
      "tile": [2, 8, 8],          # tokens per tile (T, H, W); or "auto" (least padding for the grid)
      "block_size": 128,          # optional: slots per tile (>= tile tokens; default rounds up to 64s)
      "window": [3, 3, 3],        # default window in tiles (odd ints; one int = same for T, H, W)
      "dense_steps": 0,           # steps with step_index < dense_steps attend densely
      "strategy": {               # optional per step / layer / head windows, two accepted forms:
        "0":  {"*": [5, 5, 5]},                        # nested: "<step>" -> "<layer>" -> window
        "*":  {"3": [[3, 3, 3], [1, 3, 5], ...]}       #   or one window per head ("*" = any step/layer)
      },
      # or FastVideo's flat form: {"<step>_<layer>_<head>": [wt, wh, ww], ...} (unlisted heads: "window")
      "kernel": "auto",           # auto | flex | sdpa | fa4
      "kernel_options": {}        # extra FlexAttention kernel options
    }

Lookup order for (step, layer): strategy[step][layer], strategy[step]["*"], strategy["*"][layer],
strategy["*"]["*"], then ``window``. Calls without a step index (``meta.step_index`` None) only see "*" steps.
Two keys naming the same step, layer or head ("0" and "00") are an error. Head indices are the layer's: a call
that holds only some of them (Ulysses sequence parallelism) says which with ``meta.extra["head_range"] =
(first, total)`` -- its heads are heads first .. first + H - 1 of the layer's ``total``.
:meth:`SlidingTileBackend.check_model` checks every per-head and per-layer entry against a DiT's head and layer
counts before any compute.
Block masks are built once per (grid, device, per-head windows) and cached (LRU of 64).
"""
from __future__ import annotations

import re
from typing import Any

from fastwan.errors import InvalidArgument
from fastwan.attention.base import AttentionMetadata, reject_unknown
from fastwan.attention.sparse.layout import TokenLayout
from fastwan.attention.sparse import config as cfg
from fastwan.attention.sparse import masks
from fastwan.attention.sparse.common import SparseVideoBackend
from fastwan.attention.sparse.plan import BlockPlan

_FLAT_KEY = re.compile(r"^\d+_\d+_\d+$")
_KEY = re.compile(r"^(\d+|\*)$")


class SlidingTileBackend(SparseVideoBackend):
    name = "SLIDING_TILE_ATTN"
    KEYS = ("window", "strategy") + SparseVideoBackend.COMMON_KEYS

    def __init__(
        self,
        window: Any = (3, 3, 3),
        strategy: dict | None = None,
        tile: Any = (2, 8, 8),
        block_size: int | None = None,
        dense_steps: int = 0,
        kernel: str = "auto",
        kernel_options: dict | None = None,
        **unknown: Any,
    ):
        reject_unknown(self.name, unknown, self.KEYS)
        super().__init__(tile=tile, block_size=block_size, dense_steps=dense_steps, kernel=kernel,
                         kernel_options=kernel_options)
        self.window = cfg.window(window, "window")
        self.rules = _parse_strategy(strategy)
        windows = {self.window}
        for rule in self.rules.values():
            windows.update(rule[1] if rule[0] == "list" else rule[1].values() if rule[0] == "dict" else [rule[1]])
        self._all_windows = sorted(windows)

    # ------------------------------------------------------------------ strategy
    def _lookup(self, step: int | None, layer: int) -> tuple[str, str] | None:
        """The key of the strategy entry that applies at (step, layer), or None."""
        for s in ([str(step)] if step is not None else []) + ["*"]:
            for lk in (str(layer), "*"):
                if (s, lk) in self.rules:
                    return s, lk
        return None

    def windows_for(self, step: int | None, layer: int, heads: int) -> tuple[tuple[int, int, int], ...]:
        """The window of every head (or one shared window: a 1-tuple) at (step, layer)."""
        key = self._lookup(step, layer)
        return (self.window,) if key is None else self._entry_windows(key, heads)

    def _entry_windows(self, key: tuple[str, str], heads: int) -> tuple[tuple[int, int, int], ...]:
        """The windows strategy entry ``key`` gives a layer of ``heads`` heads (see :meth:`windows_for`); raises
        when a per-head list or head index does not fit ``heads``."""
        kind, value = self.rules[key]
        if kind == "uniform":
            return (value,)
        if kind == "list":
            if len(value) != heads:
                raise InvalidArgument(
                    f"{self.name}: strategy[{key[0]!r}][{key[1]!r}] lists {len(value)} per-head windows but the "
                    f"layer has {heads} heads; give exactly {heads} windows (or one window [wt, wh, ww] for all heads)."
                )
            return _shared(value)
        too_big = [h for h in value if h >= heads]
        if too_big:
            raise InvalidArgument(
                f"{self.name}: strategy key '{key[0]}_{key[1]}_{too_big[0]}' names head {too_big[0]} but the "
                f"layer has {heads} heads (0..{heads - 1}); fix the head index."
            )
        return _shared([value.get(h, self.window) for h in range(heads)])

    # ------------------------------------------------------------------ plans
    def plan(self, layout: TokenLayout, meta: AttentionMetadata, heads: int) -> BlockPlan:
        first, total = head_range(meta, heads)
        wins = self.windows_for(meta.step_index, meta.layer_index, total)
        if len(wins) > 1:  # this call's heads only
            wins = _shared(wins[first:first + heads])
        return self.plan_for_windows(layout, wins)

    def check_model(self, num_heads: int, num_layers: int) -> None:
        """Every strategy entry against a DiT of ``num_heads`` heads and ``num_layers`` layers: per-head lists of
        ``num_heads`` windows, head indices below it, layer indices below ``num_layers`` (an entry for a layer
        the DiT lacks would never apply); raises before any compute."""
        for (step, layer), (kind, _) in self.rules.items():
            if layer != "*" and int(layer) >= num_layers:
                where = f"key '{step}_{layer}_...'" if kind == "dict" else f"[{step!r}][{layer!r}]"
                raise InvalidArgument(
                    f"{self.name}: strategy {where} names layer {layer} but the DiT has {num_layers} layers "
                    f"(0..{num_layers - 1}); fix the layer index or remove the entry.")
            self._entry_windows((step, layer), num_heads)

    def plan_for_windows(self, layout: TokenLayout, windows) -> BlockPlan:
        """The cached block plan for one window per head (or a 1-tuple shared by all heads)."""
        clamped = tuple(tuple(min(w, n) for w, n in zip(win, layout.tile_grid)) for win in windows)
        key = ("sta", layout.grid, str(layout.device), clamped)

        def make():
            any_, full = masks.sta_tables(layout, clamped)
            width = masks.sta_max_blocks(layout, self._all_windows)
            return BlockPlan(layout, any_, full, width=width, name="keys")

        return self._plans.get_or(key, make)

    def config_repr(self) -> str:
        return f"window={list(self.window)}, rules={len(self.rules)}, " + super().config_repr()


def _parse_window_entry(value: Any, where: str):
    """A strategy value: one window (int or [t, h, w]) -> ("uniform", w); a list of windows -> ("list", ...)."""
    if isinstance(value, list) and value and all(isinstance(x, list) for x in value):
        return ("list", tuple(cfg.window(w, f"{where}[head {i}]") for i, w in enumerate(value)))
    return ("uniform", cfg.window(value, where))


def _parse_strategy(strategy: Any) -> dict:
    """-> {(step_key, layer_key): ("uniform", w) | ("list", (w, ...)) | ("dict", {head: w})}."""
    if strategy is None:
        return {}
    if not isinstance(strategy, dict):
        raise InvalidArgument(
            f"strategy must be a JSON object: {{\"<step>\": {{\"<layer>\": [wt, wh, ww]}}}} or "
            f"{{\"<step>_<layer>_<head>\": [wt, wh, ww]}}; got {type(strategy).__name__}."
        )
    rules: dict = {}
    if strategy and all(isinstance(k, str) and _FLAT_KEY.match(k) for k in strategy):
        for key, value in strategy.items():
            s, lk, h = key.split("_")
            where = f"strategy[{key!r}]"
            rule = rules.setdefault((str(int(s)), str(int(lk))), ("dict", {}))
            if int(h) in rule[1]:
                _duplicate(where, f"'{int(s)}_{int(lk)}_{int(h)}'")
            rule[1][int(h)] = cfg.window(value, where)
        return rules
    for s, layers in strategy.items():
        if not isinstance(s, str) or not _KEY.match(s):
            raise InvalidArgument(
                f"strategy key {s!r} is not a step: use a step index like \"0\" or \"*\" (nested form), or "
                "\"<step>_<layer>_<head>\" keys for all entries (flat form); the two forms cannot be mixed."
            )
        if not isinstance(layers, dict):
            raise InvalidArgument(
                f"strategy[{s!r}] must be an object {{\"<layer>\": window}}, got {layers!r}."
            )
        for lk, value in layers.items():
            if not isinstance(lk, str) or not _KEY.match(lk):
                raise InvalidArgument(
                    f"strategy[{s!r}] key {lk!r} is not a layer index; use \"0\", \"1\", ... or \"*\"."
                )
            key = (s if s == "*" else str(int(s)), lk if lk == "*" else str(int(lk)))
            if key in rules:
                _duplicate(f"strategy[{s!r}][{lk!r}]", f"[{key[0]!r}][{key[1]!r}]")
            rules[key] = _parse_window_entry(value, f"strategy[{s!r}][{lk!r}]")
    return rules


def _shared(windows) -> tuple[tuple[int, int, int], ...]:
    """Per-head windows as a tuple, or a 1-tuple when every head has the same one."""
    windows = tuple(windows)
    return windows[:1] if len(set(windows)) == 1 else windows


def _duplicate(where: str, same: str) -> None:
    raise InvalidArgument(f"{where} names the same entry as another key (both are {same}); keep one of the two.")


def head_range(meta: AttentionMetadata, heads: int) -> tuple[int, int]:
    """(first, total): a call's ``heads`` heads are the layer's heads first .. first + heads - 1 of ``total``
    (``meta.extra["head_range"]``; absent: all of them, (0, heads))."""
    given = meta.extra.get("head_range") if meta.extra else None
    if given is None:
        return 0, heads
    first, total = given
    if not 0 <= first <= total - heads:
        raise ValueError(f"meta.extra['head_range'] = {given!r} does not hold this call's {heads} heads")
    return first, total
