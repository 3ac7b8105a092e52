"""fastwan's VACE DiT (the control blocks and their hints, :mod:`fastwan.models.wan.vace`) against diffusers'
WanVACETransformer3DModel on the same weights (fp32): the forward, both CFG forms, both block builds, both experts of
the two-expert checkpoint, per-layer conditioning scales."""
from __future__ import annotations

import pytest
import torch
from diffusers import WanVACETransformer3DModel

from fastwan.attention import AttentionDispatch
from fastwan.errors import InvalidArgument
from fastwan.hooks import HookRegistry
from fastwan.models import load_transformer
from fastwan.models.wan.vace import vace_control
from fastwan.options import DiTOptions


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def inputs(cfg, batch=1, seed=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, cfg.in_channels, 3, 6, 10, generator=g)  # 3 x 3 x 5 tokens
    control = torch.randn(1, cfg.vace_in_channels, 3, 6, 10, generator=g)
    texts = [torch.randn(batch, 11, cfg.text_dim, generator=g) for _ in range(2)]
    return x, control, texts


def load(folder, block):
    attn = AttentionDispatch.resolve("TORCH_SDPA", device="cpu", dtype=torch.float32, head_dim=12)
    return load_transformer(folder, dtype=torch.float32, device="cpu", attention=attn,
                            options=DiTOptions(block=block))


@pytest.mark.parametrize("variant,expert", [("wan2.1-vace", "transformer"), ("wan2.2-vace-a14b", "transformer"),
                                            ("wan2.2-vace-a14b", "transformer_2")])
@pytest.mark.parametrize("block", ["reference", "fast"])
def test_vace_dit_matches_diffusers(vace_ckpts, variant, expert, block):
    folder = vace_ckpts[variant] / expert
    ref = WanVACETransformer3DModel.from_pretrained(folder, dtype=torch.float32).eval()
    ours = load(folder, block)
    assert len(ours.vace_blocks) == len(ref.config.vace_layers) == 2
    x, control, (text, text_u) = inputs(ref.config)
    t = torch.tensor([700.0])
    scale = [0.7, 1.6]

    def want(txt, s):
        return ref(x, t, txt, control_hidden_states=control,
                   control_hidden_states_scale=torch.tensor(s), return_dict=False)[0]

    with torch.no_grad():
        plain = ours(x, t, text)  # no control: the main blocks alone
        with vace_control(ours, control, scale):
            got = ours(x, t, text)
            pairs = [ours.forward_cfg(x, t, text, text_u, batched=b) for b in (True, False)]
        with vace_control(ours, control, 1.0):
            unit = ours(x, t, text)
        w, w_u, w_unit = want(text, scale), want(text_u, scale), want(text, [1.0, 1.0])
    assert HookRegistry.of(ours).names() == []  # the hook leaves with its block
    assert rel_err(got, w) <= 1e-5 and rel_err(unit, w_unit) <= 1e-5
    assert rel_err(plain, w) > 1e-2  # the hints matter
    for cond, uncond in pairs:
        assert rel_err(cond, w) <= 1e-5 and rel_err(uncond, w_u) <= 1e-5


def test_batch_of_two_matches_diffusers(vace_ckpts):
    folder = vace_ckpts["wan2.1-vace"] / "transformer"
    ref = WanVACETransformer3DModel.from_pretrained(folder, dtype=torch.float32).eval()
    ours = load(folder, "reference")
    x, control, (text, _) = inputs(ref.config, batch=2)
    t = torch.tensor([999.0, 250.0])
    with torch.no_grad(), vace_control(ours, control, 0.5):
        got = ours(x, t, text)
    want = ref(x, t, text, control_hidden_states=control.expand(2, -1, -1, -1, -1),
               control_hidden_states_scale=torch.tensor([0.5, 0.5]), return_dict=False)[0]
    assert rel_err(got, want.detach()) <= 1e-5


def test_control_rules(vace_ckpts, tiny_ckpts):
    ours = load(vace_ckpts["wan2.1-vace"] / "transformer", "reference")
    x, control, (text, _) = inputs(ours.config)
    t = torch.tensor([500.0])
    with pytest.raises(InvalidArgument, match=r"conditioning_scale=\[1.0, 2.0, 3.0\] must be .* list of 2"):
        with vace_control(ours, control, [1.0, 2.0, 3.0]):
            pass
    with pytest.raises(InvalidArgument, match=r"conditioning_scale=a list of 99 numbers must be .* list of 2"):
        with vace_control(ours, control, [1.0] * 99):  # a long list is counted, not printed
            pass
    with pytest.raises(InvalidArgument, match=r"\[1, 8, 3, 6, 10\] must be \[1, 96"), torch.no_grad():
        with vace_control(ours, control[:, :8], 1.0):
            ours(x, t, text)
    with pytest.raises(InvalidArgument, match="give 45 tokens, but the latents give 60"), torch.no_grad():
        with vace_control(ours, control, 1.0):
            ours(torch.cat([x, x[:, :, :1]], dim=2), t, text)
    plain = load(tiny_ckpts["wan2.1"] / "transformer", "reference")
    with pytest.raises(InvalidArgument, match="no VACE blocks"):
        with vace_control(plain, control, 1.0):
            pass
    assert HookRegistry.of(plain).names() == [] and HookRegistry.of(ours).names() == []
