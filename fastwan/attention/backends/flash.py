"""FLASH_ATTN: FlashAttention 2, 3 or 4 (optionally with NVFP4 Q/K on Blackwell), whichever fits the GPU.

What each generation supports is data (:data:`VARIANTS`, :data:`PREFERENCE`); :meth:`FlashAttnBackend.reasons`
turns it into reasons. Choice: ``version=`` argument > ``FASTWAN_FLASH_ATTN_VERSION`` > the best installed
for the device, measured kernels first (sm90: FA4 > FA3 > FA2; sm100/sm103/sm110: FA4 > FA2; others: FA2). A
pinned version that is not installed or does not support the GPU is a reason, never a silent switch to another
generation. An installed generation that fails to import is skipped with a warning (once per backend instance).
A generation counts as verified only on the GPUs listed in its ``verified_on`` (where fastwan's GPU tests and
benchmarks ran it); elsewhere :meth:`FlashAttnBackend.unverified` says so and automatic selection skips it.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from fastwan.errors import InvalidArgument, InvalidArgumentType
from fastwan import envs
from fastwan.attention.backends import fa4_plan, packages
from fastwan.attention.backends import ops as _ops  # noqa: F401  (registers torch.ops.fastwan.*)
from fastwan.attention.base import (
    AttentionBackend, AttentionMetadata, Capabilities, cuda_capability, reasons_cannot_run,
)

CC = tuple[int, int]
logger = logging.getLogger("fastwan.attention")


@dataclass(frozen=True)
class HeadDimRule:
    """Allowed head dims: ``lo <= d <= hi`` and ``d % multiple == 0``, or ``d in also``."""

    lo: int = 8
    hi: int = 256
    multiple: int = 8
    also: tuple[int, ...] = ()

    def reason(self, head_dim: int) -> str | None:
        if head_dim in self.also or (self.lo <= head_dim <= self.hi and head_dim % self.multiple == 0):
            return None
        extra = f" (or one of {list(self.also)})" if self.also else ""
        multiple = f" and a multiple of {self.multiple}" if self.multiple > 1 else ""
        return f"between {self.lo} and {self.hi}{multiple}{extra}"


@dataclass(frozen=True)
class FlashVariant:
    version: int
    label: str  # what kernel_name() reports
    install: str  # how to get it
    compute_capabilities: tuple[CC, ...] | None  # exact list; None = min_cc and newer
    min_cc: CC
    head_dims: dict[int, HeadDimRule]  # by compute-capability major; key 0 = default
    verified_on: tuple[CC, ...] = ()  # GPUs on which fastwan's GPU tests and benchmarks have run this generation


VARIANTS: dict[int, FlashVariant] = {
    2: FlashVariant(
        2, "flash_attn FA2", "pip install flash-attn --no-build-isolation",
        None, (8, 0), {0: HeadDimRule(1, 256, 1)},
    ),
    3: FlashVariant(
        3, "flash_attn_interface FA3",
        "build FA3 from the hopper/ directory of github.com/Dao-AILab/flash-attention: "
        "cd hopper && python setup.py install",
        ((9, 0),), (9, 0), {0: HeadDimRule(8, 256, 8)},
    ),
    4: FlashVariant(
        4, "flash_attn.cute FA4", "pip install flash-attn-4",
        ((9, 0), (10, 0), (10, 3), (11, 0)), (9, 0),
        {9: HeadDimRule(8, 256, 8), 10: HeadDimRule(8, 128, 8, (256,)), 11: HeadDimRule(8, 128, 8, (256,))},
        verified_on=((9, 0),),
    ),
}

# By compute-capability major: generations measured on that GPU first (fastest first), then the unmeasured ones.
PREFERENCE: dict[int, tuple[int, ...]] = {9: (4, 3, 2), 10: (4, 2), 11: (4, 2)}
DEFAULT_PREFERENCE: tuple[int, ...] = (2,)

NVFP4_COMPUTE_CAPABILITIES: tuple[CC, ...] = ((10, 0), (10, 3))
NVFP4_HEAD_DIMS: tuple[int, ...] = (128,)


def _sm(cc: CC) -> str:
    return f"sm{cc[0]}{cc[1]}"


def variant_reasons(variant: FlashVariant, cc: CC | None, head_dim: int | None) -> list[str]:
    """Why FA``variant.version`` cannot run on compute capability ``cc`` (None = unknown/no GPU)."""
    fa = f"FA{variant.version}"
    reasons = []
    if not packages.flash_installed(variant.version):
        reasons.append(f"{fa} ({variant.label.split()[0]}) is not installed ({variant.install})")
    if cc is not None:
        if variant.compute_capabilities is not None and cc not in variant.compute_capabilities:
            ok = ", ".join(_sm(c) for c in variant.compute_capabilities)
            reasons.append(f"{fa} supports {ok}; this GPU is {_sm(cc)}")
        elif cc < variant.min_cc:
            reasons.append(f"{fa} needs {_sm(variant.min_cc)} or newer; this GPU is {_sm(cc)}")
        elif head_dim is not None:
            rule = variant.head_dims.get(cc[0], variant.head_dims.get(0))
            if rule is None:
                rule = next(iter(variant.head_dims.values()))
            why = rule.reason(head_dim)
            if why:
                reasons.append(f"{fa} on {_sm(cc)} needs a head dim {why}; got {head_dim}")
    return reasons


class FlashAttnBackend(AttentionBackend):
    name = "FLASH_ATTN"
    capabilities = Capabilities(
        device_types=("cuda",),
        dtypes=(torch.float16, torch.bfloat16),
        max_head_dim=256,
        min_compute_capability=(8, 0),
    )
    KEYS = ("version", "nvfp4", "fa4_tile_m", "fa4_split")

    def __init__(self, version: int | str | None = None, nvfp4: bool | None = None, fa4_tile_m: int | str = "auto",
                 fa4_split: bool = True):
        if version is None:
            version = envs.flash_attn_version()
        if version is not None:
            if isinstance(version, str) and version.strip() in ("2", "3", "4"):
                version = int(version)
            if isinstance(version, bool) or not isinstance(version, int) or version not in VARIANTS:
                raise InvalidArgument(
                    f"FLASH_ATTN version={version!r} is not 2, 3 or 4; leave it unset to use the best installed."
                )
        self.version: int | None = version
        if nvfp4 is not None and not isinstance(nvfp4, bool):
            raise InvalidArgumentType(
                f"FLASH_ATTN nvfp4={nvfp4!r} must be True or False (NVFP4 Q/K on Blackwell), or unset for "
                "FASTVIDEO_NVFP4_FA4 (default False); write a JSON true/false, not a string or a number.")
        self.nvfp4: bool = envs.nvfp4_fa4() if nvfp4 is None else nvfp4
        self._picked: dict[tuple[int, int], int] = {}  # (CUDA device index, head dim) -> FA version
        if isinstance(fa4_tile_m, str) and fa4_tile_m.strip().isdigit():
            fa4_tile_m = int(fa4_tile_m)
        if fa4_tile_m != "auto" and (isinstance(fa4_tile_m, bool) or fa4_tile_m not in fa4_plan.FA4_SM90_TILES):
            raise InvalidArgument(
                f"FLASH_ATTN fa4_tile_m={fa4_tile_m!r} must be 'auto' or one of {sorted(fa4_plan.FA4_SM90_TILES)} "
                "(FA4's query tile on sm90 for head dim 128); leave it 'auto' to pick by shape."
            )
        self.fa4_tile_m: int | str = fa4_tile_m
        if not isinstance(fa4_split, bool):
            raise InvalidArgumentType(
                f"FLASH_ATTN fa4_split={fa4_split!r} must be True or False (with fa4_tile_m='auto', "
                "whether FA4's sm90 forward may cover the query in two launches of whole waves).")
        self.fa4_split: bool = fa4_split
        self._sms: dict[int, int] = {}  # CUDA device index -> SM count, for sm90 devices (read when selecting)
        self._warned: set[str] = set()  # broken-package warnings this instance has logged

    # ---- selection ---------------------------------------------------------------------------------
    @staticmethod
    def _cc(device: torch.device) -> CC | None:
        return cuda_capability(device)[0] if device.type == "cuda" else None

    @staticmethod
    def _index(device: torch.device) -> int:
        return device.index if device.index is not None else torch.cuda.current_device()

    def _candidates(self, cc: CC | None) -> tuple[int, ...]:
        if self.nvfp4:
            return (4,)
        if self.version is not None:
            return (self.version,)
        return PREFERENCE.get(cc[0], DEFAULT_PREFERENCE) if cc else (4, 3, 2)

    def select(self, device: torch.device | str, head_dim: int | None = None) -> tuple[int | None, list[str]]:
        """(FA version to run on ``device`` for ``head_dim``, reasons why none can). A pick for a known head dim
        on a GPU is cached, so the forward pass (also under torch.compile) only looks it up."""
        device = torch.device(device)
        cc = self._cc(device)
        rejected: list[str] = []
        for ver in self._candidates(cc):
            why = variant_reasons(VARIANTS[ver], cc, head_dim)
            if not why and cc is not None:  # it could run here: make sure the installed package loads
                err = packages.flash_import_error(ver)
                if err:
                    why = [f"FA{ver} is installed but does not import ({err})"]
                    if why[0] not in self._warned:
                        self._warned.add(why[0])
                        logger.warning("FLASH_ATTN: %s; trying the next FlashAttention generation", why[0])
            if not why:
                if cc is not None and head_dim is not None:
                    self._picked[(self._index(device), head_dim)] = ver
                if cc == (9, 0):
                    idx = self._index(device)
                    if idx not in self._sms:
                        self._sms[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
                return ver, []
            rejected.extend(why)
        return None, rejected

    def reasons(self, *, device, dtype, head_dim, seq_q=None, seq_kv=None) -> list[str]:
        device = torch.device(device)
        reasons = reasons_cannot_run(
            self.capabilities, device=device, dtype=dtype, head_dim=head_dim, seq_q=seq_q, seq_kv=seq_kv
        )
        if self.nvfp4 and self.version not in (None, 4):
            reasons.append(f"nvfp4=True runs on FlashAttention 4 (flash_attn.cute), but version={self.version}")
        _, why = self.select(device, head_dim)
        reasons.extend(r for r in why if r not in reasons)
        if self.nvfp4:
            reasons.extend(self._nvfp4_reasons(device, head_dim))
        if self.fa4_tile_m != "auto":
            reasons.extend(self._tile_reasons(device, head_dim))
        return reasons

    def unverified(self, device, head_dim=None) -> str | None:
        device = torch.device(device)
        cc = self._cc(device)
        if cc is None:
            return None
        if self.nvfp4:
            return "NVFP4 Q/K attention has run only against CPU emulation, never on a Blackwell GPU"
        ver = self._picked.get((self._index(device), head_dim)) if head_dim is not None else None
        if ver is None:
            ver = self.select(device, head_dim)[0]
        if ver is None or cc in VARIANTS[ver].verified_on:
            return None
        return f"FA{ver} has not been run by fastwan on {_sm(cc)} (only against CPU fakes)"

    def _tile_reasons(self, device: torch.device, head_dim: int | None) -> list[str]:
        """Why an explicit ``fa4_tile_m`` cannot be honoured (it is a tile of FA4's sm90 kernel for D=128)."""
        cc = self._cc(device)
        rule = f"fa4_tile_m={self.fa4_tile_m} sets FA4's sm90 query tile for head dim 128"
        fix = "leave fa4_tile_m='auto'"
        reasons = []
        if cc != (9, 0):
            where = _sm(cc) if cc else device.type
            reasons.append(f"{rule}; this device is {where} ({fix})")
        if head_dim is not None and head_dim != 128:
            reasons.append(f"{rule}; the head dim is {head_dim} ({fix})")
        if self.version not in (None, 4) or self.nvfp4:
            reasons.append(f"{rule}, but version={self.version}, nvfp4={self.nvfp4} ({fix})")
        elif cc == (9, 0) and head_dim is not None:
            picked = self.select(device, head_dim)[0]
            if picked not in (None, 4):
                reasons.append(f"{rule}, but FA{picked} was picked here (pin version=4)")
        if cc == (9, 0) and not reasons:
            ok, detail = fa4_plan.fa4_accepts_tiles()
            if not ok:
                reasons.append(f"{rule}, but {detail} ({fix})")
        return reasons

    def _sm_count(self, device: torch.device) -> int | None:
        """SMs of an sm90 CUDA device this backend selected FA for (None elsewhere)."""
        return self._sms.get(self._index(device)) if device.type == "cuda" else None

    def plan_for(self, q: torch.Tensor, k: torch.Tensor, version: int) -> tuple[int, int, int]:
        """How FA4's sm90 forward covers q [B, Sq, H, D]: ``(tile_m, split, tail_tile_m)`` for
        :func:`fastwan.attention.backends.ops.flash_attn`. ``tile_m`` 0 is the kernel's default tile; ``split`` 0 is one
        launch and -1 lets the op plan at run time with :func:`~fastwan.attention.backends.fa4_plan.fa4_sm90_plan`
        (possibly two launches; ``tile_m`` is then the one-launch tile). An explicit ``fa4_tile_m`` runs in one
        launch; 'auto' uses :func:`~fastwan.attention.backends.fa4_plan.fa4_sm90_tile_m` for head dim 128 on a
        known sm90 device, planned by the op unless ``fa4_split=False``. The plan is made inside the op (plain
        ints, any torch.compile shape mode), not traced."""
        if version != 4:
            return 0, 0, 0
        if self.fa4_tile_m != "auto":
            return int(self.fa4_tile_m), 0, 0
        sms = self._sm_count(q.device)
        if sms is None or q.shape[-1] != 128:
            return 0, 0, 0
        tm = fa4_plan.fa4_sm90_tile_m(q.shape[0], q.shape[1], q.shape[2], sms)
        if self.fa4_split:
            return tm, -1, 0
        return (0 if tm == 128 else tm), 0, 0  # 128 is FA4's own default: keep its public entry point

    def _nvfp4_reasons(self, device: torch.device, head_dim: int) -> list[str]:
        cc = self._cc(device)
        where = _sm(cc) if cc else (device.type if device.type != "cuda" else "cuda without a visible GPU")
        base = (
            "NVFP4 attention needs sm100/sm103 (Blackwell) and a flash-attn build with NVFP4 Q/K; "
            f"this device is {where}"
        )
        if cc not in NVFP4_COMPUTE_CAPABILITIES:
            return [base + " (unset FASTVIDEO_NVFP4_FA4 / pass nvfp4=False for bf16 attention)"]
        reasons = []
        ok, detail = packages.fa4_accepts_nvfp4()  # imports flash_attn.cute: only on a Blackwell GPU
        if not ok:
            reasons.append(f"{base} ({detail})")
        if head_dim not in NVFP4_HEAD_DIMS:
            reasons.append(f"NVFP4 FlashAttention supports head dims {list(NVFP4_HEAD_DIMS)}; got {head_dim}")
        return reasons

    def _version_for(self, device: torch.device, head_dim: int) -> int:
        if self.version is not None:
            return self.version
        key = (self._index(device) if device.type == "cuda" else -1, head_dim)
        ver = self._picked.get(key)
        if ver is None:
            if torch.compiler.is_compiling():
                raise RuntimeError(
                    f"FLASH_ATTN has not picked a FlashAttention version for {device} / head dim {head_dim} yet; "
                    "resolve the backend first (AttentionDispatch.resolve or backend.reasons(device=..., "
                    "head_dim=...)), run it once eagerly, or pin version=2|3|4 before torch.compile."
                )
            ver, why = self.select(device, head_dim)
            if ver is None:
                raise RuntimeError(f"FLASH_ATTN cannot run on {device}: " + "; ".join(why))
        return ver

    def kernel_name(self, device=None) -> str:
        if device is None:
            device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        device = torch.device(device)
        cc = self._cc(device)
        if cc is None:
            return f"{self.name} (no CUDA device)"
        picked = [v for (idx, _), v in self._picked.items() if idx == self._index(device)]
        ver = picked[0] if picked else self.select(device)[0]
        if ver is None:
            pinned = f"FA{self.version} pinned, " if self.version else ""
            return f"{self.name} ({pinned}unavailable on {_sm(cc)})"
        label = VARIANTS[ver].label + (" NVFP4 Q/K" if self.nvfp4 else "")
        return f"{label} ({_sm(cc)})"

    def version_info(self, device=None) -> str | None:
        device = torch.device(device) if device is not None else None
        ver = self.version
        if ver is None and device is not None and self._cc(device) is not None:
            ver, _ = self.select(device)
        if ver is None:
            found = [v for v in (4, 3, 2) if packages.flash_installed(v)]
            return ", ".join(f"FA{v} {packages.flash_package_version(v) or '?'}" for v in found) or None
        return f"FA{ver} {packages.flash_package_version(ver) or '?'}" if packages.flash_installed(ver) else None

    # ---- compute -----------------------------------------------------------------------------------
    def forward(self, q, k, v, *, scale=None, meta: AttentionMetadata | None = None):
        """q: [B, Sq, H, D], k/v: [B, Skv, H, D] (fp16/bf16, CUDA) -> [B, Sq, H, D]."""
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        if self.nvfp4:
            return torch.ops.fastwan.nvfp4_flash_attn(q, k, v, scale)
        ver = self._version_for(q.device, q.shape[-1])
        return torch.ops.fastwan.flash_attn(q, k, v, scale, ver, *self.plan_for(q, k, ver))

    def __repr__(self) -> str:
        return (f"FlashAttnBackend(version={self.version!r}, nvfp4={self.nvfp4}, fa4_tile_m={self.fa4_tile_m!r}, "
                f"fa4_split={self.fa4_split})")
