"""fastwan.vae.convs: the swapped ``AutoencoderKLWan`` modules decode and encode like diffusers' own (fp32,
CPU, Wan2.1 and Wan2.2-style VAEs, 1/5/9 frames, channels-first and channels-last conv weights), also on the CUDA
routes (``cuda_routes=True``: deferred biases, stacked time taps, with the kernels' PyTorch references), which
modules are swapped and which are left alone, the helpers against diffusers' formulas, and that the swapped decode
moves fewer bytes through copy/pad/fill ops. On CUDA, also that the decoder stays channels-last throughout."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch
from diffusers.models.autoencoders import autoencoder_kl_wan as dwan
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fastwan.vae import convs as vae_convs
from fastwan.vae.convs import (STACK_TAPS_MAX_CHANNELS, fast_decoder_convs, interleave_time, stacked_taps_conv,
                               stacked_taps_ok)
from fastwan.vae.decode import AUTO_CHUNK_PIXEL_FRAMES, auto_chunk, decode_latents
from fastwan.vae.norms import fuse_decoder_norms

CL3D = torch.channels_last_3d


def tiny_vae(kind: str):
    """Wan2.1's layout (or Wan2.2-TI2V's residual one: DupUp3D / AvgDown3D shortcuts, patchified 12 channels) at
    4 levels, so both temporal upsamplers run (the second on two-frame chunks) and frames = 4 * latent - 3."""
    torch.manual_seed(0)
    kw = dict(base_dim=8, dim_mult=[1, 2, 2, 2], num_res_blocks=1, temperal_downsample=[False, True, True])
    if kind == "residual":
        kw.update(decoder_base_dim=8, z_dim=6, in_channels=12, out_channels=12, is_residual=True, patch_size=2,
                  latents_mean=[0.0] * 6, latents_std=[1.0] * 6)
    else:
        kw.update(z_dim=4)
    return dwan.AutoencoderKLWan(**kw).eval()


def make_vae(kind: str, channels_last: bool = False):
    vae = tiny_vae(kind)
    with torch.no_grad():  # non-trivial norm weights and biases, so every term of the decode shows
        for name, p in vae.named_parameters():
            if name.endswith("gamma"):
                p.copy_(torch.linspace(0.5, 1.5, p.numel()).view_as(p))
            elif name.endswith("bias"):
                p.copy_(torch.linspace(-0.2, 0.2, p.numel()).view_as(p))
    if channels_last:  # what fastwan's generator does on CUDA
        for mod in vae.modules():
            if isinstance(mod, nn.Conv3d):
                mod.weight.data = mod.weight.data.contiguous(memory_format=CL3D)
    return vae


def count(vae, name: str) -> int:
    return sum(type(m).__name__ == name for m in vae.modules())


def rel_err(got, want) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("kind", ["wan2.1", "residual"])
def test_swap_counts_and_keeps_parameters(kind):
    vae = make_vae(kind)
    ref = copy.deepcopy(vae)
    convs = count(vae, "WanCausalConv3d")
    resamples = [m for m in vae.modules() if type(m).__name__ == "WanResample"]
    others = (sum(count(vae, n) for n in ("WanUpsample", "DupUp3D", "WanResidualUpBlock", "WanResidualBlock"))
              + sum(m.mode == "upsample3d" for m in resamples)
              + sum(type(c) is nn.Conv2d for m in resamples for c in m.resample))
    n = fast_decoder_convs(vae)
    assert convs > 0 and others > 0 and n == convs + others
    assert count(vae, "FastWanCausalConv3d") == convs and count(vae, "WanCausalConv3d") == 0
    assert sum(isinstance(m, dwan.WanCausalConv3d) for m in vae.modules()) == convs  # still subclasses
    assert fast_decoder_convs(vae) == 0  # already swapped: left alone
    sd, rsd = vae.state_dict(), ref.state_dict()
    assert list(sd) == list(rsd) and all(torch.equal(sd[k], rsd[k]) for k in sd)
    assert fast_decoder_convs(nn.Sequential(nn.Conv3d(2, 2, 3), nn.Upsample(scale_factor=2.0))) == 0
    again = pickle.loads(pickle.dumps(vae))  # the swapped classes are found by name
    assert [type(m) for m in again.modules()] == [type(m) for m in vae.modules()]


@pytest.mark.parametrize("channels_last", [False, True], ids=["cf", "cl"])
@pytest.mark.parametrize("kind", ["wan2.1", "residual"])
def test_decode_and_encode_match_diffusers(kind, channels_last):
    ref = make_vae(kind)  # diffusers' modules, channels-first weights
    vae = make_vae(kind, channels_last=channels_last)
    fast_decoder_convs(vae)
    fuse_decoder_norms(vae)  # as fastwan uses it; the norm swap alone is tested in test_vae_norms.py
    z_dim = vae.config.z_dim
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for lat_t in (1, 2, 3):  # 1, 5 and 9 frames
            z = torch.randn(1, z_dim, lat_t, 3, 2, generator=g)
            got, want = vae.decode(z).sample, ref.decode(z).sample
            assert got.shape == want.shape and want.shape[2] == 4 * lat_t - 3
            assert want.std() > 0.01 and rel_err(got, want) <= 1e-5, (lat_t, rel_err(got, want))
            patch = vae.config.patch_size or 1
            video = torch.randn(1, vae.config.in_channels // patch**2, 4 * lat_t - 3, 24 * patch, 16 * patch,
                                generator=g)
            got, want = vae.encode(video).latent_dist.mean, ref.encode(video).latent_dist.mean
            assert got.shape == want.shape == (1, z_dim, lat_t, 3, 2)
            assert rel_err(got, want) <= 1e-5, (lat_t, rel_err(got, want))


@pytest.mark.parametrize("swapped", [False, True], ids=["diffusers-modules", "fastwan-modules"])
@pytest.mark.parametrize("kind", ["wan2.1", "residual"])
def test_chunked_decode_matches_frame_by_frame(kind, swapped):
    """decode_latents with 1-5 latent frames per decoder call after the first = diffusers' frame-by-frame
    decode (fp32), for frame counts that the chunks divide and that leave a short last chunk."""
    ref = make_vae(kind)
    vae = make_vae(kind, channels_last=swapped)
    if swapped:
        fast_decoder_convs(vae)
        fuse_decoder_norms(vae)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for lat_t in (1, 2, 6):
            z = torch.randn(1, vae.config.z_dim, lat_t, 3, 2, generator=g)
            want = ref.decode(z).sample
            for chunk in (1, 2, 3, 5, "auto"):
                got = decode_latents(vae, z, chunk)
                assert got.shape == want.shape and want.shape[2] == 4 * lat_t - 3
                assert rel_err(got, want) <= 1e-5, (lat_t, chunk, rel_err(got, want))
            assert all(c is None for c in vae._feat_map)  # the cache is cleared after the decode


def test_chunked_decode_sizes_and_errors():
    vae = make_vae("wan2.1")
    assert auto_chunk(vae, 480, 832) == AUTO_CHUNK_PIXEL_FRAMES // (4 * 480 * 832) == 2
    assert auto_chunk(vae, 720, 1280) == 1 and auto_chunk(vae, 64, 64) > 20
    assert auto_chunk(vae, 480, 832, batch=2) == 1  # the budget is per call, over the batch
    z = torch.zeros(1, vae.config.z_dim, 2, 3, 2)
    for bad in (0, -1, 1.5, True, "2", None):
        with pytest.raises(ValueError, match="vae_chunk_frames=.*'auto' or an int >= 1"):
            decode_latents(vae, z, bad)
    with pytest.raises(ValueError, match=r"\[B, C, F, h, w\]"):
        decode_latents(vae, z[0], 1)
    vae.enable_tiling(tile_sample_min_height=16, tile_sample_min_width=16, tile_sample_stride_height=8,
                      tile_sample_stride_width=8)
    z = torch.randn(1, vae.config.z_dim, 2, 4, 4, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():  # larger than a tile: diffusers' tiled decode itself
        assert torch.equal(decode_latents(vae, z, 2), vae.decode(z).sample)


def test_unexpected_modules_are_left_alone():
    vae = make_vae("wan2.1")
    before = fast_decoder_convs(make_vae("wan2.1"))
    odd_conv = vae.decoder.conv_in
    odd_conv._padding = (1, 0, 1, 1, 2, 0)  # asymmetric: not what the native conv padding can express
    reflect = vae.decoder.conv_out
    reflect.padding_mode = "reflect"
    ups = [m for m in vae.modules() if type(m).__name__ == "WanUpsample"]
    ups[0].mode = "bilinear"  # interpolating, not selecting: the fp32 round trip matters
    res3d = next(m for m in vae.modules() if type(m).__name__ == "WanResample" and m.mode == "upsample3d")
    del res3d.time_conv
    res3d.time_conv = nn.Identity()
    assert fast_decoder_convs(vae) == before - 5  # 2 convs, 1 upsample, 1 resample and its time_conv
    for m in (odd_conv, reflect, ups[0], res3d):
        assert not type(m).__name__.startswith("Fast")


@pytest.mark.parametrize("layout", ["cf", "cl"])
def test_interleave_time_is_diffusers_stack_and_keeps_layout(layout):
    b, c, t, h, w = 1, 3, 2, 4, 5
    y = torch.randn(b, 2 * c, t, h, w)
    if layout == "cl":
        y = y.contiguous(memory_format=CL3D)
    r = y.reshape(b, 2, c, t, h, w)
    want = torch.stack((r[:, 0], r[:, 1]), 3).reshape(b, c, 2 * t, h, w)
    got = interleave_time(y, c)
    assert torch.equal(got, want)
    assert got.is_contiguous(memory_format=CL3D if layout == "cl" else torch.contiguous_format)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_nearest_upsample_in_own_dtype_is_bit_identical(dtype):
    vae = make_vae("wan2.1")
    up = next(m for m in vae.modules() if type(m).__name__ == "WanUpsample")
    ref = copy.deepcopy(up)
    fast_decoder_convs(up)
    assert type(up).__name__ == "FastWanUpsample"
    for c in (4, 3, 6, 8):  # int64 words (bf16/fp16 C % 4 == 0), int32 (C even), or element by element
        x = torch.randn(3, c, 5, 7).to(dtype)
        cl = x.contiguous(memory_format=torch.channels_last)
        for inp in (x, cl, cl[1:], cl[:, :, 1:]):  # offset and strided views too
            got, want = up(inp), ref(inp)
            assert got.dtype == dtype and torch.equal(got, want), (c, inp.stride())
            assert got.is_contiguous(memory_format=torch.channels_last) == want.is_contiguous(
                memory_format=torch.channels_last)


@pytest.mark.parametrize("first_chunk", [False, True])
def test_dup_up_matches_and_keeps_layout(first_chunk):
    # repeats = F (= ft*fs*fs), fs*fs, fs, 1 (views of x), then 8 > F and 2 (not trailing factors: the repeat)
    mods = [dwan.DupUp3D(8, 8, 2, 2), dwan.DupUp3D(8, 4, 2, 2), dwan.DupUp3D(8, 2, 2, 2), dwan.DupUp3D(16, 2, 2, 2),
            dwan.DupUp3D(4, 8, 1, 2), dwan.DupUp3D(9, 1, 2, 3)]
    for mod in mods:
        ref = copy.deepcopy(mod)
        assert fast_decoder_convs(mod) == 1
        x = torch.randn(1, mod.in_channels, 3, 4, 5)
        for inp in (x, x.contiguous(memory_format=CL3D)):
            got = mod(inp, first_chunk=first_chunk)
            assert torch.equal(got, ref(x, first_chunk=first_chunk))
            if inp is not x or not first_chunk:  # (a time slice of a channels-first tensor is not dense)
                assert got.is_contiguous(memory_format=CL3D if inp is not x else torch.contiguous_format)


class CopyBytes(TorchDispatchMode):
    """Bytes written by ops that only move or fill data."""

    OPS = {"cat", "constant_pad_nd", "copy_", "clone", "fill_", "zero_", "stack", "_to_copy", "zeros_like",
           "repeat_interleave", "index_select", "upsample_nearest2d", "_upsample_nearest_exact2d"}

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.__name__.split(".")[0] in self.OPS:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.bytes += t.numel() * t.element_size()
        return out


def test_swapped_decode_copies_less():
    ref = make_vae("wan2.1").to(torch.bfloat16)
    vae = copy.deepcopy(ref)
    fast_decoder_convs(vae)
    z = torch.randn(1, 4, 3, 3, 2, dtype=torch.bfloat16)
    moved = {}
    with torch.no_grad():
        for name, m in (("diffusers", ref), ("fast", vae)):
            with CopyBytes() as cb:
                out = m.decode(z).sample
            moved[name] = (cb.bytes, out)
    assert torch.equal(moved["fast"][1], moved["diffusers"][1]) or rel_err(moved["fast"][1].float(),
                                                                           moved["diffusers"][1].float()) < 2e-2
    assert moved["fast"][0] < 0.75 * moved["diffusers"][0], {k: v[0] for k, v in moved.items()}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (cuDNN picks channels-last outputs)")
def test_cuda_decoder_stays_channels_last():
    vae = make_vae("wan2.1", channels_last=True).cuda().to(torch.bfloat16)
    ref = copy.deepcopy(vae)
    ref32 = make_vae("wan2.1").cuda()  # the same weights in fp32
    fast_decoder_convs(vae)
    fuse_decoder_norms(vae)
    fuse_decoder_norms(ref)
    seen = []  # the up blocks' residual blocks (the mid block's attention output is channels-first: not ours)
    for name, blk in vae.decoder.up_blocks.named_modules():
        if isinstance(blk, dwan.WanResidualBlock):  # (FastWanResidualBlock)
            blk.register_forward_pre_hook(
                lambda m, a, name=name: seen.append((name, tuple(a[0].shape), a[0].stride())))
    z = torch.randn(1, 4, 3, 8, 8, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=CL3D)
    with torch.no_grad():
        got, want, exact = vae.decode(z).sample, ref.decode(z).sample, ref32.decode(z.float()).sample
    assert seen
    bad = [s for s in seen if not torch.empty_strided(s[1], s[2]).is_contiguous(memory_format=CL3D)]
    assert not bad, bad
    # both bf16 decodes are a few bf16 units from the fp32 one; the swapped modules (stacked-taps convs: every
    # conv here has <= 96 channels) are no further from it than diffusers' own
    err, err_ref = rel_err(got.float(), exact), rel_err(want.float(), exact)
    assert err <= max(1.5 * err_ref, 1e-2), (err, err_ref)


def test_stacked_taps_conv_equals_conv3d():
    """The stacked-taps conv2d route (PyTorch stacking on the CPU) = time_pad + conv3d, fp32: caches of 0-3
    frames, batch 2, a conv with bias and one without, and a 1x3x3 kernel with 1-frame time padding."""
    g = torch.Generator().manual_seed(4)
    for (b, c, o, k, t, cache_t, bias) in [(1, 6, 5, (3, 3, 3), 4, None, True), (2, 4, 7, (3, 3, 3), 1, 1, True),
                                           (1, 5, 5, (3, 3, 3), 2, 2, False), (1, 3, 4, (3, 1, 1), 3, 3, True),
                                           (2, 4, 4, (2, 3, 3), 2, 2, True)]:
        torch.manual_seed(b * 100 + c)
        conv = dwan.WanCausalConv3d(c, o, k, padding=(1, k[1] // 2, k[2] // 2))
        conv._padding = conv._padding[:4] + (k[0] - 1, 0)  # causal: kt - 1 frames (diffusers: 2 * padding[0])
        if not bias:
            conv.bias = None
        pt = conv._padding[4]
        x = torch.randn(b, c, t, 5, 6, generator=g).contiguous(memory_format=CL3D)
        cache = None if cache_t is None else torch.randn(b, c, cache_t, 5, 6, generator=g)
        with torch.no_grad():
            want = conv(x, cache)  # diffusers' own forward
            got = stacked_taps_conv(conv, x, cache, pt)
        assert got.shape == want.shape and rel_err(got, want) <= 1e-5, (b, c, k, cache_t, rel_err(got, want))


def test_stacked_taps_only_where_measured():
    conv = dwan.WanCausalConv3d(8, 8, 3, padding=1).to(torch.bfloat16)
    x = torch.zeros(1, 8, 2, 4, 4, dtype=torch.bfloat16).contiguous(memory_format=CL3D)
    assert STACK_TAPS_MAX_CHANNELS == 96
    wide = dwan.WanCausalConv3d(STACK_TAPS_MAX_CHANNELS + 1, 8, 3, padding=1)
    xw = torch.zeros(1, STACK_TAPS_MAX_CHANNELS + 1, 2, 4, 4).contiguous(memory_format=CL3D)
    off = dwan.WanCausalConv3d(8, 8, 3, padding=1)
    fast_decoder_convs(off, cuda_routes=False)
    with torch.no_grad():
        assert not stacked_taps_ok(conv, x, 2)  # the CPU: no CUDA routes
        fast_decoder_convs(conv, cuda_routes=True)
        fast_decoder_convs(wide, cuda_routes=True)
        assert stacked_taps_ok(conv, x, 2)
        assert not stacked_taps_ok(conv, x.contiguous(), 2)  # channels-first x
        assert not stacked_taps_ok(conv, x, 1)  # not causal: kernel time size != pad_t + 1
        assert not stacked_taps_ok(conv, x.float(), 2)  # x not in the weight's dtype
        assert not stacked_taps_ok(wide, xw, 2)
        assert not stacked_taps_ok(off, x.float(), 2)
        conv.float()
        assert stacked_taps_ok(conv, x.float(), 2)  # forced routes: any dtype
    assert not stacked_taps_ok(conv, x.float(), 2)  # autograd: the kernels have no backward


def test_decode_through_the_stacked_route_matches_diffusers(monkeypatch):
    """A tiny Wan2.1 decode on the CUDA routes (every conv here has <= 96 channels: the stacked taps, deferred and
    folded biases; the kernels' PyTorch references on the CPU) = diffusers' (fp32, chunks 1 and 2)."""
    calls = []
    stacked = vae_convs.stacked_taps_conv
    monkeypatch.setattr(vae_convs, "stacked_taps_conv", lambda *a, **k: calls.append(1) or stacked(*a, **k))
    ref = make_vae("wan2.1")
    vae = make_vae("wan2.1", channels_last=True)
    fast_decoder_convs(vae, cuda_routes=True)
    fuse_decoder_norms(vae)
    z = torch.randn(1, 4, 3, 3, 2, generator=torch.Generator().manual_seed(5)).contiguous(memory_format=CL3D)
    with torch.no_grad():
        want = ref.decode(z).sample
        for chunk in (1, 2):
            got = decode_latents(vae, z, chunk)
            assert rel_err(got, want) <= 1e-5, (chunk, rel_err(got, want))
    assert len(calls) > 20, len(calls)
