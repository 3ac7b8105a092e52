"""A VACE hint of scale 1 is the control block's projection itself (x * 1.0 == x): no pass over it; any other
scale multiplies it. Outputs against diffusers: test_vace_dit."""
from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from fastwan.attention import AttentionDispatch
from fastwan.models import WanConfig, WanTransformer
from fastwan.models.wan.vace import vace_control
from fastwan.options import DiTOptions

CONFIG = dict(_class_name="WanVACETransformer3DModel", patch_size=(1, 2, 2), num_attention_heads=2,
              attention_head_dim=8, in_channels=4, out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=3,
              vace_layers=[0, 2], vace_in_channels=6)


def muls(model, args, control, scale) -> tuple[int, torch.Tensor]:
    with vace_control(model, control, scale), profile(activities=[ProfilerActivity.CPU]) as prof:
        out = model(*args)
    return sum(e.name == "aten::mul" for e in prof.events()), out


@torch.no_grad()
def test_unit_scale_skips_the_multiply():
    torch.manual_seed(0)
    attn = AttentionDispatch.resolve("TORCH_SDPA", device="cpu", dtype=torch.float32, head_dim=8)
    model = WanTransformer(WanConfig.from_dict(CONFIG), attn, DiTOptions(block="reference")).eval()
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(1, 4, 2, 4, 4, generator=g), torch.tensor([500.0]), torch.randn(1, 7, 16, generator=g))
    control = torch.randn(1, 6, 2, 4, 4, generator=g)
    muls(model, args, control, 1.0)  # the first forward fills the RoPE cache
    n1, out1 = muls(model, args, control, 1.0)
    n2, out2 = muls(model, args, control, [1.0, 2.0])
    assert n2 == n1 + 1  # the scale-2 hint only
    with vace_control(model, control, [1.0, 2.0]):  # the same forward again: deterministic
        assert torch.equal(model(*args), out2)
    assert not torch.equal(out1, out2)
