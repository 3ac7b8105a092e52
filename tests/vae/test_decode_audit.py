"""The VAE decode of the tiny checkpoints (Wan2.1's VAE and Wan2.2-TI2V's z_dim-48 residual one, as fastwan loads
them) against diffusers' ``AutoencoderKLWan.decode`` on the same latents: odd latent sizes, 1/2/4 latent frames,
batch 2, chunked and tiled decodes, twice in a row; ``decode_frames``' de-normalisation against WanPipeline's; and
output paths the file system refuses, which must fail as user errors before any compute."""
from __future__ import annotations

import copy
import os

import diffusers
import numpy as np
import pytest
import torch

from fastwan.errors import InvalidArgument, OutputPathError
from fastwan.pipelines import output
from fastwan.pipelines.setup import load_vae
from fastwan.vae import decode as vae_decode
from fastwan.vae.decode import decode_frames, decode_latents, vae_tiling_kwargs

CPU = torch.device("cpu")


def vaes(folder, dtype=torch.float32, tiling=None):
    """(diffusers' AutoencoderKLWan as saved, fastwan's decode-ready copy with the same weights), non-trivial
    norm scales and biases so every term of the decode shows."""
    ref = diffusers.AutoencoderKLWan.from_pretrained(folder).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("gamma"):
                p.copy_(torch.linspace(0.5, 1.5, p.numel()).view_as(p))
            elif name.endswith("bias"):
                p.copy_(torch.linspace(-0.2, 0.2, p.numel()).view_as(p))
    fast = load_vae(folder, dtype, CPU, True, tiling, False)
    fast.load_state_dict(ref.state_dict())
    return ref, fast


@pytest.mark.parametrize("variant", ["wan2.1", "wan2.2-ti2v"])
def test_decode_matches_diffusers_odd_sizes_and_batches(tiny_ckpts, variant):
    ref, fast = vaes(tiny_ckpts[variant] / "vae")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for b, f, h, w in [(2, 2, 1, 3), (1, 4, 3, 5)]:  # 5 and 13 frames; latent sizes not even; batch 2
            z = torch.randn(b, ref.config.z_dim, f, h, w, generator=g)
            want = ref.decode(z).sample
            assert want.shape == (b, 3, 4 * f - 3, h * ref.spatial_compression_ratio,
                                  w * ref.spatial_compression_ratio) and want.std() > 0.01
            for chunk in (1, 3):
                got = decode_latents(fast, z, chunk)
                assert got.shape == want.shape
                assert float((got - want).abs().max()) < 1e-5, (b, f, h, w, chunk)
                assert torch.equal(decode_latents(fast, z, chunk), got)  # a second call: the caches were reset


@pytest.mark.parametrize("variant", ["wan2.1", "wan2.2-ti2v"])
def test_tiled_decode_matches_diffusers(tiny_ckpts, variant):
    folder = tiny_ckpts[variant] / "vae"
    s = diffusers.AutoencoderKLWan.load_config(folder).get("scale_factor_spatial", 8)
    tiles = vae_tiling_kwargs({"tile_sample_min_height": 2 * s, "tile_sample_min_width": 3 * s,
                               "tile_sample_stride_height": s, "tile_sample_stride_width": 2 * s}, folder)
    ref, fast = vaes(folder, tiling=tiles)
    ref = copy.deepcopy(ref)
    ref.enable_tiling(**tiles)
    z = torch.randn(1, ref.config.z_dim, 2, 3, 5, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = ref.decode(z).sample, decode_latents(fast, z, 2)
    assert got.shape == want.shape and float((got - want).abs().max()) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_decode_frames_denormalises_like_wan_pipeline(tiny_ckpts, monkeypatch, dtype):
    """The latents reaching the decoder are, bit for bit, WanPipeline's ``latents / latents_std + latents_mean``,
    its ``latents_std = 1.0 / std`` taken in the latents' dtype (Wan2.1's real std values: in bf16 a third of the
    latents change by one unit if the reciprocal is taken in fp32 and then rounded)."""
    vae = load_vae(tiny_ckpts["wan2.1"] / "vae", dtype, CPU, True, None, False)
    seen = []

    def capture(vae_, z, chunk):
        seen.append(z)
        return torch.zeros(1, 3, 1, 2, 2, dtype=z.dtype)

    monkeypatch.setattr(vae_decode, "decode_latents", capture)
    latents = torch.randn(1, 16, 3, 6, 10, generator=torch.Generator().manual_seed(2))
    frames = decode_frames(vae, latents)
    assert frames.dtype == np.uint8 and frames.shape == (1, 2, 2, 3) and (frames == 128).all()
    c = vae.config
    lat = latents.to(dtype)  # WanPipeline.__call__, output_type != "latent" (diffusers 0.42)
    mean = torch.tensor(c.latents_mean).view(1, c.z_dim, 1, 1, 1).to(lat.device, lat.dtype)
    inv_std = 1.0 / torch.tensor(c.latents_std).view(1, c.z_dim, 1, 1, 1).to(lat.device, lat.dtype)
    want = lat / inv_std + mean
    assert len(set(c.latents_std)) > 1  # real, varied std values
    assert seen[0].dtype == dtype and torch.equal(seen[0], want)


def test_vae_tiling_keys_of_any_type_get_the_user_error(tiny_ckpts):
    with pytest.raises(InvalidArgument, match="unknown keys"):
        vae_tiling_kwargs({1: 256, "tile": 256}, tiny_ckpts["wan2.1"] / "vae")


def test_nul_in_output_path_is_refused_before_compute(no_compute, tmp_path):
    for path in (tmp_path / "a\0b.mp4", f"{tmp_path}/sub\0dir/"):
        with pytest.raises(InvalidArgument, match="NUL"):
            no_compute.generate_video("a cat", seed=0, output_path=path, num_inference_steps=1)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("name", ["a" * 300 + ".mp4", "视" * 90 + ".mp4"], ids=["ascii", "cjk"])  # 304, 274 bytes
def test_too_long_file_name_is_a_user_error_before_compute(no_compute, tmp_path, name):
    with pytest.raises(OutputPathError, match="cannot be written") as e:
        no_compute.generate_video("a cat", seed=0, output_path=tmp_path / name, num_inference_steps=1)
    assert str(tmp_path) in str(e.value)
    assert os.listdir(tmp_path) == []
    target = output.check_output_path(tmp_path / ("b" * 251 + ".mp4"), False)  # 255 bytes: allowed
    output.prepare_output(target)
    assert os.listdir(tmp_path) == []
