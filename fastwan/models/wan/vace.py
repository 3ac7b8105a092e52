"""VACE in the Wan DiT: control blocks that turn the VACE context (control latents) into hints added to the stream.

A VACE DiT (``WanVACETransformer3DModel``, config ``vace_layers``, ``vace_in_channels``) has, besides the Wan
blocks, a patch embedding for the control latents (``vace_patch_embedding``) and one control block per entry of
``vace_layers`` (``vace_blocks``): a Wan block of the same build as the main ones (reference or fast, so it
compiles the same way), plus an output projection ``proj_out`` and, on the first, an input projection ``proj_in``.
The rules (diffusers' ``WanVACETransformer3DModel``):

* the control tokens ``c`` = the control latents patch-embedded; the first control block starts from
  ``proj_in(c) + x`` (``x``: the embedded stream before any main block); each control block runs on ``c`` as a main
  block runs on ``x`` (its own cross-attention over the same text), and its hint is ``proj_out(c)``;
* hint ``k`` times ``scale[k]`` is added to the stream after main block ``vace_layers[k]``.

The control input is not an argument of the forward: :func:`vace_control` attaches a :class:`VaceControl` hook
(:mod:`fastwan.hooks`) for a run, which computes the hints at the call point ``run_blocks`` and adds them at the
points ``block_calls.i`` of the VACE layers; ``run_cfg`` runs both CFG passes through ``run_blocks`` (the hints
depend on each pass's text, so the passes share no block-0 half). A VACE DiT with no hook attached runs its main
blocks alone.

Several processes (:mod:`fastwan.parallel`):

* sequence parallelism: the control tokens come from the call point ``embed_control``, which the DiT's sequence plan
  splits as it splits ``embed`` (the same shard sizes, after the same sparse compact order), so each rank's hints
  are its shard's; the control blocks run with the DiT's attention dispatch, so their self-attention takes the
  main blocks' Ulysses / ring path;
* CFG parallelism splits the passes above the DiT: each CFG group's ranks run one plain forward with their pass's
  text, which computes that pass's hints at ``run_blocks``; ``run_cfg`` (wrapped by this hook alone: the step
  cache, the other hook there, is refused with VACE) runs only where one process group runs both passes.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn as nn

from fastwan.errors import InvalidArgument
from fastwan.hooks import Hook, HookRegistry
from fastwan.models.wan.block import Residual, settle
from fastwan.models.wan.config import WanConfig

HOOK_NAME = "vace"


def vace_modules(cfg: WanConfig, block: type) -> tuple[nn.Module | None, nn.ModuleList]:
    """The VACE patch embedding and control blocks of the DiT ``cfg`` describes, each control block a ``block``
    (the main blocks' class) with ``proj_in`` (the first only; None on the others) and ``proj_out``; (None, an empty
    list) for a DiT without VACE."""
    if not cfg.vace:
        return None, nn.ModuleList()
    dim = cfg.inner_dim
    embed = nn.Conv3d(cfg.vace_in_channels, dim, kernel_size=cfg.patch_size, stride=cfg.patch_size)
    blocks = nn.ModuleList()
    for k in range(len(cfg.vace_layers)):
        blk = block(cfg)
        blk.proj_in = nn.Linear(dim, dim) if k == 0 else None
        blk.proj_out = nn.Linear(dim, dim)
        blocks.append(blk)
    return embed, blocks


def control_scales(scale, layers: int) -> tuple[float, ...]:
    """``scale`` (a number, or one per VACE layer) -> one float per VACE layer."""
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        return (float(scale),) * layers
    if isinstance(scale, torch.Tensor):
        scale = scale.flatten().tolist()
    if not (isinstance(scale, Sequence) and len(scale) == layers):
        given = f"a list of {len(scale)} numbers" if isinstance(scale, Sequence) and len(scale) > 8 else repr(scale)
        raise InvalidArgument(f"conditioning_scale={given} must be a number or a list of {layers} numbers (one per "
                              "VACE layer of this DiT).", field="conditioning_scale")
    return tuple(float(s) for s in scale)


class ControlTokens(NamedTuple):
    """The control tokens ``c`` [1, S, C] of one forward, in the stream's order (a sparse backend's compact order)."""
    c: torch.Tensor


def control_tokens(model, control: torch.Tensor, grid: tuple[int, int, int], layout) -> ControlTokens:
    """The control latents ``control`` [1, vace_in_channels, F, H, W] patch-embedded, for the token ``grid`` of the
    stream and its sparse ``layout`` (None for a dense backend) -> every token's control token, in the stream's
    order."""
    cfg = model.config
    if not (control.dim() == 5 and control.shape[1] == cfg.vace_in_channels):
        raise InvalidArgument(f"VACE control latents {list(control.shape)} must be [1, {cfg.vace_in_channels}, F, H, "
                              "W] (this DiT's vace_in_channels).")
    c = model.vace_patch_embedding(control.to(model.dtype)).flatten(2).transpose(1, 2)
    if c.shape[1] != math.prod(grid):
        raise InvalidArgument(f"VACE control latents {list(control.shape)} give {c.shape[1]} tokens, but the latents "
                              f"give {math.prod(grid)}; pass control latents of the latents' frames, height and "
                              "width.")
    if layout is not None:  # a sparse backend's compact order, as the stream's
        c = layout.permute_compact(c, dim=1)
    return ControlTokens(c.contiguous())


def control_hints(model, e, control: torch.Tensor, contexts: list, scales: Sequence[float], step_index,
                  num_steps) -> list[torch.Tensor]:
    """The hints [B, S, C] of ``model``'s control blocks (each times its scale), for the embedded input ``e`` (an
    :class:`~fastwan.models.wan.transformer.Embedded`, its stream not yet run through any block; under sequence
    parallelism this rank's shard, and the control tokens the same shard), the control latents ``control``
    [1, vace_in_channels, F, H, W] and the cross-attention inputs ``contexts`` (the main blocks' first, then the
    control blocks')."""
    cfg = model.config
    c = model.embed_control(control, e.grid, e.layout).c
    if c.shape[1] != e.x.shape[1]:
        raise RuntimeError(f"VACE control tokens {list(c.shape)} and the stream {list(e.x.shape)} differ in length: "
                           "a sequence plan must split 'embed_control' as it splits 'embed'.")
    first = len(model.blocks)
    hints = []
    for k, (blk, layer) in enumerate(zip(model.vace_blocks, cfg.vace_layers)):
        if blk.proj_in is not None:
            c = blk.proj_in(c) + e.x
        meta = model.attention_meta(e, layer, step_index, num_steps)
        c = settle(blk(Residual(c), contexts[first + k], e.mod, e.rope, model.attention, meta))
        hints.append(blk.proj_out(c) * scales[k])
    return hints


class VaceControl(Hook):
    """The control input of one run on a VACE DiT (see the module docstring): ``control`` latents
    [1, vace_in_channels, F, H, W] and ``scales`` (one per VACE layer)."""

    name = HOOK_NAME

    def __init__(self, control: torch.Tensor, scales: Sequence[float]):
        self.control = control
        self.scales = tuple(scales)
        self._hints: list | None = None  # the current forward's hints, set while its blocks run

    def attach(self, module) -> None:
        if len(self.scales) != len(module.config.vace_layers):
            raise InvalidArgument(f"{len(self.scales)} conditioning scales for {len(module.config.vace_layers)} VACE "
                                  "layers; give one per layer, or one number for all.")

    def points(self, module) -> dict:
        points = {"run_blocks": self._run_blocks, "run_cfg": self._run_cfg}
        for k, layer in enumerate(module.config.vace_layers):
            points[f"block_calls.{layer}"] = self._after(k)
        return points

    def _run_blocks(self, module, inner, e, contexts, step_index, num_steps):
        self._hints = control_hints(module, e, self.control, contexts, self.scales, step_index, num_steps)
        try:
            return inner(e, contexts, step_index, num_steps)
        finally:
            self._hints = None

    def _run_cfg(self, module, inner, e, contexts, batched, step_index, num_steps):
        if batched:
            both = e._replace(x=torch.cat([e.x, e.x]))
            return module.head(module.run_blocks(both, contexts, step_index, num_steps), both).chunk(2)
        return tuple(module.head(module.run_blocks(e._replace(x=e.x.clone()), ctx, step_index, num_steps), e)
                     for ctx in contexts)

    def _after(self, k: int):
        def add_hint(module, inner, r, *args):
            r = inner(r, *args)
            return r if self._hints is None else Residual(settle(r) + self._hints[k])
        return add_hint


@contextlib.contextmanager
def vace_control(model, control: torch.Tensor, scale=1.0):
    """``model`` (a VACE :class:`~fastwan.models.wan.transformer.WanTransformer`) runs with the control latents
    ``control`` and ``scale`` (a number or one per VACE layer) inside the block."""
    if not model.config.vace:
        raise InvalidArgument("this Wan DiT has no VACE blocks (its config has no vace_layers); VACE control needs a "
                              "WanVACETransformer3DModel checkpoint.")
    hook = HookRegistry.of(model).add(VaceControl(control, control_scales(scale, len(model.config.vace_layers))))
    try:
        yield hook
    finally:
        HookRegistry.of(model).remove(hook.name)
