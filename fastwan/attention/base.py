"""The contract every attention backend follows.

Layout everywhere: ``q, k, v`` are ``[B, S, H, D]`` (batch, sequence, heads, head dim); the output has the
shape of ``q``. A backend declares what it can run as data (:class:`Capabilities`); :func:`reasons_cannot_run`
turns that data plus the actual tensors into a list of human-readable reasons. An empty list means "can run".
"""
from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from fastwan.errors import InvalidArgument, InvalidArgumentType

if TYPE_CHECKING:
    from fastwan.attention.sparse.layout import TokenLayout


@dataclass(frozen=True)
class Capabilities:
    """What a backend supports. ``None`` means "no restriction"."""

    device_types: tuple[str, ...] = ("cpu", "cuda")
    dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)
    head_dims: tuple[int, ...] | None = None  # exact allowed head dims
    max_head_dim: int | None = None
    head_dim_multiple: int | None = None
    min_compute_capability: tuple[int, int] | None = None  # CUDA only
    max_compute_capability: tuple[int, int] | None = None  # CUDA only (inclusive)
    compute_capabilities: tuple[tuple[int, int], ...] | None = None  # exact list, CUDA only
    packages: tuple[tuple[str, str], ...] = ()  # (import name, pip install hint)
    supports_cross_attention: bool = True  # q and k/v sequence lengths may differ


@dataclass
class AttentionMetadata:
    """Per-call context for self-attention inside the DiT.

    ``grid`` is the (T, H, W) token grid of the video after patchify; ``layout`` is set when the tokens were
    reordered for a sparse backend; ``compact``: q, k, v (and the per-token extras, :data:`TOKEN_EXTRAS`) hold
    the layout's real tokens only, in its compact order (``layout.permute_compact``), and
    :class:`~fastwan.attention.AttentionDispatch` pads them to the layout's slots for the backend (a backend
    itself always takes the slots); ``step_index``/``num_steps`` are the denoising step (None outside a loop);
    ``layer_index`` is the DiT block index; ``extra``: backend inputs by name; ``lossless``: this call is one of a
    hybrid schedule's lossless steps (:meth:`~fastwan.attention.AttentionDispatch.step_meta`, a dense dispatch's
    only metadata).
    """

    grid: tuple[int, int, int] | None = None
    step_index: int | None = None
    num_steps: int | None = None
    layer_index: int = 0
    layout: TokenLayout | None = None
    extra: dict = field(default_factory=dict)
    compact: bool = False
    lossless: bool = False


TOKEN_EXTRAS = ("gate_compress",)  # AttentionMetadata.extra entries that are per token: [B, S, H, D] like q


def package_available(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def cuda_capability(device: torch.device | str) -> tuple[tuple[int, int] | None, str | None]:
    """(compute capability, None) of a CUDA ``device`` that exists here, else (None, why it cannot be used)."""
    device = torch.device(device)
    if not torch.cuda.is_available():
        return None, "CUDA is not available"
    try:
        return tuple(torch.cuda.get_device_capability(device)), None
    except (AssertionError, RuntimeError, ValueError) as exc:  # torch: AssertionError('Invalid device id')
        count = torch.cuda.device_count()
        have = f"cuda:0 to cuda:{count - 1}" if count else "none"
        return None, (f"CUDA device {device} cannot be used ({type(exc).__name__}: {exc}); this machine has {count} "
                      f"CUDA device(s) ({have}): pick one of them")


def reasons_cannot_run(
    caps: Capabilities,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    head_dim: int | None,
    seq_q: int | None = None,
    seq_kv: int | None = None,
) -> list[str]:
    """Turn a backend's declared capabilities into the list of reasons it cannot run this problem, the device's
    first (the main reason, which an error states: :func:`fastwan.attention.registry.resolve_backend`).

    ``head_dim`` / ``seq_q`` / ``seq_kv`` None: that fact is unknown and its checks are skipped."""
    device = torch.device(device)
    reasons: list[str] = []  # the device's first: no package, dtype or head dim makes a backend run on it
    if device.type not in caps.device_types:
        reasons.append(f"device type '{device.type}' is not supported (needs {', '.join(caps.device_types)})")
    elif device.type == "cuda":
        cc, why = cuda_capability(device)
        if why:
            reasons.append(why)
        else:
            sm = f"sm{cc[0]}{cc[1]}"
            if caps.min_compute_capability and cc < caps.min_compute_capability:
                need = caps.min_compute_capability
                reasons.append(f"compute capability {sm} is below the minimum sm{need[0]}{need[1]}")
            if caps.max_compute_capability and cc > caps.max_compute_capability:
                top = caps.max_compute_capability
                reasons.append(f"compute capability {sm} is above the supported maximum sm{top[0]}{top[1]}")
            if caps.compute_capabilities and cc not in caps.compute_capabilities:
                ok = ", ".join(f"sm{a}{b}" for a, b in caps.compute_capabilities)
                reasons.append(f"compute capability {sm} is not one of {ok}")
    for module, hint in caps.packages:
        if not package_available(module):
            reasons.append(f"package '{module}' is not installed ({hint})")
    if dtype not in caps.dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in caps.dtypes)
        reasons.append(f"dtype {str(dtype).replace('torch.', '')} is not supported (needs one of {names})")
    if head_dim is not None:
        if caps.head_dims is not None and head_dim not in caps.head_dims:
            reasons.append(f"head dim {head_dim} is not supported (needs one of {list(caps.head_dims)})")
        if caps.max_head_dim is not None and head_dim > caps.max_head_dim:
            reasons.append(f"head dim {head_dim} exceeds the maximum {caps.max_head_dim}")
        if caps.head_dim_multiple is not None and head_dim % caps.head_dim_multiple:
            reasons.append(f"head dim {head_dim} is not a multiple of {caps.head_dim_multiple}")
    if (
        not caps.supports_cross_attention
        and seq_q is not None
        and seq_kv is not None
        and seq_q != seq_kv
    ):
        reasons.append(f"query length {seq_q} != key length {seq_kv} (self-attention only)")
    return reasons


def reject_unknown(backend: str, unknown: Iterable, valid: Sequence[str], hint: str = "") -> None:
    """Raise :class:`InvalidArgument` when ``unknown`` (config keys) is not empty: it names the keys, the backend
    and the keys it accepts (or that it takes none); ``hint`` is appended (e.g. which backends take them)."""
    unknown = sorted(unknown, key=str)
    if not unknown:
        return
    names = ", ".join(repr(k) for k in unknown)
    if valid:
        rule = f"valid keys are {', '.join(valid)}"
        fix = "Check the spelling in attention_config / FASTWAN_ATTENTION_CONFIG"
    else:
        rule = "it takes no settings"
        fix = "Remove attention_config / FASTWAN_ATTENTION_CONFIG, or name the backend these settings are for"
    raise InvalidArgument(f"{backend}: unknown config key(s) {names}; {rule}. {fix}{hint}.")


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Validate shapes/dtypes/devices of a [B, S, H, D] attention call; raises :class:`InvalidArgument` /
    :class:`InvalidArgumentType` (a ``ValueError`` / ``TypeError``)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise InvalidArgumentType(f"{name} must be a torch.Tensor of shape [B, S, H, D], got {type(t).__name__}")
        if t.dim() != 4:
            raise InvalidArgument(
                f"{name} has rank {t.dim()} (shape {tuple(t.shape)}); attention takes [B, S, H, D] tensors. "
                "Reshape with x.unflatten(-1, (heads, head_dim))."
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise InvalidArgumentType(
            f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); cast them to one dtype first.")
    if not (q.device == k.device == v.device):
        raise InvalidArgument(
            f"q, k, v are on different devices ({q.device}, {k.device}, {v.device}); move them to one.")
    if k.shape != v.shape:
        raise InvalidArgument(f"k shape {tuple(k.shape)} != v shape {tuple(v.shape)}; they must match.")
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.shape[3] != k.shape[3]:
        raise InvalidArgument(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch, heads and head dim ([B, S, H, D])."
        )


class AttentionBackend:
    """Base class. Subclasses set ``name``, ``capabilities`` and implement :meth:`forward`.

    Instances may hold configuration (a pinned kernel, a sparse window ...) but no per-call state, so one
    instance can serve every layer of a model.
    """

    name: ClassVar[str] = "BASE"
    capabilities: ClassVar[Capabilities] = Capabilities()
    sparse: ClassVar[bool] = False  # sparse backends need a TokenLayout and only serve self-attention
    # Constructor keywords a config (attention_config / FASTWAN_ATTENTION_CONFIG) may set; any other key is
    # rejected by registry.create_backend before the backend is built.
    KEYS: ClassVar[tuple[str, ...]] = ()
    # Serves self-attention only: the dispatch sends cross-attention, and the steps of lossless_steps(), to the
    # automatic (lossless) dense backend.
    self_attention_only: ClassVar[bool] = False

    def settings(self) -> dict[str, Any]:
        """This instance's config values (its ``KEYS`` it holds as attributes): what sets its output beside its name
        (the automatic file name's identity)."""
        return {k: getattr(self, k) for k in self.KEYS if hasattr(self, k)}

    def lossless_steps(self) -> tuple[int, int]:
        """(first, last): how many of the first and of the last denoising steps a lossy backend leaves to the
        lossless one (a hybrid schedule; only with ``self_attention_only``); (0, 0): none."""
        return (0, 0)

    def reasons(
        self,
        *,
        device: torch.device | str,
        dtype: torch.dtype,
        head_dim: int,
        seq_q: int | None = None,
        seq_kv: int | None = None,
    ) -> list[str]:
        """Why this backend cannot run the described problem (empty list: it can)."""
        return reasons_cannot_run(
            self.capabilities, device=device, dtype=dtype, head_dim=head_dim, seq_q=seq_q, seq_kv=seq_kv
        )

    def kernel_name(self, device: torch.device | str | None = None) -> str:
        """The concrete kernel this backend runs (e.g. 'flash_attn.cute (FA4, sm90)')."""
        return self.name

    def version_info(self, device: torch.device | str | None = None) -> str | None:
        """Version of the package that provides the kernel (e.g. 'FA4 4.0.0'), None if not installed."""
        return None

    def unverified(self, device: torch.device | str, head_dim: int | None = None) -> str | None:
        """Why the kernel this backend would run on ``device`` counts as unverified (None: fastwan has run and
        measured it on such a GPU). Automatic selection skips unverified kernels; asking for one by name runs
        it with a warning."""
        return None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float | None = None,
        meta: AttentionMetadata | None = None,
    ) -> torch.Tensor:
        """q: [B, Sq, H, D], k/v: [B, Skv, H, D] -> [B, Sq, H, D]."""
        raise NotImplementedError

    def __call__(self, q, k, v, *, scale=None, meta=None):
        return self.forward(q, k, v, scale=scale, meta=meta)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
