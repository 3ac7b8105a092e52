"""Backends that run on CPU, checked against an independent float64 softmax(QK^T)V reference."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastwan.attention import AttentionDispatch, AttentionMetadata, attention, create_backend
from fastwan.attention.backends.sdpa import TorchSDPABackend
from fastwan.attention.synthetic import reference_attention, wan_like_qkv

CPU_SDPA_KERNELS = ("auto", "flash", "math")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def qkv(b=2, sq=37, skv=37, h=3, d=64, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, h, d, generator=g, dtype=dtype)
    k = torch.randn(b, skv, h, d, generator=g, dtype=dtype)
    v = torch.randn(b, skv, h, d, generator=g, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("kernel", CPU_SDPA_KERNELS)
def test_sdpa_kernels_on_cpu_match_fp64_reference(kernel):
    backend = TorchSDPABackend(kernel=kernel)
    assert backend.reasons(device="cpu", dtype=torch.float32, head_dim=64) == []
    q, k, v = qkv()
    out = backend(q, k, v)
    assert out.shape == q.shape and out.dtype == torch.float32
    assert rel_err(out, reference_attention(q, k, v)) <= 1e-5


@pytest.mark.parametrize("kernel", ("cudnn", "efficient"))
def test_cuda_only_sdpa_kernels_say_why_on_cpu(kernel):
    reasons = TorchSDPABackend(kernel=kernel).reasons(device="cpu", dtype=torch.float32, head_dim=64)
    assert reasons and f"'{kernel}' does not exist on cpu" in reasons[0]


@pytest.mark.parametrize("kernel", CPU_SDPA_KERNELS)
@pytest.mark.parametrize("sq,skv", [(37, 11), (5, 64), (1, 1)])
def test_cross_attention_lengths(kernel, sq, skv):
    q, k, v = qkv(sq=sq, skv=skv, d=32)
    out = TorchSDPABackend(kernel=kernel)(q, k, v)
    assert out.shape == (2, sq, 3, 32)
    assert rel_err(out, reference_attention(q, k, v)) <= 1e-5


@pytest.mark.parametrize("kernel", CPU_SDPA_KERNELS)
def test_scale_is_honoured(kernel):
    q, k, v = qkv(d=16)
    backend = TorchSDPABackend(kernel=kernel)
    out = backend(q, k, v, scale=0.7)
    assert rel_err(out, reference_attention(q, k, v, scale=0.7)) <= 1e-5
    # and it is not the default 1/sqrt(16) = 0.25 result
    assert rel_err(out, reference_attention(q, k, v)) > 1e-2


def test_bf16_sdpa_close_to_reference_on_wan_like_inputs():
    q, k, v = wan_like_qkv((2, 8, 8), 2, 64, dtype=torch.bfloat16)
    out = TorchSDPABackend("auto")(q, k, v)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, reference_attention(q, k, v)) <= 2e-2


def test_standalone_attention_and_dispatch_use_the_named_backend():
    q, k, v = qkv(sq=20, skv=20)
    ref = reference_attention(q, k, v)
    assert rel_err(attention(q, k, v, backend="torch_sdpa"), ref) <= 1e-5
    assert rel_err(attention(q, k, v, backend="TORCH_SDPA", config={"kernel": "math"}), ref) <= 1e-5
    d = AttentionDispatch.resolve("TORCH_SDPA", device="cpu", dtype=torch.float32, head_dim=64)
    assert d.describe("cpu").startswith("TORCH_SDPA (torch.sdpa[")
    assert not d.sparse and d.layout_for((1, 4, 5), torch.device("cpu")) is None
    assert rel_err(d.self_attention(q, k, v), ref) <= 1e-5
    kt, vt = k[:, :7], v[:, :7]  # text-length keys
    assert rel_err(d.cross_attention(q, kt, vt), reference_attention(q, kt, vt)) <= 1e-5


def test_fp64_inputs_run_on_cpu():
    q, k, v = qkv(dtype=torch.float64, d=8)
    out = create_backend("TORCH_SDPA", {"kernel": "math"})(q, k, v)
    assert float((out - reference_attention(q, k, v)).abs().max()) < 1e-12


def test_dynamo_loads_only_for_a_sparse_dispatch():
    """``import fastwan`` and dense attention never import torch._dynamo (it costs seconds); a sparse dispatch
    does, to keep its call out of torch.compile graphs."""
    code = (
        "import sys, torch\n"
        "from fastwan.attention import AttentionDispatch, attention, create_backend\n"
        "d = AttentionDispatch.resolve('TORCH_SDPA', device='cpu', dtype=torch.float32, head_dim=8)\n"
        "q = torch.randn(1, 4, 2, 8)\n"
        "d.self_attention(q, q, q); attention(q, q, q)\n"
        "assert 'torch._dynamo' not in sys.modules, 'dense attention imported torch._dynamo'\n"
        "AttentionDispatch(create_backend('SLIDING_TILE_ATTN'), create_backend('TORCH_SDPA'))\n"
        "assert 'torch._dynamo' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=Path(__file__).resolve().parents[2])


def test_sparse_self_attention_runs_outside_compiled_graphs():
    """The sparse call is one graph break inside a compiled function, and gives the eager result."""
    d = AttentionDispatch(create_backend("SLIDING_TILE_ATTN", {"tile": [1, 2, 2], "window": 1}),
                          create_backend("TORCH_SDPA"))
    grid = (2, 4, 4)
    layout = d.layout_for(grid, torch.device("cpu"))
    q, k, v = (layout.permute(t, dim=1) for t in qkv(b=1, sq=32, skv=32, h=2, d=8))
    meta = AttentionMetadata(grid=grid, layout=layout)

    def block(q):
        return d.self_attention(q * 2, k, v, meta) + 1

    explain = torch._dynamo.explain(block)(q)
    assert explain.graph_break_count == 1
    torch.testing.assert_close(torch.compile(block, backend="eager")(q), block(q))
