"""Hooks: behaviour attached to a module's call points when the module is built or a run starts, instead of
branches in its forward (the step cache, block streaming and sequence parallelism of the Wan DiT attach this way).

A *point* is a callable that the module's forward calls through an attribute: a method by name (``"embed"``), or
entry ``i`` of a list of callables (``"block_calls.3"``: the DiT's block loop calls ``block_calls[3]``). A
:class:`Hook` gives a function per point it wraps; each runs as ``fn(module, inner, *args, **kwargs)`` instead of
the point's call, ``inner`` being the call it wraps. Rules:

* A module has one :class:`HookRegistry` (:meth:`HookRegistry.of`); a hook is registered under its ``name``, once.
* The hooks of one point nest in the order they were added: the last added runs outermost.
* :meth:`Hook.attach` runs before a hook's functions are installed (it may refuse, leaving the module as it was);
  :meth:`Hook.detach` runs after they are removed.
* Removing a hook rebuilds its points from the hooks left; a point with none left is the module's own again (the
  method's instance attribute deleted, the list entry restored), so the module runs as if it had never been hooked.
* Points are called outside any ``torch.compile``'d unit (a compiled block is the entry a point wraps, not the
  code around it), so hooks run in Python between compiled calls and add no graph break inside one.

:class:`Split` and :class:`Gather` are the entries of a module's sequence plan (``_sp_plan``: point -> entry), which
:func:`fastwan.parallel.plan.apply_sequence_parallel` turns into hooks.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch.nn as nn

from fastwan.errors import InvalidArgument

_ATTRIBUTE = "_fastwan_hooks"


class Hook:
    """Behaviour wrapped around some call points of one module. Subclasses set ``name`` and return their
    functions from :meth:`points`."""

    name: str = "hook"

    def points(self, module: nn.Module) -> dict[str, Callable]:
        """point -> ``fn(module, inner, *args, **kwargs)``, run instead of the point's call."""
        return {}

    def attach(self, module: nn.Module) -> None:
        """Runs when the hook is added, before its functions are installed; raise to refuse."""

    def detach(self, module: nn.Module) -> None:
        """Runs when the hook is removed, after its functions are."""


def _split_point(point: str) -> tuple[str, int | None]:
    attr, dot, index = point.partition(".")
    return attr, (int(index) if dot else None)


class HookRegistry:
    """The hooks of one module, by name (see the module docstring for the rules)."""

    def __init__(self, module: nn.Module):
        self.module = module
        self._hooks: dict[str, tuple[Hook, dict[str, Callable]]] = {}  # name -> (hook, its functions by point)
        self._own: dict[str, Callable] = {}  # point -> the module's own callable, while some hook wraps it

    @classmethod
    def of(cls, module: nn.Module) -> HookRegistry:
        """The registry of ``module``, made on first use."""
        registry = module.__dict__.get(_ATTRIBUTE)
        if registry is None:
            registry = cls(module)
            object.__setattr__(module, _ATTRIBUTE, registry)
        return registry

    def get(self, name: str) -> Hook | None:
        entry = self._hooks.get(name)
        return None if entry is None else entry[0]

    def __contains__(self, name: str) -> bool:
        return name in self._hooks

    def names(self) -> list[str]:
        """The registered hooks' names, in the order they were added."""
        return list(self._hooks)

    def add(self, hook: Hook) -> Hook:
        """Register ``hook`` (after its :meth:`Hook.attach`) and wrap its points -> ``hook``."""
        if hook.name in self._hooks:
            raise InvalidArgument(f"a {hook.name!r} hook is already on this {type(self.module).__name__}; remove it "
                                  "first (HookRegistry.of(module).remove(name)).")
        functions = hook.points(self.module)
        for point in functions:
            self._read(point)  # an unknown point raises before anything changes
        hook.attach(self.module)
        self._hooks[hook.name] = (hook, functions)
        for point in functions:
            self._own.setdefault(point, self._read(point))
            self._rebuild(point)
        return hook

    def remove(self, name: str) -> Hook | None:
        """Unwrap and forget hook ``name`` (then its :meth:`Hook.detach`) -> the hook, or None if there was none."""
        entry = self._hooks.pop(name, None)
        if entry is None:
            return None
        hook, functions = entry
        for point in functions:
            self._rebuild(point)
        hook.detach(self.module)
        return hook

    def _read(self, point: str) -> Callable:
        attr, index = _split_point(point)
        target = getattr(self.module, attr, None)
        if index is None and callable(target):
            return target
        if index is not None and isinstance(target, list) and 0 <= index < len(target):
            return target[index]
        raise InvalidArgument(f"{type(self.module).__name__} has no call point {point!r} (a method, or an entry "
                              "of a list of callables as 'name.index').")

    def _rebuild(self, point: str) -> None:
        """Point ``point`` as the module's own callable wrapped by every hook on it, in the order they came."""
        call = self._own[point]
        wrapped = False
        for _, functions in self._hooks.values():
            fn = functions.get(point)
            if fn is not None:
                call, wrapped = functools.partial(fn, self.module, call), True
        attr, index = _split_point(point)
        if index is not None:
            getattr(self.module, attr)[index] = call
        elif wrapped:
            object.__setattr__(self.module, attr, call)
        else:
            self.module.__dict__.pop(attr, None)  # the class's method again
        if not wrapped:
            del self._own[point]


@dataclass(frozen=True)
class Split:
    """A sequence-plan entry: the point's result (a NamedTuple) has its ``fields`` cut along dim 1, the token axis,
    into this rank's contiguous shard. ``fields``: name -> the dims the field has when it is per token (a field
    with other dims, e.g. a modulation shared by every token, stays whole)."""
    fields: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Gather:
    """A sequence-plan entry: the point's positional argument ``arg`` (a tensor split by a :class:`Split`) is
    gathered from every rank along dim 1 before the point runs."""
    arg: int = 0
