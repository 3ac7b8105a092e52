"""A VACE DiT under sequence parallelism on CPU processes (gloo, fp32): every rank's prediction with the control
hints equals the one-process DiT's within 1e-5, for the plain forward and both CFG forms (``run_cfg``'s override
under the plan), on Ulysses 2, a ring of 3 (2 heads), and Ulysses 2 under a sparse backend (the control tokens in
its compact order), at a token count (45) neither 2 nor 3 leaves even. The whole videos are in
``test_vace_parallel.py``; this checks the DiT tightly (a tiny VAE's frames move little with the hints)."""
from __future__ import annotations

import pytest
import torch

from fastwan.attention import AttentionDispatch
from fastwan.hooks import HookRegistry
from fastwan.models import WanConfig, WanTransformer
from fastwan.models.wan.vace import vace_control
from fastwan.options import DiTOptions
from fastwan.parallel import SequenceParallel
from fastwan.parallel.plan import apply_sequence_parallel
from tests.parallel.test_sequence_parallel import run

HEADS, HEAD_DIM, CONTROL = 2, 8, 12
LATENT = (1, 4, 5, 6, 6)  # a 5 x 3 x 3 token grid with patch (1, 2, 2): 45 tokens


def model(backend: str, conf: dict | None, block: str) -> WanTransformer:
    cfg = WanConfig(num_layers=3, num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, ffn_dim=32, text_dim=8,
                    freq_dim=16, in_channels=4, out_channels=4, cross_attn_norm=True,
                    qk_norm="rms_norm_across_heads", vace_layers=(0, 2), vace_in_channels=CONTROL)
    attn = AttentionDispatch.resolve(backend, device="cpu", dtype=torch.float32, head_dim=HEAD_DIM, config=conf)
    torch.manual_seed(0)
    m = WanTransformer(cfg, attn, DiTOptions(block=block))
    with torch.no_grad():
        for p in m.parameters():  # weights large enough that the control blocks' attention moves the hints
            p.copy_(torch.randn_like(p) * 0.3)
    return m.eval().requires_grad_(False)


def _compare(rank: int, case: dict) -> None:
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(LATENT, generator=g)
    control = torch.randn(1, CONTROL, *LATENT[2:], generator=g)
    text, text_u = (torch.randn(1, 7, 8, generator=g) for _ in range(2))
    t = torch.tensor([700.0])
    ref = model(case["backend"], case["conf"], case["block"])
    par = model(case["backend"], case["conf"], case["block"])
    sp = SequenceParallel.from_group(ring_degree=case["ring"])
    assert (sp.ulysses_degree, sp.ring_degree) == case["layout"]
    apply_sequence_parallel(par, sp)
    with torch.no_grad(), vace_control(ref, control, [0.7, 1.4]), vace_control(par, control, [0.7, 1.4]):
        assert HookRegistry.of(par).names() == ["sequence_parallel", "vace"]
        kw = dict(step_index=0, num_steps=1)
        want = [ref(latents, t, text, **kw), *ref.forward_cfg(latents, t, text, text_u, batched=True, **kw),
                *ref.forward_cfg(latents, t, text, text_u, batched=False, **kw)]
        got = [par(latents, t, text, **kw), *par.forward_cfg(latents, t, text, text_u, batched=True, **kw),
               *par.forward_cfg(latents, t, text, text_u, batched=False, **kw)]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


CASES = {
    "ulysses2": (2, dict(backend="TORCH_SDPA", conf=None, block="reference", ring=1, layout=(2, 1))),
    "ring3": (3, dict(backend="TORCH_SDPA", conf=None, block="fast", ring=3, layout=(1, 3))),
    "sparse-ulysses2": (2, dict(backend="SLIDING_TILE_ATTN", conf={"tile": [1, 2, 2], "window": 1},
                                block="reference", ring=1, layout=(2, 1))),
}


@pytest.mark.parametrize("case", list(CASES))
def test_vace_dit_under_sequence_parallelism_matches_one_process(case, tmp_path):
    world, kw = CASES[case]
    run(world, str(tmp_path / "store"), call=_compare, **kw)
