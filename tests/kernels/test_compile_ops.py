"""Custom ops around external kernels: schema/fake-impl checks and torch.compile(fullgraph=True) on CPU.

The external kernels (FlashAttention, SageAttention) are not on this machine, so their loaders in
``fastwan.attention.backends.packages`` are replaced with a float64 reference kernel: everything else — backend
forward, custom op, fake impl, dynamo/AOT/inductor — is the production path.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from fastwan.attention import AttentionDispatch
from fastwan.attention.backends import fa4_plan
from fastwan.attention.backends import packages as kernels
from fastwan.attention.backends.flash import FlashAttnBackend
from fastwan.attention.backends.sage import SageAttnBackend
from fastwan.attention.synthetic import reference_attention
from fastwan.attention.backends import ops as _ops

CALLS: list[dict] = []


def fake_flash_kernel(version):
    def run(q, k, v, scale, *tile):
        strides_ok = all(x.stride(-1) == 1 for x in (q, k, v))
        CALLS.append({"kernel": f"FA{version}", "scale": scale, "strides_ok": strides_ok, "rows": q.shape[1], **(
            {"tile_m": tile[0]} if tile else {})})
        out = reference_attention(q, k, v, scale).to(q.dtype)
        return (out, torch.zeros(q.shape[0], q.shape[2], q.shape[1])) if version in (3, 4) else out  # FA3/4: (out, lse)

    return run


def fake_sage_kernel():
    def run(q, k, v, scale):
        CALLS.append({"kernel": "sage", "scale": scale})
        return reference_attention(q, k, v, scale).to(q.dtype)

    return run


@pytest.fixture(autouse=True)
def cpu_kernels(monkeypatch):
    CALLS.clear()
    monkeypatch.setattr(kernels, "flash_kernel", fake_flash_kernel)
    monkeypatch.setattr(kernels, "sage_kernel", fake_sage_kernel)
    monkeypatch.setattr(kernels, "nvfp4_flash_kernel", lambda: fake_flash_kernel(4))


def qkv(sq=12, skv=9, h=2, d=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, s, h, d, generator=g, dtype=dtype) for s in (sq, skv, skv))


def rel_err(out, ref):
    return float((out.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("version", [2, 3, 4])
def test_flash_backend_forward_path(version):
    q, k, v = qkv()
    out = FlashAttnBackend(version=version)(q, k, v, scale=0.4)
    assert out.shape == q.shape and out.is_contiguous()
    assert rel_err(out, reference_attention(q, k, v, 0.4)) <= 1e-5
    assert CALLS == [{"kernel": f"FA{version}", "scale": 0.4, "strides_ok": True, "rows": 12}]


def test_fa4_tile_reaches_the_kernel_only_when_set():
    q, k, v = qkv()
    out = torch.ops.fastwan.flash_attn(q, k, v, 0.4, 4, 192)
    torch.ops.fastwan.flash_attn(q, k, v, 0.4, 4)  # default 0: FA4's own tile, public entry point
    assert rel_err(out, reference_attention(q, k, v, 0.4)) <= 1e-5
    assert CALLS[0]["tile_m"] == 192 and "tile_m" not in CALLS[1]
    # an explicit tile on a CPU tensor goes through the backend unchanged (its reasons() refuse it on resolve)
    FlashAttnBackend(version=4, fa4_tile_m=128)(q, k, v, scale=0.4)
    assert CALLS[2]["tile_m"] == 128


@pytest.mark.parametrize("batch", [1, 2])
def test_fa4_split_covers_the_query_in_two_launches(batch):
    """split > 0: rows [0, split) with tile_m and the rest with tail_tile_m, into one output; the same values as
    one launch (the reference), also for a strided q (a view into a fused QKV buffer)."""
    g = torch.Generator().manual_seed(1)
    qkv_buf = torch.randn(batch, 13, 3, 2, 16, generator=g)
    q, k, v = qkv_buf[:, :, 0], qkv_buf[:, :9, 1], qkv_buf[:, :9, 2]  # [B, S, H, D] views, stride(-1) == 1
    out = torch.ops.fastwan.flash_attn(q, k, v, 0.4, 4, 192, 5, 128)
    assert out.shape == q.shape and out.is_contiguous()
    assert rel_err(out, reference_attention(q, k, v, 0.4)) <= 1e-6
    assert [(c["tile_m"], c["rows"]) for c in CALLS] == [(192, 5), (128, 8)]
    fn = torch.compile(lambda a, b, c: torch.ops.fastwan.flash_attn(a, b, c, 0.4, 4, 192, 5, 128) * 2,
                       fullgraph=True)
    assert torch.allclose(fn(q, k, v), out * 2)


@pytest.mark.parametrize("plan,want", [((192, 5, 128), [(192, 5), (128, 8)]), ((192, 0, 0), [(192, 13)]),
                                       ((128, 0, 0), [(None, 13)])])
def test_fa4_split_planned_inside_the_op(monkeypatch, plan, want):
    """split=-1: the op asks fa4_plan.fa4_sm90_plan (shapes, SM count) at run time and runs what it says; a
    one-launch plan with 128-row tiles takes FA4's public entry point."""
    seen = []
    monkeypatch.setattr(_ops, "_sm_count", lambda device: 132)
    monkeypatch.setattr(fa4_plan, "fa4_sm90_plan", lambda *a: seen.append(a) or plan)
    q, k, v = qkv(sq=13)
    out = torch.ops.fastwan.flash_attn(q, k, v, 0.4, 4, 192, -1, 0)
    assert seen == [(1, 13, 9, 2, 132)]
    assert [(c.get("tile_m"), c["rows"]) for c in CALLS] == want
    assert rel_err(out, reference_attention(q, k, v, 0.4)) <= 1e-6


@pytest.mark.parametrize("args,msg", [((2, 192, 5, 128), "needs FA4"), ((4, 192, 13, 128), "0 < split < Sq=13"),
                                      ((4, 192, 5, 96), "tail_tile_m=96")])
def test_fa4_split_rejects_what_it_cannot_run(args, msg):
    q, k, v = qkv(sq=13)
    with pytest.raises(ValueError, match=msg):
        torch.ops.fastwan.flash_attn(q, k, v, 0.4, *args)


def test_default_scale_and_non_contiguous_inputs():
    q, k, v = qkv(d=32)
    qn = torch.randn(1, 2, 12, 32).transpose(1, 2)  # [B, S, H, D] view with stride(-1) == 1
    kt = torch.randn(1, 9, 32, 2).transpose(-1, -2)  # stride(-1) != 1: made contiguous for the kernel
    out = FlashAttnBackend(version=4)(qn, kt, v)
    assert CALLS[0]["scale"] == pytest.approx(32**-0.5) and CALLS[0]["strides_ok"]
    assert rel_err(out, reference_attention(qn, kt, v)) <= 1e-5


def test_sage_backend_forward_path():
    q, k, v = qkv()
    out = SageAttnBackend()(q, k, v, scale=0.3)
    assert rel_err(out, reference_attention(q, k, v, 0.3)) <= 1e-5 and CALLS[0]["scale"] == 0.3


def test_nvfp4_backend_calls_the_nvfp4_op():
    q, k, v = qkv(dtype=torch.bfloat16)
    out = FlashAttnBackend(nvfp4=True)(q, k, v)
    assert out.dtype == torch.bfloat16 and CALLS[0]["kernel"] == "FA4"


@pytest.mark.parametrize(
    "op,extra",
    [
        ("flash_attn", (0.3, 4)),
        ("flash_attn", (0.3, 4, 192)),
        ("sage_attn", (0.3,)),
        ("nvfp4_flash_attn", (0.3,)),
    ],
)
def test_opcheck(op, extra):
    q, k, v = qkv(d=16)
    dtype_args = (q, k, v) if op != "nvfp4_flash_attn" else tuple(x.bfloat16() for x in (q, k, v))
    result = torch.library.opcheck(getattr(torch.ops.fastwan, op).default, (*dtype_args, *extra))
    assert all(v == "SUCCESS" for v in result.values()), result


def test_fake_impl_shape_dtype_and_layout():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 7, 3, 64, dtype=torch.bfloat16)
        kv = torch.empty(2, 5, 3, 64, dtype=torch.bfloat16)
        for out in (
            torch.ops.fastwan.flash_attn(q, kv, kv, 0.1, 4),
            torch.ops.fastwan.sage_attn(q, kv, kv, 0.1),
            torch.ops.fastwan.nvfp4_flash_attn(q, kv, kv, 0.1),
        ):
            assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()


class Block(torch.nn.Module):
    """A tiny Wan-ish block: qkv projection, qk RMS norm, self-attention through the dispatch, projection."""

    def __init__(self, dispatch: AttentionDispatch, dim=64, heads=4):
        super().__init__()
        self.dispatch, self.heads = dispatch, heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.norm_q = torch.nn.RMSNorm(dim)
        self.norm_k = torch.nn.RMSNorm(dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x, text):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k = self.norm_q(q), self.norm_k(k)
        split = lambda t: t.unflatten(-1, (self.heads, -1))  # noqa: E731
        y = self.dispatch.self_attention(split(q), split(k), split(v))
        t = split(text)
        y = y + self.dispatch.cross_attention(split(q), t, t)
        return self.out(y.flatten(-2))


@pytest.mark.parametrize("backend", [FlashAttnBackend(version=4), SageAttnBackend()], ids=["flash", "sage"])
@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_compile_fullgraph_no_graph_breaks(backend, compiler):
    torch.manual_seed(0)
    block = Block(AttentionDispatch(backend)).eval()
    x, text = torch.randn(2, 10, 64), torch.randn(2, 6, 64)
    with torch.no_grad():
        eager = block(x, text)
        explain = torch._dynamo.explain(block)(x, text)
        assert explain.graph_break_count == 0 and explain.graph_count == 1
        torch._dynamo.reset()
        compiled = torch.compile(block, fullgraph=True, backend=compiler)
        out = compiled(x, text)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    assert len(CALLS) >= 4  # eager + compiled, self + cross: the kernel ran inside the compiled graph


def test_importing_fastwan_imports_no_external_kernel_package():
    code = (
        "import importlib.abc, sys\n"
        "seen = []\n"
        "class Spy(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('flash_attn', 'flash_attn_interface', 'flash_attn_2_cuda',"
        " 'sageattention', 'triton', 'flashinfer'):\n"
        "            seen.append(name)\n"
        "        return None\n"
        "sys.meta_path.insert(0, Spy())\n"
        "import fastwan, fastwan.attention, fastwan.attention.backends.flash, fastwan.attention.backends.sage\n"
        "import fastwan.attention.backends.ops, fastwan.envinfo, fastwan.profiler\n"
        "from fastwan.attention import create_backend\n"
        "create_backend('FLASH_ATTN'); create_backend('SAGE_ATTN')\n"
        "print(seen)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
