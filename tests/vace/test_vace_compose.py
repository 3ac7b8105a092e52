"""What composes with VACE: compiled blocks (fullgraph, the control blocks too) give the eager DiT's output, and an
FP8 DiT (the main blocks' linears in e4m3, the control blocks dense) runs with the control hints."""
from __future__ import annotations

import torch
import torch.nn as nn

from fastwan.kernels.fp8 import Fp8Linear
from fastwan.models.wan.vace import vace_control
from fastwan.options import DiTOptions
from tests.vace.test_vace_dit import inputs, load, rel_err


def test_compiled_blocks_match_eager(vace_ckpts):
    torch._dynamo.reset()
    model = load(vace_ckpts["wan2.1-vace"] / "transformer", "reference")
    x, control, (text, text_u) = inputs(model.config)
    t = torch.tensor([600.0])
    with torch.no_grad(), vace_control(model, control, [0.8, 1.3]):
        want = model(x, t, text), *model.forward_cfg(x, t, text, text_u)
        model.compile_blocks(fullgraph=True, backend="aot_eager")  # fullgraph: any graph break raises
        got = model(x, t, text), *model.forward_cfg(x, t, text, text_u)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert all(blk._compiled_call_impl is not None for blk in model.vace_blocks)


def test_fp8_dit_runs_the_hints(vace_ckpts):
    from fastwan.attention import AttentionDispatch
    from fastwan.models import load_transformer

    folder = vace_ckpts["wan2.2-vace-a14b"] / "transformer_2"
    attn = AttentionDispatch.resolve("TORCH_SDPA", device="cpu", dtype=torch.float32, head_dim=12)
    fp8 = load_transformer(folder, dtype=torch.float32, device="cpu", attention=attn,
                           options=DiTOptions(block="fast"), quantization="fp8")
    dense = load(folder, "fast")
    assert any(isinstance(m, Fp8Linear) for m in fp8.blocks.modules())
    assert not any(isinstance(m, Fp8Linear) for m in fp8.vace_blocks.modules())
    assert any(isinstance(m, nn.Linear) for m in fp8.vace_blocks.modules())
    x, control, (text, _) = inputs(dense.config)
    t = torch.tensor([300.0])
    with torch.no_grad():
        plain = dense(x, t, text)
        with vace_control(dense, control, 1.0), vace_control(fp8, control, 1.0):
            want, got = dense(x, t, text), fp8(x, t, text)
    assert rel_err(got, want) < 0.1 * rel_err(plain, want)  # e4m3 rounding, far below the hints' effect
