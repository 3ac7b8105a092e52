"""How a causal (autoregressive, few-step) Wan checkpoint samples: :class:`CausalRecipe`.

A causal DiT (Self-Forcing, CausVid, FastVideo's ``WanCausalDMDPipeline`` checkpoints) makes a video chunk after
chunk: ``frames_per_chunk`` latent frames at a time, each chunk denoised in ``len(timesteps)`` steps while its
self-attention reads the keys and values its earlier chunks left in a cache; after its last step the clean chunk
runs once more at ``context_noise`` to write its own keys and values (the published rule: the cache holds clean
context). ``window_frames`` bounds how many latent frames (the current chunk's included) the self-attention sees,
``sink_frames`` of them always the first ones (attention sinks): with a window, memory stays flat however long the
video runs. ``context_frames``: the latent frames the model was trained to attend to (Self-Forcing's and
FastVideo's cache: 21, the 81-frame video); a stream longer than that without a window rolls a window of that many.
"""
from __future__ import annotations

from dataclasses import dataclass

from fastwan.errors import InvalidArgument


@dataclass(frozen=True)
class CausalRecipe:
    """The sampling rule of a causal checkpoint (checked when built).

    ``timesteps``: the denoising steps of every chunk on the 0..1000 scale, first to last; with ``warp`` each
    ``t`` is replaced by the shifted schedule's timestep at index ``1000 - t`` (Self-Forcing's
    ``warp_denoising_step``: 1000/750/500/250 at shift 5 -> 1000, 937.5, 833.3, 625); ``shift``: the flow shift of
    that 1000-step schedule (sigma = shift * s / (1 + (shift - 1) * s), s from 1 down to 1/1000).
    """

    frames_per_chunk: int = 3
    timesteps: tuple[float, ...] = (1000.0, 750.0, 500.0, 250.0)
    warp: bool = True
    shift: float = 5.0
    context_noise: float = 0.0
    window_frames: int | None = None
    sink_frames: int = 0
    context_frames: int = 21

    def __post_init__(self):
        if not (isinstance(self.frames_per_chunk, int) and self.frames_per_chunk >= 1):
            raise InvalidArgument(f"frames_per_chunk={self.frames_per_chunk!r} must be an int >= 1 (latent frames "
                                  "made per chunk; Self-Forcing uses 3).")
        if not self.timesteps or any(not 0 < float(t) <= 1000 for t in self.timesteps):
            raise InvalidArgument(f"timesteps={self.timesteps!r} must be one or more values in (0, 1000], first to "
                                  "last (Self-Forcing: 1000, 750, 500, 250).")
        if self.warp and any(float(t) != int(t) for t in self.timesteps):
            raise InvalidArgument(f"timesteps={self.timesteps!r}: with warp=True each must be a whole number (an "
                                  "index into the 1000-step schedule); pass whole numbers or warp=False.")
        if not self.shift > 0:
            raise InvalidArgument(f"shift={self.shift!r} must be > 0 (the flow shift; Self-Forcing uses 5).")
        if not 0 <= self.context_noise < 1000:
            raise InvalidArgument(f"context_noise={self.context_noise!r} must be in [0, 1000) (the timestep the clean "
                                  "chunk is run at to write its keys and values; 0 is the published rule).")
        if self.window_frames is not None and not (isinstance(self.window_frames, int)
                                                   and self.window_frames >= 2 * self.frames_per_chunk):
            raise InvalidArgument(
                f"window_frames={self.window_frames!r} must be None (every earlier frame) or an int >= "
                f"2 x frames_per_chunk = {2 * self.frames_per_chunk} (the current chunk and at least one before it).")
        if not (isinstance(self.context_frames, int) and self.context_frames >= 2 * self.frames_per_chunk):
            raise InvalidArgument(f"context_frames={self.context_frames!r} must be an int >= 2 x frames_per_chunk = "
                                  f"{2 * self.frames_per_chunk} (the latent frames the model attends to; 21 for "
                                  "Self-Forcing).")
        if not (isinstance(self.sink_frames, int) and self.sink_frames >= 0):
            raise InvalidArgument(f"sink_frames={self.sink_frames!r} must be an int >= 0.")
        if self.sink_frames and (self.window_frames is None
                                 or self.sink_frames > self.window_frames - 2 * self.frames_per_chunk):
            raise InvalidArgument(
                f"sink_frames={self.sink_frames} needs a window_frames of at least sink_frames + 2 x "
                f"frames_per_chunk = {self.sink_frames + 2 * self.frames_per_chunk} (got {self.window_frames}); "
                "sinks are kept only when a window drops older frames.")

    def sigma(self, t: float) -> float:
        """The noise level of timestep ``t``: the sigma of the nearest of the shifted 1000-step schedule's timesteps
        (the published code looks sigmas up so; a warped step is one of them exactly)."""
        table = self._table()
        i = min(range(len(table)), key=lambda j: abs(table[j] - float(t)))
        return table[i] / 1000.0

    def _table(self) -> tuple[float, ...]:
        """The shifted 1000-step schedule's timesteps, 1000 sigma_i for s_i = 1 - i / 1000, i = 0 .. 999."""
        out = []
        for i in range(1000):
            s = 1.0 - i / 1000.0
            out.append(1000.0 * self.shift * s / (1.0 + (self.shift - 1.0) * s))
        return tuple(out)

    def schedule(self) -> tuple[float, ...]:
        """Each step's timestep (0..1000] after the warp: with ``warp``, entry ``1000 - t`` of the shifted
        1000-step schedule, s_i = 1 - i / 1000, sigma_i = shift s_i / (1 + (shift - 1) s_i), timestep 1000 sigma_i."""
        if not self.warp:
            return tuple(float(t) for t in self.timesteps)
        table = self._table()
        return tuple(table[1000 - int(t)] for t in self.timesteps)
