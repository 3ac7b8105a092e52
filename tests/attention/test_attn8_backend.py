"""ATTN_8BIT (fastwan.attention.backends.attn8): chosen by name only, never automatically; the reasons it cannot run
name what is missing; its settings' rules; the dispatch sends cross-attention to a lossless backend; the hybrid
schedule (bf16_steps) runs the first and last steps' self-attention on that backend, checked through a tiny DiT's
forward per step."""
from __future__ import annotations

import logging

import pytest
import torch

from fastwan.attention import AttentionDispatch, base, create_backend
from fastwan.attention.backends.attn8 import Attn8Backend
from fastwan.attention.registry import AUTO_ORDER, BackendUnavailableError, auto_backend, resolve_backend
from fastwan.errors import InvalidArgument, InvalidArgumentType
from fastwan.models import load_transformer


@pytest.fixture
def with_triton(monkeypatch):
    """Triton installed, whatever this machine has (the fake GPU's other packages unchanged)."""
    real = base.package_available
    monkeypatch.setattr(base, "package_available", lambda n: True if n == "triton" else real(n))


def test_reasons_on_cpu_name_the_device():
    reasons = Attn8Backend().reasons(device="cpu", dtype=torch.bfloat16, head_dim=128)
    assert reasons[0] == "device type 'cpu' is not supported (needs cuda)"
    with pytest.raises(BackendUnavailableError, match="ATTN_8BIT .* cannot run on cpu .*needs cuda"):
        resolve_backend("ATTN_8BIT", device="cpu", dtype=torch.bfloat16, head_dim=128)


def test_reasons_on_a_gpu_name_what_is_missing(fake_gpu, no_packages):
    fake_gpu(cc=(8, 0))
    reasons = Attn8Backend().reasons(device="cuda", dtype=torch.float32, head_dim=96)
    assert "compute capability sm80 is below the minimum sm90" in reasons
    assert any("package 'triton' is not installed" in r for r in reasons)
    assert any("dtype float32 is not supported" in r for r in reasons)
    assert any("head dim 96 is not supported (needs one of [64, 128])" in r for r in reasons)


def test_explicit_choice_runs_with_a_warning_and_automatic_never_picks_it(fake_gpu, with_triton, caplog):
    fake_gpu(cc=(9, 0), fa=())
    assert "ATTN_8BIT" not in AUTO_ORDER
    assert auto_backend(device="cuda", dtype=torch.bfloat16, head_dim=128).name != "ATTN_8BIT"
    with caplog.at_level(logging.WARNING, logger="fastwan.attention"):
        backend = resolve_backend("attn_8bit", device="cuda", dtype=torch.bfloat16, head_dim=128)
    assert isinstance(backend, Attn8Backend)
    assert "is unverified" in caplog.text
    dispatch = AttentionDispatch.resolve("ATTN_8BIT", device="cuda", dtype=torch.bfloat16, head_dim=128,
                                         config={"bf16_steps": [2, 1]})
    assert dispatch.self_backend.name == "ATTN_8BIT" and dispatch.cross_backend.name == "TORCH_SDPA"
    assert dispatch.lossless_steps == (2, 1)
    assert "cross-attention and the lossless steps TORCH_SDPA" in dispatch.describe("cuda")


def test_settings_rules():
    assert create_backend("ATTN_8BIT", {"bf16_steps": 3}).bf16_steps == (3, 3)
    assert create_backend("ATTN_8BIT", {"bf16_steps": [4, 0]}).lossless_steps() == (4, 0)
    with pytest.raises(InvalidArgument, match=r"bf16_steps=-1 must be >= 0"):
        create_backend("ATTN_8BIT", {"bf16_steps": -1})
    with pytest.raises(InvalidArgumentType, match=r"bf16_steps=\[1, 2, 3\] must be an int k"):
        create_backend("ATTN_8BIT", {"bf16_steps": [1, 2, 3]})
    with pytest.raises(InvalidArgumentType, match="smooth_k='no' must be true or false"):
        create_backend("ATTN_8BIT", {"smooth_k": "no"})
    with pytest.raises(InvalidArgument, match="unknown config key"):
        create_backend("ATTN_8BIT", {"dense_steps": 2})
    with pytest.raises(InvalidArgument, match="serves self-attention only"):
        AttentionDispatch(Attn8Backend())


class Counting:
    """Wraps a backend; counts its calls."""

    def __init__(self, backend):
        self.backend, self.calls, self.name, self.sparse = backend, 0, backend.name, False
        self.self_attention_only = getattr(backend, "self_attention_only", False)

    def lossless_steps(self):
        return self.backend.lossless_steps()

    def __call__(self, q, k, v, *, scale=None, meta=None):
        self.calls += 1
        return self.backend(q, k, v, scale=scale, meta=meta)


def test_hybrid_steps_run_on_the_lossless_backend(tiny_ckpts):
    """bf16_steps [1, 2] over 5 steps: steps 0, 3, 4 make the plain SDPA DiT's prediction (every attention call on
    SDPA), steps 1, 2 run the 8-bit op (its CPU reference) for self-attention and differ; forward and forward_cfg
    alike (the reference block: cross-attention through the dispatch)."""
    folder = tiny_ckpts["wan2.1"] / "transformer"
    plain = AttentionDispatch(create_backend("TORCH_SDPA"))
    model = load_transformer(folder, dtype=torch.float32, device="cpu", attention=plain)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, model.config.in_channels, 3, 6, 10, generator=g)
    text, uncond = (torch.randn(1, 7, model.config.text_dim, generator=g) for _ in range(2))
    t = torch.tensor([500.0])
    eight, sdpa = Counting(Attn8Backend(bf16_steps=[1, 2])), Counting(create_backend("TORCH_SDPA"))
    hybrid = AttentionDispatch(eight, sdpa)
    layers = model.config.num_layers
    with torch.no_grad():
        for step in range(5):
            model.set_attention(plain)
            want = model(x, t, text, step_index=step, num_steps=5)
            want_cfg = model.forward_cfg(x, t, text, uncond, step_index=step, num_steps=5)
            model.set_attention(hybrid)
            eight.calls = sdpa.calls = 0
            got = model(x, t, text, step_index=step, num_steps=5)
            got_cfg = model.forward_cfg(x, t, text, uncond, step_index=step, num_steps=5)
            if step in (0, 3, 4):
                assert eight.calls == 0 and sdpa.calls == 4 * layers  # self- and cross-attention
                torch.testing.assert_close(got, want, rtol=0, atol=0)
                torch.testing.assert_close(got_cfg, want_cfg, rtol=0, atol=0)
            else:
                assert eight.calls == 2 * layers  # forward, then forward_cfg's batch of two
                assert sdpa.calls == 2 * layers  # the cross-attention
                assert (got - want).abs().max() > 0
        model.set_attention(hybrid)
        eight.calls = 0
        model(x, t, text)  # outside a loop (no step): the 8-bit backend
        assert eight.calls == layers


def test_hybrid_dit_compiles_once_per_kind_of_step(tiny_ckpts):
    """Blocks compiled with fullgraph=True under a hybrid dispatch: two graphs (the 8-bit steps' and the lossless
    steps'), none per step, with the eager DiT's predictions."""
    from torch._dynamo.utils import counters

    folder = tiny_ckpts["wan2.1"] / "transformer"
    hybrid = AttentionDispatch(Attn8Backend(bf16_steps=[1, 1]), create_backend("TORCH_SDPA"))
    model = load_transformer(folder, dtype=torch.float32, device="cpu", attention=hybrid)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, model.config.in_channels, 3, 6, 10, generator=g)
    text = torch.randn(1, 7, model.config.text_dim, generator=g)
    t = torch.tensor([500.0])
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        eager = [model(x, t, text, step_index=i, num_steps=4) for i in range(4)]
        model.compile_blocks(fullgraph=True)
        for i in range(4):
            torch.testing.assert_close(model(x, t, text, step_index=i, num_steps=4), eager[i], rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 2
