"""GPU: fastwan's collapsed text cross-attention kernel (fastwan.kernels.text_cross) in bf16 against an fp32
attention over all 512 (padded) keys, at the Wan shapes; its error must be no larger than a dense bf16 kernel's
(cuDNN through SDPA) over the same keys; the q norm fused in; the output projection folded into the values
(text_fold). And the DiT with the collapse or the fold on vs off (same weights, bf16)."""
import pytest
import torch
import torch.nn.functional as F

import fastwan.kernels.text_cross  # noqa: F401  (registers the fastwan:: text ops)
import fastwan.kernels.norms  # noqa: F401  (registers rms_rope, residual_linear_, residual_bmm_)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _fp32_attention(q, k, v):
    return F.scaled_dot_product_attention(*(t.float().transpose(1, 2) for t in (q, k, v))).transpose(1, 2)


@pytest.mark.parametrize("b,s,h,tokens", [(1, 32760, 12, 20), (2, 4096, 12, 150), (1, 4097, 40, 511),
                                          (1, 300, 2, 0)])
def test_kernel_matches_fp32_attention_over_all_keys(b, s, h, tokens):
    from fastwan.kernels.text_cross import text_cross_ok

    g = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(b, s, h, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(b, 512, h, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    k[:, tokens:], v[:, tokens:] = k[:, tokens:tokens + 1].clone(), v[:, tokens:tokens + 1].clone()
    keys = torch.full((b,), min(tokens + 1, 512), device="cuda", dtype=torch.int32)
    assert text_cross_ok(q, 128)
    got = torch.ops.fastwan.text_cross_attention(q, k, v, keys)
    want = _fp32_attention(q, k, v)
    dense = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    err, err_dense = ((x.float() - want).abs().max().item() for x in (got, dense))
    print(f"\n{b}x{s}x{h}, {tokens} tokens: collapsed {err:.2e}, dense bf16 {err_dense:.2e}")
    assert err <= max(2 * err_dense, 4e-3)


def _normq_case(b, s, h, tokens, strided, g):
    """bf16 inputs of the q-norm text kernels: raw q [b, s, h * 128] (a view with row stride 2C if ``strided``),
    norm weight, k/v [b, 512, h, 128] padded after ``tokens`` rows as Wan pads them, and the key counts."""
    c = h * 128
    buf = torch.randn(b, s, 2 * c if strided else c, device="cuda", dtype=torch.bfloat16, generator=g) * 3
    w = torch.rand(c, device="cuda", dtype=torch.bfloat16, generator=g) + 0.5
    k, v = (torch.randn(b, 512, h, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    k[:, tokens:], v[:, tokens:] = k[:, tokens:tokens + 1].clone(), v[:, tokens:tokens + 1].clone()
    keys = torch.full((b,), min(tokens + 1, 512), device="cuda", dtype=torch.int32)
    return buf[..., :c], w, k, v, keys


@pytest.mark.parametrize("b,s,h,tokens,strided", [(1, 32760, 12, 20, True), (2, 4097, 40, 100, False),
                                                  (1, 300, 2, 0, False)])
def test_normq_kernel_equals_norm_then_attention(b, s, h, tokens, strided):
    """fastwan::text_cross_attention_normq (the q RMSNorm inside the kernel) against the two-kernel route
    (rms_rope, then text_cross_attention): the same bf16 q values up to the last bit of the statistic."""
    g = torch.Generator("cuda").manual_seed(1)
    q, w, k, v, keys = _normq_case(b, s, h, tokens, strided, g)
    got = torch.ops.fastwan.text_cross_attention_normq(q, w, 1e-6, k, v, keys)
    qn = torch.ops.fastwan.rms_rope(q, w, None, 1e-6, 128).unflatten(-1, (h, 128))
    two = torch.ops.fastwan.text_cross_attention(qn, k, v, keys)
    want = _fp32_attention(qn, k, v)
    diff = (got.float() - two.float()).abs().max().item()
    err, err_two = ((x.float() - want).abs().max().item() for x in (got, two))
    frac = (got != two).float().mean().item()
    print(f"\n{b}x{s}x{h}: |fused - two kernels| {diff:.2e} ({frac:.2e} of elements differ); vs fp32 {err:.2e} "
          f"/ {err_two:.2e}")
    assert err <= max(1.5 * err_two, 4e-3) and frac < 1e-3


@pytest.mark.parametrize("b,s,h,tokens,strided", [(1, 32760, 12, 20, True), (2, 4097, 40, 60, False),
                                                  (1, 300, 2, 0, False)])
def test_folded_projection_matches_fp32(b, s, h, tokens, strided):
    """The folded cross-attention (text_cross_probs_normq + residual_bmm_ with fold_values) against the
    unfolded one (text_cross_attention_normq + residual_linear_), both against fp32 arithmetic on the same bf16
    inputs: the fold's error must be no larger than the unfolded route's (bf16 P and U instead of bf16 P@V)."""
    from fastwan.kernels import text_cross

    g = torch.Generator("cuda").manual_seed(2)
    c = h * 128
    q, w, k, v, keys = _normq_case(b, s, h, tokens, strided, g)
    wo = torch.randn(c, c, device="cuda", dtype=torch.bfloat16, generator=g) * c ** -0.5
    x0 = torch.randn(b, s, c, device="cuda", dtype=torch.bfloat16, generator=g)
    width = text_cross.fold_width(tokens + 1, 128)
    p = torch.ops.fastwan.text_cross_probs_normq(q, w, 1e-6, k, keys, width)
    # fp32 truth: the normalized q (bf16, as both routes round it), attention and projection in fp32
    qn = torch.ops.fastwan.rms_rope(q, w, None, 1e-6, 128).unflatten(-1, (h, 128))
    want = x0.float() + _fp32_attention(qn, k, v).flatten(2) @ wo.float().t()
    p32 = torch.softmax(torch.einsum("bshd,blhd->bshl", qn.float(), k.float()) / 128 ** 0.5, -1)
    p32 = torch.cat([p32[..., :tokens], p32[..., tokens:].sum(-1, keepdim=True)], -1)  # padding summed
    p_err = float((p[..., :tokens + 1].float() - p32).abs().max())
    if width > tokens + 1:
        assert float(p[..., tokens + 1:].abs().max()) == 0  # the keys after the last get no weight
    xa, xb = x0.clone(), x0.clone()
    torch.ops.fastwan.residual_linear_(xa, torch.ops.fastwan.text_cross_attention_normq(q, w, 1e-6, k, v, keys)
                                       .flatten(2), wo)
    torch.ops.fastwan.residual_bmm_(xb, p.flatten(2), text_cross.fold_values(v, keys, width, wo))
    err_a, err_b = ((x.float() - want).abs().max().item() for x in (xa, xb))
    print(f"\n{b}x{s}x{h}, {tokens} tokens, width {width}: P vs fp32 {p_err:.2e}; x error unfolded {err_a:.2e}, "
          f"folded {err_b:.2e}")
    assert p_err <= 4e-3 and err_b <= max(1.5 * err_a, 2e-2)


@pytest.mark.parametrize("option", ["text_collapse", "text_fold"])
def test_dit_fast_path_on_vs_off(option):
    """A 4-layer 1.3B-width DiT in bf16 with a padded 20-token prompt, with the option on against off."""
    pytest.importorskip("flash_attn.cute")
    from fastwan.attention import AttentionDispatch
    from fastwan.models import WanConfig, WanTransformer

    cfg = WanConfig(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, num_layers=4, text_dim=4096)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = WanTransformer(cfg).to(torch.bfloat16)
    model.set_attention(AttentionDispatch.resolve("FLASH_ATTN", device="cuda", dtype=torch.bfloat16, head_dim=128))
    g = torch.Generator("cuda").manual_seed(1)
    x = torch.randn(1, 16, 5, 30, 52, device="cuda", generator=g)
    t = torch.tensor([700.0], device="cuda")
    text = torch.zeros(1, 512, 4096, device="cuda")
    text[:, :20] = torch.randn(1, 20, 4096, device="cuda", generator=g)
    if option == "text_collapse":
        model.set_fast_paths(text_fold=False)  # the collapse alone (the fold builds on it)
    with torch.no_grad():
        model.set_fast_paths(**{option: False})
        want = model(x, t, text).float()
        model.set_fast_paths(**{option: True})
        got = model(x, t, text).float()
        assert model._text_keys(text).tolist() == [21]
        assert (model._contexts((text,), True)[0].u is not None) == (option == "text_fold")  # the fold ran
    rel = ((got - want).norm() / want.norm()).item()
    print(f"\nDiT (4 layers) {option} on vs off: rel L2 {rel:.2e}")
    assert rel <= 1e-2
