"""The step cache on the Wan DiT: a hook (:mod:`fastwan.hooks`) on the block stack that skips or replays the blocks
as the request's :class:`fastwan.cache.CacheRun` decides.

:func:`apply_step_cache` attaches it to one DiT (one expert) when a run starts; :func:`remove_step_cache` takes it
off, after which the DiT runs as it did before. The hook wraps two call points of
:class:`~fastwan.models.wan.transformer.WanTransformer`:

* ``run_blocks`` (a forward): the pass :meth:`StepCacheHook.select` names (default "cond") decides with its own
  :class:`~fastwan.cache.PassCache`;
* ``run_cfg`` (a forward_cfg): the "cond" and "uncond" passes run one after the other (``batched=False``), each
  deciding with its own state; block 0's video half, which they share, runs once if either computes.

A skipped stack is the stream entering block 0 plus the cached residual (a First-Block cache: block 0's output plus
the residual of blocks 1..; TaylorSeer: its prediction, from the outputs it kept); the embedding and the head always
run. The fast block adds into its input in place, so
every tensor kept for a residual is a copy. Step caches do not run under sequence parallelism
(:func:`fastwan.parallel.mesh.check_cache`, checked when the hook attaches).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from fastwan.cache import CacheRun, PassCache
from fastwan.errors import InvalidArgument
from fastwan.hooks import Hook, HookRegistry
from fastwan.models.wan.block import Residual, settle
from fastwan.models.wan.transformer import Embedded
from fastwan.parallel.mesh import check_cache

PASSES = ("cond", "uncond")


class StepCacheHook(Hook):
    """One request's step cache on one DiT: ``run`` (the request's caches), ``expert`` (this DiT's index among the
    checkpoint's experts: its passes' state is fresh at an expert switch)."""

    name = "step_cache"

    def __init__(self, run: CacheRun, expert: int = 0):
        self.run, self.expert = run, expert
        self.pass_name = PASSES[0]

    def select(self, name: str) -> None:
        """The pass (one of :data:`PASSES`) whose state the next forward decides with."""
        self.pass_name = name

    def attach(self, module: nn.Module) -> None:
        sp = HookRegistry.of(module).get("sequence_parallel")
        check_cache(self.run.config, 1 if sp is None else sp.sp.world)

    def points(self, module: nn.Module) -> dict:
        return {"run_blocks": self._run_blocks, "run_cfg": self._run_cfg}

    def _run_blocks(self, module, inner, e: Embedded, contexts: list, step_index, num_steps) -> torch.Tensor:
        if step_index is None:
            raise InvalidArgument("a DiT under a step cache needs step_index (the denoising step of this call).")
        cache = self.run.state(self.expert, self.pass_name)
        start = e.x.clone()  # the stream entering block 0
        if cache.skip_stack(step_index, e.temb, e.mod):
            return cache.reuse(start)
        head = module.blocks_range(0, Residual(e.x), contexts, e, step_index, num_steps, stop=1)
        return _rest(module, cache, head, start, contexts, e, step_index, num_steps)

    def _run_cfg(self, module, inner, e: Embedded, contexts: list, batched: bool, step_index,
                 num_steps) -> tuple[torch.Tensor, torch.Tensor]:
        if batched or step_index is None:
            raise InvalidArgument("forward_cfg under a step cache runs the passes one after the other: pass "
                                  "batched=False and the step_index.")
        video_half, text_half = module.first_halves()
        caches = [self.run.state(self.expert, name) for name in PASSES]
        start = e.x.clone()  # the stream entering block 0 (the fast block adds into x in place)
        skips = [c.skip_stack(step_index, e.temb, e.mod) for c in caches]
        computing = [i for i in (0, 1) if not skips[i]]
        if computing:
            r, h = video_half(Residual(e.x), e.mod, e.rope, module.attention,
                              module.attention_meta(e, 0, step_index, num_steps))
        outs = []
        for i, cache in enumerate(caches):
            if skips[i]:
                outs.append(cache.reuse(start))
                continue
            shared = module.prompts is not None and i == computing[0] and len(computing) == 2
            ri = text_half(r._replace(x=r.x.clone()) if shared else r, h, contexts[i][0], e.mod, module.attention)
            outs.append(_rest(module, cache, ri, start, contexts[i], e, step_index, num_steps))
        return tuple(module.head(o, e) for o in outs)


def _rest(module, cache: PassCache, head: Residual, start: torch.Tensor, contexts: list, e: Embedded, step: int,
          num_steps) -> torch.Tensor:
    """Blocks 1.. under a step cache that did not skip the whole stack: ``head`` is the stream after block 0,
    ``start`` a copy of the stream entering it -> the stream after the last block; the cache stores the residual of
    what ran (a First-Block cache may skip blocks 1.. here)."""
    if not cache.head_decides:
        out = settle(module.blocks_range(1, head, contexts, e, step, num_steps))
        cache.stored(step, out if cache.keeps_output else out - start)
        return out
    head_x = settle(head)
    head_residual = head_x - start
    if cache.skip_rest(step, head_residual):
        return cache.reuse(head_x)
    head_out = head_x.clone()
    out = settle(module.blocks_range(1, Residual(head_x), contexts, e, step, num_steps))
    cache.stored(step, out - head_out, head_residual)
    return out


def apply_step_cache(module: nn.Module, run: CacheRun, expert: int = 0) -> StepCacheHook:
    """Put ``run``'s step cache on the DiT ``module`` (expert ``expert``) -> the hook (refused under sequence
    parallelism, or when one is already on)."""
    return HookRegistry.of(module).add(StepCacheHook(run, expert))


def remove_step_cache(module: nn.Module) -> None:
    """Take the step cache off ``module`` (nothing if none is on)."""
    HookRegistry.of(module).remove(StepCacheHook.name)
