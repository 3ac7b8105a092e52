"""8-bit attention, second round (fastwan.kernels.attn8_*): the fused Triton quantizer against ``quantize`` bit for
bit, kernel version 2 (and version 1 on the fused quantizer's layout) against ``attention_reference`` at each
configuration's blocks, the lossy options (fold, ffma, exp2 polynomial) against the reference and exact attention,
the polynomial's error, the configuration table, and the sm90 compile of both. Under Triton's interpreter in a
subprocess (tests/kernels/interpreter.py); the GPU run: tests/gpu/test_gpu_attn8_v2.py."""
from __future__ import annotations

import importlib.util
import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from fastwan.errors import InvalidArgument
from fastwan.kernels import attn8 as A
from fastwan.kernels.attn8_configs import CONFIGS, DEFAULT, Attn8Config, check_config, config_for, parse_config
from tests.kernels.interpreter import worst_error
from tests.kernels.test_attn8 import inputs

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs the triton package")

QUANT = r"""
import torch
from fastwan.kernels import attn8 as A, attn8_quant_triton as QT
from fastwan.kernels.attn8_triton import row_plane, token_plane
from tests.kernels.test_attn8 import inputs

bad = 0
cases = ((1, 200, 150, 2, 128, 128, 64, True, torch.bfloat16, 6.0),
         (2, 70, 33, 3, 64, 32, 16, True, torch.float16, 6.0),
         (1, 45, 1100, 1, 64, 64, 128, False, torch.float32, 6.0),
         (1, 128, 64, 2, 64, 128, 64, True, torch.bfloat16, 6.0),
         (1, 16, 3000, 1, 64, 16, 64, True, torch.float32, 3000.0))  # a sum an fp32 accumulator rounds
for B, Sq, Skv, H, D, bm, bn, smooth, dtype, k_offset in cases:
    q, k, v = (x.to(dtype) for x in inputs(B, Sq, Skv, H, D, k_offset=k_offset, v_mean=0.5, seed=Sq))
    q = torch.cat([q, q], dim=-1)[..., :D]  # q as a slice of a wider projection
    ref = A.quantize(q, k, v, D ** -0.5, smooth, bm, bn)
    got = QT.quantize(q, k, v, D ** -0.5, smooth, bm, bn)
    assert (got.block_m, got.block_n) == (bm, bn)
    for name in ("q8", "qs", "k8", "ks", "v8", "vs"):
        a, b = getattr(ref, name), getattr(got, name)
        assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, b.shape, a.dtype, b.dtype)
        if a.dtype == A.E4M3:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        elif a.dtype == torch.float32:
            a, b = a.view(torch.int32), b.view(torch.int32)
        bad += int((a != b).sum())
    for x, block, S in ((got.q8, bm, Sq), (got.k8, bn, Skv)):  # the views' buffers, padded with zeros
        plane, n = row_plane(x, block)
        assert plane.data_ptr() == x.data_ptr() and n * block >= S
        assert not plane.view(B, H, n * block, D)[:, :, S:].any()
    plane = token_plane(got.v8, bn)
    assert plane.data_ptr() == got.v8.data_ptr() and not plane.view(torch.uint8).view(B, H, D, -1)[..., Skv:].any()
print(f"WORST {bad}")
"""

EXACT = ("v2-m128-n64-w8-s3", "v2-m64-n32-w4-s2-desc", "v2-m32-n128-w4-s2", "v2-m16-n16-w4-s1-cvt",
         "v2-m64-n32-w4-s2-ws", "v1-m64-n32-w4-s2")
KERNELS = r"""
import torch
from fastwan.kernels import attn8 as A, interpreted_kernels
from fastwan.kernels.attn8_configs import parse_config
from tests.kernels.test_attn8 import inputs

worst = 0.0
for B, Sq, Skv, H, D in ((1, 200, 200, 2, 128), (2, 130, 70, 1, 64)):
    q, k, v = inputs(B, Sq, Skv, H, D, k_offset=8.0, v_mean=0.5, seed=Sq)
    q = torch.cat([q, q], dim=-1)[..., :D]
    for label in LABELS:
        cfg = parse_config(label)
        want = A.attention_reference(A.quantize(q, k, v, D ** -0.5, True, cfg.block_m, cfg.block_n))
        with interpreted_kernels():
            got = A.attn8_config(q, k, v, D ** -0.5, True, cfg)  # the fused quantizer's planes
        copied = A.attend(A.quantize(q, k, v, D ** -0.5, True, cfg.block_m, cfg.block_n), cfg, q.dtype)
        for out in (got, copied):  # copied: the reference quantizer's layout, copied into planes
            assert out.shape == want.shape and bool(torch.isfinite(out).all())
            worst = max(worst, float(((out - want).abs() / (want.abs() + 1e-2)).max()))
print(f"WORST {worst:.3e}")
"""


def test_quantize_follows_the_blocks_it_is_given():
    """Q's scales per ``block_m`` rows and K's per ``block_n`` (each its block's amax over 127), recorded in the
    tuple; the reference's online softmax then steps ``block_n`` keys at a time."""
    q, k, v = inputs(Sq=100, Skv=90, H=2, D=64, k_offset=3.0)
    t = A.quantize(q, k, v, 0.125, True, 32, 16)
    assert (t.block_m, t.block_n) == (32, 16) and t.qs.shape == (1, 4, 2) and t.ks.shape == (1, 6, 2)
    smooth = k - k.double().mean(dim=1, keepdim=True).float()
    torch.testing.assert_close(t.ks[:, 5], smooth[:, 80:].abs().amax(dim=(1, 3)) / 127)
    torch.testing.assert_close(t.qs[:, 3] / (0.125 * math.log2(math.e)), q[:, 96:].abs().amax(dim=(1, 3)) / 127)
    default = A.attention_reference(A.quantize(q, k, v, 0.125))
    other = A.attention_reference(t)
    assert 0 < float((other - default).abs().max()) < 0.1  # other roundings, the same attention


@needs_triton
def test_fused_quantizer_equals_quantize_bit_for_bit():
    """int8 / e4m3 values and fp32 scales (as bits) equal for bf16, fp16 and fp32 inputs, lengths that are no
    multiple of the blocks, a strided q, K smoothed and not; padded rows hold zeros."""
    assert worst_error(QUANT) == 0


@needs_triton
def test_kernels_match_the_reference_at_each_config():
    """Kernel version 2 (pointer and descriptor paths, tiles from 16 to 128, the conversion instruction, warp
    specialization asked for) and version 1 on the fused quantizer's planes, and version 2 on the reference
    quantizer's layout, against the reference at the configuration's blocks."""
    assert worst_error(KERNELS.replace("LABELS", repr(EXACT))) <= 1e-4


LOSSY = r"""
import torch
import torch.nn.functional as F
from fastwan.kernels import attn8 as A, interpreted_kernels
from fastwan.kernels.attn8_configs import parse_config
from fastwan.attention.synthetic import wan_like_qkv

q, k, v = wan_like_qkv((3, 8, 10), 2, 64, seed=3)  # 240 tokens: 7 full blocks of 32 and a tail
ex = F.scaled_dot_product_attention(*(t.double().transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
rel = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm())
worst = 0.0
for label in LABELS:
    cfg = parse_config(label)
    want = A.attention_reference(A.quantize(q, k, v, 0.125, True, cfg.block_m, cfg.block_n))
    with interpreted_kernels():
        got = A.attn8_config(q, k, v, 0.125, True, cfg)
    assert rel(got, ex) <= 1.05 * rel(want, ex), (label, rel(got, ex), rel(want, ex))
    worst = max(worst, rel(got, want))
print(f"WORST {worst:.3e}")
"""
LOSSY_LABELS = ("v2-m64-n32-w4-s2-fold", "v2-m64-n32-w4-s2-ffma", "v2-m64-n32-w4-s2-desc-fold-ffma",
                "v2-m64-n32-w4-s2-poly2d3", "v2-m32-n32-w4-s2-poly3d5-fold-ffma")


@needs_triton
def test_lossy_options_stay_near_the_reference():
    """fold, ffma and the exp2 polynomial move p in its last bits or (degree 3) by 1e-4: some e4m3 roundings of p
    flip. Rel. L2 to the reference <= 5e-3 (the GPU's own exp2 gives 1.7e-3), no worse against exact attention
    than the reference (5%)."""
    assert worst_error(LOSSY.replace("LABELS", repr(LOSSY_LABELS))) <= 5e-3


POLY = r"""
import torch, triton, triton.language as tl
from fastwan.kernels.attn8_triton import exp2_poly

@triton.jit
def run(X, Y, N, DEGREE: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + o, exp2_poly(tl.load(X + o, mask=o < N, other=0.0), DEGREE), mask=o < N)

x = torch.cat([torch.linspace(-126, 9, 270001), torch.tensor([-float("inf"), -1e30, -127.5, -125.5, -0.5, 8.5])])
ratio = 0.0
for degree, bound in ((3, 1.02e-4), (4, 3.0e-6), (5, 2.0e-7)):
    y = torch.empty_like(x)
    run[(triton.cdiv(x.numel(), 4096),)](x, y, x.numel(), degree, 4096)
    err = float(((y.double() - torch.exp2(x.double())).abs() / torch.exp2(x.double()))[x >= -126].max())
    print(f"degree {degree}: max rel. error {err:.3e}")
    ratio = max(ratio, err / bound)
    low = y[x < -126]
    assert bool(((low > 0) & (low <= 2.0 ** -125)).all()), low  # clamped: tiny, positive, never NaN
print(f"WORST {ratio:.3f}")
"""


@needs_triton
def test_exp2_polynomial_error():
    """Max relative error over [-126, 9] against float64 exp2 (fp32 rounding included): degree 3 <= 1.02e-4, degree
    4 <= 3.0e-6, degree 5 <= 2.0e-7 (e4m3 rounds p by up to 6.25e-2); below -126 (and -inf) a tiny positive."""
    assert worst_error(POLY) <= 1.0


def test_config_table_and_labels():
    assert config_for(128, (9, 0)) == CONFIGS[(128, None)] and config_for(96, None) == DEFAULT
    for cfg in (*CONFIGS.values(), parse_config("v2-m64-n128-w4-s4-desc-ws-poly4d5-fold-ffma")):
        assert parse_config(cfg.label) == check_config(cfg)
    assert parse_config("v2-m64-n128-w4-s4-cvt").cvt and parse_config("v1-m128-n64-w8-s3").version == 1
    for bad, field in (("v2-m96-n64-w8-s3", "block_m"), ("v1-m128-n64-w8-s3-desc", "version"),
                       ("v2-m128-n64-w8-s3-poly1d3", "poly_group"), ("v2-m128-n64-w8-s3-cvt-ffma", "cvt"),
                       ("m128-n64", "config")):
        with pytest.raises(InvalidArgument, match=re.escape(field)) as e:
            parse_config(bad)
        assert e.value.field == field


def test_attend_refuses_blocks_other_than_its_config():
    q, k, v = inputs(Sq=20, Skv=20, D=64)
    t = A.quantize(q, k, v, 0.125, True, 32, 16)
    with pytest.raises(ValueError, match="quantize with the configuration's blocks"):
        A.attend(t, Attn8Config(block_m=64, block_n=16), q.dtype)


BENCH = r"""
import json, sys, tempfile
from pathlib import Path
from benchmarks import attn8_bench

out = Path(tempfile.mkdtemp()) / "attn8.json"
assert attn8_bench.main(["--smoke", "--interpret", "--out", str(out)]) == 0
rows = json.loads(out.read_text())["results"]
configs = [r for r in rows if r["variant"].startswith(("v1-m", "v2-m"))]
assert len(configs) >= 6 and all("ms" in r and r["route"] == "triton" for r in configs), rows
assert any(r["variant"].endswith("fold-ffma") for r in configs)  # the options were applied to the fastest
print(f"WORST {max(r['rel_l2'] for r in configs):.3e}")
"""


@needs_triton
def test_benchmark_sweeps_the_kernels_under_the_interpreter():
    """benchmarks/attn8_bench.py --smoke --interpret: the sweep's rows run the fused quantizer and the kernels (not
    the references), each within the error bound against exact attention."""
    assert worst_error(BENCH) <= 3e-2


def _sm90(fn, signature: dict, consts: dict, warps: int, stages: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(fn=fn, signature={**signature, **dict.fromkeys(consts, "constexpr")}, constexprs=consts)
    try:
        return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages})
    except (RuntimeError, FileNotFoundError) as exc:  # no CUDA backend / ptxas in this Triton install
        pytest.skip(f"Triton cannot compile for sm90 here: {exc}")


def _local_bytes(kernel) -> int | None:
    """The compiled kernel's stack (register spills) in bytes, from cuobjdump; None without it."""
    import triton.backends.nvidia as nvidia

    tool = Path(nvidia.__file__).parent / "bin" / "cuobjdump"
    if not tool.exists() and not shutil.which("cuobjdump"):
        return None
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([str(tool) if tool.exists() else "cuobjdump", "-res-usage", f.name],
                             capture_output=True, text=True).stdout
    match = re.search(r"STACK:(\d+)", out)
    return int(match.group(1)) if match else None


@needs_triton
@pytest.mark.parametrize("label", [DEFAULT.label, "v2-m128-n128-w8-s3-desc-fold-ffma"])
def test_v2_compiles_for_sm90_on_tensor_cores_without_spills(label):
    """Q·K^T as an INT8 wgmma, P·V as an e4m3 one (K-major operands: no transposing copy), TMA loads with
    descriptors, and no register spills."""
    from fastwan.kernels import attn8_triton

    cfg = parse_config(label)
    desc = {"Q8": f"tensordesc<i8[{cfg.block_m}, 128]>", "K8": f"tensordesc<i8[{cfg.block_n}, 128]>",
            "V8": f"tensordesc<fp8e4nv[128, {cfg.block_n}]>"}
    ptrs = {"Q8": "*i8", "QS": "*fp32", "K8": "*i8", "KS": "*fp32", "V8": "*fp8e4nv", "VS": "*fp32", "OUT": "*bf16"}
    ptrs = {**ptrs, **(desc if cfg.descriptors else {})}
    ints = dict.fromkeys("sob sos soh Sq Skv H n_m n_n".split(), "i32")
    consts = dict(D=128, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, P_SCALE=A.P_SCALE, ROUND_BY_BITS=False,
                  DESC=cfg.descriptors, WARP_SPEC=cfg.warp_specialize, POLY_GROUP=cfg.poly_group,
                  POLY_DEGREE=cfg.poly_degree, FOLD=cfg.fold, CVT=cfg.cvt, FFMA=cfg.ffma)
    kernel = _sm90(attn8_triton.attn8_v2_fwd, {**ptrs, **ints}, consts, cfg.num_warps, cfg.num_stages)
    mmas = set(re.findall(r"wgmma\.mma_async\.[\w.]+", kernel.asm["ptx"]))
    assert any(m.endswith(".s32.s8.s8") for m in mmas) and any(m.endswith(".f32.e4m3.e4m3") for m in mmas), mmas
    if cfg.descriptors:
        assert "cp.async.bulk.tensor" in kernel.asm["ptx"]
    stack = _local_bytes(kernel)
    assert stack in (None, 0), f"{label}: {stack} bytes of register spills"


@needs_triton
def test_quantizer_compiles_for_sm90():
    from fastwan.kernels import attn8_quant_triton as QT

    i32 = "i32"
    _sm90(QT.kv_stats, {"K": "*bf16", "V": "*bf16", "KSUM": "*fp64", "VMAX": "*fp32",
                        **dict.fromkeys("skb sks skh svb svs svh S H n_chunks".split(), i32)},
          dict(D=128, ROWS=QT.STATS_ROWS, STEPS=QT.STATS_CHUNK, SMOOTH=True), 4, 1)
    _sm90(QT.quant_rows, {"X": "*bf16", "MEAN": "*fp32", "OUT": "*i8", "SCALE": "*fp32",
                          **dict.fromkeys("sxb sxs sxh S H n_blocks".split(), i32), "factor": "fp32"},
          dict(D=128, BLOCK=64, SMOOTH=True), 4, 1)
    kernel = _sm90(QT.quant_v, {"V": "*bf16", "VSCALE": "*fp32", "OUT": "*fp8e4nv",
                                **dict.fromkeys("svb svs svh S H n_blocks".split(), i32)},
                   dict(D=128, BLOCK=64, ROUND_BY_BITS=False), 4, 1)
    assert "cvt.rn.satfinite.e4m3x2.f32" in kernel.asm["ptx"]  # e4m3 rounded to nearest even by the GPU
