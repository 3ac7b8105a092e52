"""The residual blocks swapped by fastwan.vae.convs (``ResidualBlockMixin``) add each conv's bias in the pass
that reads the conv output next: conv1's in the fused RMSNorm+SiLU (``rms_silu(..., pre_bias=)``), conv2's in the
residual add (``add_bias_residual``). Checked here: the swap and what it leaves alone; on the CPU, with the convs
on the CUDA routes (``fast_decoder_convs(cuda_routes=True)``: they defer their bias, and the kernels run their
PyTorch references), that the folded route gives the same bits as the two-step one (bf16 and fp32, with and without
the feature cache) and matches diffusers' decode; on CUDA (skipped here), bit-identity of the bf16 decode. The two
kernels against the unfused composition: tests/kernels/test_vae_kernels.py."""
from __future__ import annotations

import copy

import pytest
import torch
from diffusers.models.autoencoders import autoencoder_kl_wan as dwan
from torch import nn

from fastwan.vae import convs as vae_convs
from fastwan.vae.convs import fast_decoder_convs
from fastwan.vae.decode import decode_latents
from fastwan.vae.norms import RMSNormSiLU, fuse_decoder_norms

CL3D = torch.channels_last_3d


def make_vae(channels_last: bool = False, dtype=torch.float32):
    torch.manual_seed(0)
    vae = dwan.AutoencoderKLWan(base_dim=8, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                                temperal_downsample=[False, True, True], z_dim=4).eval()
    with torch.no_grad():  # non-trivial norm weights and biases, so a misplaced bias shows
        for name, p in vae.named_parameters():
            if name.endswith("gamma"):
                p.copy_(torch.linspace(0.5, 1.5, p.numel()).view_as(p))
            elif name.endswith("bias"):
                p.copy_(torch.linspace(-0.2, 0.2, p.numel()).view_as(p))
    if channels_last:
        for mod in vae.modules():
            if isinstance(mod, nn.Conv3d):
                mod.weight.data = mod.weight.data.contiguous(memory_format=CL3D)
    return vae.to(dtype)


def fast(vae, cuda_routes: bool | None = True):
    fast_decoder_convs(vae, cuda_routes=cuda_routes)
    fuse_decoder_norms(vae)
    return vae


def unfolded(vae):
    """A copy of a swapped VAE whose residual blocks run diffusers' forward (each deferred bias added at once)."""
    ref = copy.deepcopy(vae)
    for m in ref.modules():
        if isinstance(m, vae_convs.ResidualBlockMixin):
            m.__class__ = dwan.WanResidualBlock
    return ref


def rel_err(got, want) -> float:
    return float((got - want).abs().max() / want.abs().max())


def test_residual_blocks_swapped_only_when_as_expected():
    vae = make_vae()
    blocks = [m for m in vae.modules() if type(m).__name__ == "WanResidualBlock"]
    odd = blocks[0]
    odd.conv2 = nn.Conv3d(odd.conv2.in_channels, odd.conv2.out_channels, 3, padding=1)  # not a causal conv
    fast_decoder_convs(vae)
    assert type(odd) is dwan.WanResidualBlock
    assert all(type(b).__name__ == "FastWanResidualBlock" and isinstance(b, dwan.WanResidualBlock)
               for b in blocks[1:])
    assert len(blocks) > 10  # decoder and encoder
    assert fuse_decoder_norms(vae) == fuse_decoder_norms(make_vae()) > 0  # either order: the swapped blocks too
    assert any(type(b.norm2) is RMSNormSiLU and type(b).__name__ == "FastWanResidualBlock" for b in blocks)


@pytest.fixture
def deferring(monkeypatch):
    """Counts the folds (calls of the fused norm with a ``pre_bias``, of the residual add with a bias)."""
    counts = {"norm": 0, "residual": 0}
    norm_forward, residual = RMSNormSiLU.forward, vae_convs.add_bias_residual

    def counting_norm(self, x, pre_bias=None):
        counts["norm"] += pre_bias is not None
        return norm_forward(self, x, pre_bias)

    def counting_residual(y, bias, res):
        counts["residual"] += bias is not None
        return residual(y, bias, res)

    monkeypatch.setattr(RMSNormSiLU, "forward", counting_norm)
    monkeypatch.setattr(vae_convs, "add_bias_residual", counting_residual)
    return counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True], ids=["cf", "cl"])
def test_folded_bias_is_bit_identical_to_two_steps(deferring, channels_last, dtype):
    vae = fast(make_vae(channels_last, dtype))
    ref = unfolded(vae)
    diffusers_ref = make_vae()
    calls = []
    for blk in vae.decoder.modules():
        if isinstance(blk, vae_convs.ResidualBlockMixin):
            blk.register_forward_pre_hook(lambda m, a: calls.append(m))  # a hook on the block: no effect
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for lat_t in (1, 3):
            z = torch.randn(1, 4, lat_t, 3, 2, generator=g).to(dtype)
            n_calls = len(calls)
            got = vae.decode(z).sample
            assert deferring["norm"] == deferring["residual"] == len(calls) > n_calls
            assert torch.equal(got, ref.decode(z).sample)
            for chunk in (2, 3):  # several frames per call: the feature cache on multi-frame inputs
                assert torch.equal(decode_latents(vae, z, chunk), decode_latents(ref, z, chunk))
            if dtype == torch.float32:
                assert rel_err(got, diffusers_ref.decode(z).sample) <= 1e-5


def test_hooked_conv_keeps_its_bias(deferring):
    """A conv with a hook (accelerate / diffusers offloading installs them) runs as called by diffusers: its output
    with the bias; the other blocks still fold."""
    vae = fast(make_vae())
    ref = unfolded(vae)
    blocks = [m for m in vae.decoder.modules() if isinstance(m, vae_convs.ResidualBlockMixin)]
    seen = []
    blocks[0].conv1.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    z = torch.randn(1, 4, 1, 3, 2, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = vae.decode(z).sample
        assert torch.equal(got, ref.decode(z).sample)
    assert len(seen) == 1  # (ref, copied before, has no hook)
    assert deferring["residual"] == len(blocks) and deferring["norm"] == len(blocks) - 1


def test_cache_slots_like_diffusers(deferring):
    """After a frame-by-frame decode the swapped blocks leave the same feature cache (conv inputs) as diffusers'."""
    vae = fast(make_vae())
    ref = unfolded(vae)
    z = torch.randn(1, 4, 2, 3, 2, generator=torch.Generator().manual_seed(3))
    caches = []
    with torch.no_grad():
        for m in (vae, ref):
            m.clear_cache()
            x = m.post_quant_conv(z)
            for i in range(2):
                m._conv_idx = [0]
                m.decoder(x[:, :, i:i + 1], feat_cache=m._feat_map, feat_idx=m._conv_idx, first_chunk=i == 0)
            caches.append((m._conv_idx[0], list(m._feat_map)))
    (n, got), (n_ref, want) = caches
    assert n == n_ref > 0
    for a, b in zip(got, want):
        assert (a is None and b is None) or (isinstance(a, str) and a == b) or torch.equal(a, b)


def test_default_routes_on_the_cpu_fold_nothing(deferring):
    """Off CUDA (``cuda_routes`` None) and with ``cuda_routes=False`` the convs add their own bias: no fold."""
    z = torch.randn(1, 4, 2, 3, 2, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = make_vae().decode(z).sample
        for routes in (None, False):
            assert rel_err(fast(make_vae(), cuda_routes=routes).decode(z).sample, want) <= 1e-5
    assert deferring["norm"] == deferring["residual"] == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("channels_last", [False, True], ids=["cf", "cl"])
def test_cuda_folded_decode_is_bit_identical(channels_last):
    vae = fast(make_vae(channels_last).cuda().to(torch.bfloat16), cuda_routes=None)  # the production default
    ref = unfolded(vae)
    z = torch.randn(1, 4, 3, 8, 8, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for chunk in (1, 2):
            assert torch.equal(decode_latents(vae, z, chunk), decode_latents(ref, z, chunk))
