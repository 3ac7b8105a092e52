"""Attention: one entry point, many backends. Layout everywhere is [B, S, H, D]."""
from fastwan.attention.base import AttentionBackend, AttentionMetadata, Capabilities, reasons_cannot_run
from fastwan.attention.dispatch import AttentionDispatch, attention
from fastwan.attention.registry import (
    AUTO_ORDER,
    BACKENDS,
    BackendUnavailableError,
    attention_backend,
    auto_backend,
    backend_names,
    create_backend,
    resolve_backend,
)

__all__ = [
    "AUTO_ORDER",
    "BACKENDS",
    "AttentionBackend",
    "AttentionDispatch",
    "AttentionMetadata",
    "BackendUnavailableError",
    "Capabilities",
    "attention",
    "attention_backend",
    "auto_backend",
    "backend_names",
    "create_backend",
    "reasons_cannot_run",
    "resolve_backend",
]
