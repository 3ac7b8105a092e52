"""Training-free step caching: skip the DiT's blocks at steps where their output barely changes.

Each method is a frozen config; a request builds one :class:`PassCache` per CFG pass and expert from it (the
conditional and unconditional passes decide separately, as diffusers' cache contexts do; a Wan2.2 A14B expert
starts with fresh state at the switch). A skipped forward still embeds its input and runs the output head; only the
blocks are replaced:

* :class:`FirstBlockCache` (diffusers' ``apply_first_block_cache``): block 0 always runs; if the mean absolute change
  of its residual (output - input) since the last computed step, relative to that step's, is at most
  ``threshold``, the other blocks are skipped and block 0's output plus their cached residual is the output.
* :class:`TeaCache` (TeaCache for Wan2.1): the relative mean absolute change of the timestep modulation since the
  previous step, rescaled by the model's published polynomial, is accumulated; below ``threshold`` the whole stack is
  skipped (input plus the last computed residual), otherwise it runs and the sum restarts. The first steps (5 with
  ``use_ret_steps``, else 1) and, without ``use_ret_steps``, the last step always run.
* :class:`MagCache` (diffusers' ``MagCacheConfig``): from step ``round(retention_ratio * N)`` on, the product of the
  model's per-step residual magnitude ratios is accumulated and its distance from 1 summed; while that error is at
  most ``threshold`` and at most ``max_skip_steps`` steps were skipped in a row, the stack is skipped (input plus
  the last residual). ``calibrate=True`` never skips and records the curve of the model it runs. On Wan2.2 A14B the
  retention steps and ratios follow the request's step index across both experts (the calibrated curve runs over
  them in order); diffusers' per-transformer hooks count the second expert's steps from 0 instead.
* :class:`TaylorSeer` (diffusers' ``TaylorSeerCacheConfig``, :mod:`fastwan.cache.taylorseer`): after a warm-up, the
  blocks compute every ``cache_interval`` steps; between, the stream after the last block is a Taylor expansion of the
  computed streams' divided differences (up to ``max_order``) in the step index.
* :class:`SkipSteps`: the listed steps reuse the last computed residual (a fixed schedule, e.g. for measurements).

A threshold of 0 turns a method off (the request runs as without a cache, bit for bit; a calibrating MagCache,
which never skips, still calibrates). A request whose step count leaves the method no step it could skip, or that
lacks a step SkipSteps lists, is refused before its denoising loop.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from fastwan.cache.checks import flag, floats, number
from fastwan.cache.taylorseer import TaylorSeer, TaylorState
from fastwan.errors import InvalidArgument, InvalidArgumentType

# TeaCache's published polynomials for Wan2.1 (TeaCache4Wan2.1): by model, for the time embedding ("e") and, with
# use_ret_steps, the time projection ("e0"); highest power first.
TEACACHE_COEFFICIENTS = {
    "t2v-1.3b": {"e": (2.39676752e03, -1.31110545e03, 2.01331979e02, -8.29855975e00, 1.37887774e-01),
                 "e0": (-5.21862437e04, 9.23041404e03, -5.28275948e02, 1.36987616e01, -4.99875664e-02)},
    "t2v-14b": {"e": (-5784.54975374, 5449.50911966, -1811.16591783, 256.27178429, -13.02252404),
                "e0": (-3.03318725e05, 4.90537029e04, -2.65530556e03, 5.87365115e01, -3.15583525e-01)},
    "i2v-480p": {"e": (-3.02331670e02, 2.23948934e02, -5.25463970e01, 5.87348440e00, -2.01973289e-01),
                 "e0": (2.57151496e05, -3.54229917e04, 1.40286849e03, -1.35890334e01, 1.32517977e-01)},
    "i2v-720p": {"e": (-114.36346466, 65.26524496, -18.82220707, 4.91518089, -0.23412683),
                 "e0": (8.10705460e03, 2.13393892e03, -3.72934672e02, 1.66203073e01, -4.17769401e-02)},
}


@dataclass(frozen=True)
class FirstBlockCache:
    """diffusers' First-Block cache. ``threshold``: relative change of block 0's residual up to which the other
    blocks are skipped (diffusers' default 0.05)."""
    threshold: float = 0.05
    name: ClassVar[str] = "first_block"

    def __post_init__(self):
        number("FirstBlockCache", "threshold", self.threshold)


@dataclass(frozen=True)
class TeaCache:
    """TeaCache for Wan2.1. ``coefficients``: the rescaling polynomial, highest power first (None: the published one
    for the checkpoint: Wan2.1 T2V 1.3B / 14B, I2V 480p / 720p); ``use_ret_steps``: TeaCache's "retention steps"
    mode (the time projection, 5 warm-up steps) instead of the time embedding with the first and last step run."""
    threshold: float = 0.08
    coefficients: tuple[float, ...] | None = None
    use_ret_steps: bool = True
    name: ClassVar[str] = "teacache"

    def __post_init__(self):
        number("TeaCache", "threshold", self.threshold)
        object.__setattr__(self, "coefficients", floats("TeaCache", "coefficients", self.coefficients))
        flag("TeaCache", "use_ret_steps", self.use_ret_steps)


@dataclass(frozen=True)
class MagCache:
    """diffusers' MagCache. ``mag_ratios``: the model's per-step residual magnitude ratios (any length: resampled to
    the step count by nearest neighbour); required unless ``calibrate`` (which records them and never skips)."""
    threshold: float = 0.06
    max_skip_steps: int = 3
    retention_ratio: float = 0.2
    mag_ratios: tuple[float, ...] | None = None
    calibrate: bool = False
    name: ClassVar[str] = "magcache"

    def __post_init__(self):
        number("MagCache", "threshold", self.threshold)
        number("MagCache", "max_skip_steps", self.max_skip_steps, lo=1, integer=True)
        number("MagCache", "retention_ratio", self.retention_ratio, hi=1.0)
        flag("MagCache", "calibrate", self.calibrate)
        if isinstance(self.mag_ratios, Mapping):
            raise InvalidArgumentType(f"MagCache(mag_ratios=...): got a mapping with keys {sorted(self.mag_ratios)}; "
                                      "pass one curve, e.g. result.cache['calibration']['cond'].")
        object.__setattr__(self, "mag_ratios", floats("MagCache", "mag_ratios", self.mag_ratios, positive=True))
        if self.mag_ratios is None and not self.calibrate:
            raise InvalidArgument("MagCache(mag_ratios=None): the ratios are model-specific; pass the model's curve, "
                                  "or run once with MagCache(calibrate=True) and pass "
                                  "result.cache['calibration']['cond'].")
        if self.mag_ratios is not None and self.calibrate:
            raise InvalidArgument("MagCache(calibrate=True, mag_ratios=...): calibration never skips and records a "
                                  "new curve, so the given ratios would be ignored; drop mag_ratios or calibrate.")


@dataclass(frozen=True)
class SkipSteps:
    """Skip the blocks at the listed step indices (each reuses the residual of the last computed step; step 0
    always computes). ``first_block``: block 0 still runs at a skipped step and the others reuse their residual
    (the First-Block cache's mechanism on a fixed schedule)."""
    steps: tuple[int, ...] = ()
    first_block: bool = False
    name: ClassVar[str] = "skip_steps"

    def __post_init__(self):
        flag("SkipSteps", "first_block", self.first_block)
        if isinstance(self.steps, (str, bytes)) or not hasattr(self.steps, "__iter__"):
            raise InvalidArgumentType(f"SkipSteps(steps={self.steps!r}): must be a list of step indices.")
        steps = tuple(self.steps)
        if not steps:
            raise InvalidArgument("SkipSteps(steps=()): no step to skip; list the step indices (>= 1; step 0 always "
                                  "computes), e.g. SkipSteps((10, 11, 12)) or 'skip_steps:steps=10-12', or pass "
                                  "cache=None.")
        for s in steps:
            number("SkipSteps", "steps", s, lo=1, integer=True)
        object.__setattr__(self, "steps", tuple(sorted(set(int(s) for s in steps))))


CACHES = {c.name: c for c in (FirstBlockCache, TeaCache, MagCache, TaylorSeer, SkipSteps)}
CacheConfig = FirstBlockCache | TeaCache | MagCache | TaylorSeer | SkipSteps
MAX_RANGE = 100_000  # the most steps one 'a-b' range of the CLI form may name
# the form of each setting in the CLI form, for its error messages
FORMS = {"threshold": "a number >= 0", "max_skip_steps": "an int >= 1", "retention_ratio": "a number in [0, 1]",
         "coefficients": "numbers separated by ',' or '/' (highest power first), or @file.json",
         "mag_ratios": "positive numbers separated by ',' or '/', or @file.json",
         "steps": "step indices >= 1 separated by ',' or '/', ranges a-b (a <= b), or @file.json",
         "use_ret_steps": "true or false", "calibrate": "true or false", "first_block": "true or false",
         "cache_interval": "an int >= 2", "disable_cache_before_step": "an int >= 1",
         "disable_cache_after_step": "an int, or none", "max_order": "an int in [0, 4]",
         "taylor_factors_dtype": "bfloat16, float16 or float32"}
INTS = ("max_skip_steps", "cache_interval", "disable_cache_before_step", "max_order")  # int settings (besides steps)
LISTS = ("coefficients", "mag_ratios", "steps")  # the settings whose value is a list
# one valid CLI form of each type, shown when a setting cannot be read
EXAMPLES = {"first_block": "first_block:threshold=0.05", "teacache": "teacache:threshold=0.1,use_ret_steps=true",
            "magcache": "magcache:threshold=0.1,mag_ratios=@ratios.json",
            "taylorseer": "taylorseer:cache_interval=4,max_order=2",
            "skip_steps": "skip_steps:steps=2,4,10-12,first_block=true"}


def check_cache(cache) -> CacheConfig | None:
    """``cache`` (a config, None, or its CLI form as :func:`parse_cache` reads it) -> a config or None; a
    threshold of 0 is None (off)."""
    if cache is None:
        return None
    if isinstance(cache, str):
        cache = parse_cache(cache)
        if cache is None:
            return None
    if not isinstance(cache, tuple(CACHES.values())):
        raise InvalidArgumentType(f"cache={cache!r} must be one of {', '.join(c.__name__ for c in CACHES.values())}"
                                  " (from fastwan.cache), a string such as 'teacache:threshold=0.1', or None.")
    if isinstance(cache, MagCache) and cache.calibrate:
        return cache  # calibration never skips: its threshold does not turn it off
    return None if getattr(cache, "threshold", None) == 0 else cache  # SkipSteps has no threshold


def check_steps(cache: CacheConfig | None, num_steps: int) -> None:
    """Raises when ``cache`` names steps that a request of ``num_steps`` steps does not have (SkipSteps), or when
    its rule can skip none of them (a cache that cannot act is refused, not run as none; MagCache's calibration,
    which never skips, excepted)."""
    if isinstance(cache, SkipSteps):
        beyond = [s for s in cache.steps if s >= num_steps]
        if beyond:
            raise InvalidArgument(f"SkipSteps(steps={list(cache.steps)}): step(s) {beyond[:8]} do not exist in this "
                                  f"request of {num_steps} step(s) (indices 0..{num_steps - 1}; step 0 always "
                                  "computes); list steps below the step count, or raise num_inference_steps.",
                                  field="cache")
        return
    if cache is None or isinstance(cache, MagCache) and cache.calibrate:
        return
    # the steps the rule may skip: first..last (step 0 has no residual to reuse)
    first, last, rule = 1, num_steps - 1, "step 0 always computes"
    if isinstance(cache, TeaCache):
        first, last = (5, num_steps - 1) if cache.use_ret_steps else (1, num_steps - 2)
        rule = ("steps 0-4 always compute (use_ret_steps=True)" if cache.use_ret_steps
                else "the first and the last step always compute (use_ret_steps=False)")
    elif isinstance(cache, MagCache):
        first = max(1, int(cache.retention_ratio * num_steps + 0.5))
        rule = f"steps before round(retention_ratio * steps) = {first} always compute"
    elif isinstance(cache, TaylorSeer):
        first = cache.first_predicted(num_steps)
        first = num_steps if first is None else first
        rule = f"steps before disable_cache_before_step={cache.disable_cache_before_step} always compute"
        if cache.disable_cache_after_step is not None:
            rule += f", and those from disable_cache_after_step={cache.disable_cache_after_step} on"
    if first > last:
        raise InvalidArgument(f"cache={cache!r} cannot skip any step of a request of {num_steps} step(s): {rule}. "
                              "Run more steps, or pass cache=None (or 'none').", field="cache")


def _parse_value(name: str, field: str, text: str):
    if field in LISTS:
        if text.startswith("@"):
            path = Path(text[1:])
            try:
                return json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                raise InvalidArgument(f"cache {name!r} (CLI --cache): {field}={text!r}: cannot read a JSON list "
                                      f"from {path} ({exc}).") from None
        if text.startswith("[") and text.endswith("]"):
            text = text[1:-1]
        out = []
        for part in text.replace(",", "/").split("/"):
            if field == "steps" and "-" in part:
                lo, _, hi = part.partition("-")
                lo, hi = int(lo), int(hi)
                if not 0 <= hi - lo <= MAX_RANGE:
                    raise InvalidArgument(f"cache {name!r} (CLI --cache): steps range {part!r} must be a-b with "
                                          f"a <= b and at most {MAX_RANGE} steps, e.g. 10-20.")
                out.extend(range(lo, hi + 1))
            else:
                out.append(int(part) if field == "steps" else float(part))
        return out
    if field in ("use_ret_steps", "calibrate", "first_block"):
        if text.lower() not in ("true", "false", "1", "0"):
            raise InvalidArgument(f"cache {name!r} (CLI --cache): {field}={text!r} must be true or false.")
        return text.lower() in ("true", "1")
    if field == "taylor_factors_dtype":
        return text
    if field == "disable_cache_after_step":
        return None if text.lower() == "none" else int(text)
    return int(text) if field in INTS else float(text)


def _settings(text: str, rest: str, example: str) -> list[tuple[str, str]]:
    """'key=value,...' -> [(key, value), ...]. A list's items are separated by ',' or '/' (optionally in
    brackets): a part without '=' after a list setting is its next item ('steps=2,4' is steps 2 and 4)."""
    out: list[tuple[str, str]] = []
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq and out and out[-1][0] in LISTS:
            out[-1] = (out[-1][0], f"{out[-1][1]},{item}")
            continue
        if not eq:
            raise InvalidArgument(f"cache={text!r} (CLI --cache): {item!r} is not KEY=VALUE; the form is "
                                  f"TYPE:KEY=VALUE,KEY=VALUE,... with list items separated by ',' or '/', "
                                  f"e.g. {example!r}.")
        out.append((key, value))
    return out


def parse_cache(text: str) -> CacheConfig | None:
    """'none' | 'TYPE[:key=value,...]' -> config. Lists (coefficients, mag_ratios, steps) are ',' or
    '/'-separated, optionally in brackets (steps also 'a-b' ranges), or '@file.json'. E.g.
    'magcache:threshold=0.1,mag_ratios=@wan13b.json', 'skip_steps:steps=2,4,10-20'."""
    name, _, rest = text.strip().partition(":")
    if name.lower() == "none":
        if rest:
            raise InvalidArgument(f"cache={text!r} (CLI --cache): 'none' takes no settings; pass 'none' alone, or a "
                                  f"cache type ({', '.join(CACHES)}) with its settings.")
        return None
    cls = CACHES.get(name.lower())
    if cls is None:
        raise InvalidArgument(f"cache={text!r} (CLI --cache): unknown type {name!r}; use none, {', '.join(CACHES)}.")
    fields = {f.name for f in dataclasses.fields(cls)}
    example = EXAMPLES[cls.name]
    kwargs = {}
    for key, value in _settings(text, rest, example):
        if key not in fields:
            raise InvalidArgument(f"cache={text!r} (CLI --cache): unknown setting {key!r} of {cls.name}; its "
                                  f"settings are {', '.join(sorted(fields))}, e.g. {example!r}.")
        if key in kwargs:
            raise InvalidArgument(f"cache={text!r} (CLI --cache): {key} is given twice; give each setting once.")
        try:
            kwargs[key] = _parse_value(name, key, value)
        except InvalidArgument:
            raise
        except ValueError:
            raise InvalidArgument(f"cache={text!r} (CLI --cache): {key}={value!r}: must be {FORMS[key]}, e.g. "
                                  f"{example!r}.") from None
    return cls(**kwargs)


def teacache_model(variant: str, dim: int, height: int, width: int) -> str | None:
    """The key of :data:`TEACACHE_COEFFICIENTS` for a checkpoint kind, model width and video size (None: no
    published coefficients)."""
    if variant == "wan2.1":
        return {1536: "t2v-1.3b", 5120: "t2v-14b"}.get(dim)
    if variant == "wan2.1-i2v" and dim == 5120:
        return "i2v-720p" if height * width >= (720 * 1280 + 480 * 832) / 2 else "i2v-480p"
    return None


def resolve_coefficients(cache: CacheConfig | None, variant: str, dim: int, height: int, width: int,
                         num_steps: int | None = None):
    """TeaCache's coefficients for this request (its own, or the published ones); raises when there are none, or
    (given ``num_steps``, the request's step count) as :func:`check_steps` does."""
    if num_steps is not None:
        check_steps(cache, num_steps)
    if not isinstance(cache, TeaCache) or cache.coefficients is not None:
        return None if not isinstance(cache, TeaCache) else cache.coefficients
    model = teacache_model(variant, dim, height, width)
    if model is None:
        raise InvalidArgument(f"TeaCache has no published coefficients for this checkpoint ({variant}, width {dim}); "
                              f"they exist for {', '.join(TEACACHE_COEFFICIENTS)}. Pass TeaCache(coefficients=...) "
                              "fitted for this model, or use FirstBlockCache / MagCache.", field="cache")
    return TEACACHE_COEFFICIENTS[model]["e0" if cache.use_ret_steps else "e"]


def nearest_resample(values: tuple[float, ...], n: int) -> list[float]:
    """``values`` resampled to ``n`` entries by nearest neighbour (the ends kept; ties to even, in float32)."""
    if n == 1:
        return [values[-1]]
    scale = (len(values) - 1) / (n - 1)
    idx = torch.round(torch.arange(n, dtype=torch.float32) * scale).long().tolist()
    return [values[i] for i in idx]


def _rel_l1(a: torch.Tensor, b: torch.Tensor) -> float:
    """mean |a - b| / mean |b| (one host sync)."""
    a, b = a.float(), b.float()
    return ((a - b).abs().mean() / b.abs().mean()).item()


class PassCache:
    """The state of one CFG pass of one expert in one request, asked at each step by the step cache's hook on the
    DiT's blocks (:mod:`fastwan.models.wan.step_cache`).

    The hook calls :meth:`skip_stack` before the blocks (``temb`` / ``mod`` the timestep embedding and modulation)
    and, with a First-Block cache, :meth:`skip_rest` after block 0; it then calls :meth:`stored` with the residual
    of what it ran, or :meth:`reuse` for the output of what it skipped.
    """

    def __init__(self, config: CacheConfig, num_steps: int, coefficients: tuple[float, ...] | None = None):
        self.config, self.num_steps = config, num_steps
        self.coefficients = coefficients
        self.head_decides = isinstance(config, FirstBlockCache) or getattr(config, "first_block", False)
        self.keeps_output = isinstance(config, TaylorSeer)  # stored() takes the blocks' output, not a residual
        self.residual: torch.Tensor | None = None  # last computed residual (FBC: of blocks 1..; else all blocks)
        self.head_residual: torch.Tensor | None = None  # FBC: block 0's, at the last computed step
        self.previous: torch.Tensor | None = None  # TeaCache: the previous step's modulated input
        self.accumulated = 0.0
        self.ratio, self.run_length = 1.0, 0  # MagCache accumulators (with self.accumulated: the error)
        self.ratios = None
        if isinstance(config, MagCache) and not config.calibrate:
            self.ratios = nearest_resample(config.mag_ratios, num_steps)
        self.taylor = TaylorState(config) if isinstance(config, TaylorSeer) else None
        self.computed: list[int] = []
        self.calibration: list[float] = []

    def skip_stack(self, step: int, temb: torch.Tensor, mod: torch.Tensor) -> bool:
        """Whether every block is skipped at ``step`` (the output is then :meth:`reuse`)."""
        c = self.config
        if isinstance(c, TeaCache):
            ret = 5 if c.use_ret_steps else 1
            cutoff = self.num_steps if c.use_ret_steps else self.num_steps - 1
            inp = mod if c.use_ret_steps else temb
            skip = False
            if step < ret or step >= cutoff or self.previous is None:
                self.accumulated = 0.0
            else:
                x = _rel_l1(inp, self.previous)
                self.accumulated += sum(k * x ** p for p, k in enumerate(reversed(self.coefficients)))
                skip = self.accumulated < c.threshold
                if not skip:
                    self.accumulated = 0.0
            self.previous = inp.detach().clone()
            return skip and self.residual is not None
        if isinstance(c, MagCache):
            if c.calibrate or step < int(c.retention_ratio * self.num_steps + 0.5):
                return False
            self.ratio *= self.ratios[step] if step < len(self.ratios) else 1.0
            self.run_length += 1
            self.accumulated += abs(1.0 - self.ratio)
            if self.residual is not None and self.accumulated <= c.threshold and self.run_length <= c.max_skip_steps:
                return True
            self.ratio, self.run_length, self.accumulated = 1.0, 0, 0.0
            return False
        if isinstance(c, SkipSteps) and not c.first_block:
            return step in c.steps and self.residual is not None
        if self.taylor is not None:
            return not self.taylor.computes(step)
        return False

    def skip_rest(self, step: int, head_residual: torch.Tensor) -> bool:
        """First-Block cache: whether blocks 1.. are skipped, from block 0's residual at this step."""
        if isinstance(self.config, SkipSteps):
            return step in self.config.steps and self.residual is not None
        prev = self.head_residual
        if prev is None or self.residual is None:
            return False
        diff = ((head_residual - prev).abs().mean() / prev.abs().mean()).item()  # in the residual's dtype, as diffusers
        return diff <= self.config.threshold

    def reuse(self, x: torch.Tensor) -> torch.Tensor:
        """The output of the skipped blocks: their input plus the cached residual (TaylorSeer: the predicted
        output)."""
        if self.taylor is not None:
            return self.taylor.predict()
        return self.residual + x if self.head_decides else x + self.residual

    def stored(self, step: int, residual: torch.Tensor, head_residual: torch.Tensor | None = None) -> None:
        """Record a computed step's residual (FBC: of blocks 1.., and block 0's; TaylorSeer: the blocks' output,
        :attr:`keeps_output`)."""
        if self.taylor is not None:
            self.taylor.update(residual)
            self.computed.append(step)
            return
        if isinstance(self.config, MagCache) and self.config.calibrate:
            if self.residual is None:
                self.calibration.append(1.0)
            else:
                now = torch.linalg.norm(residual.float(), dim=-1)
                before = torch.linalg.norm(self.residual.float(), dim=-1)
                self.calibration.append((now / (before + 1e-8)).mean().item())
        self.residual = residual
        if head_residual is not None:
            self.head_residual = head_residual
        self.computed.append(step)


class CacheRun:
    """One request's caches: a :class:`PassCache` per pass ("cond", "uncond") of the current expert, fresh at an
    expert switch; and the report of the steps each pass computed."""

    def __init__(self, config: CacheConfig, num_steps: int, coefficients: tuple[float, ...] | None = None):
        check_steps(config, num_steps)
        self.config, self.num_steps, self.coefficients = config, num_steps, coefficients
        self.expert: int | None = None
        self.passes: dict[str, PassCache] = {}
        self.finished: list[tuple[int, str, PassCache]] = []

    def state(self, expert: int, name: str) -> PassCache:
        if expert != self.expert:
            self.finished += [(self.expert, n, p) for n, p in self.passes.items()]
            self.expert, self.passes = expert, {}
        if name not in self.passes:
            self.passes[name] = PassCache(self.config, self.num_steps, self.coefficients)
        return self.passes[name]

    def report(self) -> dict:
        """{"type", "computed": {pass: step indices whose blocks ran}, "calibration": {pass: ratios} (MagCache
        calibrate only)}; a pass's steps and ratios run over the experts in order."""
        done = self.finished + [(self.expert, n, p) for n, p in self.passes.items()]
        out: dict = {"type": self.config.name, "computed": {}}
        for _, name, p in done:
            out["computed"].setdefault(name, []).extend(p.computed)
            if isinstance(self.config, MagCache) and self.config.calibrate:
                out.setdefault("calibration", {}).setdefault(name, []).extend(p.calibration)
        return out
