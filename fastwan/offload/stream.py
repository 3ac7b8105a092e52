"""Block streaming: the weights of chosen blocks of a module list live in host memory and come onto the compute
device one block at a time, just before the block runs.

Rules:

* A streamed block's parameters and buffers (except the ``keep``-ed ones) are host copies (pinned when the device
  is CUDA) outside :meth:`BlockStreamer.before` / :meth:`BlockStreamer.after`; inside, they are fresh device copies
  with equal values. The swap assigns ``param.data`` and ``module._buffers[name]``; the module objects get no
  hooks and no attributes, so a torch.compile'd block forward reads the swapped tensors like any other input.
* ``before(i)`` also starts copying the next streamed block (wrap-around order) on a side CUDA stream, so that copy
  overlaps block i's compute; the compute stream waits on the copy's event before it uses it. A device copy made
  on the side stream is ``record_stream``-ed on the compute stream, so dropping it while its kernels are queued is
  safe. The streamer holds at most two streamed blocks on the device: the running one and the prefetched next.
* Kept tensors and the blocks that are not streamed stay on the device for good.
* Without CUDA (device "cpu") the same bookkeeping runs with plain synchronous copies.
* On a model whose block loop calls its blocks through call points ``block_calls.i`` (the Wan DiT, whose blocks may
  be compiled), :func:`stream_blocks` hooks (:mod:`fastwan.hooks`) those points of the streamed blocks with
  ``before(i)`` / ``after(i)`` (``after`` also when the block raises); :func:`stop_streaming` removes them.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn as nn

from fastwan.errors import InvalidArgument
from fastwan.hooks import Hook, HookRegistry


def _never(name: str) -> bool:
    """The default ``keep``: every tensor is streamed."""
    return False


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass(eq=False)
class Held:
    """One tensor of a module and every place that holds it (a tensor held by several places, e.g. a tied weight,
    is one entry): ``name`` (its first name), ``host`` (its host copy, or where it was put), the parameters and the
    (module, buffer name) slots that hold it."""
    name: str
    host: torch.Tensor
    params: list[nn.Parameter] = field(default_factory=list)
    buffers: list[tuple[nn.Module, str]] = field(default_factory=list)

    def point(self, t: torch.Tensor) -> None:
        """Make every place hold ``t`` (same shape and dtype as the host copy)."""
        for p in self.params:
            p.data = t
        for mod, name in self.buffers:
            mod._buffers[name] = t


@dataclass(eq=False)
class _Copy:
    """Block ``index``'s device copies, one per :class:`Held` in the same order; ``event``: recorded on the side
    stream after the copies (None for a copy made on the compute stream or without CUDA)."""
    index: int
    tensors: list[torch.Tensor]
    event: torch.cuda.Event | None = None


def _places(block: nn.Module) -> Iterator[tuple[str, torch.Tensor, nn.Module, str, bool]]:
    """(name as in ``block.named_parameters()``, tensor, owning module, attribute name, is a parameter) for every
    parameter and buffer of ``block``."""
    for prefix, mod in block.named_modules():
        for is_param, table in ((True, mod._parameters), (False, mod._buffers)):
            for name, t in table.items():
                if t is not None:
                    yield (f"{prefix}.{name}" if prefix else name), t, mod, name, is_param


def held_tensors(module: nn.Module) -> list[tuple[torch.Tensor, list[str], Callable[[torch.Tensor], Held]]]:
    """Each distinct tensor of ``module`` -> (the tensor, its names, ``hold(where)``: a :class:`Held` for it whose
    ``host`` is ``where``, every place of the tensor listed, not yet pointed there)."""
    groups: dict[int, list] = {}
    for place in _places(module):
        groups.setdefault(id(place[1]), []).append(place)
    out = []
    for places in groups.values():
        def hold(where: torch.Tensor, places=places) -> Held:
            entry = Held(places[0][0], where)
            for _, tensor, mod, name, is_param in places:
                if is_param and all(tensor is not p for p in entry.params):
                    entry.params.append(tensor)
                elif not is_param:
                    entry.buffers.append((mod, name))
            return entry
        out.append((places[0][1], [p[0] for p in places], hold))
    return out


def _check_index(i, n: int, what: str) -> int:
    """``i`` as a block index of a list of ``n`` blocks."""
    if isinstance(i, bool) or not isinstance(i, int):
        raise InvalidArgument(f"{what} {i!r} is a {type(i).__name__}; block indices are ints in [0, {n}).")
    if not 0 <= i < n:
        raise InvalidArgument(f"{what} {i} is out of range: there are {n} blocks, so an index is in [0, {n}).")
    return i


def _check_streamed(streamed: Sequence[int], n: int) -> tuple[int, ...]:
    """The streamed indices, sorted; each an int in [0, n), none repeated."""
    out = [_check_index(i, n, "streamed block index") for i in streamed]
    dup = sorted({i for i in out if out.count(i) > 1})
    if dup:
        raise InvalidArgument(f"streamed block indices {dup} are given more than once; list each block once.")
    return tuple(sorted(out))


class BlockStreamer:
    """Streams the weights of ``blocks[i]`` for i in ``streamed`` from host memory to ``device``.

    ``keep(name)``: the tensors of a streamed block that stay on ``device`` (names as in
    ``block.named_parameters()`` / ``named_buffers()``, e.g. "attn2.to_k.weight"). Call :meth:`before` right before
    a block runs and :meth:`after` right after it (or :meth:`attach_hooks` for modules that are not compiled)."""

    def __init__(self, blocks: Sequence[nn.Module], device: torch.device | str, streamed: Sequence[int],
                 keep: Callable[[str], bool] = _never):
        self._blocks = list(blocks)
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        if cuda and not torch.cuda.is_available():
            raise InvalidArgument(f"device {str(self.device)!r} is CUDA but CUDA is not available here; "
                                  "stream to the device the model runs on (e.g. 'cpu').")
        self.streamed = _check_streamed(streamed, len(self._blocks))
        self._side = torch.cuda.Stream(self.device) if cuda else None
        self._tensors = {i: self._split(self._blocks[i], keep, pin=cuda) for i in self.streamed}
        self._next = {s: self.streamed[(k + 1) % len(self.streamed)] for k, s in enumerate(self.streamed)}
        self._live: dict[int, _Copy] = {}  # blocks between before(i) and after(i)
        self._pending: _Copy | None = None  # the prefetched next block
        self._hooks: list = []

    def _split(self, block: nn.Module, keep: Callable[[str], bool], pin: bool) -> list[Held]:
        """Move ``block``'s kept tensors to the device and its other tensors to host copies -> the streamed ones.
        A tensor held by several places is kept if any of its names is kept."""
        out = []
        for tensor, names, hold in held_tensors(block):
            t = tensor.detach()
            kept = any(keep(n) for n in names)
            target = t.to(self.device) if kept else (t.to("cpu").pin_memory() if pin else t.to("cpu"))
            entry = hold(target)
            entry.point(target)
            if not kept:
                out.append(entry)
        return out

    # -- the block loop -------------------------------------------------------------------------------------
    def _streams(self, i: int) -> bool:
        """Whether block ``i`` (checked as an index) is streamed."""
        return _check_index(i, len(self._blocks), "block index") in self._tensors

    def before(self, i: int) -> None:
        """Block ``i`` is about to run on the current stream: its tensors become device copies, and the copy of the
        next streamed block starts on the side stream. No-op for a block that is not streamed."""
        if not self._streams(i):
            return
        if i in self._live:
            raise RuntimeError(f"block {i} is already on the device: before({i}) was called again without "
                               f"after({i}); pair them (resident({i}) does).")
        copy = self._take(i)
        self._use(copy)
        for t, d in zip(self._tensors[i], copy.tensors):
            t.point(d)
        self._live[i] = copy
        nxt = self._next[i]
        if nxt not in self._live:
            self._pending = self._copy(nxt, prefetch=True)

    def after(self, i: int) -> None:
        """Block ``i`` ran: its tensors become the host copies again and its device copies are dropped."""
        if not self._streams(i):
            return
        if self._live.pop(i, None) is None:
            raise RuntimeError(f"after({i}) without before({i}): block {i} is not on the device.")
        for t in self._tensors[i]:
            t.point(t.host)

    @contextlib.contextmanager
    def resident(self, i: int) -> Iterator[None]:
        """Block ``i``'s weights on the device for the ``with`` body (for code outside the block loop)."""
        self.before(i)
        try:
            yield
        finally:
            self.after(i)

    def release(self) -> None:
        """Drop the prefetched copy, so the streamer holds no streamed tensor on the device until the next
        :meth:`before` (e.g. while the VAE decodes)."""
        self._pending = None

    def _take(self, i: int) -> _Copy:
        """Block ``i``'s device copy: the prefetched one if it is for block i, else one made now (a prefetch of
        another block is dropped, so at most two blocks stay on the device)."""
        pending, self._pending = self._pending, None
        if pending is not None and pending.index == i:
            return pending
        return self._copy(i, prefetch=False)

    def _copy(self, i: int, prefetch: bool) -> _Copy:
        """Fresh device copies of block ``i``'s host tensors: on the side stream (with an event) when ``prefetch``
        and CUDA, else on the current stream."""
        blocking = self._side is None
        if not prefetch or blocking:
            return _Copy(i, [h.to(self.device, non_blocking=not blocking, copy=True)
                             for h in (t.host for t in self._tensors[i])])
        with torch.cuda.stream(self._side):
            tensors = [t.host.to(self.device, non_blocking=True, copy=True) for t in self._tensors[i]]
            event = torch.cuda.Event()
            event.record(self._side)
        return _Copy(i, tensors, event)

    def _use(self, copy: _Copy) -> None:
        """Order the compute stream after a side-stream copy and tie the copy's memory to the compute stream."""
        if copy.event is None:
            return
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(copy.event)
        for d in copy.tensors:
            d.record_stream(stream)

    # -- hooks for modules that are not compiled -------------------------------------------------------------
    def attach_hooks(self) -> list:
        """Register a forward pre-hook (:meth:`before`) and a forward hook (:meth:`after`, also when the forward
        raises) on each streamed block -> the hook handles. Not for compiled blocks: use before/after there."""
        if not self._hooks:
            for i in self.streamed:
                blk = self._blocks[i]
                self._hooks.append(blk.register_forward_pre_hook(lambda mod, args, i=i: self.before(i)))
                self._hooks.append(blk.register_forward_hook(lambda mod, args, out, i=i: self.after(i),
                                                             always_call=True))
        return list(self._hooks)

    def detach_hooks(self) -> None:
        """Remove the hooks of :meth:`attach_hooks`."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # -- sizes and teardown ----------------------------------------------------------------------------------
    def block_bytes(self, i: int) -> int:
        """Bytes of block ``i``'s streamed tensors (0 for a block that is not streamed)."""
        return sum(_nbytes(t.host) for t in self._tensors.get(i, ()))

    def device_bytes(self) -> int:
        """Peak bytes the streamer holds on the device: its two largest streamed blocks (the two slots)."""
        return sum(sorted((self.block_bytes(i) for i in self.streamed), reverse=True)[:2])

    def host_bytes(self) -> int:
        """Bytes of the host copies."""
        return sum(self.block_bytes(i) for i in self.streamed)

    def close(self) -> None:
        """Stop streaming: every streamed block's tensors go to the device for good and the hooks are removed."""
        self.detach_hooks()
        self._pending = None
        for i in self.streamed:
            live = self._live.get(i)
            for k, t in enumerate(self._tensors[i]):
                t.point(live.tensors[k] if live is not None else t.host.to(self.device, copy=True))
        self._tensors, self._live, self._next, self.streamed = {}, {}, {}, ()


class StreamHook(Hook):
    """``streamer``'s before(i) / after(i) around the call points ``block_calls.i`` of the streamed blocks."""

    name = "block_streaming"

    def __init__(self, streamer: BlockStreamer):
        self.streamer = streamer

    def points(self, module: nn.Module) -> dict:
        blocks = getattr(module, "blocks", None)
        if blocks is None or [id(b) for b in blocks] != [id(b) for b in self.streamer._blocks]:
            raise InvalidArgument(f"the streamer's blocks are not this {type(module).__name__}'s blocks; stream a "
                                  "model with the streamer made for its own blocks.")
        return {f"block_calls.{i}": partial(self._around, i) for i in self.streamer.streamed}

    def _around(self, i: int, module, inner, *args, **kwargs):
        self.streamer.before(i)
        try:
            return inner(*args, **kwargs)
        finally:
            self.streamer.after(i)


def stream_blocks(module: nn.Module, streamer: BlockStreamer) -> StreamHook:
    """Run ``module``'s streamed blocks (its ``block_calls``) through ``streamer`` -> the hook."""
    return HookRegistry.of(module).add(StreamHook(streamer))


def stop_streaming(module: nn.Module) -> None:
    """Remove :func:`stream_blocks`'s hook (nothing if there is none)."""
    HookRegistry.of(module).remove(StreamHook.name)
