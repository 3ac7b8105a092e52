"""GPU: the fast path (compiled blocks) stays within a bf16 tolerance of the eager path, same backend.

Random weights at the real Wan2.1-1.3B width (12 heads x 128, 30 layers) on a small video grid, so the test
takes seconds. Tolerance: relative L2 error of the DiT output <= 3e-2 (bf16 through 30 blocks; measured
figures are printed with -s).
"""
import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _wan13b_small_grid():
    """Random weights at the Wan2.1-1.3B width (fp32 where the loader keeps fp32), FLASH_ATTN, and inputs of a
    5 x 15 x 26 token grid: (model, (latents, timestep, text))."""
    pytest.importorskip("flash_attn.cute")
    from fastwan.attention import AttentionDispatch
    from fastwan.models import WanConfig, WanTransformer, keep_in_fp32

    cfg = WanConfig(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, num_layers=30, text_dim=4096)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = WanTransformer(cfg).to(torch.bfloat16)
    for name, prm in model.named_parameters():
        if keep_in_fp32(name):
            prm.data = prm.data.float()
    g = torch.Generator("cuda").manual_seed(1)
    x = torch.randn(1, 16, 5, 30, 52, device="cuda", generator=g)
    t = torch.tensor([700.0], device="cuda")
    text = torch.randn(1, 512, 4096, device="cuda", generator=g).bfloat16()
    model.set_attention(AttentionDispatch.resolve("FLASH_ATTN", device="cuda", dtype=torch.bfloat16, head_dim=128))
    return model, (x, t, text)


@torch.no_grad()
def test_compiled_flash_matches_eager():
    model, (x, t, text) = _wan13b_small_grid()
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

    from fastwan.models.wan.layers import linear_gelu_tanh

    g = torch.Generator("cuda").manual_seed(0)
    lin = torch.nn.Linear(1536, 8960, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2, 4096, 1536, device="cuda", generator=g).bfloat16()
    ref = F.gelu(F.linear(x.float(), lin.weight.float(), lin.bias.float()), approximate="tanh")
    fused = linear_gelu_tanh(x, lin).float()
    plain = F.gelu(lin(x), approximate="tanh").float()
    err_fused, err_plain = (fused - ref).abs().max().item(), (plain - ref).abs().max().item()
    print(f"GELU epilogue max abs err {err_fused:.2e}, unfused bf16 {err_plain:.2e}")
    assert err_fused <= 2 * err_plain + 1e-5


def _within_bf16_steps(got, ref, what, scale=None):
    """Same math and roundings as the PyTorch path, so only a flipped rounding can differ (fp32 summation order
    moves the statistics by ~1e-7): at most two bf16 steps (2 x 2^-7 relative), as the RMSNorm path rounds
    twice (normalized value, then times the weight) before its last operation. ``scale``: the magnitude those
    steps are relative to where it is not the output's own (RoPE: a step in either input of the rotation
    moves the output by a step of that input)."""
    got, ref = got.float(), ref.float()
    diff = (got - ref).abs()
    tol = (ref.abs() if scale is None else scale.float()) * 2.0**-6 + 1e-3
    print(f"{what}: max |diff| {diff.max().item():.2e}, elements differing {(diff > 0).float().mean().item():.2%}")
    assert torch.isfinite(got).all() and bool((diff <= tol).all()), what


@torch.no_grad()
@pytest.mark.parametrize("C,head_dim,per_token", [(1536, 128, False), (5120, 128, False), (3072, 128, True),
                                                  (40, 8, False), (96, 12, False)])
def test_fused_norm_kernels_match_the_pytorch_path(C, head_dim, per_token):
    pytest.importorskip("triton")
    from fastwan.kernels import norms as fused
    from fastwan.kernels import triton_runs
    from fastwan.models.wan.layers import rope_tables

    assert triton_runs(torch.empty(1, 1, C, device="cuda", dtype=torch.bfloat16), max_last_dim=fused.MAX_C)
    ops = torch.ops.fastwan
    B, grid = 2, (3, 11, 7)
    S = grid[0] * grid[1] * grid[2]
    g = torch.Generator("cuda").manual_seed(C)
    x, y = (torch.randn(B, S, C, device="cuda", generator=g).bfloat16() for _ in range(2))
    mods = torch.randn(B, S if per_token else 1, 4, C, device="cuda", generator=g)
    gate, scale, shift, _ = mods.unbind(2)  # strided views, as the block passes them
    w, b = torch.randn(C, device="cuda", generator=g), torch.randn(C, device="cuda", generator=g)
    _within_bf16_steps(ops.norm_mod(x, None, None, scale, shift, 1e-6),
                       fused.norm_mod_reference(x, None, None, scale, shift, 1e-6), f"norm_mod C={C}")
    r, h = ops.residual_norm_mod(x, y, gate, w, b, None, None, 1e-6)
    r_ref = fused.residual_reference(x, y, gate)
    _within_bf16_steps(r, r_ref, f"residual C={C}")
    _within_bf16_steps(h, fused.norm_mod_reference(r, w, b, None, None, 1e-6), f"residual + affine LN C={C}")
    r, h = ops.residual_norm_mod(x, y, None, None, None, scale, shift, 1e-6)
    _within_bf16_steps(h, fused.norm_mod_reference(r, None, None, scale, shift, 1e-6), f"residual + mod C={C}")
    wq = torch.randn(C, device="cuda", generator=g).bfloat16()
    table = rope_tables(grid, head_dim, 1024, torch.device("cuda"))
    normed = fused.rms_rope_reference(x, wq, None, 1e-6, head_dim).float()  # before the rotation
    pair = normed.unflatten(-1, (-1, 2)).abs().sum(-1, keepdim=True).expand(*normed.shape[:-1], -1, 2).flatten(-2)
    _within_bf16_steps(ops.rms_rope(x, wq, None, 1e-6, head_dim), normed, f"rms (no rope) C={C}")
    _within_bf16_steps(ops.rms_rope(x, wq, table, 1e-6, head_dim),
                       fused.rms_rope_reference(x, wq, table, 1e-6, head_dim), f"rms_rope C={C}", scale=pair)


@torch.no_grad()
@pytest.mark.parametrize("prompt_tokens", [20, 100, 512])
def test_fast_build_is_as_close_to_fp32_as_the_reference(prompt_tokens):
    """The compiled fast build (fused norms, residual adds in the GEMMs, per-prompt cross-attention keys: the
    padding collapsed, and for 20 tokens the output projection folded) against an fp32 model on the same weights:
    no further from it than the bf16 reference build (diffusers' rounding points), through forward and
    forward_cfg in both CFG modes."""
    import copy

    from fastwan.attention import AttentionDispatch
    from fastwan.models import WanTransformer
    from fastwan.options import DiTOptions

    torch._dynamo.reset()  # each prompt class is its own cross-attention route: fresh compile caches per case
    model, (x, t, text) = _wan13b_small_grid()
    text[:, prompt_tokens:] = 0  # the padding of a prompt
    text_u = torch.zeros_like(text)
    text_u[:, :7] = text[:, :7].flip(-1)
    ref32 = copy.deepcopy(model).float()
    ref32.set_attention(AttentionDispatch.resolve("TORCH_SDPA", device="cuda", dtype=torch.float32, head_dim=128))
    exact, exact_u = ref32(x, t, text.float()).double(), ref32(x, t, text_u.float()).double()
    del ref32
    fast = WanTransformer(model.config, model.attention, DiTOptions(block="fast").resolve("cuda", torch.bfloat16))
    fast.load_state_dict(model.state_dict(), assign=True)
    fast.compile_blocks(fullgraph=True)

    def rel(out, want):
        return ((out.double() - want).norm() / want.norm()).item()

    err = {"reference bf16": rel(model(x, t, text), exact), "fast": rel(fast(x, t, text), exact)}
    for batched in (True, False):
        c, u = fast.forward_cfg(x, t, text, text_u, batched=batched)
        err[f"fast cfg batched={batched}"] = max(rel(c, exact), rel(u, exact_u))
    ctx = fast._contexts((text,))[0]
    assert (ctx.keys is not None) == (prompt_tokens < 512) and (ctx.u is not None) == (prompt_tokens == 20)
    print(f"{prompt_tokens} tokens, rel L2 vs fp32:", {k: f"{v:.3e}" for k, v in err.items()})
    base = err["reference bf16"]
    assert base <= 3e-2 and all(v <= max(1.25 * base, 1e-2) for v in err.values()), err


@torch.no_grad()
@pytest.mark.parametrize("channels_last,bias", [(False, False), (True, False), (True, True)])
def test_vae_rms_silu_kernel_is_as_accurate_as_diffusers(channels_last, bias):
    """The VAE decoder's fused RMSNorm + SiLU (Triton) against fp32 math on the same bf16 input: it rounds once,
    so it is within one bf16 step, and no worse than diffusers' WanRMS_norm + SiLU in bf16 (which rounds 4x)."""
    pytest.importorskip("triton")
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanRMS_norm

    from fastwan.kernels import triton_runs
    from fastwan.kernels.vae import KERNEL_DTYPES, rms_silu_fits, rms_silu_reference

    C = 96
    g = torch.Generator("cuda").manual_seed(7)
    x = (torch.randn(1, C, 3, 40, 52, device="cuda", generator=g) * 3).bfloat16()
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last_3d)
    norm = WanRMS_norm(C, images=False, bias=bias).cuda()
    norm.gamma.data.uniform_(0.5, 1.5, generator=g)
    if bias:
        norm.bias.data.uniform_(-0.5, 0.5, generator=g)
    norm = norm.bfloat16()
    assert triton_runs(x, dtypes=KERNEL_DTYPES) and rms_silu_fits(x, None)
    got = torch.ops.fastwan.rms_silu(x, norm.gamma, norm.bias if bias else None)
    assert got.stride() == x.stride()
    exact = rms_silu_reference(x.float(), norm.gamma.float(), norm.bias.float() if bias else None)
    eager = torch.nn.functional.silu(norm(x)).float()
    err_fused = ((got.float() - exact).abs() / (exact.abs() + 1e-2)).max().item()
    err_eager = ((eager - exact).abs() / (exact.abs() + 1e-2)).max().item()
    print(f"VAE rms_silu channels_last={channels_last} bias={bias}: max rel err fused {err_fused:.2e}, "
          f"diffusers bf16 {err_eager:.2e}")
    assert torch.isfinite(got).all() and err_fused <= 2.0**-8 + 1e-4 and err_fused <= err_eager + 1e-4


@pytest.mark.parametrize("cache_t", [None, 1, 2])
def test_stacked_taps_conv_on_cuda(cache_t):
    """The 96-channel causal conv through the stacked-taps conv2d (Triton stacking + cuDNN conv2d) against the
    conv3d route of the same bf16 inputs and an fp32 conv3d: no further from fp32 than the conv3d route."""
    from diffusers.models.autoencoders import autoencoder_kl_wan as dwan

    from fastwan.kernels.vae import add_channel_bias_, time_pad
    from fastwan.vae import convs as vae_convs

    torch.manual_seed(0)
    conv = dwan.WanCausalConv3d(96, 96, 3, padding=1).cuda().to(torch.bfloat16)
    conv.weight.data = conv.weight.data.contiguous(memory_format=torch.channels_last_3d)
    ref32 = dwan.WanCausalConv3d(96, 96, 3, padding=1).cuda()
    ref32.load_state_dict({k: v.float() for k, v in conv.state_dict().items()})
    vae_convs.fast_decoder_convs(conv)  # the module itself is swapped
    x = torch.randn(1, 96, 4, 48, 40, device="cuda", dtype=torch.bfloat16).contiguous(
        memory_format=torch.channels_last_3d)
    cache = None if cache_t is None else torch.randn(1, 96, cache_t, 48, 40, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():  # (under autograd the kernel route is not taken: it has no backward)
        assert vae_convs.stacked_taps_ok(conv, x, 2)
        got = conv(x, cache)
        want32 = ref32(x.float(), None if cache is None else cache.float())
        pt = time_pad(x, cache, 2, torch.channels_last_3d)
        via3d = add_channel_bias_(F.conv3d(pt, conv.weight, None, 1, (0, 1, 1)), conv.bias)
    assert got.is_contiguous(memory_format=torch.channels_last_3d)
    err = float((got.float() - want32).abs().max() / want32.abs().max())
    err3d = float((via3d.float() - want32).abs().max() / want32.abs().max())
    assert err <= max(2 * err3d, 4e-3), (err, err3d)
