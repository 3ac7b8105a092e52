"""A checkpoint's request rules, read from its files with no weight loaded: what checks a request where no model
runs (the CLI before it loads one, ``fastwan serve --role api``).

Rule: :meth:`CheckpointRules.resolve` is the loaded generator's ``resolve`` for the same checkpoint and step
cache; both call :func:`~fastwan.pipelines.request.resolve_request`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastwan.checkpoint.resolver import Checkpoint
from fastwan.pipelines.request import ResolvedRequest, checkpoint_vae_factors, resolve_request


@dataclass(frozen=True)
class CheckpointRules:
    """``checkpoint``'s rules: its scheduler (not stepped), its VAE's (temporal, spatial) factors and the step
    cache a request that names none gets (the load options')."""

    checkpoint: Checkpoint
    scheduler: Any
    vae_scale_factors: tuple[int, int]
    cache: Any = None

    @classmethod
    def of(cls, ckpt: Checkpoint, cache=None) -> CheckpointRules:
        from fastwan.pipelines.setup import load_scheduler

        return cls(ckpt, load_scheduler(ckpt), checkpoint_vae_factors(ckpt), cache)

    def resolve(self, request) -> ResolvedRequest:
        return resolve_request(self.checkpoint, self.scheduler, self.vae_scale_factors, request, self.cache)
