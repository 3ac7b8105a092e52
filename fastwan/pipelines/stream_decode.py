"""How a causal stream decodes its chunks and in which order it hands them out: :class:`DecodeQueue`.

A chunk's clean latents go to the queue (:meth:`DecodeQueue.put`) as soon as its DiT steps are queued (its cache
write comes after the hand-outs: :mod:`fastwan.pipelines.stream`); chunks leave the queue (:meth:`DecodeQueue.pop`)
in order, as uint8 frames on the host. Rules:

- Serial (``overlap`` off): a chunk is decoded at ``put``, on the calling thread's stream, and leaves before the
  next chunk starts (``lag`` 0).
- Overlapped (``overlap`` on): a chunk leaves only after the next chunk has been put (``lag`` 1), so the next
  chunk's DiT work is queued on the device before the caller waits for this chunk's frames; the first chunk
  leaves at once (:meth:`DecodeQueue.may_wait`: the first frames' latency stays the serial one). On CUDA the decode
  runs on a side stream (:class:`SideStreamDecode`): it waits on an event recorded on the main stream after the
  chunk's latents are final, decodes, copies the frames to pinned host memory without blocking, and records an
  event that ``pop`` waits on; the main stream goes on with the next chunk's DiT meanwhile. A chunk that leaves at
  once (the first, the last) has nothing to run beside: its decode runs on the main stream, after the side
  stream's earlier decodes (the main stream waits for them), so the first frames take the serial path's time.
  Off CUDA the decode runs at ``put`` (the same order of calls, nothing overlaps).
- Stream semantics: the latents a decode reads are marked as used by the side stream (``record_stream``) and
  kept referenced until the decode is done; nothing on the main stream writes them after ``put``. The decoder's
  causal state is touched by one stream at a time, chunk after chunk: a decode on the side stream waits for the
  main stream's work before it, one on the main stream waits for the side stream; state made by a decode on the
  main stream is marked as used by the side stream (``record_stream``), so its memory is not reused while a later
  side decode may still read it. :meth:`DecodeQueue.drop` (a stream closed
  early, or an error) waits for every queued kernel of the device, then forgets the chunks not handed out.
- Timings come from a clock (:class:`HostClock`: the device synchronised, then the host's time; :class:`EventClock`:
  CUDA events, read once they are complete), so serial and overlapped chunks report the same quantities: with
  events, each is the GPU time of that work on its own stream, which, overlapped, shares the GPU with the other
  stream's work.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from fastwan.pipelines.setup import sync


class HostClock:
    """Marks are host times taken after the device's queued work is done (on CUDA a synchronisation: every stream
    waits)."""

    def __init__(self, device: torch.device):
        self._device = device

    def mark(self) -> float:
        sync(self._device)
        return time.perf_counter()

    @staticmethod
    def seconds(a: float, b: float) -> float:
        return b - a


class EventClock:
    """Marks are timing CUDA events recorded on the current stream (nothing waits); :meth:`seconds` needs both
    complete."""

    @staticmethod
    def mark() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def seconds(a: torch.cuda.Event, b: torch.cuda.Event) -> float:
        return a.elapsed_time(b) / 1000.0


@dataclass
class Decoded:
    """A chunk whose frames are on the host: ``wait()`` -> (frames uint8 [t, H, W, 3], decode seconds)."""
    frames: np.ndarray
    seconds: float

    def wait(self) -> tuple[np.ndarray, float]:
        return self.frames, self.seconds


class InlineDecode:
    """Decode at ``submit`` on the current stream, timed with ``clock``."""

    def __init__(self, decoder, clock):
        self._decoder, self._clock = decoder, clock

    def submit(self, latents: torch.Tensor, at_once: bool = False) -> Decoded:
        t0 = self._clock.mark()
        frames = self._decoder.push(latents)
        return Decoded(frames, self._clock.seconds(t0, self._clock.mark()))


class _OnSide:
    """A decode queued on the side stream: its pinned host frames, its timing events and the tensors it reads."""

    def __init__(self, host: torch.Tensor, start, end, keep: tuple):
        self._host, self._start, self._end, self._keep = host, start, end, keep

    def wait(self) -> tuple[np.ndarray, float]:
        self._end.synchronize()
        self._keep = ()
        frames = self._host.numpy().copy()  # out of pinned memory: a consumer may keep every chunk
        return frames, self._start.elapsed_time(self._end) / 1000.0


class SideStreamDecode:
    """CUDA: decode on the side stream ``side`` (the module's rules)."""

    def __init__(self, decoder, side: torch.cuda.Stream):
        self._decoder = decoder
        self._side = side

    def submit(self, latents: torch.Tensor, at_once: bool = False) -> _OnSide:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if at_once:  # nothing would run beside it: the main stream, after the side stream's earlier decodes
            torch.cuda.current_stream().wait_stream(self._side)
            done = self._decode(latents, start, end)
            for t in self._decoder.state_tensors():  # made on the main stream, read next on the side stream
                t.record_stream(self._side)
            return done
        ready = torch.cuda.Event()
        ready.record()  # the main stream: the latents are final once it gets here
        with torch.cuda.stream(self._side):
            self._side.wait_event(ready)
            latents.record_stream(self._side)
            return self._decode(latents, start, end)

    def _decode(self, latents: torch.Tensor, start, end) -> _OnSide:
        """The decode and the frames' copy to pinned host memory, queued on the current stream between ``start``
        and ``end``."""
        start.record()
        frames = self._decoder.push_device(latents).contiguous()
        host = torch.empty(frames.shape, dtype=frames.dtype, pin_memory=True)
        host.copy_(frames, non_blocking=True)
        end.record()
        return _OnSide(host, start, end, (latents, frames))


@dataclass
class _Entry:
    decoding: Decoded | _OnSide
    info: object


class DecodeQueue:
    """Chunks between their DiT and their hand-out (the module's rules). ``decoder``: a
    :class:`~fastwan.vae.stream.StreamDecoder`; ``overlap``: the stream's setting, fixed for its life; ``side``: the
    CUDA stream overlapped decodes run on (None: a new one). A caller making several streams passes one side stream
    to all (the generator's ``decode_stream``): the caching allocator reuses a block only on the stream that freed
    it, so a new side stream per video would allocate its decode's memory afresh, on the first chunk's path."""

    def __init__(self, decoder, device: torch.device, overlap: bool, side: torch.cuda.Stream | None = None):
        self.lag = 1 if overlap else 0
        self._device = device
        self._side = overlap and device.type == "cuda"
        self.clock = EventClock() if self._side else HostClock(device)
        if self._side:
            self._decode = SideStreamDecode(decoder, torch.cuda.Stream(device) if side is None else side)
        else:
            self._decode = InlineDecode(decoder, self.clock)
        self._pending: deque[_Entry] = deque()

    @property
    def waiting(self) -> int:
        """Chunks put and not yet popped."""
        return len(self._pending)

    def may_wait(self, put: int, last: bool) -> int:
        """How many chunks may stay queued after the ``put``-th chunk (1-based). Rule: the first chunk and the last
        leave at once (the first's frames are the stream's first, whose latency must not include the next chunk's
        DiT); the others lag by :attr:`lag`."""
        return 0 if last or put == 1 else self.lag

    def put(self, latents: torch.Tensor, info, at_once: bool = False) -> None:
        """Queue the decode of a chunk's clean latents, on the current stream after its DiT work; ``info`` comes
        back with its frames. ``at_once``: the chunk leaves before anything else is queued (:meth:`may_wait` gave
        0), so its decode runs on the main stream (see the module's rules)."""
        self._pending.append(_Entry(self._decode.submit(latents, at_once), info))

    def pop(self) -> tuple[np.ndarray, float, object]:
        """The oldest chunk: (frames uint8 [t, H, W, 3], decode seconds, its info), once its frames are on the
        host."""
        entry = self._pending.popleft()
        frames, seconds = entry.decoding.wait()
        return frames, seconds, entry.info

    def drop(self) -> None:
        """Wait for the device's queued work (both streams), then forget the chunks not handed out."""
        if self._side:
            sync(self._device)
        self._pending.clear()


__all__ = ["DecodeQueue", "EventClock", "HostClock", "InlineDecode", "SideStreamDecode"]
