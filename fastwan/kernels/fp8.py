"""FP8 (e4m3) weights for linear layers: per-output-channel weight quantization, :func:`fp8_linear` and
:class:`Fp8Linear`.

Storage: a weight w [O, I] becomes ``weight`` float8_e4m3fn [O, I] and ``weight_scale`` fp32 [O], with
``w ~= weight.float() * weight_scale[:, None]`` (the names of an :class:`Fp8Linear`'s tensors, and of the saved
files). Rule: ``weight_scale[o] = amax(|w[o, :]|) / 448`` (448: e4m3's largest finite value, so every row's
largest magnitude lands on +-448), 1 for an all-zero row; ``weight = e4m3(w / weight_scale)`` rounded to nearest
(ties to even) after clamping to +-448. Error of one element: at most half an e4m3 ulp, ``2^-4 * |w|`` for scaled
values in e4m3's normal range (|w / weight_scale| >= 2^-6) and ``2^-10 * weight_scale`` below it (subnormal step
2^-9).

``fp8_linear(x, weight, weight_scale, bias, route)``: x [..., I] -> [..., O] in x's dtype, by one of two routes,
chosen when a layer is built (:func:`choose_route`, from :data:`ROUTES`: capabilities as data; :func:`route_reasons`
lists why a route cannot run):

* ``"scaled_mm"`` (CUDA, compute capability >= 8.9, bf16/fp16 x and output, I and O multiples of 16):
  x is quantized per token (:func:`quantize_activation`), then one ``torch._scaled_mm`` with row-wise scales
  (fp32 scale_a [M, 1], scale_b [1, O]), fp32 accumulation and bias in the epilogue. The arithmetic is
  :func:`fp8_linear_emulated` (any device, what the CPU tests check);
* ``"dequant"`` (any device, fp16/bf16/fp32 x): ``F.linear(x, dequantize_weight(weight, weight_scale, x.dtype),
  bias)``, the PyTorch reference: FP8 storage only, the matmul in x's dtype.

``route="auto"`` takes "scaled_mm" where it can run and pays (:data:`AUTO_MIN_OUT_FEATURES`) and "dequant"
otherwise (the caller logs the reasons it could not run); a
route asked for by name that cannot run raises ValueError with its reasons. Both routes are plain PyTorch ops, so
``torch.compile`` fuses the activation quantization (amax, scale, cast) into one pass with the ops before it;
run eagerly, that quantization is several passes over x.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from fastwan.kernels import FLOATS, HALF

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
# Floor of a token's activation scale: an all-zero (or denormal-tiny) token quantizes to zeros instead of 0 / 0.
# fp32's smallest normal keeps |x| / scale <= 448 for any token whose amax is below 448 * floor.
ACT_SCALE_FLOOR = torch.finfo(torch.float32).tiny
_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def _name(dtype: torch.dtype) -> str:
    return _NAMES.get(dtype, str(dtype).replace("torch.", ""))


# ---------------------------------------------------------------------------------------------- quantization
def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [O, I] (bf16/fp16/fp32, finite) -> (w8 float8_e4m3fn [O, I], w_scale fp32 [O]), per output channel."""
    if w.dim() != 2 or w.dtype not in FLOATS:
        raise ValueError(f"quantize_weight: w has shape {tuple(w.shape)} and dtype {_name(w.dtype)}; it takes a "
                         "2-D [out_features, in_features] bfloat16/float16/float32 weight (an nn.Linear's .weight).")
    wf = w.detach().float()
    if not bool(torch.isfinite(wf).all()):
        raise ValueError("quantize_weight: w holds NaN/inf values, which e4m3 cannot scale; fix the checkpoint.")
    amax = wf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))  # zero rows: scale 1, w8 = 0
    w8 = (wf / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)  # the cast rounds to nearest even
    return w8, scale


def dequantize_weight(w8: torch.Tensor, w_scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(w8 [O, I], w_scale fp32 [O]) -> w8.float() * w_scale[:, None] rounded to ``dtype``, [O, I]."""
    return (w8.float() * w_scale.float()[:, None]).to(dtype)


def quantize_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token scaling: x [..., I] -> (x8 float8_e4m3fn [..., I], x_scale fp32 [..., 1]).

    ``x_scale = max(amax(|x|, last dim) / 448, ACT_SCALE_FLOOR)``; ``x8 = e4m3(clamp(x / x_scale, +-448))`` with
    the division in fp32 (one rounding, to e4m3)."""
    xf = x.float()
    x_scale = (xf.abs().amax(dim=-1, keepdim=True) / E4M3_MAX).clamp(min=ACT_SCALE_FLOOR)
    return (xf / x_scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), x_scale


def fp8_linear_emulated(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None
                        ) -> torch.Tensor:
    """The "scaled_mm" route's arithmetic in fp32 on any device: x [..., I] -> [..., O] in x's dtype.

    e4m3 x e4m3 products are exact in fp32 and summed in fp32; the epilogue is the kernel's: ``(acc * x_scale) *
    w_scale + bias`` in fp32, one rounding to the output dtype. Equal, up to fp32 rounding, to the fp32 matmul of
    the dequantized activations and weight."""
    x8, x_scale = quantize_activation(x)
    y = (x8.float() @ w8.float().t()) * x_scale * w_scale.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


# ---------------------------------------------------------------------------------------------- routes
@dataclass(frozen=True)
class RouteCaps:
    """What a route of ``fp8_linear`` runs on. ``None``: no restriction."""

    device_types: tuple[str, ...] | None
    dtypes: tuple[torch.dtype, ...]  # x's (the output's too)
    min_compute_capability: tuple[int, int] | None = None  # CUDA only
    feature_multiple: int | None = None  # in_features and out_features
    needs: str | None = None  # a torch function the route calls


# torch._scaled_mm's row-wise FP8 GEMM: CUTLASS for sm89 and sm90 (cuBLASLt >= 12.9 on sm90), sm100 / sm110 / sm120;
# K and N multiples of 16; mat1 row-major, mat2 column-major; bias in the output's dtype.
ROUTES: dict[str, RouteCaps] = {
    "scaled_mm": RouteCaps(("cuda",), HALF, min_compute_capability=(8, 9), feature_multiple=16, needs="_scaled_mm"),
    "dequant": RouteCaps(None, FLOATS),
}


def route_reasons(route: str, *, device: torch.device | str, dtype: torch.dtype, in_features: int,
                  out_features: int) -> list[str]:
    """Why ``route`` cannot run an fp8_linear of x (``dtype`` on ``device``) with a [out_features, in_features]
    weight; an empty list means it can. Each reason names the value, the rule and a fix."""
    caps, device = ROUTES[route], torch.device(device)
    reasons = []
    if caps.needs and not hasattr(torch, caps.needs):
        reasons.append(f"torch {torch.__version__} has no torch.{caps.needs} (upgrade torch)")
    if caps.device_types is not None and device.type not in caps.device_types:
        reasons.append(f"device type '{device.type}' is not supported (needs {', '.join(caps.device_types)})")
    elif device.type == "cuda" and caps.min_compute_capability:
        if not torch.cuda.is_available():
            reasons.append("CUDA is not available")
        elif (cc := torch.cuda.get_device_capability(device)) < caps.min_compute_capability:
            need = caps.min_compute_capability
            reasons.append(f"compute capability sm{cc[0]}{cc[1]} is below sm{need[0]}{need[1]} (no FP8 tensor cores)")
    if dtype not in caps.dtypes:
        ok = " or ".join(_name(d) for d in caps.dtypes)
        reasons.append(f"activation dtype {_name(dtype)} is not supported (needs {ok}): use dtype=torch.bfloat16")
    m = caps.feature_multiple
    for what, n in (("in_features", in_features), ("out_features", out_features)):
        if m and n % m:
            reasons.append(f"{what} {n} is not a multiple of {m} (the FP8 GEMM's rule): pad it to "
                           f"{-(-n // m) * m} or use route 'dequant'")
    return reasons


# "auto" takes the FP8 GEMM from this many output features: the activation quantization reads x once per GEMM
# (M * I bytes against 2 * M * I * O flops), so its share falls with O. H100, torch 2.11, compiled, tokens 32,760 /
# 75,600 (benchmarks/fp8_bench.py): O = 1536 loses (465 vs 690 TFLOP/s at I = 1536, 639 vs 799 at I = 8960); O >=
# 5120 wins (881-971 vs 673-734), O = 8960 too (899 vs 746).
AUTO_MIN_OUT_FEATURES = 4096


def choose_route(route: str, *, device: torch.device | str, dtype: torch.dtype, in_features: int,
                 out_features: int) -> tuple[str, list[str]]:
    """The route a layer takes, decided when it is built -> (route, why "scaled_mm" was passed over: [] unless
    "auto" fell back). ``route`` itself if it can run (ValueError with its reasons if not); "auto": "scaled_mm"
    where it can run and ``out_features >= AUTO_MIN_OUT_FEATURES`` (where it pays), else "dequant"."""
    if route != "auto" and route not in ROUTES:
        raise ValueError(f"fp8_linear: route {route!r} is unknown; use 'auto', {', '.join(map(repr, ROUTES))}.")
    facts = dict(device=device, dtype=dtype, in_features=in_features, out_features=out_features)
    if route != "auto":
        if reasons := route_reasons(route, **facts):
            raise ValueError(f"fp8_linear: route {route!r} cannot run: {'; '.join(reasons)}.")
        return route, []
    fast = route_reasons("scaled_mm", **facts)
    if not fast and out_features >= AUTO_MIN_OUT_FEATURES:
        return "scaled_mm", []
    if not fast:
        return "dequant", []  # it could run, but does not pay here
    if slow := route_reasons("dequant", **facts):
        raise ValueError(f"fp8_linear: no route can run: {'; '.join(fast + slow)}.")
    return "dequant", fast


def _check(x, weight, weight_scale, bias) -> None:
    """Shape/dtype rules every route shares (ValueError naming the value and the rule)."""
    if weight.dim() != 2 or weight.dtype != E4M3:
        raise ValueError(f"fp8_linear: weight has shape {tuple(weight.shape)} and dtype {_name(weight.dtype)}; it "
                         "must be a float8_e4m3fn [out_features, in_features] matrix from quantize_weight.")
    if x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fp8_linear: x of shape {tuple(x.shape)} does not end in in_features = {weight.shape[1]}.")
    if weight_scale.shape != (weight.shape[0],) or weight_scale.dtype != torch.float32:
        raise ValueError(f"fp8_linear: weight_scale has shape {tuple(weight_scale.shape)} and dtype "
                         f"{_name(weight_scale.dtype)}; it must be float32 [{weight.shape[0]}] (one scale per output "
                         "channel).")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"fp8_linear: bias has shape {tuple(bias.shape)}; it must be [{weight.shape[0]}].")


def _scaled_mm_route(x, weight, weight_scale, bias) -> torch.Tensor:
    x8, x_scale = quantize_activation(x.reshape(-1, x.shape[-1]))  # row-major [M, I], scale_a fp32 [M, 1]
    y = torch._scaled_mm(
        x8, weight.t(),  # mat2 column-major: the transpose of a row-major [O, I]
        scale_a=x_scale, scale_b=weight_scale.view(1, -1),  # scale_b fp32 [1, O]
        bias=None if bias is None else bias.to(x.dtype),  # the kernel's rule: bias dtype == output's
        out_dtype=x.dtype,
    )
    return y.view(*x.shape[:-1], weight.shape[0])


def _dequant_route(x, weight, weight_scale, bias) -> torch.Tensor:
    return F.linear(x, dequantize_weight(weight, weight_scale, x.dtype), None if bias is None else bias.to(x.dtype))


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
               route: str) -> torch.Tensor:
    """y = x @ (weight * weight_scale[:, None])^T + bias: x [..., I], weight e4m3 [O, I], weight_scale fp32 [O],
    bias [O] or None -> [..., O] in x's dtype, by ``route`` ("scaled_mm" or "dequant", from :func:`choose_route`)."""
    _check(x, weight, weight_scale, bias)
    if route == "scaled_mm":
        return _scaled_mm_route(x, weight, weight_scale, bias)
    if route == "dequant":
        return _dequant_route(x, weight, weight_scale, bias)
    raise ValueError(f"fp8_linear: route {route!r} is not a built route; use one of {', '.join(map(repr, ROUTES))} "
                     "(choose_route turns 'auto' into one).")


# ---------------------------------------------------------------------------------------------- module
class Fp8Linear(nn.Module):
    """An nn.Linear with an e4m3 weight: buffers ``weight`` float8_e4m3fn [O, I], ``weight_scale`` fp32 [O] and
    ``bias`` [O] (activation dtype) or None; ``route`` fixed at construction ("scaled_mm" or "dequant").
    forward: x [..., I] -> [..., O] in x's dtype (:func:`fp8_linear`).

    ``module.to(dtype)`` / ``.half()`` cast the bias only: weight and weight_scale keep their dtypes."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, route: str = "dequant",
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None):
        super().__init__()
        if route not in ROUTES:
            raise ValueError(f"Fp8Linear: route {route!r} is not one of {', '.join(map(repr, ROUTES))} (resolve "
                             "'auto' with choose_route first).")
        self.in_features, self.out_features, self.route = in_features, out_features, route
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=E4M3, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device) if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, route: str = "dequant", dtype: torch.dtype | None = None) -> Fp8Linear:
        """Quantize ``linear`` (:func:`quantize_weight`, on the weight's device); the bias is kept in ``dtype``
        (default: the weight's)."""
        w = linear.weight
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, route=route,
                dtype=dtype or w.dtype, device=w.device)
        m.weight, m.weight_scale = quantize_weight(w)
        if linear.bias is not None:
            m.bias = linear.bias.detach().to(dtype or w.dtype).clone()
        return m

    def forward(self, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale, self.bias if with_bias else None, self.route)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized weight [O, I] in ``dtype``."""
        return dequantize_weight(self.weight, self.weight_scale, dtype)

    def _apply(self, fn, recurse=True):
        scale = self.weight_scale
        super()._apply(fn, recurse)
        # module.to(dtype) casts every floating buffer; e4m3 values are exact in any float dtype (casting back
        # restores them), and the fp32 scales are re-moved from the saved originals.
        self.weight = self.weight.to(E4M3)
        self.weight_scale = scale.to(self.weight.device)
        return self

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"route={self.route!r}")


def dense_weight(linear: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """An nn.Linear's or Fp8Linear's weight as a dense [O, I] matrix in ``dtype``."""
    return linear.dense_weight(dtype) if isinstance(linear, Fp8Linear) else linear.weight.to(dtype)


def fp8_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` ready for ``safetensors.torch.save_file`` (detached, contiguous, on the CPU;
    float8_e4m3fn kept). Load with ``module.load_state_dict(safetensors.torch.load_file(path))``."""
    return {k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}
