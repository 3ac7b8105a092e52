"""Cross-attention with the text padding collapsed into one weighted key (fastwan.kernels.text_cross).

The collapse must equal attention over every (duplicated) padding key: checked in float64 against a dense
softmax, for the PyTorch reference, the Triton kernel (under the interpreter, fp32) and the DiT's wiring (forward,
forward_cfg batched and sequential, compiled). The kernel's bf16 behaviour is checked on the GPU
(tests/gpu/test_gpu_text_cross.py)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from fastwan.attention import AttentionDispatch
from fastwan.kernels import text_cross
from fastwan.models import load_transformer
from fastwan.models.wan import transformer as wan_mod

ops = torch.ops.fastwan


def padded(B, L, D, lengths, seed=0, dtype=torch.float64):
    """[B, L, D] rows: ``lengths[b]`` random rows, then copies of one padding row (zeros, as Wan pads)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.zeros(B, L, D, dtype=dtype)
    for b, n in enumerate(lengths):
        t[b, :n] = torch.randn(n, D, generator=g, dtype=dtype)
    return t


def dense64(q, k, v):
    """Plain softmax attention over every key, float64. q [B, S, H, D], k/v [B, L, H, D]."""
    q, k, v = (t.double() for t in (q, k, v))
    s = torch.einsum("bshd,blhd->bhsl", q, k) / q.shape[-1] ** 0.5
    return torch.einsum("bhsl,blhd->bshd", s.softmax(-1), v)


def qkv_with_padding(B, S, L, H, D, lengths, seed=0):
    """q random; k, v random for the first lengths[b] keys, then one repeated padding key/value per sample."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, H, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, L, H, D, generator=g, dtype=torch.float64) for _ in range(2))
    for b, n in enumerate(lengths):
        if n < L:
            k[b, n:], v[b, n:] = k[b, n].clone(), v[b, n].clone()
    return q, k, v


def test_text_keys():
    t = padded(4, 10, 3, [4, 10, 0, 9])
    assert text_cross.text_keys(t).tolist() == [5, 10, 1, 10]  # 4 tokens + 1; none; all padding; 9 + 1 = 10
    t2 = t.clone()
    t2[0, 7] = 1.0  # a non-padding row inside the tail ends the run later
    assert text_cross.text_keys(t2)[0].item() == 9
    t3 = t.clone()
    t3[1, -1] = float("nan")  # NaN rows never compare equal: no collapse
    assert text_cross.text_keys(t3)[1].item() == 10
    assert text_cross.text_keys(t).dtype == torch.int32
    with pytest.raises(ValueError, match=r"\[B, L, D\]"):
        text_cross.text_keys(torch.zeros(2, 0, 3))


@pytest.mark.parametrize("lengths", [[5, 13], [16, 1], [0, 7]])
def test_reference_equals_attention_over_all_padding_keys(lengths):
    B, S, L, H, D = 2, 11, 16, 3, 8
    q, k, v = qkv_with_padding(B, S, L, H, D, lengths)
    keys = torch.tensor([min(n + 1, L) for n in lengths], dtype=torch.int32)
    got = text_cross.text_cross_reference(q, k, v, keys)
    torch.testing.assert_close(got, dense64(q, k, v), rtol=1e-12, atol=1e-12)
    # the op takes the reference off CUDA; more keys than needed stay exact, fewer drop a real key
    torch.testing.assert_close(ops.text_cross_attention(q, k, v, keys), dense64(q, k, v), rtol=1e-12, atol=1e-12)
    more = text_cross.text_cross_reference(q, k, v, (keys + 2).clamp(max=L))
    torch.testing.assert_close(more, dense64(q, k, v), rtol=1e-12, atol=1e-12)
    wrong = text_cross.text_cross_reference(q, k, v, (keys - 1).clamp(min=1))
    assert (wrong - dense64(q, k, v)).abs().max() > 1e-3


def test_bad_inputs_raise():
    q, k, v = qkv_with_padding(2, 4, 6, 2, 8, [2, 3])
    with pytest.raises(ValueError, match="int32"):
        ops.text_cross_attention(q, k, v, torch.tensor([3, 4]))
    with pytest.raises(ValueError, match=r"k, v \[B, L, H, D\]"):
        ops.text_cross_attention(q, k[:, :, :1], v, torch.tensor([3, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="keys are on meta"):
        text_cross.check_inputs(q, k, v, torch.tensor([3, 4], dtype=torch.int32, device="meta"))


def test_opcheck():
    q, k, v = (t.float() for t in qkv_with_padding(2, 4, 6, 2, 8, [2, 3]))
    result = torch.library.opcheck(ops.text_cross_attention.default, (q, k, v, torch.tensor([3, 4], dtype=torch.int32)))
    assert all(r == "SUCCESS" for r in result.values()), result


KERNEL_SCRIPT = r"""
import torch
from fastwan.kernels import text_cross
text_cross._kernel_device = lambda x: True
text_cross.DTYPES = (torch.float32,)  # fp32 CPU tensors through the kernel (the interpreter runs it)
worst = 0.0
g = torch.Generator().manual_seed(0)
for B, S, L, H, D, lengths in [(2, 130, 70, 2, 16, [3, 69]), (1, 7, 512, 1, 32, [150]), (2, 5, 4, 3, 16, [4, 0])]:
    q = torch.randn(B, S, H, D, generator=g)
    k, v = torch.randn(B, L, H, D, generator=g), torch.randn(B, L, H, D, generator=g)
    for b, n in enumerate(lengths):
        if n < L:
            k[b, n:], v[b, n:] = k[b, n].clone(), v[b, n].clone()
    keys = torch.tensor([min(n + 1, L) for n in lengths], dtype=torch.int32)
    got = torch.ops.fastwan.text_cross_attention(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, keys)
    s = torch.einsum("bshd,blhd->bhsl", q.double(), k.double()) / D ** 0.5
    want = torch.einsum("bhsl,blhd->bshd", s.softmax(-1), v.double())
    worst = max(worst, float((got.double() - want).abs().max()))
print(f"WORST {worst:.3e}")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs the triton package")
def test_kernel_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", KERNEL_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert float(out.stdout.split("WORST")[-1]) <= 1e-5, out.stdout


@pytest.fixture
def collapse_on_cpu(monkeypatch):
    """The DiT takes the collapsed route on the CPU (the op runs its reference there)."""
    monkeypatch.setattr(wan_mod, "text_cross_ok", lambda x, head_dim: True)


def _calls(fn):
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    with prof:
        out = fn()
    return out, sum(e.name == "fastwan::text_cross_attention" for e in prof.events())


@pytest.mark.parametrize("variant", ["wan2.1", "wan2.2-a14b"])
def test_dit_collapsed_route_matches_full_cross_attention(tiny_ckpts, collapse_on_cpu, variant):
    attn = AttentionDispatch.resolve("TORCH_SDPA", device="cpu", dtype=torch.float32, head_dim=12)
    model = load_transformer(tiny_ckpts[variant] / "transformer", dtype=torch.float32, device="cpu", attention=attn)
    n = model.config.num_layers
    g = torch.Generator().manual_seed(3)
    x, t = torch.randn(1, model.config.in_channels, 3, 6, 10, generator=g), torch.tensor([700.0])
    text, text_u = padded(2, 24, model.config.text_dim, [9, 3], seed=4, dtype=torch.float32).split(1)
    with torch.no_grad():
        model.set_fast_paths(text_collapse=False)
        (want, want_u), calls_off = _calls(lambda: (model(x, t, text), model(x, t, text_u)))
        model.set_fast_paths(text_collapse=True)
        (got, got_u), calls = _calls(lambda: (model(x, t, text), model(x, t, text_u)))
        cfg = {b: model.forward_cfg(x, t, text, text_u, batched=b) for b in (True, False)}
        x2, t2 = torch.cat([x, x]), torch.tensor([700.0, 300.0])
        model.set_fast_paths(text_collapse=False)
        want2 = model(x2, t2, torch.cat([text, text_u]))
        model.set_fast_paths(text_collapse=True)
        got2 = model(x2, t2, torch.cat([text, text_u]))
    assert calls_off == 0 and calls == 2 * n
    with torch.no_grad():  # no padding in the text: the dispatch's backend, over all tokens
        _, calls_unpadded = _calls(lambda: model(x, t, torch.randn(1, 24, model.config.text_dim)))
    assert calls_unpadded == 0
    for a, b in ((got, want), (got_u, want_u), (got2, want2), *zip(cfg[True], (want, want_u)),
                 *zip(cfg[False], (want, want_u))):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_dit_collapsed_route_compiles_without_recompiling_per_prompt(tiny_ckpts, collapse_on_cpu):
    """The key counts are a tensor: prompts of other lengths reuse the compiled blocks (fullgraph)."""
    torch._dynamo.reset()
    attn = AttentionDispatch.resolve("TORCH_SDPA", device="cpu", dtype=torch.float32, head_dim=12)
    model = load_transformer(tiny_ckpts["wan2.1"] / "transformer", dtype=torch.float32, device="cpu",
                             attention=attn)
    x, t = torch.randn(1, model.config.in_channels, 3, 6, 10), torch.tensor([500.0])
    with torch.no_grad():
        eager = [model(x, t, padded(1, 24, model.config.text_dim, [n], seed=n, dtype=torch.float32))
                 for n in (5, 17)]
        model.compile_blocks(fullgraph=True)
        from torch._dynamo.utils import counters
        counters.clear()
        compiled, graphs = [], []
        for n in (5, 17):
            compiled.append(model(x, t, padded(1, 24, model.config.text_dim, [n], seed=n, dtype=torch.float32)))
            graphs.append(counters["stats"]["unique_graphs"])
    torch._dynamo.reset()
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert graphs[0] >= 1 and graphs[1] == graphs[0], graphs  # the second prompt length compiles nothing new
