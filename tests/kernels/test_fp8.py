"""FP8 linear layers (fastwan.kernels.fp8) on the CPU: the weight quantizer's rule and error bound, both routes of
``fp8_linear`` against float64 formulas written here, their fidelity to the unquantized fp32 linear, route choice
and its errors, torch.compile, and the safetensors round trip. The "scaled_mm"
route's math is checked through :func:`fp8_linear_emulated`, and through ``torch._scaled_mm`` itself where this
torch runs it on the CPU (tests/gpu holds the CUDA run)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

from fastwan.kernels import fp8


# Every finite, non-negative e4m3 value, from the raw bit patterns: code c (0..126) is the c-th value, ascending.
E4M3_TABLE = torch.arange(127, dtype=torch.int16).to(torch.uint8).view(torch.float8_e4m3fn).double()


def round_e4m3(v: torch.Tensor) -> torch.Tensor:
    """float64 -> nearest e4m3 value (ties to the even code), saturating at 448, by search in the table: an
    implementation independent of torch's cast."""
    a = v.abs().clamp(max=448.0)
    hi = torch.searchsorted(E4M3_TABLE, a).clamp(max=126)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - E4M3_TABLE[lo], E4M3_TABLE[hi] - a
    pick = torch.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, lo)
    return torch.sign(v) * E4M3_TABLE[pick]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error of a against b, in float64."""
    return float((a.double() - b.double()).norm() / b.double().norm())


def make_linear(i=256, o=384, seed=0, dtype=torch.float32) -> nn.Linear:
    """Gaussian weight with std 1/sqrt(I) (outputs of unit scale) and a unit-scale bias."""
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(i, o)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(o, i, generator=g) / i ** 0.5)
        lin.bias.copy_(torch.randn(o, generator=g))
    return lin.to(dtype)


def tokens(*shape, seed=1, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def scaled_mm_on_cpu() -> bool:
    """Whether this torch runs torch._scaled_mm with row-wise scales on the CPU (2.13 does)."""
    try:
        a = torch.ones(16, 16).to(fp8.E4M3)
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError, AttributeError):
        return False
    return True


needs_cpu_scaled_mm = pytest.mark.skipif(not scaled_mm_on_cpu(), reason="torch._scaled_mm does not run on the CPU")


# ---------------------------------------------------------------------------------------------- quantizer
def test_weight_scale_is_row_amax_over_448_and_zero_rows_get_1():
    w = tokens(6, 64) * torch.logspace(-4, 2, 6)[:, None]  # rows six orders of magnitude apart
    w[3] = 0
    w8, scale = fp8.quantize_weight(w)
    assert w8.dtype == torch.float8_e4m3fn and w8.shape == (6, 64)
    assert scale.dtype == torch.float32 and scale.shape == (6,)
    nonzero = torch.tensor([0, 1, 2, 4, 5])
    assert torch.equal(scale[nonzero], w[nonzero].abs().amax(1) / 448)
    assert scale[3] == 1 and torch.all(w8[3].float() == 0)
    # each non-zero row's largest magnitude lands exactly on e4m3's largest finite value
    assert torch.all(w8.float()[nonzero].abs().amax(1) == 448)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_error_is_half_an_e4m3_ulp_per_channel(dtype):
    # Rule: w8 is w / scale rounded to nearest. e4m3 has 3 mantissa bits, so for a scaled value v in the binade
    # [2^e, 2^(e+1)) (e >= -6, normal) the ulp is 2^(e-3) and the error at most half of it: 2^(e-4) <= 2^-4 |v|.
    # Below 2^-6 (subnormal) the step is 2^-9, error <= 2^-10. In weight units (times the row's scale):
    # |w - deq| <= max(2^-4 |w|, 2^-10 * scale). Rows spanning 1e-4..1e2 fail this with a per-tensor scale.
    w = (tokens(8, 256, seed=3) * torch.logspace(-4, 2, 8)[:, None]).to(dtype)
    w8, scale = fp8.quantize_weight(w)
    deq = fp8.dequantize_weight(w8, scale, torch.float64)
    w64 = w.double()
    bound = torch.maximum(2.0 ** -4 * w64.abs(), 2.0 ** -10 * scale.double()[:, None])
    assert torch.all((deq - w64).abs() <= bound * (1 + 1e-6))  # slack: the fp32 product w8 * scale
    # the rule itself, against an independent nearest-e4m3 rounding in float64
    assert torch.equal(w8.double(), round_e4m3(w64 / (w64.abs().amax(1, keepdim=True) / 448)))
    assert rel(deq, w64) > 0.01  # quantization is not a no-op


def test_dequantize_weight_gives_the_dtype_asked_for():
    w8, scale = fp8.quantize_weight(tokens(16, 32))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        d = fp8.dequantize_weight(w8, scale, dtype)
        assert d.dtype == dtype and d.shape == (16, 32)
        assert torch.equal(d, (w8.float() * scale[:, None]).to(dtype))


# ---------------------------------------------------------------------------------------------- dequant route
def test_dequant_route_matches_float64_of_the_dequantized_weight():
    lin = make_linear()
    m = fp8.Fp8Linear.from_linear(lin, route="dequant")
    x = tokens(2, 33, 256)
    want = x.double() @ fp8.dequantize_weight(m.weight, m.weight_scale, torch.float64).t() + lin.bias.double()
    y = m(x)
    assert y.shape == (2, 33, 384) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)  # fp32 matmul of the same operands
    # bf16 activations: the weight rounds to bf16 (e4m3 values are exact there, the scaled products are not) and
    # the output too, ~2^-8 relative each
    mb = fp8.Fp8Linear.from_linear(lin.to(torch.bfloat16), route="dequant")
    yb = mb(x.bfloat16())
    assert yb.dtype == torch.bfloat16 and mb.bias.dtype == torch.bfloat16
    wb = fp8.dequantize_weight(mb.weight, mb.weight_scale, torch.bfloat16).double()
    assert rel(yb, x.bfloat16().double() @ wb.t() + mb.bias.double()) < 1e-2


def test_dequant_route_vs_the_fp32_linear():
    # Error of FP8 weights alone. Rounding to e4m3 leaves a relative error uniform within +-half an ulp, whose RMS
    # over a binade is 2^-3 / sqrt(12) * sqrt(1/2) ~ 0.026 of |w| (the ulp is 2^-3 of the binade's bottom); a
    # Gaussian x and weight carry it unchanged to the output. Measured: 0.0254-0.0264 for I in 64..1536 (seeds
    # 0-2); bound 0.035.
    lin = make_linear()
    x = tokens(64, 256)
    m = fp8.Fp8Linear.from_linear(lin, route="dequant")
    with torch.no_grad():
        want = x.double() @ lin.weight.double().t()  # compare without the bias, which is not quantized
        err = rel(m(x) - lin.bias, want)
    assert 0.015 < err < 0.035


# ---------------------------------------------------------------------------------------------- scaled_mm math
def emulate_float64(x, w8, w_scale, bias):
    """The scaled_mm rule in float64: per-token scale amax/448, x rounded to e4m3 (table search), the product
    with the dequantized weight, bias."""
    x64 = x.double()
    x_scale = (x64.abs().amax(-1, keepdim=True) / 448).clamp(min=torch.finfo(torch.float32).tiny)
    xq = round_e4m3(x64 / x_scale) * x_scale
    out = xq @ (w8.double() * w_scale.double()[:, None]).t()
    return out + bias.double() if bias is not None else out


def test_emulated_scaled_mm_matches_the_float64_rule():
    lin = make_linear()
    w8, s = fp8.quantize_weight(lin.weight)
    x = tokens(3, 21, 256)
    x[0, 4] = 0  # an all-zero token: scale at the floor, x8 = 0, output = bias
    y = fp8.fp8_linear_emulated(x, w8, s, lin.bias)
    assert y.shape == (3, 21, 384) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), emulate_float64(x, w8, s, lin.bias), rtol=1e-5, atol=1e-5)
    assert torch.equal(y[0, 4], lin.bias.detach())
    yb = fp8.fp8_linear_emulated(x.bfloat16(), w8, s, lin.bias.bfloat16())  # one rounding, to bf16
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb.double(), emulate_float64(x.bfloat16(), w8, s, lin.bias.bfloat16()),
                               rtol=2 ** -8, atol=1e-5)


def test_emulated_scaled_mm_vs_the_fp32_linear():
    # Weights and activations both rounded to e4m3, independent errors of ~0.026 each (see the dequant bound):
    # sqrt(2) * 0.026 ~ 0.037. Measured 0.0370-0.0373 for I in 64..1536; bound 0.05.
    lin = make_linear()
    w8, s = fp8.quantize_weight(lin.weight)
    x = tokens(64, 256)
    with torch.no_grad():
        err = rel(fp8.fp8_linear_emulated(x, w8, s, None), x.double() @ lin.weight.double().t())
    assert 0.025 < err < 0.05


@needs_cpu_scaled_mm
def test_scaled_mm_route_runs_torch_scaled_mm_with_the_emulated_math(monkeypatch):
    # Let "scaled_mm" run on the CPU: "auto" picks it and the layer calls torch._scaled_mm with the row-wise
    # argument layout (x8 [M, I] row-major, w8.t() column-major, scale_a fp32 [M, 1], scale_b fp32 [1, O], bf16
    # bias). Its fp32 accumulation order differs from ours: within one bf16 rounding.
    caps = dataclasses.replace(fp8.ROUTES["scaled_mm"], device_types=("cpu", "cuda"))
    monkeypatch.setitem(fp8.ROUTES, "scaled_mm", caps)
    x = tokens(2, 40, 256, dtype=torch.bfloat16)
    facts = dict(device="cpu", dtype=torch.bfloat16, in_features=256)
    # "auto" takes the FP8 GEMM only where it pays: from AUTO_MIN_OUT_FEATURES output features
    assert fp8.choose_route("auto", **facts, out_features=fp8.AUTO_MIN_OUT_FEATURES) == ("scaled_mm", [])
    assert fp8.choose_route("auto", **facts, out_features=fp8.AUTO_MIN_OUT_FEATURES - 16) == ("dequant", [])
    route, _ = fp8.choose_route("scaled_mm", **facts, out_features=384)
    m = fp8.Fp8Linear.from_linear(make_linear(dtype=torch.bfloat16), route=route)
    want = fp8.fp8_linear_emulated(x, m.weight, m.weight_scale, m.bias).double()
    torch.testing.assert_close(m(x).double(), want, rtol=2 ** -7, atol=1e-3)
    assert rel(m(x), want) < 2e-3


def test_zero_weight_rows_give_the_bias_on_both_routes():
    lin = make_linear(64, 48)
    with torch.no_grad():
        lin.weight[5] = 0
    m = fp8.Fp8Linear.from_linear(lin, route="dequant")
    x = tokens(7, 64)
    assert torch.equal(m(x)[:, 5], lin.bias[5].detach().expand(7))
    y = fp8.fp8_linear_emulated(x, m.weight, m.weight_scale, m.bias)
    assert torch.equal(y[:, 5], lin.bias[5].detach().expand(7)) and torch.isfinite(y).all()


# ---------------------------------------------------------------------------------------------- routes, errors
def test_auto_on_cpu_takes_dequant_and_says_why():
    route, why = fp8.choose_route("auto", device="cpu", dtype=torch.float32, in_features=64, out_features=48)
    assert route == "dequant" and any("device type 'cpu'" in r for r in why)
    assert fp8.choose_route("dequant", device="cpu", dtype=torch.float32, in_features=64, out_features=48) == \
        ("dequant", [])


def test_route_reasons_name_value_rule_and_fix(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    ok = dict(device="cuda", dtype=torch.bfloat16, in_features=1536, out_features=8960)
    assert fp8.route_reasons("scaled_mm", **ok) == []
    (act,) = fp8.route_reasons("scaled_mm", **{**ok, "dtype": torch.float32})  # the output follows x's dtype
    assert "activation dtype float32" in act and "float16 or bfloat16" in act and "dtype=torch.bfloat16" in act
    (r,) = fp8.route_reasons("scaled_mm", **{**ok, "in_features": 40})
    assert "in_features 40 is not a multiple of 16" in r and "pad it to 48" in r and "'dequant'" in r
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    (r,) = fp8.route_reasons("scaled_mm", **ok)
    assert "sm86 is below sm89" in r
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))  # Blackwell: CUTLASS
    assert fp8.route_reasons("scaled_mm", **ok) == []
    assert fp8.route_reasons("dequant", **{**ok, "dtype": torch.float32}) == []


def test_a_route_asked_for_that_cannot_run_raises_with_its_reasons():
    facts = dict(device="cpu", dtype=torch.float32, in_features=40, out_features=48)
    with pytest.raises(ValueError, match=r"route 'scaled_mm' cannot run: device type 'cpu'.*in_features 40 is not"):
        fp8.choose_route("scaled_mm", **facts)
    with pytest.raises(ValueError, match="route 'fast' is unknown"):
        fp8.choose_route("fast", **facts)
    with pytest.raises(ValueError, match="route 'auto' is not one of"):
        fp8.Fp8Linear(16, 16, route="auto")
    with pytest.raises(ValueError, match="no route can run: .*activation dtype float64"):
        fp8.choose_route("auto", **{**facts, "dtype": torch.float64})
    w8, s = fp8.quantize_weight(tokens(48, 40))
    with pytest.raises(ValueError, match="route 'fast' is not a built route"):
        fp8.fp8_linear(tokens(3, 40), w8, s, None, "fast")


def test_bad_inputs_raise_clear_errors():
    w8, s = fp8.quantize_weight(tokens(16, 32))
    x = tokens(4, 32)
    with pytest.raises(ValueError, match=r"2-D \[out_features, in_features\]"):
        fp8.quantize_weight(tokens(32))
    with pytest.raises(ValueError, match="dtype float64"):
        fp8.quantize_weight(tokens(4, 4).double())
    with pytest.raises(ValueError, match="NaN/inf"):
        fp8.quantize_weight(torch.tensor([[1.0, float("inf")]]))
    with pytest.raises(ValueError, match="weight has shape .* dtype bfloat16; it must be a float8_e4m3fn"):
        fp8.fp8_linear(x, w8.bfloat16(), s, None, "dequant")
    with pytest.raises(ValueError, match=r"x of shape \(4, 24\) does not end in in_features = 32"):
        fp8.fp8_linear(tokens(4, 24), w8, s, None, "dequant")
    with pytest.raises(ValueError, match=r"weight_scale .* must be float32 \[16\]"):
        fp8.fp8_linear(x, w8, s.bfloat16(), None, "dequant")
    with pytest.raises(ValueError, match=r"bias has shape \(15,\); it must be \[16\]"):
        fp8.fp8_linear(x, w8, s, torch.zeros(15), "dequant")


# ---------------------------------------------------------------------------------------------- op, compile, module
@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_compile_fullgraph_matches_eager(compiler):
    m = fp8.Fp8Linear.from_linear(make_linear(64, 48, dtype=torch.bfloat16)).eval()
    x = tokens(2, 9, 64, dtype=torch.bfloat16)

    def f(t):
        return torch.nn.functional.silu(m(t)) * 2

    torch._dynamo.reset()
    with torch.no_grad():
        eager = f(x)
        out = torch.compile(f, fullgraph=True, backend=compiler)(x)
    torch.testing.assert_close(out, eager, rtol=2 ** -7, atol=1e-2)  # inductor may fuse differently: one bf16 step


def test_module_to_dtype_casts_only_the_bias():
    m = fp8.Fp8Linear.from_linear(make_linear(64, 48))
    w8, s = m.weight.clone(), m.weight_scale.clone()
    m.to(torch.bfloat16)
    assert m.bias.dtype == torch.bfloat16 and m.weight_scale.dtype == torch.float32
    assert m.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(m.weight.view(torch.uint8), w8.view(torch.uint8)) and torch.equal(m.weight_scale, s)
    m.half()
    assert m.bias.dtype == torch.float16 and torch.equal(m.weight_scale, s)
    assert "in_features=64, out_features=48, bias=True, route='dequant'" in repr(m)


def test_safetensors_round_trip_is_bit_exact(tmp_path):
    from safetensors.torch import load_file, save_file

    model = nn.Sequential(fp8.Fp8Linear.from_linear(make_linear(64, 48, dtype=torch.bfloat16)),
                          fp8.Fp8Linear.from_linear(nn.Linear(48, 32, bias=False)))
    state = fp8.fp8_state(model)
    assert set(state) == {"0.weight", "0.weight_scale", "0.bias", "1.weight", "1.weight_scale"}
    save_file(state, tmp_path / "fp8.safetensors")
    loaded = load_file(tmp_path / "fp8.safetensors")
    fresh = nn.Sequential(fp8.Fp8Linear(64, 48), fp8.Fp8Linear(48, 32, bias=False))
    fresh.load_state_dict(loaded)
    for k, v in fp8.fp8_state(fresh).items():
        assert v.dtype == state[k].dtype and torch.equal(v.view(torch.uint8), state[k].view(torch.uint8)), k
    x = tokens(3, 64, dtype=torch.bfloat16)
    assert torch.equal(fresh(x), model(x))
