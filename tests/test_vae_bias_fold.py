"""The residual blocks swapped by fastwan.vae.convs (``ResidualBlockMixin``) add each conv's bias in the pass
that reads the conv output next: conv1's in the fused RMSNorm+SiLU (``rms_silu(..., pre_bias=)``), conv2's in the
residual add (``add_bias_residual``). Checked here: the swap and what it leaves alone; on the CPU, with the convs
forced to defer their bias (what they do on CUDA) and PyTorch's fallbacks, that the folded route gives the same
bits as the two-step one (bf16 and fp32, with and without the feature cache) and matches diffusers' decode; under
Triton's interpreter, the two kernels against the unfused kernel composition and a decode through them; on CUDA
(skipped here), bit-identity of the bf16 decode."""
from __future__ import annotations

import copy
import importlib.util
import os
import subprocess
import sys

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


def fast(vae):
    fast_decoder_convs(vae)
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
    """The CPU convs defer their bias as on CUDA, and every Triton kernel takes its PyTorch path; counts the
    folds."""
    monkeypatch.setattr(vae_convs, "_kernel_device", lambda x: True)
    monkeypatch.setattr(vae_convs, "triton_importable", lambda: False)
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


def test_rms_silu_pre_bias_reference():
    g = torch.Generator().manual_seed(4)
    x, gamma, bias, pre = (torch.randn(2, 6, 3, 4, 5, generator=g).to(torch.bfloat16), torch.randn(6, generator=g),
                           torch.randn(6, generator=g), torch.randn(6, generator=g).to(torch.bfloat16))
    want = torch.ops.fastwan.rms_silu(x.clone().add_(pre.view(1, 6, 1, 1, 1)), gamma, bias)
    assert torch.equal(torch.ops.fastwan.rms_silu(x, gamma, bias, pre), want)
    assert torch.equal(torch.ops.fastwan.rms_silu(x, gamma, bias, pre.float()), want)  # fp32 sum, one rounding
    with pytest.raises(ValueError, match="pre_bias"):
        torch.ops.fastwan.rms_silu(x, gamma, bias, pre[:5])


KERNEL_SCRIPT = r"""
import copy
import torch
from diffusers.models.autoencoders import autoencoder_kl_wan as dwan
from fastwan.vae import convs as vae_convs
from fastwan.vae import norms as vae_norms
from fastwan.vae.decode import decode_latents

vae_convs._kernel_device = lambda x: True  # CPU tensors through the Triton kernels (the interpreter runs them)
vae_norms.kernel_ok = lambda x: vae_norms._layout(x) is not None
ops = torch.ops.fastwan
CL = torch.channels_last_3d


class Count:
    # kernel[grid](...) launches, by the value of one constexpr flag
    def __init__(self, kernel, flag):
        self.kernel, self.flag, self.n = kernel, flag, {True: 0, False: 0}

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.n[bool(kw[self.flag])] += 1
            return self.kernel[grid](*args, **kw)
        return launch


rows, planes = (Count(k, "HAS_RES") for k in vae_convs._bias_kernels())
vae_convs._bias_kernels = lambda: (rows, planes)
norm_kernel = Count(vae_norms._kernel(), "HAS_PRE")
vae_norms._kernel = lambda: norm_kernel


def trunc_bf16(v):
    return (v.float().view(torch.int32) & -65536).view(torch.float32).bfloat16()


n, two_roundings_show = 0, False
for shape in [(2, 5, 3, 4, 7), (1, 96, 2, 3, 5), (1, 24, 1, 9, 8), (1, 3, 2, 2, 3)]:
    c = shape[1]
    g = torch.Generator().manual_seed(c)
    y, h = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
    b, gamma, nb = (torch.randn(c, generator=g) for _ in range(3))
    for dtype in (torch.float32, torch.bfloat16):
        for fmt in (torch.contiguous_format, CL):
            yd, hd = y.to(dtype).contiguous(memory_format=fmt), h.to(dtype).contiguous(memory_format=fmt)
            bd = b.to(dtype)
            assert vae_convs.residual_kernel_ok(yd, bd, hd), shape
            ub = vae_convs._launch_bias(yd.clone(), bd, None)  # the bias kernel alone (any C)
            # conv1's bias folded into the norm = the bias kernel, then the norm kernel
            got = ops.rms_silu(yd, gamma, nb, bd)
            assert got.stride() == yd.stride() and torch.equal(got, ops.rms_silu(ub, gamma, nb)), (shape, dtype)
            if dtype == torch.float32:
                want = vae_norms.rms_silu_reference(y + b.view(1, -1, 1, 1, 1), gamma, nb)
                assert float((got - want).abs().max()) <= 1e-5
            # conv2's bias folded into the residual add = round(round(y + b) + h), with the rounding the kernels
            # have here: the interpreter truncates to bf16 (the GPU rounds to nearest even, as PyTorch)
            s = yd.float() + bd.float().view(1, -1, 1, 1, 1)
            rnd = trunc_bf16 if dtype == torch.bfloat16 and torch.equal(ub, trunc_bf16(s)) else (
                lambda v, dtype=dtype: v.to(dtype))
            assert torch.equal(ub, rnd(s))
            yy = yd.clone()
            got = vae_convs.add_bias_residual(yy, bd, hd)
            assert got is yy and got.stride() == yd.stride(), (shape, dtype)
            assert torch.equal(got, rnd(rnd(s).float() + hd.float())), (shape, dtype)
            if dtype == torch.float32:
                assert torch.equal(got, y + b.view(1, -1, 1, 1, 1) + h)
            else:
                two_roundings_show |= not torch.equal(got, rnd(s + hd.float()))
            n += 1
    # mixed layouts: the two-step route (no residual kernel)
    ycl = y.contiguous(memory_format=CL)
    assert not vae_convs.residual_kernel_ok(ycl, b, h)
    assert torch.equal(vae_convs.add_bias_residual(ycl.clone(), b, h), y + b.view(1, -1, 1, 1, 1) + h)
assert norm_kernel.n[True] == n and rows.n[True] + planes.n[True] == n, (norm_kernel.n, rows.n, planes.n)
assert two_roundings_show  # the bf16 check tells the two-step rounding from a single one

# a decode: each decoder residual block call launches one folded norm and one folded residual kernel, and the
# result is the two-step route's (same kernels, unfolded) bit for bit and diffusers' to rounding
torch.manual_seed(0)
ref = dwan.AutoencoderKLWan(base_dim=8, dim_mult=[1, 2, 2], num_res_blocks=1, temperal_downsample=[False, True],
                            z_dim=4).eval()
with torch.no_grad():
    for name, p in ref.named_parameters():
        if name.endswith("bias"):
            p.copy_(torch.linspace(-0.2, 0.2, p.numel()).view_as(p))
g = torch.Generator().manual_seed(1)
z = torch.randn(1, 4, 3, 3, 2, generator=g)
with torch.no_grad():
    want = ref.decode(z).sample
for channels_last in (False, True):
    vae = copy.deepcopy(ref)
    if channels_last:
        for mod in vae.modules():
            if isinstance(mod, torch.nn.Conv3d):
                mod.weight.data = mod.weight.data.contiguous(memory_format=CL)
    vae_convs.fast_decoder_convs(vae)
    vae_norms.fuse_decoder_norms(vae)
    two_step = copy.deepcopy(vae)
    for m in two_step.modules():
        if isinstance(m, vae_convs.ResidualBlockMixin):
            m.__class__ = dwan.WanResidualBlock
    calls = []
    for m in vae.decoder.modules():
        if isinstance(m, vae_convs.ResidualBlockMixin):
            m.register_forward_pre_hook(lambda m, a: calls.append(1))
    for chunk in (1, 2):
        pre, res = norm_kernel.n[True], rows.n[True] + planes.n[True]
        with torch.no_grad():
            got = decode_latents(vae, z, chunk)
        folded_norms, folded_res = norm_kernel.n[True] - pre, rows.n[True] + planes.n[True] - res
        with torch.no_grad():
            assert torch.equal(got, decode_latents(two_step, z, chunk)), (channels_last, chunk)
        err = float((got - want).abs().max() / want.abs().max())
        assert err < 1e-5, (channels_last, chunk, err)
        # every block folds conv1's bias; conv2's where the shortcut is dense in the conv output's layout (here on
        # the CPU not the block after the spatial-only upsample on several frames: its input is time-major)
        assert folded_norms == len(calls) and 3 * folded_norms // 4 <= folded_res <= folded_norms, (
            folded_norms, folded_res)
        calls.clear()
        n += 1
print("CHECKED", n)
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs the triton package")
def test_fold_kernels_under_the_interpreter():
    """fp32 and bf16 (with the interpreter's own bf16 rounding, truncation), channels-first and channels-last 5-D,
    C not a power of two: the folded norm = the bias kernel followed by the norm kernel, the folded residual add =
    round(round(y + b) + h), bit for bit; and a tiny decode through them (chunks 1 and 2) = the unfolded route and
    diffusers', with the launches counted."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", KERNEL_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "CHECKED 20" in out.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("channels_last", [False, True], ids=["cf", "cl"])
def test_cuda_folded_decode_is_bit_identical(channels_last):
    vae = fast(make_vae(channels_last).cuda().to(torch.bfloat16))
    ref = unfolded(vae)
    z = torch.randn(1, 4, 3, 8, 8, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for chunk in (1, 2):
            assert torch.equal(decode_latents(vae, z, chunk), decode_latents(ref, z, chunk))
