"""GPU: fastwan's collapsed text cross-attention kernel (fastwan.kernels.text_cross) in bf16 against an fp32
attention over all 512 (padded) keys, at the Wan shapes; its error must be no larger than a dense bf16 kernel's
(cuDNN through SDPA) over the same keys; the q norm fused in; the output projection folded into the values
(fold_values). The fast DiT build as a whole: tests/gpu/test_gpu_fastpath.py."""
import pytest
import torch
import torch.nn.functional as F

import fastwan.kernels.text_cross  # noqa: F401  (registers the fastwan:: text ops)
import fastwan.kernels.norms  # noqa: F401  (registers rms_rope, residual_linear_, residual_bmm_)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _fp32_attention(q, k, v):
    return F.scaled_dot_product_attention(*(t.float().transpose(1, 2) for t in (q, k, v))).transpose(1, 2)


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
                                                  (2, 4096, 12, 150, False), (1, 300, 2, 0, False)])
def test_normq_kernel_matches_fp32_attention_over_all_keys(b, s, h, tokens, strided):
    """fastwan::text_cross_attention_normq (q's RMSNorm inside, the padding collapsed) against fp32 attention of
    the same normalized bf16 q over all 512 keys: no further from it than a dense bf16 kernel (cuDNN through
    SDPA) over all keys."""
    from fastwan.kernels.text_cross import kernel_runs

    g = torch.Generator("cuda").manual_seed(1)
    q, w, k, v, keys = _normq_case(b, s, h, tokens, strided, g)
    assert kernel_runs(q, w, k, v, head_dim=128)
    got = torch.ops.fastwan.text_cross_attention_normq(q, w, 1e-6, k, v, keys)
    qn = torch.ops.fastwan.rms_rope(q, w, None, 1e-6, 128).unflatten(-1, (h, 128))
    want = _fp32_attention(qn, k, v)
    dense = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (qn, k, v))).transpose(1, 2)
    err, err_dense = ((x.float() - want).abs().max().item() for x in (got, dense))
    print(f"\n{b}x{s}x{h}, {tokens} tokens: collapsed {err:.2e}, dense bf16 {err_dense:.2e}")
    assert err <= max(2 * err_dense, 4e-3)


@pytest.mark.parametrize("b,s,h,tokens,strided", [(1, 32760, 12, 20, True), (2, 4097, 40, 60, False),
                                                  (1, 300, 2, 0, False)])
def test_folded_projection_matches_fp32(b, s, h, tokens, strided):
    """The folded cross-attention (text_cross_probs_normq + residual_bmm_ with fold_values) against the
    unfolded one (text_cross_attention_normq + residual_linear_), both against fp32 arithmetic on the same bf16
    inputs: the fold's error must be no larger than the unfolded route's (bf16 P and U instead of bf16 P@V)."""
    from fastwan.models.wan.cross import fold_values, fold_width

    g = torch.Generator("cuda").manual_seed(2)
    c = h * 128
    q, w, k, v, keys = _normq_case(b, s, h, tokens, strided, g)
    wo = torch.randn(c, c, device="cuda", dtype=torch.bfloat16, generator=g) * c ** -0.5
    x0 = torch.randn(b, s, c, device="cuda", dtype=torch.bfloat16, generator=g)
    width = fold_width(tokens + 1, 128)
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
    torch.ops.fastwan.residual_bmm_(xb, p.flatten(2), fold_values(v, keys, width, wo))
    err_a, err_b = ((x.float() - want).abs().max().item() for x in (xa, xb))
    print(f"\n{b}x{s}x{h}, {tokens} tokens, width {width}: P vs fp32 {p_err:.2e}; x error unfolded {err_a:.2e}, "
          f"folded {err_b:.2e}")
    assert p_err <= 4e-3 and err_b <= max(1.5 * err_a, 2e-2)
