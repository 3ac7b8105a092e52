"""GPU: the fast path (compiled blocks) stays within a bf16 tolerance of the eager path, same backend.

Random weights at the real Wan2.1-1.3B width (12 heads x 128, 30 layers) on a small video grid, so the test
takes seconds. Tolerance: relative L2 error of the DiT output <= 3e-2 (bf16 through 30 blocks; measured
figures are printed with -s).
"""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@torch.no_grad()
def test_compiled_flash_matches_eager():
    pytest.importorskip("flash_attn.cute")
    from fastwan.attention import AttentionDispatch
    from fastwan.models import WanConfig, WanTransformer

    cfg = WanConfig(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, num_layers=30, text_dim=4096)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = WanTransformer(cfg).to(torch.bfloat16)
    for blk in model.blocks:  # what the loader keeps in fp32
        blk.scale_shift_table.data = blk.scale_shift_table.data.float()
    g = torch.Generator("cuda").manual_seed(1)
    x = torch.randn(1, 16, 5, 30, 52, device="cuda", generator=g)
    t = torch.tensor([700.0], device="cuda")
    text = torch.randn(1, 512, 4096, device="cuda", generator=g).bfloat16()

    model.set_attention(AttentionDispatch.resolve("FLASH_ATTN", device="cuda", dtype=torch.bfloat16, head_dim=128))
    ref = model(x, t, text).float()
    for blk in model.blocks:
        blk.compile(fullgraph=True)
    got = model(x, t, text).float()
    rel = ((got - ref).norm() / ref.norm()).item()
    print(f"compiled FLASH_ATTN vs eager FLASH_ATTN: rel L2 {rel:.3e}")
    assert torch.isfinite(got).all()
    assert rel <= 3e-2


@torch.no_grad()
def test_gelu_epilogue_matches_fp32_reference():
    """The cuBLASLt GELU(tanh) epilogue vs an fp32 linear + GELU(tanh) on the same bf16 operands: at most
    2x the error of the unfused bf16 path (linear rounded to bf16, then GELU), plus 1e-5."""
    import torch.nn.functional as F

    from fastwan.models.wan import linear_gelu_tanh

    g = torch.Generator("cuda").manual_seed(0)
    lin = torch.nn.Linear(1536, 8960, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2, 4096, 1536, device="cuda", generator=g).bfloat16()
    ref = F.gelu(F.linear(x.float(), lin.weight.float(), lin.bias.float()), approximate="tanh")
    fused = linear_gelu_tanh(x, lin, epilogue=True).float()
    plain = linear_gelu_tanh(x, lin, epilogue=False).float()
    err_fused, err_plain = (fused - ref).abs().max().item(), (plain - ref).abs().max().item()
    print(f"GELU epilogue max abs err {err_fused:.2e}, unfused bf16 {err_plain:.2e}")
    assert err_fused <= 2 * err_plain + 1e-5
