"""Sequence parallelism (Ulysses x Ring) applied to a model from its sequence plan, as hooks (:mod:`fastwan.hooks`).

A model class declares ``_sp_plan``: call point -> :class:`~fastwan.hooks.Split` (the point's result is cut into
this rank's shard of the token sequence) or :class:`~fastwan.hooks.Gather` (the point's input is gathered back from
every rank). :func:`apply_sequence_parallel` hooks those points, and wraps the model's attention dispatch (its
``attention``, and whatever ``set_attention`` installs later) in a
:class:`~fastwan.parallel.ulysses.UlyssesDispatch`, so self-attention exchanges sequence shards for head shards
(and, with a ring, passes key/value chunks round it). Between the split and the gather every rank runs its own
contiguous shard (:func:`~fastwan.parallel.ulysses.shard_sizes`, fixed by the token count of each forward).
:func:`remove_sequence_parallel` undoes all of it. Step caches do not run under sequence parallelism
(:func:`fastwan.parallel.mesh.check_cache`, checked when the plan is applied).
"""
from __future__ import annotations

from functools import partial

import torch.nn as nn

from fastwan.errors import InvalidArgument
from fastwan.hooks import Gather, Hook, HookRegistry, Split
from fastwan.parallel.mesh import check_cache
from fastwan.parallel.ulysses import SequenceParallel, UlyssesDispatch, shard_sizes


class SequenceParallelHook(Hook):
    """The hooks of a model's sequence plan for the group ``sp``. ``sizes``: the current forward's shard sizes."""

    name = "sequence_parallel"

    def __init__(self, sp: SequenceParallel):
        self.sp = sp
        self.sizes: tuple[int, ...] | None = None

    def points(self, module: nn.Module) -> dict:
        plan = getattr(type(module), "_sp_plan", None)
        if not plan:
            raise InvalidArgument(f"{type(module).__name__} declares no sequence plan (_sp_plan); sequence "
                                  "parallelism cannot split it.")
        out = {"set_attention": self._set_attention}
        for point, entry in plan.items():
            if isinstance(entry, (Split, Gather)):
                out[point] = partial(self._split if isinstance(entry, Split) else self._gather, entry)
            else:
                raise InvalidArgument(f"{type(module).__name__}._sp_plan[{point!r}] = {entry!r} is not a Split or "
                                      "a Gather (fastwan.hooks).")
        return out

    def attach(self, module: nn.Module) -> None:
        self.sp.check_heads(module.config.num_attention_heads)
        cache = HookRegistry.of(module).get("step_cache")
        if cache is not None:
            check_cache(cache.run.config, self.sp.world)
        if module.attention is not None:
            module.attention = UlyssesDispatch(module.attention, self.sp)

    def detach(self, module: nn.Module) -> None:
        if isinstance(module.attention, UlyssesDispatch):
            module.attention = module.attention.inner

    def _set_attention(self, module, inner, dispatch) -> None:
        inner(UlyssesDispatch(dispatch, self.sp))

    def _split(self, entry: Split, module, inner, *args, **kwargs):
        """The point's result with the fields ``entry`` names (those with the dims it gives) cut to this rank's
        contiguous shard; the shard sizes follow the first field's token count."""
        result = inner(*args, **kwargs)
        first = getattr(result, next(iter(entry.fields)))
        sizes = self.sizes = module.attention.sizes = shard_sizes(first.shape[1], self.sp.world)
        parts = {}
        for name, dims in entry.fields.items():
            t = getattr(result, name)
            if t.dim() == dims:
                parts[name] = self.sp.shard(t, sizes).contiguous()
        return result._replace(**parts)

    def _gather(self, entry: Gather, module, inner, *args, **kwargs):
        """The point called with its argument ``entry.arg`` gathered from every rank."""
        args = list(args)
        args[entry.arg] = self.sp.gather(args[entry.arg], self.sizes)
        return inner(*args, **kwargs)


def apply_sequence_parallel(module: nn.Module, sp: SequenceParallel) -> SequenceParallelHook:
    """Split every forward of ``module`` over the ranks of ``sp`` as its ``_sp_plan`` says: each rank runs its shard
    through the blocks, self-attention exchanges shards for heads (Ulysses), the prediction is gathered on every
    rank -> the hook. Raises if the heads do not divide over the Ulysses ranks, a ring meets a sparse backend, or a
    step cache is on the module."""
    return HookRegistry.of(module).add(SequenceParallelHook(sp))


def remove_sequence_parallel(module: nn.Module) -> None:
    """Undo :func:`apply_sequence_parallel` (nothing if it was not applied)."""
    HookRegistry.of(module).remove(SequenceParallelHook.name)
