"""Backend registry: names, the automatic order, and resolution (explicit raises, automatic logs).

Choice order: an explicit name (argument) > ``FASTVIDEO_ATTENTION_BACKEND`` / ``FASTWAN_ATTENTION_BACKEND``
> automatic. Automatic mode walks :data:`AUTO_ORDER` (fastest first for the device), skips backends that
cannot run or whose kernel here is unverified (never run on such a GPU by fastwan; debug log with the reasons)
and logs the one it picked at info level. An unverified kernel asked for by name runs, with a warning. An
explicitly requested backend that cannot run raises :class:`BackendUnavailableError`: one line with its main
reason and the backends that can run instead (every reason in its ``reasons``).
"""
from __future__ import annotations

import contextlib
import contextvars
import importlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from fastwan import envs
from fastwan.attention.base import AttentionBackend, reject_unknown
from fastwan.errors import InvalidArgument, InvalidArgumentType, UserError

logger = logging.getLogger("fastwan.attention")

# name -> "module:Class". One module per backend; modules are imported lazily.
BACKENDS: dict[str, str] = {
    "TORCH_SDPA": "fastwan.attention.backends.sdpa:TorchSDPABackend",
    "FLASH_ATTN": "fastwan.attention.backends.flash:FlashAttnBackend",
    "SAGE_ATTN": "fastwan.attention.backends.sage:SageAttnBackend",
    "ATTN_8BIT": "fastwan.attention.backends.attn8:Attn8Backend",
    "SLIDING_TILE_ATTN": "fastwan.attention.sparse.sta:SlidingTileBackend",
    "VIDEO_SPARSE_ATTN": "fastwan.attention.sparse.vsa:VideoSparseBackend",
    "NEIGHBORHOOD_ATTN": "fastwan.attention.sparse.neighborhood:NeighborhoodBackend",
}

# Automatic choice, fastest first. Only lossless dense backends are picked automatically: INT8/FP4 and
# sparse backends change the result and must be asked for by name.
AUTO_ORDER: tuple[str, ...] = ("FLASH_ATTN", "TORCH_SDPA")


# Names other libraries use for attention that fastwan does not register, with what to ask for instead. Keys are
# upper-cased: FastVideo's AttentionBackendEnum names, diffusers' attention-dispatcher names and common spellings.
OTHER_NAMES: dict[str, str] = {
    "SAGE_ATTN_THREE": "FastVideo's SageAttention 3 (FP4) is not implemented; SAGE_ATTN runs SageAttention 1.x/2.x",
    "SAGE_ATTN_3": "SageAttention 3 (FP4) is not implemented; SAGE_ATTN runs SageAttention 1.x/2.x",
    "VIDEO_SPARSE_ATTN_H3": "FastVideo's H3 variant is not implemented; VIDEO_SPARSE_ATTN is video sparse attention",
    "VMOBA_ATTN": "FastVideo's VMoBA is not implemented; the sparse backends are SLIDING_TILE_ATTN, "
                  "VIDEO_SPARSE_ATTN and NEIGHBORHOOD_ATTN",
    "SLA_ATTN": "FastVideo's SLA is not implemented; the sparse backends are SLIDING_TILE_ATTN, VIDEO_SPARSE_ATTN "
                "and NEIGHBORHOOD_ATTN",
    "SAGE_SLA_ATTN": "FastVideo's SageSLA is not implemented; SAGE_ATTN is SageAttention",
    "BSA_ATTN": "FastVideo's block sparse attention is not implemented; the sparse backends are SLIDING_TILE_ATTN, "
                "VIDEO_SPARSE_ATTN and NEIGHBORHOOD_ATTN",
    "NABLA_ATTN": "FastVideo's NABLA is not implemented; the sparse backends are SLIDING_TILE_ATTN, "
                  "VIDEO_SPARSE_ATTN and NEIGHBORHOOD_ATTN",
    "NO_ATTENTION": "a Wan DiT cannot run without attention; leave the backend unset for automatic selection",
    "SDPA": "PyTorch SDPA is TORCH_SDPA",
    "NATIVE": "diffusers' 'native' (PyTorch SDPA) is TORCH_SDPA",
    "_NATIVE_CUDNN": "diffusers' '_native_cudnn' is TORCH_SDPA with attention_config {\"kernel\": \"cudnn\"}",
    "_NATIVE_FLASH": "diffusers' '_native_flash' is TORCH_SDPA with attention_config {\"kernel\": \"flash\"}",
    "_NATIVE_EFFICIENT": "diffusers' '_native_efficient' is TORCH_SDPA with attention_config "
                         "{\"kernel\": \"efficient\"}",
    "_NATIVE_MATH": "diffusers' '_native_math' is TORCH_SDPA with attention_config {\"kernel\": \"math\"}",
    "FLASH": "diffusers' 'flash' (FlashAttention 2) is FLASH_ATTN (pin it with attention_config {\"version\": 2})",
    "FLASH_HUB": "diffusers' 'flash_hub' (FlashAttention 2) is FLASH_ATTN with attention_config {\"version\": 2}",
    "_FLASH_3": "diffusers' '_flash_3' is FLASH_ATTN with attention_config {\"version\": 3}",
    "_FLASH_3_HUB": "diffusers' '_flash_3_hub' is FLASH_ATTN with attention_config {\"version\": 3}",
    "XFORMERS": "xFormers is not used; TORCH_SDPA with attention_config {\"kernel\": \"efficient\"} runs the same "
                "memory-efficient kernel family",
    "FA": "FlashAttention is FLASH_ATTN",
    "FA2": "FlashAttention 2 is FLASH_ATTN with attention_config {\"version\": 2}",
    "FA3": "FlashAttention 3 is FLASH_ATTN with attention_config {\"version\": 3}",
    "FA4": "FlashAttention 4 is FLASH_ATTN with attention_config {\"version\": 4}",
    "FLASH_ATTN_3": "FlashAttention 3 is FLASH_ATTN with attention_config {\"version\": 3}",
    "SAGE": "diffusers' 'sage' is SAGE_ATTN",
    "STA": "sliding tile attention is SLIDING_TILE_ATTN",
    "VSA": "video sparse attention is VIDEO_SPARSE_ATTN",
    "NATTEN": "neighborhood attention is NEIGHBORHOOD_ATTN",
    "FP8_ATTN": "fastwan's 8-bit attention (INT8 Q·K, FP8 P·V) is ATTN_8BIT",
    "INT8_ATTN": "fastwan's 8-bit attention (INT8 Q·K, FP8 P·V) is ATTN_8BIT",
}


class BackendUnavailableError(UserError, RuntimeError):
    """An explicitly requested backend cannot run. The message is one line: the backend, its main reason and the
    backends that can run instead; ``reasons`` holds every reason (``fastwan env`` lists them too)."""

    def __init__(self, message: str, reasons: list[str] | None = None):
        super().__init__(message)
        self.reasons = list(reasons or [])


def backend_names() -> list[str]:
    return list(BACKENDS)


def backend_keys(name: str) -> tuple[str, ...]:
    """The config keys backend ``name`` (a valid name, any case) accepts."""
    return tuple(_backend_class(_check_name(name, "backend_keys")).KEYS)


def _check_name(name: str, source: str) -> str:
    if not isinstance(name, str):
        raise InvalidArgumentType(
            f"{source}={name!r} must be a backend name (a string) or an AttentionBackend instance; valid names: "
            f"{', '.join(BACKENDS)}."
        )
    key = name.strip().upper()
    if key not in BACKENDS:
        spelled = "_".join(key.replace("-", " ").split())
        hint = f"did you mean {spelled}" if spelled in BACKENDS else OTHER_NAMES.get(spelled)
        raise InvalidArgument(
            f"Unknown attention backend {name!r} (from {source}){f' ({hint})' if hint else ''}; valid names: "
            f"{', '.join(BACKENDS)}."
        )
    return key


def _check_problem(device, dtype, head_dim) -> torch.device:
    """``device`` as a torch device; :class:`InvalidArgument` / :class:`InvalidArgumentType` for a device, dtype or
    head dim that describes no attention problem (raised before any backend is judged on it)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise InvalidArgument(f"device={device!r} is not a torch device; use e.g. 'cuda', 'cuda:1' or 'cpu'.") from None
    if not isinstance(dtype, torch.dtype):
        raise InvalidArgumentType(f"dtype={dtype!r} must be a torch.dtype, e.g. torch.bfloat16 (not a string).")
    if isinstance(head_dim, bool) or not isinstance(head_dim, (int, torch.SymInt)) or head_dim < 1:
        raise InvalidArgument(f"head_dim={head_dim!r} must be a positive int (the last dim of q/k/v), e.g. 128.")
    return dev


def _backend_class(key: str) -> type[AttentionBackend]:
    module, cls = BACKENDS[key].split(":")
    return getattr(importlib.import_module(module), cls)


def create_backend(name: str, config: Mapping[str, Any] | None = None, *, source: str = "attention_backend"):
    """Instantiate a backend by name (case-insensitive); ``config`` goes to its constructor.

    Every key of ``config`` must be one of the backend's declared ``KEYS``; others raise
    :class:`InvalidArgument` (naming the keys, the backend, the keys it accepts and the backends that take
    them) before the backend is built."""
    key = _check_name(name, source)
    if config is not None and not isinstance(config, Mapping):
        raise InvalidArgumentType(
            f"attention config {config!r} must be a dict of {key}'s settings (keyword -> value), got "
            f"{type(config).__name__}."
        )
    config = dict(config or {})
    klass = _backend_class(key)
    unknown = [k for k in config if k not in klass.KEYS]
    if unknown:
        takers = {k: [n for n in BACKENDS if n != key and k in _backend_class(n).KEYS] for k in unknown}
        hint = "; ".join(f"{k!r} is a setting of {' / '.join(v)}" for k, v in takers.items() if v)
        reject_unknown(key, unknown, klass.KEYS, hint=f" ({hint})" if hint else "")
    return klass(**config)


_CURRENT: contextvars.ContextVar[AttentionBackend | str | None] = contextvars.ContextVar(
    "fastwan_attention_backend", default=None
)


@contextlib.contextmanager
def attention_backend(backend: AttentionBackend | str | None) -> Iterator[None]:
    """Scope a backend choice to a ``with`` block (context-local, not process-global)."""
    if not (backend is None or isinstance(backend, AttentionBackend)):
        _check_name(backend, "attention_backend()")
    token = _CURRENT.set(backend)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def context_backend() -> AttentionBackend | str | None:
    """The backend an enclosing :func:`attention_backend` context names (None outside one)."""
    return _CURRENT.get()


def requested_backend(
    explicit: AttentionBackend | str | None = None, env: Mapping[str, str] | None = None
) -> tuple[AttentionBackend | str | None, str]:
    """Which backend was asked for, and by whom: (argument | context | env var | None)."""
    if explicit is not None:
        return explicit, "attention_backend= (CLI --attention-backend)"
    scoped = context_backend()
    if scoped is not None:
        return scoped, "attention_backend() context"
    name = envs.attention_backend(env)
    if name is not None:
        return name, envs.attention_backend_variable(env)
    if envs.nvfp4_fa4(env):  # asking for NVFP4 attention is asking for FLASH_ATTN: never skipped silently
        return "FLASH_ATTN", "FASTVIDEO_NVFP4_FA4=1"
    return None, "automatic"


def resolve_backend(
    requested: AttentionBackend | str | None = None,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    head_dim: int,
    config: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    seq_q: int | None = None,
    seq_kv: int | None = None,
    source: str | None = None,
) -> AttentionBackend:
    """Return a backend that can run (device, dtype, head_dim); raise if an explicit one cannot. ``source`` names
    who asked for ``requested`` in messages when it is not the user's argument (e.g. a checkpoint's default)."""
    device = _check_problem(device, dtype, head_dim)
    choice, source = (requested, source) if requested is not None and source else requested_backend(requested, env)
    if choice is not None:
        if isinstance(choice, AttentionBackend):
            if config:
                raise InvalidArgument(
                    f"an attention config ({sorted(config, key=str)}) was given with an already-built "
                    f"{choice.name} backend instance (requested by {source}); a config cannot change a built "
                    f"backend. Pass these settings to its constructor (e.g. create_backend({choice.name!r}, "
                    f"config)), or pass the backend by name ({choice.name!r}) together with the config."
                )
            backend = choice
        else:
            backend = create_backend(choice, config, source=source)
        if backend.name != "FLASH_ATTN" and envs.nvfp4_fa4(env):
            raise InvalidArgument(
                f"FASTVIDEO_NVFP4_FA4 (or FASTWAN_NVFP4_FA4) asks for NVFP4 Q/K in the FLASH_ATTN backend, but "
                f"{backend.name} was requested by {source}; unset the NVFP4 variable, or request FLASH_ATTN."
            )
        problem = {"device": device, "dtype": dtype, "head_dim": head_dim, "seq_q": seq_q, "seq_kv": seq_kv}
        reasons = backend.reasons(**problem)
        if reasons:
            raise _unavailable(backend.name, source, reasons, config, problem)
        why = backend.unverified(device, head_dim)
        if why:
            logger.warning("attention backend %s (%s), requested by %s, is unverified: %s", backend.name,
                           backend.kernel_name(device), source, why)
        logger.info("attention backend %s (%s), requested by %s", backend.name, backend.kernel_name(device), source)
        return backend
    if config:
        raise InvalidArgument(
            f"an attention config was given ({sorted(config)}) but no attention backend was named; name the "
            "backend it is for (attention_backend= or FASTVIDEO_ATTENTION_BACKEND), e.g. SLIDING_TILE_ATTN."
        )
    return auto_backend(device=device, dtype=dtype, head_dim=head_dim, seq_q=seq_q, seq_kv=seq_kv)


def runnable_instead(refused: str, problem: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """The registered backends other than ``refused`` that can run ``problem`` (``reasons``' keywords) with their
    default settings: (the dense ones, the sparse ones, which change the result)."""
    dense, sparse = [], []
    for name in BACKENDS:
        try:
            other = create_backend(name)
        except UserError:  # its settings from the environment are wrong: not one to suggest
            continue
        if name != refused and not other.reasons(**problem):
            (sparse if other.sparse else dense).append(name)
    return dense, sparse


def _unavailable(name: str, source: str, reasons: list[str], config, problem: Mapping[str, Any]):
    """The one-line error for backend ``name``, asked for by ``source``, that cannot run ``problem``: its main
    reason (the first: the device's come first), how many more there are, and the fix, which never names ``name``:
    dropping ``config`` when ``name`` runs without it, else the dense backends that run here (and automatic
    selection when it would pick one of them), else the sparse ones."""
    fixes = []
    if config:
        try:
            plain = create_backend(name).reasons(**problem)
        except UserError:
            plain = reasons
        if not plain:
            fixes.append(f"drop the attention config ({', '.join(map(str, config))})")
    dense, sparse = runnable_instead(name, problem) if not fixes else ([], [])
    others = dense or sparse
    if others:
        fixes.append(f"use {' or '.join(others)}, which run{'s' if len(others) == 1 else ''} here")
    if any(n in AUTO_ORDER for n in dense):
        fixes.append("unset it for automatic selection")
    fix = ", or ".join(fixes) if fixes else "no other backend runs it here either"
    where = f"{torch.device(problem['device'])} ({str(problem['dtype']).replace('torch.', '')}, head dim " \
            f"{problem['head_dim']})"
    more = f" (+{len(reasons) - 1} more: see 'fastwan env')" if len(reasons) > 1 else ""
    return BackendUnavailableError(f"Attention backend {name} (requested by {source}) cannot run on {where}: "
                                   f"{reasons[0]}{more}. {fix[0].upper()}{fix[1:]}.", reasons)


def auto_backend(
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    head_dim: int,
    seq_q: int | None = None,
    seq_kv: int | None = None,
) -> AttentionBackend:
    """The first backend of :data:`AUTO_ORDER` that can run; skips are logged at debug level.

    Only a backend's ``reasons`` (it cannot run here) or an unverified kernel let it be skipped. Constructing a
    backend reads the user's settings (e.g. ``FASTWAN_SDPA_KERNEL``, ``FASTWAN_FLASH_ATTN_VERSION``); an error
    there is the user's to fix and propagates, whatever the device."""
    device = _check_problem(device, dtype, head_dim)
    skipped = []
    for name in AUTO_ORDER:
        backend = create_backend(name)
        reasons = backend.reasons(device=device, dtype=dtype, head_dim=head_dim, seq_q=seq_q, seq_kv=seq_kv)
        if not reasons:
            why = backend.unverified(device, head_dim)
            reasons = [f"unverified: {why} (ask for it by name to run it)"] if why else []
        if reasons:
            skipped.append(f"{name}: {'; '.join(reasons)}")
            logger.debug("auto attention: skip %s (%s)", name, "; ".join(reasons))
            continue
        logger.info("attention backend %s (%s), chosen automatically", backend.name, backend.kernel_name(device))
        return backend
    raise BackendUnavailableError(
        f"No attention backend can run device={torch.device(device)} dtype={dtype} head_dim={head_dim}:\n  - "
        + "\n  - ".join(skipped)
    )
