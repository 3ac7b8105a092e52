"""settle: the pending part added to the stream in one eager kernel, bit for bit the fp32 sum rounded once (the
reference rounding: x.float() + pending, then x's dtype), for an offset, a pending output with no gate, a shared
gate and a per-token gate, in 16- and 32-bit streams; under autograd the reference expression (out= takes no
gradient)."""
from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from fastwan.models.wan.block import Residual, settle


def cases(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 96, 32, generator=g) * 50).to(dtype)
    y = (torch.randn(2, 96, 32, generator=g) * 3).to(dtype)
    off = torch.randn(1, 1, 32, generator=g)
    gate, gate_tok = torch.randn(1, 1, 32, generator=g), torch.randn(2, 96, 32, generator=g)
    return [(Residual(x, offset=off), x.float() + off), (Residual(x, y=y), x.float() + y.float()),
            (Residual(x, y=y, gate=gate), x.float() + y.float() * gate),
            (Residual(x, y=y, gate=gate_tok), x.float() + y.float() * gate_tok)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_settle_rounds_the_fp32_sum_once(dtype):
    for r, want in cases(dtype):
        got = settle(r)
        assert got.dtype == dtype and torch.equal(got, want.to(dtype))
    x = torch.ones(2, 3)
    assert settle(Residual(x)) is x


def test_settle_of_an_offset_is_one_kernel():
    r = cases(torch.bfloat16)[0][0]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        settle(r)
    kernels = [e.name for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None
               and e.name not in ("aten::empty_like", "aten::empty_strided", "aten::empty")]
    assert kernels == ["aten::add"], kernels


def test_settle_keeps_gradients():
    x = torch.randn(4, 8, requires_grad=True)
    off = torch.randn(1, 8)
    settle(Residual(x, offset=off)).sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
