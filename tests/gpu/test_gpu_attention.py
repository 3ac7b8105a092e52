"""GPU attention kernels vs an independent float64 reference at Wan shapes (skipped without CUDA).

Run: ``pytest -q -s tests/gpu/test_gpu_attention.py`` (``-s`` prints the measured errors for the record).

Accuracy rule for exact bf16 kernels (FlashAttention's): the max abs error vs the float64 reference must be
at most 2x that of attention written in PyTorch in bf16 (bf16 QK^T, fp32 softmax rounded to bf16, bf16 PV),
plus 1e-5. Full S x S references do not fit at S = 32760 / 75600, so the reference and the bf16 baseline are
computed for a sample of 512 query rows against all keys; the kernels run the full problem and are compared
on those rows. SageAttention (INT8 QK^T) is lossy and is held to cos >= 0.99 and relative error <= 5e-2.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastwan.attention import AttentionDispatch, create_backend
from fastwan.attention.synthetic import wan_like_qkv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BF16 = torch.bfloat16
SHAPES = {
    "wan2.1-1.3b-480p": ((21, 30, 52), 12),  # S = 32760, H = 12
    "wan2.1-14b-720p": ((21, 45, 80), 40),  # S = 75600, H = 40
}
EXACT = [
    ("TORCH_SDPA", {"kernel": "flash"}),
    ("TORCH_SDPA", {"kernel": "cudnn"}),
    ("TORCH_SDPA", {"kernel": "efficient"}),
    ("FLASH_ATTN", {}),
    ("FLASH_ATTN", {"version": 4}),
]
ROWS = 512


def backend_or_skip(name, config, head_dim=128, dtype=BF16, seq_q=None, seq_kv=None):
    b = create_backend(name, config)
    why = b.reasons(device="cuda", dtype=dtype, head_dim=head_dim, seq_q=seq_q, seq_kv=seq_kv)
    if why:
        pytest.skip(f"{name}{config}: " + "; ".join(why))
    return b


@pytest.fixture(scope="module", params=list(SHAPES))
def problem(request):
    grid, heads = SHAPES[request.param]
    q, k, v = wan_like_qkv(grid, heads, 128, dtype=BF16, device="cuda", seed=0)
    s = q.shape[1]
    rows = torch.randperm(s, generator=torch.Generator().manual_seed(0))[:ROWS].sort().values.cuda()
    qr = q[:, rows]
    ref = torch.empty(qr.shape, dtype=torch.float64, device="cuda")
    base = torch.empty(qr.shape, dtype=BF16, device="cuda")
    for h in range(heads):  # per head keeps the S_rows x S score matrices small
        hs = slice(h, h + 1)
        qh, kh, vh = (x[:, :, hs].transpose(1, 2) for x in (qr, k, v))
        p = torch.softmax((qh.double() @ kh.double().transpose(-1, -2)) / 128**0.5, dim=-1)
        ref[:, :, hs] = (p @ vh.double()).transpose(1, 2)
        # PyTorch in bf16, written out: bf16 QK^T, softmax in fp32 rounded to bf16, bf16 PV
        pb = torch.softmax((qh @ kh.transpose(-1, -2)).float() / 128**0.5, dim=-1).to(BF16)
        base[:, :, hs] = (pb @ vh).transpose(1, 2)
    base_err = float((base.double() - ref).abs().max())
    yield {"name": request.param, "q": q, "k": k, "v": v, "rows": rows, "ref": ref, "base_err": base_err}
    del q, k, v, ref
    torch.cuda.empty_cache()


def errors(out_rows: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    d = out_rows.double() - ref
    return {
        "max_abs": float(d.abs().max()),
        "rel": float(d.norm() / ref.norm()),
        "cos": float(F.cosine_similarity(out_rows.double().flatten(), ref.flatten(), dim=0)),
    }


@pytest.mark.parametrize("name,config", EXACT, ids=lambda x: str(x))
def test_exact_kernels_within_2x_of_bf16_math(problem, name, config):
    q, k, v = problem["q"], problem["k"], problem["v"]
    b = backend_or_skip(name, config, seq_q=q.shape[1], seq_kv=k.shape[1])
    with torch.inference_mode():
        out = b(q, k, v)
    torch.cuda.synchronize()
    assert out.shape == q.shape and out.dtype == BF16
    e = errors(out[:, problem["rows"]], problem["ref"])
    print(f"\n[{problem['name']}] {name}{config} {b.kernel_name('cuda')}: max_abs={e['max_abs']:.3e} "
          f"(bf16 math {problem['base_err']:.3e}, ratio {e['max_abs'] / problem['base_err']:.2f}) "
          f"rel={e['rel']:.3e} cos={e['cos']:.6f}")
    assert e["max_abs"] <= 2 * problem["base_err"] + 1e-5


def test_sage_within_int8_bounds(problem):
    q, k, v = problem["q"], problem["k"], problem["v"]
    b = backend_or_skip("SAGE_ATTN", {})
    k_before = k.clone()
    with torch.inference_mode():
        out = b(q, k, v)
    torch.cuda.synchronize()
    assert torch.equal(k, k_before), "SAGE_ATTN modified its input k"
    e = errors(out[:, problem["rows"]], problem["ref"])
    print(f"\n[{problem['name']}] SAGE_ATTN {b.kernel_name('cuda')}: max_abs={e['max_abs']:.3e} "
          f"rel={e['rel']:.3e} cos={e['cos']:.6f}")
    assert e["cos"] >= 0.99 and e["rel"] <= 5e-2


@pytest.mark.parametrize("name", ["FLASH_ATTN", "SAGE_ATTN", "TORCH_SDPA"])
def test_cross_attention_and_scale(name):
    q, k, v = wan_like_qkv((21, 30, 52), 12, 128, kv_len=512, dtype=BF16, device="cuda", seed=1)
    b = backend_or_skip(name, {}, seq_q=q.shape[1], seq_kv=512)
    with torch.inference_mode():
        out = b(q, k, v, scale=0.05)
    ref = F.scaled_dot_product_attention(*(x.double().transpose(1, 2) for x in (q, k, v)), scale=0.05)
    e = errors(out, ref.transpose(1, 2))
    print(f"\n{name} cross-attention S=32760 L=512 scale=0.05: {e}")
    assert e["cos"] >= (0.99 if name == "SAGE_ATTN" else 0.9999)


def test_nvfp4_flash_attention_vs_emulation():
    """Runs only on sm100/sm103 with a flash-attn build that takes NVFP4 Q/K (skips with the reason otherwise)."""
    from tests.kernels.test_fp4 import fp4_emulated_attention

    q, k, v = wan_like_qkv((4, 32, 32), 12, 128, dtype=BF16, device="cuda", seed=2)
    b = backend_or_skip("FLASH_ATTN", {"nvfp4": True})
    with torch.inference_mode():
        out = b(q, k, v)
    ref = F.scaled_dot_product_attention(*(x.double().transpose(1, 2) for x in (q, k, v))).transpose(1, 2)
    emu = fp4_emulated_attention(q, k, v)
    e, e_emu = errors(out, ref), errors(emu, ref)
    print(f"\nNVFP4 FA4: {e}; emulation: {e_emu}")
    assert e["cos"] >= 0.99


class Block(torch.nn.Module):
    def __init__(self, dispatch, dim=1536, heads=12):
        super().__init__()
        self.dispatch, self.heads = dispatch, heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.norm_q, self.norm_k = torch.nn.RMSNorm(dim), torch.nn.RMSNorm(dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k = self.norm_q(q), self.norm_k(k)
        y = self.dispatch.self_attention(*(t.unflatten(-1, (self.heads, -1)) for t in (q, k, v)))
        return self.out(y.flatten(-2))


@pytest.mark.parametrize("name", ["FLASH_ATTN", "SAGE_ATTN"])
def test_compile_fullgraph(name):
    backend_or_skip(name, {})
    dispatch = AttentionDispatch.resolve(name, device="cuda", dtype=BF16, head_dim=128)
    block = Block(dispatch).to("cuda", BF16).eval()
    x = torch.randn(1, 4096, 1536, device="cuda", dtype=BF16)
    with torch.no_grad():
        eager = block(x)
        explain = torch._dynamo.explain(block)(x)
        assert explain.graph_break_count == 0, explain.break_reasons
        torch._dynamo.reset()
        out = torch.compile(block, fullgraph=True)(x)
    cos = float(F.cosine_similarity(out.float().flatten(), eager.float().flatten(), dim=0))
    print(f"\ncompiled {dispatch.describe('cuda')}: cos vs eager {cos:.6f}")
    assert cos >= 0.999


@pytest.mark.parametrize("batch,fused", [(1, False), (2, False), (1, True)], ids=["b1", "b2", "b1-strided"])
def test_fa4_split_equals_one_launch(batch, fused):
    """FA4 on sm90 with the query in two launches (fa4_plan.fa4_sm90_plan) gives the same bits as one launch: a
    row's output depends on its own query row and all keys only, whatever tile it lands in."""
    from fastwan.attention.backends import fa4_plan

    b = backend_or_skip("FLASH_ATTN", {"version": 4}, seq_q=32760, seq_kv=32760)
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("FA4's sm90 tiles only")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    s, h = 32760, 12
    tm, split, tail = fa4_plan.fa4_sm90_plan(batch, s, s, h, sms)
    assert split > 0, "the 1.3B 480p shape is split on an H100/H200 (132 SMs)"
    g = torch.Generator(device="cuda").manual_seed(0)
    if fused:  # q/k/v as strided views into one [B, S, 3, H, D] buffer (the fused QKV projection's layout)
        buf = torch.randn(batch, s, 3, h, 128, device="cuda", dtype=BF16, generator=g)
        q, k, v = buf.unbind(2)
    else:
        q, k, v = (torch.randn(batch, s, h, 128, device="cuda", dtype=BF16, generator=g) for _ in range(3))
    scale = 128**-0.5
    two = torch.ops.fastwan.flash_attn(q, k, v, scale, 4, tm, split, tail)
    one = torch.ops.fastwan.flash_attn(q, k, v, scale, 4, tm)
    assert torch.equal(two, one)
    # the backend leaves the split to the op (-1), with the one-launch tile as its fallback
    assert b.plan_for(q, k, 4) == (fa4_plan.fa4_sm90_tile_m(batch, s, h, sms), -1, 0)
    assert torch.equal(torch.ops.fastwan.flash_attn(q, k, v, scale, 4, tm, -1, 0), one)
    assert torch.equal(b(q, k, v), one)
