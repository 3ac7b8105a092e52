"""Named backend configurations ("variants") that `fastwan env` lists and the profiler times.

A :class:`BackendSpec` is a registered backend name plus constructor config, e.g. ``TORCH_SDPA[cudnn]`` or
``FLASH_ATTN[FA4]``. :func:`backend_specs` expands the registry into specs: the default configuration of each
backend, or with ``variants=True`` every kernel variant worth comparing.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from fastwan.errors import InvalidArgument
from fastwan.attention.registry import BACKENDS, create_backend

# Per backend: extra variants (label suffix, config) beyond the default configuration.
VARIANT_CONFIGS: dict[str, tuple[tuple[str, dict[str, Any]], ...]] = {
    "TORCH_SDPA": (
        ("flash", {"kernel": "flash"}),
        ("cudnn", {"kernel": "cudnn"}),
        ("efficient", {"kernel": "efficient"}),
        ("math", {"kernel": "math"}),
    ),
    "FLASH_ATTN": (
        ("FA4", {"version": 4}),
        ("FA3", {"version": 3}),
        ("FA2", {"version": 2}),
        ("FA4-NVFP4", {"version": 4, "nvfp4": True}),
    ),
}

# Backends whose results differ from exact attention (quantized or sparse): never the "exact" fastest.
APPROXIMATE = frozenset({"SAGE_ATTN", "ATTN_8BIT"})


@dataclass(frozen=True)
class BackendSpec:
    name: str
    config: dict[str, Any] = field(default_factory=dict)
    suffix: str | None = None

    @property
    def label(self) -> str:
        return f"{self.name}[{self.suffix}]" if self.suffix else self.name

    @property
    def approximate(self) -> bool:
        return self.name in APPROXIMATE or bool(self.config.get("nvfp4"))

    def create(self):
        """Instantiate; raises whatever the backend's module or constructor raises."""
        return create_backend(self.name, self.config, source=f"spec {self.label}")


def backend_specs(names: Iterable[str] | None = None, *, variants: bool = False) -> list[BackendSpec]:
    """Specs for ``names`` (None or 'all': every registered backend). Unknown names raise ValueError."""
    wanted: list[str] = []
    for n in names or ["all"]:
        key = n.strip().upper()
        if key == "ALL":
            wanted.extend(BACKENDS)
        elif key in BACKENDS:
            wanted.append(key)
        else:
            raise InvalidArgument(f"Unknown attention backend {n!r}; valid names: {', '.join(BACKENDS)} or 'all'.")
    specs: list[BackendSpec] = []
    for name in dict.fromkeys(wanted):
        if name == "TORCH_SDPA":
            specs.append(BackendSpec(name, {"kernel": "auto"}, "auto"))  # the baseline: independent of env
        else:
            specs.append(BackendSpec(name))
        if variants:
            specs.extend(BackendSpec(name, dict(cfg), sfx) for sfx, cfg in VARIANT_CONFIGS.get(name, ()))
    return specs
