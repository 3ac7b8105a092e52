"""The launch configuration of fastwan's 8-bit attention (:mod:`fastwan.kernels.attn8`): one constant table keyed by
(head dim, GPU compute capability), filled from ``python -m benchmarks.attn8_bench`` (it prints the best
configuration's table entry).

A configuration's ``block_m`` / ``block_n`` are both the kernel's tiles and the quantization blocks (Q's scale per
``block_m`` query rows, K's per ``block_n`` key rows): the op quantizes with the configuration it launches, and
:func:`fastwan.kernels.attn8.attention_reference` follows the blocks its :class:`~fastwan.kernels.attn8.Quantized`
carries.
"""
from __future__ import annotations

import re
from types import MappingProxyType
from typing import NamedTuple

from fastwan.errors import InvalidArgument


class Attn8Config(NamedTuple):
    """One launch of the 8-bit attention.

    ``version`` 1: the first kernel (strided loads, any layout); 2: K and Q as [rows, D] tiles (K transposed for
    Q·K^T in shared memory), V read token-fastest, from the fused quantizer's padded head-major planes.
    Version 2 only: ``descriptors`` loads through TMA tensor descriptors; ``warp_specialize`` asks Triton to
    warp-specialize the key loop; ``poly_group`` g >= 2 computes exp2 of one key block in every g by a polynomial
    on the FMA units (:func:`fastwan.kernels.attn8_triton.exp2_poly`, degree ``poly_degree``), 0 none; ``fold``
    computes e4m3's 448 p as exp2(s - m + log2 448) (one multiply less a score; p rounds differently in the last
    fp32 bit); ``cvt`` converts the int32 scores by the conversion instruction, not by an integer and an fp32 add;
    ``ffma`` computes the exponent in one FMA of the biased integer scores (p moves by about 1e-5 relative).
    Without ``fold``, ``ffma`` and ``poly_group`` every version computes the reference's values (up to exp2's
    rounding)."""
    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3
    version: int = 2
    descriptors: bool = False
    warp_specialize: bool = False
    poly_group: int = 0
    poly_degree: int = 3
    fold: bool = False
    cvt: bool = False
    ffma: bool = False

    @property
    def label(self) -> str:
        """A short name, read back by :func:`parse_config`:
        ``v2-m128-n64-w8-s3[-desc][-ws][-poly4d3][-fold][-cvt][-ffma]``."""
        extra = ("-desc" if self.descriptors else "") + ("-ws" if self.warp_specialize else "")
        if self.poly_group:
            extra += f"-poly{self.poly_group}d{self.poly_degree}"
        extra += ("-fold" if self.fold else "") + ("-cvt" if self.cvt else "") + ("-ffma" if self.ffma else "")
        return f"v{self.version}-m{self.block_m}-n{self.block_n}-w{self.num_warps}-s{self.num_stages}{extra}"


# the build measured on a GPU (RESULTS.md): version 1 on the PyTorch quantizer; version 2 and the fused quantizer
# take over from benchmarks.attn8_bench's table entry once a GPU run has checked and timed them
DEFAULT = Attn8Config(version=1)
BLOCKS = (16, 32, 64, 128, 256)  # tile sizes (tl.arange needs a power of two; the tensor cores 16 or more)
POLY_DEGREES = (3, 4, 5)
# (head dim, (major, minor) or None for any GPU) -> configuration; the benchmark's best entry goes here
CONFIGS = MappingProxyType({
    (64, None): DEFAULT,
    (128, None): DEFAULT,
})


def config_for(head_dim: int, capability: tuple[int, int] | None) -> Attn8Config:
    """The table's entry for ``head_dim`` on a GPU of ``capability`` (None: off GPU), else its entry for any GPU,
    else :data:`DEFAULT`."""
    return CONFIGS.get((head_dim, capability)) or CONFIGS.get((head_dim, None)) or DEFAULT


def check_config(cfg: Attn8Config) -> Attn8Config:
    """``cfg`` if each field is one the kernels take, else :class:`InvalidArgument` naming the field."""
    rules = (
        ("block_m", cfg.block_m in BLOCKS, f"one of {BLOCKS}"),
        ("block_n", cfg.block_n in BLOCKS, f"one of {BLOCKS}"),
        ("num_warps", cfg.num_warps in (1, 2, 4, 8, 16), "one of 1, 2, 4, 8, 16"),
        ("num_stages", isinstance(cfg.num_stages, int) and 1 <= cfg.num_stages <= 8, "an int in 1..8"),
        ("version", cfg.version in (1, 2), "1 or 2"),
        ("poly_group", cfg.poly_group == 0 or (isinstance(cfg.poly_group, int) and 2 <= cfg.poly_group <= 16),
         "0 (off) or an int in 2..16"),
        ("poly_degree", cfg.poly_degree in POLY_DEGREES, f"one of {POLY_DEGREES}"),
    )
    for field, ok, rule in rules:
        if not ok:
            raise InvalidArgument(f"attn8 config {field}={getattr(cfg, field)!r} must be {rule}.", field=field)
    if cfg.version == 1 and (cfg.descriptors or cfg.warp_specialize or cfg.poly_group or cfg.fold or cfg.cvt
                             or cfg.ffma):
        raise InvalidArgument(f"attn8 config {cfg.label}: descriptors, warp_specialize, poly_group, fold, cvt and ffma "
                              "are options of kernel version 2; use version=2 or leave them off.", field="version")
    if cfg.cvt and cfg.ffma:
        raise InvalidArgument(f"attn8 config {cfg.label}: cvt and ffma are two ways of converting the scores; pick "
                              "one.", field="cvt")
    return cfg


_LABEL = re.compile(r"v(\d)-m(\d+)-n(\d+)-w(\d+)-s(\d+)((?:-desc)?)((?:-ws)?)(?:-poly(\d+)d(\d))?"
                    r"((?:-fold)?)((?:-cvt)?)((?:-ffma)?)")


def parse_config(label: str) -> Attn8Config:
    """The configuration of a :attr:`Attn8Config.label` (e.g. ``v2-m128-n128-w8-s3-desc-poly4d3-fold``)."""
    match = _LABEL.fullmatch(label.strip())
    if not match:
        raise InvalidArgument(f"attn8 config {label!r} is not a label like v2-m128-n64-w8-s3[-desc][-ws][-poly4d3]"
                              "[-fold][-cvt][-ffma] (kernel version, block_m, block_n, warps, stages, options).",
                              field="config")
    v, m, n, w, s, desc, ws, group, degree, fold, cvt, ffma = match.groups()
    return check_config(Attn8Config(int(m), int(n), int(w), int(s), int(v), bool(desc), bool(ws),
                                    int(group or 0), int(degree or 3), bool(fold), bool(cvt), bool(ffma)))
