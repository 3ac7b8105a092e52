"""The memory planner: which offload levers a job needs to fit a GPU memory budget (pure arithmetic on bytes).

Symbols (from :class:`Footprint`): T text_encoder, Tl text_encoder_layer, TL text_encoder_layers, I image_encoder,
V vae, D the experts' weights (D[0] high-noise, D[-1] low-noise), B dit_block, A_t text_activations, A_d
dit_activations, A_v vae_decode (vae_decode_tiled with tiling); k streamed_blocks. A component on the GPU in a
phase counts its weights. The peak bytes of each phase are:

* encode  = TE + I + V + A_t + DiT_enc, where TE = T, or T - TL*Tl + 2*Tl when the text encoder is "stream" (two
  layer slots), and DiT_enc = 0 with dit_offload, D[0] with experts "swap" (the expert that denoises first), else
  sum(D).
* denoise = DiT_den + V + A_d + (T + I when the text encoder is "resident"; an image encoder leaves the GPU with
  the text encoder), where DiT_den sums, over the experts on the GPU (max(D) alone with "swap", else every D[j]),
  each expert's E - k*B + 2*B when k > 0 (two block slots per streaming expert), else E.
* decode  = V + A_v + DiT_dec + (T + I when "resident"), where DiT_dec = 0 with dit_offload, D[-1] with "swap"
  (the expert that denoised last), else sum(D); streamed blocks are counted as on the GPU (an upper bound).

The peak of a plan is the largest phase peak. :func:`plan_offload` starts from everything resident and applies the
levers in a fixed order, each only while the plan's peak exceeds the budget and only if it lowers a phase that is
over the budget: text encoder "offload", experts "swap" (two experts only), dit_offload, vae_tiling, text encoder
"stream" (encode over), then the smallest k that brings denoise within the budget (denoise over).
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

from fastwan.errors import InvalidArgument

GiB = 2**30
PHASES = ("encode", "denoise", "decode")

# Units are binary: GB, MB, KB and TB are read as GiB, MiB, KiB and TiB (GPU memory is sold in binary units).
_UNITS = {"b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20, "mib": 2**20,
          "g": GiB, "gb": GiB, "gib": GiB, "t": 2**40, "tb": 2**40, "tib": 2**40}
_SIZE = re.compile(r"\s*([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:e[-+]?\d+)?|[-+]?(?:nan|inf(?:inity)?))\s*([a-z]*)\s*",
                   re.IGNORECASE)


def gib(n: int) -> str:
    """``n`` bytes as GiB with two decimals, e.g. '23.50 GiB'."""
    return f"{n / GiB:.2f} GiB"


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class Footprint:
    """Bytes of each component's weights as they will sit on the GPU, and activation peaks of each phase."""
    text_encoder: int           # whole text encoder weights
    text_encoder_layer: int     # its largest streamable layer (block)
    text_encoder_layers: int    # number of streamable layers
    text_activations: int       # peak activations while encoding the prompts
    image_encoder: int          # 0 when the checkpoint has none
    vae: int
    dit: tuple[int, ...]        # each expert's total weight bytes (1 or 2 experts, high-noise first)
    dit_block: int              # the largest DiT block's streamable bytes (excluding the kept cross-attention K/V)
    dit_blocks: int             # blocks per expert
    dit_activations: int        # peak activations of one DiT forward at the job's size (incl. CFG batching)
    vae_decode: int             # decode peak activations, untiled
    vae_decode_tiled: int       # decode peak activations with spatial tiling

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            for x in (v if f.name == "dit" else (v,)):
                if not _is_int(x) or x < 0:
                    raise InvalidArgument(f"Footprint.{f.name}={v!r}: sizes and counts are non-negative ints.")
        if not isinstance(self.dit, tuple) or len(self.dit) not in (1, 2):
            raise InvalidArgument(f"Footprint.dit={self.dit!r} must be a tuple of 1 or 2 experts' weight bytes.")
        if self.text_encoder_layers * self.text_encoder_layer > self.text_encoder:
            raise InvalidArgument(f"Footprint: {self.text_encoder_layers} text encoder layers of "
                                  f"{self.text_encoder_layer} bytes exceed text_encoder={self.text_encoder}; "
                                  "give the largest layer's bytes and the layer count.")
        if self.dit_blocks * self.dit_block > min(self.dit):
            raise InvalidArgument(f"Footprint: {self.dit_blocks} DiT blocks of {self.dit_block} bytes exceed the "
                                  f"smallest expert's {min(self.dit)} bytes; give the largest block's streamable "
                                  "bytes and the blocks per expert.")


@dataclass(frozen=True)
class OffloadPlan:
    """The levers chosen for one job and the expected peak bytes of each phase (see the module docstring)."""
    text_encoder: str     # "resident" (always on the GPU), "offload" (on the GPU only while encoding), "stream"
    #                       (layer by layer from the host while encoding)
    experts: str          # "resident" (all experts on the GPU) or "swap" (only the expert in use); "resident" for one
    dit_offload: bool     # the DiT leaves the GPU while encoding and decoding
    vae_tiling: bool
    streamed_blocks: int  # DiT blocks per expert streamed from the host during denoising (0: none)
    peaks: dict[str, int]  # expected peak bytes per phase: "encode", "denoise", "decode"

    @property
    def peak(self) -> int:
        """The largest phase peak, bytes."""
        return max(self.peaks.values())

    def levers(self) -> list[str]:
        """The levers that are on, in the planner's order, e.g. ['text_encoder=offload', 'experts=swap']."""
        out = [] if self.text_encoder == "resident" else [f"text_encoder={self.text_encoder}"]
        out += ["experts=swap"] if self.experts == "swap" else []
        out += ["dit_offload"] if self.dit_offload else []
        out += ["vae_tiling"] if self.vae_tiling else []
        out += [f"streamed_blocks={self.streamed_blocks}"] if self.streamed_blocks else []
        return out

    def describe(self) -> str:
        """A few human lines: each lever that is on, then the expected peak per phase."""
        lines = {
            "text_encoder": {"offload": "text encoder: offloaded (on the GPU only while encoding)",
                             "stream": "text encoder: streamed layer by layer from host memory while encoding"},
            "experts": {"swap": "experts: only the expert in use on the GPU (swapped at the boundary)"},
            "dit_offload": {True: "DiT: off the GPU while encoding and decoding"},
            "vae_tiling": {True: "VAE: spatially tiled decode"},
        }
        out = [text for key, opts in lines.items() for val, text in opts.items() if getattr(self, key) == val]
        if self.streamed_blocks:
            out.append(f"DiT: {self.streamed_blocks} blocks per expert streamed from host memory while denoising")
        out = out or ["all weights resident on the GPU (no offloading)"]
        out.append("expected peak: " + ", ".join(f"{p} {gib(self.peaks[p])}" for p in PHASES))
        return "\n".join(out)


def _te_encode(fp: Footprint, mode: str) -> int:
    if mode == "stream":
        return fp.text_encoder - fp.text_encoder_layers * fp.text_encoder_layer + 2 * fp.text_encoder_layer
    return fp.text_encoder


def _dit_denoise(fp: Footprint, swap: bool, k: int) -> int:
    experts = (max(fp.dit),) if swap else fp.dit
    return sum(e - k * fp.dit_block + 2 * fp.dit_block if k else e for e in experts)


def _dit_idle(fp: Footprint, swap: bool, dit_offload: bool, first: bool) -> int:
    """DiT bytes on the GPU while encoding (``first``) or decoding."""
    if dit_offload:
        return 0
    return (fp.dit[0] if first else fp.dit[-1]) if swap else sum(fp.dit)


def phase_peaks(fp: Footprint, text_encoder: str, experts: str, dit_offload: bool, vae_tiling: bool,
                streamed_blocks: int) -> dict[str, int]:
    """Peak bytes of each phase for these levers (the formulas of the module docstring)."""
    swap = experts == "swap"
    resident = fp.text_encoder + fp.image_encoder if text_encoder == "resident" else 0
    vae_act = fp.vae_decode_tiled if vae_tiling else fp.vae_decode
    return {
        "encode": _te_encode(fp, text_encoder) + fp.image_encoder + fp.vae + fp.text_activations
        + _dit_idle(fp, swap, dit_offload, first=True),
        "denoise": _dit_denoise(fp, swap, streamed_blocks) + fp.vae + fp.dit_activations + resident,
        "decode": fp.vae + vae_act + _dit_idle(fp, swap, dit_offload, first=False) + resident,
    }


def _make(fp: Footprint, text_encoder: str = "resident", experts: str = "resident", dit_offload: bool = False,
          vae_tiling: bool = False, streamed_blocks: int = 0) -> OffloadPlan:
    levers = dict(text_encoder=text_encoder, experts=experts, dit_offload=dit_offload, vae_tiling=vae_tiling,
                  streamed_blocks=streamed_blocks)
    return OffloadPlan(**levers, peaks=phase_peaks(fp, **levers))


def _change(fp: Footprint, plan: OffloadPlan, **change) -> OffloadPlan:
    levers = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan) if f.name != "peaks"}
    return _make(fp, **{**levers, **change})


def _lever(fp: Footprint, plan: OffloadPlan, budget: int, **change) -> OffloadPlan:
    """``plan`` with ``change`` applied if the plan is over ``budget`` and the change lowers an over-budget phase."""
    cand = _change(fp, plan, **change)
    over = [p for p in PHASES if plan.peaks[p] > budget]
    return cand if any(cand.peaks[p] < plan.peaks[p] for p in over) else plan


def _stream_blocks(fp: Footprint, plan: OffloadPlan, budget: int) -> OffloadPlan:
    """The smallest k that brings denoise within ``budget``; if none does, the k with the lowest denoise peak
    (the smallest such k), when it is lower than ``plan``'s."""
    cands = [_change(fp, plan, streamed_blocks=k) for k in range(1, fp.dit_blocks + 1)]
    fits = [c for c in cands if c.peaks["denoise"] <= budget]
    if fits:
        return fits[0]
    best = min(cands, key=lambda c: c.peaks["denoise"], default=plan)
    return best if best.peaks["denoise"] < plan.peaks["denoise"] else plan


def _check_budget(budget) -> int:
    if not _is_int(budget) or budget <= 0:
        raise InvalidArgument(f"max_gpu_memory={budget!r} is not a positive int of bytes; give bytes as an int, a "
                              "size string such as '24GiB' (parse_memory), or None for no limit.")
    return budget


def reserve(total: int) -> int:
    """Bytes of a budget ``total`` a plan leaves free for the CUDA caching allocator: max(1 GiB, 1/16 of it)
    (:func:`fastwan.offload.placement.usable` says why)."""
    return max(GiB, total // 16)


def _gib_up(n: int) -> str:
    """``n`` bytes as GiB rounded up to two decimals (a budget of that size holds ``n``)."""
    return f"{math.ceil(n * 100 / GiB) / 100:.2f} GiB"


class Usable(int):
    """The bytes of a user's budget ``total`` that a plan may fill (``total - reserve(total)``): an int that keeps
    ``total``, so that a budget too small is reported as the user gave it, with the budget the job needs."""

    def __new__(cls, total: int) -> Usable:
        total = _check_budget(total)
        if total <= reserve(total):
            raise InvalidArgument(f"max_gpu_memory={gib(total)} leaves nothing to plan with: {gib(reserve(total))} "
                                  "of a budget stays free for the CUDA caching allocator (at least 1 GiB); give a "
                                  "larger max_gpu_memory, e.g. '8GiB'.")
        self = super().__new__(cls, total - reserve(total))
        self.total = total
        return self

    @staticmethod
    def needed(peak: int) -> int:
        """The smallest budget whose usable part holds ``peak`` bytes."""
        lo, hi = peak, peak + GiB + peak // 8 + 16  # total - reserve(total) never decreases as total grows
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if mid - reserve(mid) >= peak else (mid + 1, hi)
        return lo


def _too_small(plan: OffloadPlan, budget: int) -> InvalidArgument:
    phase = max(PHASES, key=lambda p: plan.peaks[p])
    over = [p for p in PHASES if plan.peaks[p] > budget]
    peaks = ", ".join(f"{p} {gib(plan.peaks[p])}" for p in PHASES)
    levers = ", ".join(plan.levers()) or "none"
    given, need = gib(budget), ""
    if isinstance(budget, Usable):
        given = gib(budget.total)
        need = (f" With {gib(budget.total - budget)} of the budget kept free for the CUDA caching allocator, these "
                f"levers need max_gpu_memory of at least {_gib_up(Usable.needed(plan.peak))}.")
    return InvalidArgument(
        f"max_gpu_memory={given} is too small for this job: the smallest reachable peak is "
        f"{gib(plan.peak)} in the {phase} phase (levers: {levers}; {peaks}; over the budget: {', '.join(over)})."
        f"{need} Fix: FP8 DiT weights (quantization='fp8', unless they are already), a smaller video (fewer frames "
        "or pixels), or a larger max_gpu_memory.")


def plan_offload(fp: Footprint, budget: int | None) -> OffloadPlan:
    """The levers that fit ``fp`` into ``budget`` bytes of GPU memory (None: no limit, everything resident; a
    :class:`Usable`: the part of a user's budget a plan may fill). Raises InvalidArgument when no plan fits."""
    plan = _make(fp)
    if budget is None:
        return plan
    budget = _check_budget(budget)
    swap = [dict(experts="swap")] if len(fp.dit) == 2 else []
    for change in [dict(text_encoder="offload"), *swap, dict(dit_offload=True), dict(vae_tiling=True)]:
        if plan.peak > budget:
            plan = _lever(fp, plan, budget, **change)
    if plan.peaks["encode"] > budget:
        plan = _lever(fp, plan, budget, text_encoder="stream")
    if plan.peaks["denoise"] > budget:
        plan = _stream_blocks(fp, plan, budget)
    if plan.peak > budget:
        raise _too_small(plan, budget)
    return plan


def parse_memory(value, name: str = "max_gpu_memory") -> int | None:
    """A memory size -> bytes: an int is bytes; a string is a number and a binary unit ("24GiB", "24 GiB", "24GB",
    "8g", "512MiB", "1.5TiB"; GB/MB/KB/TB read as GiB/MiB/KiB/TiB). None -> None (no limit). Errors name the
    value as ``name=value``."""
    if value is None:
        return None
    if _is_int(value):
        if value <= 0:
            raise InvalidArgument(f"{name}={value!r} must be a positive number of bytes.")
        return value
    if not isinstance(value, str):
        raise InvalidArgument(f"{name}={value!r} is a {type(value).__name__}; give an int of bytes or a "
                              "string with a unit, such as '24GiB' or '512MiB'.")
    m = _SIZE.fullmatch(value)
    if m is None:
        raise InvalidArgument(f"{name}={value!r} is not a number with a unit; write it like '24GiB' or '512MiB'.")
    num, unit = float(m.group(1)), m.group(2).lower()
    if not math.isfinite(num) or num <= 0:  # checked before the unit: no unit makes '0' or 'inf' a size
        raise InvalidArgument(f"{name}={value!r} must be a finite positive size, e.g. '24GiB'.")
    if not unit:
        raise InvalidArgument(f"{name}={value!r} has no unit; add one, e.g. '{m.group(1)}GiB' (from Python, "
                              "an int of bytes needs no unit).")
    if unit not in _UNITS:
        raise InvalidArgument(f"{name}={value!r} has unknown unit {m.group(2)!r}; use B, KiB, MiB, GiB or TiB "
                              "(K/KB, M/MB, G/GB, T/TB read as binary units).")
    size = int(num * _UNITS[unit])
    if size <= 0:
        raise InvalidArgument(f"{name}={value!r} is less than one byte; give a size such as '512MiB'.")
    return size
