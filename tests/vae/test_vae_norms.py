"""The VAE decoder's fused RMSNorm + SiLU swap (fastwan.vae.norms) on diffusers' AutoencoderKLWan: which pairs it
replaces, which it leaves alone, and a decode with the swapped modules against diffusers' own decode. The op
itself is tested in tests/kernels/test_vae_kernels.py and on the GPU in tests/gpu."""
from __future__ import annotations

import copy

import torch
from diffusers import AutoencoderKLWan
from torch import nn

from fastwan.vae.norms import RMSNormSiLU, fuse_decoder_norms


def tiny_vae(**kw):
    torch.manual_seed(0)
    return AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1,
                            temperal_downsample=[False, True], **kw).eval()


def test_swap_replaces_each_norm_silu_pair_and_decodes_like_diffusers():
    vae = tiny_vae()
    ref = copy.deepcopy(vae)
    blocks = [m for m in vae.decoder.modules() if type(m).__name__ == "WanResidualBlock"]
    gamma = vae.decoder.norm_out.gamma
    n = fuse_decoder_norms(vae)
    assert n == 2 * len(blocks) + 1 and len(blocks) > 0
    assert all(isinstance(b.norm1, RMSNormSiLU) and isinstance(b.nonlinearity, nn.Identity) for b in blocks)
    assert isinstance(vae.decoder.norm_out, RMSNormSiLU) and isinstance(vae.decoder.nonlinearity, nn.Identity)
    assert vae.decoder.norm_out.gamma is gamma  # the parameters are shared, not copied
    assert set(vae.state_dict()) == set(ref.state_dict())  # same parameters under the same names
    for m in (vae, ref):  # non-trivial norm weights, so a missing gamma would show
        with torch.no_grad():
            for name, p in m.named_parameters():
                if name.endswith("gamma"):
                    p.copy_(torch.linspace(0.5, 1.5, p.numel()).view_as(p))
    z = torch.randn(1, 4, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = vae.decode(z).sample, ref.decode(z).sample
    assert got.shape == want.shape == (1, 3, 5, 32, 32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert want.std() > 0.01


def test_swap_leaves_unexpected_blocks_alone():
    vae = tiny_vae()
    blk = next(m for m in vae.decoder.modules() if type(m).__name__ == "WanResidualBlock")
    blk.nonlinearity = nn.GELU()  # not the SiLU the fused op computes
    before = fuse_decoder_norms(tiny_vae())
    assert fuse_decoder_norms(vae) == before - 2
    assert not isinstance(blk.norm1, RMSNormSiLU) and isinstance(blk.nonlinearity, nn.GELU)
    assert fuse_decoder_norms(nn.Linear(2, 2)) == 0
