"""The VAE decode of the tiny checkpoints (Wan2.1's VAE and Wan2.2-TI2V's z_dim-48 residual one, as fastwan loads
them) against diffusers' ``AutoencoderKLWan.decode`` on the same latents: odd latent sizes, 1/2/4 latent frames,
batch 2, chunked and tiled decodes, twice in a row; ``decode_frames``' de-normalisation against WanPipeline's.
The frames a call returns and writes, against independent references: the uint8 conversion of a decoded video
against diffusers' ``VideoProcessor.postprocess_video(output_type="np")`` then ``* 255`` rounded (WanPipeline's
path), in each VAE dtype; tiled decodes at the edges of the tiling rules (stride equal to the tile, a tile larger
than the video on one axis, one latent frame) against diffusers' ``enable_tiling`` with the same sizes; a
one-frame video written and read back; and the automatic file name, which must tell apart videos that a VAE
setting makes different."""
from __future__ import annotations

import copy

import diffusers
import imageio.v2 as imageio
import numpy as np
import pytest
import torch
from diffusers.video_processor import VideoProcessor

from fastwan import VideoGenerator
from fastwan.errors import InvalidArgument
from fastwan.pipelines.setup import load_vae
from fastwan.vae import decode as vae_decode
from fastwan.vae.decode import decode_frames, decode_latents, tiling_state, vae_tiling_kwargs

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

    def capture(vae_, z, chunk, bars=True):
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


# ---- the frames a call returns and writes -------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_uint8_frames_are_wan_pipelines_postprocess(tiny_ckpts, monkeypatch, dtype):
    """Every representable value of [-1.1, 1.1] in ``dtype`` (clamped ends included) becomes the uint8 that
    diffusers' postprocess gives, laid out [T, H, W, 3]; fp32 values also equal a float64 round-half-even."""
    vae = load_vae(tiny_ckpts["wan2.1"] / "vae", dtype, CPU, False, None, False)
    values = torch.linspace(-1.1, 1.1, 3 * 2 * 40 * 64, dtype=torch.float64).to(dtype)
    video = values.view(1, 3, 2, 40, 64)  # [B, C, T, H, W]: each channel, frame and pixel a different value
    monkeypatch.setattr(vae_decode, "decode_latents", lambda vae_, z, chunk, bars=True: video)
    frames = decode_frames(vae, torch.zeros(1, 16, 1, 5, 8))
    pp = VideoProcessor(vae_scale_factor=8).postprocess_video(video, output_type="np")[0]  # [T, H, W, 3] float
    want = (pp * 255).round().astype(np.uint8)
    assert frames.dtype == np.uint8 and frames.shape == want.shape == (2, 40, 64, 3)
    assert np.array_equal(frames, want)
    assert frames.min() == 0 and frames.max() == 255
    if dtype == torch.float32:
        exact = np.round((video[0].double().clamp(-1, 1).numpy() + 1) / 2 * 255).astype(np.uint8)
        assert np.array_equal(frames, exact.transpose(1, 2, 3, 0))


def _tiles(s: int, tile_h: int, tile_w: int, stride_h: int, stride_w: int) -> dict:
    return {"tile_sample_min_height": tile_h * s, "tile_sample_min_width": tile_w * s,
            "tile_sample_stride_height": stride_h * s, "tile_sample_stride_width": stride_w * s}


# (tile h, tile w, stride h, stride w) in latent pixels; (latent frames, h, w)
TILINGS = [
    ((2, 2, 2, 2), (2, 3, 5)),  # stride equal to the tile: tiles side by side, no blending
    ((64, 2, 64, 1), (1, 3, 5)),  # taller than the video, narrow tiles; one latent frame
    ((1, 1, 1, 1), (1, 2, 2)),  # one-latent-pixel tiles
]


@pytest.mark.parametrize("variant", ["wan2.1", "wan2.2-ti2v"])
def test_tiling_edges_match_diffusers(tiny_ckpts, variant):
    folder = tiny_ckpts[variant] / "vae"
    ref = diffusers.AutoencoderKLWan.from_pretrained(folder).eval()
    s = ref.spatial_compression_ratio
    untiled = load_vae(folder, torch.float32, CPU, True, None, False)
    g = torch.Generator().manual_seed(4)
    for sizes, (f, h, w) in TILINGS:
        kw = vae_tiling_kwargs(_tiles(s, *sizes), folder)
        fast = load_vae(folder, torch.float32, CPU, True, kw, False)
        ref.enable_tiling(**kw)
        z = torch.randn(1, ref.config.z_dim, f, h, w, generator=g)
        with torch.no_grad():
            want, got = ref.decode(z).sample, decode_latents(fast, z, 2)
            plain = decode_latents(untiled, z, 2)
        assert got.shape == want.shape == (1, 3, 4 * f - 3, h * s, w * s), sizes
        assert float((got - want).abs().max()) < 1e-5, sizes
        assert float((got - plain).abs().max()) > 1e-3, sizes  # the tiles really differ from one decode


def test_one_frame_video_is_written_and_reads_back(gen, tmp_path):
    res = gen.generate_video("a cat", seed=0, height=32, width=48, num_frames=1, num_inference_steps=1,
                             output_path=tmp_path / "one.mp4")
    assert res.frames.shape == (1, 32, 48, 3) and res.frames.std() > 5
    reader = imageio.get_reader(res.video_path)
    try:
        back = np.stack([frame for frame in reader])
    finally:
        reader.close()
    assert back.shape == (1, 32, 48, 3)
    assert np.abs(back.astype(int) - res.frames.astype(int)).mean() < 16  # lossy H.264 of the same picture


def test_tiling_state_is_what_the_vae_decodes_with(tiny_ckpts):
    """None untiled; the four tile sizes diffusers' tiled decode reads, whether set by vae_tiling or by a memory
    plan's plain ``enable_tiling()`` (diffusers' defaults)."""
    folder = tiny_ckpts["wan2.1"] / "vae"
    vae = load_vae(folder, torch.float32, CPU, False, None, False)
    assert tiling_state(vae) is None
    vae.enable_tiling()
    assert tiling_state(vae) == {"tile_sample_min_height": 256, "tile_sample_min_width": 256,
                                 "tile_sample_stride_height": 192, "tile_sample_stride_width": 192}
    kw = vae_tiling_kwargs({"tile_sample_min_width": 64, "tile_sample_stride_width": 32}, folder)
    vae = load_vae(folder, torch.float32, CPU, False, kw, False)
    vae.enable_tiling()  # a plan's lever on top of the user's sizes keeps them
    assert tiling_state(vae) == {"tile_sample_min_height": 256, "tile_sample_min_width": 64,
                                 "tile_sample_stride_height": 192, "tile_sample_stride_width": 32}


# VideoGenerator._identity must add "vae_tiling": tiling_state(self.vae); then drop this marker
def test_tiled_and_untiled_videos_get_different_automatic_names(gen, tiny_ckpts, tmp_path):
    """vae_tiling changes the video's values, so the automatic name must change too: with overwrite=True the
    tiled video must not replace the untiled one."""
    tiled = VideoGenerator.from_pretrained(tiny_ckpts["wan2.1"], device="cpu", dtype=torch.float32,
                                           vae_tiling=_tiles(8, 2, 2, 2, 2))
    kw = dict(seed=0, height=32, width=32, num_frames=1, num_inference_steps=1, output_path=tmp_path,
              overwrite=True, return_frames=True)
    a, b = gen.generate_video("a cat", **kw), tiled.generate_video("a cat", **kw)
    assert np.abs(a.frames.astype(int) - b.frames.astype(int)).max() > 1  # different videos
    assert a.video_path != b.video_path
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.rsplit("/", 1)[-1] for p in (a.video_path, b.video_path))


@pytest.mark.parametrize("variant", ["wan2.1", "wan2.2-ti2v"])
def test_frames_leave_as_each_decoder_call_makes_them(tiny_ckpts, variant):
    """iter_decode_frames yields each decoder call's frames before the next call runs (1 frame, then chunk x 4), and
    the chunks make diffusers' decode of the whole video."""
    ref, fast = vaes(tiny_ckpts[variant] / "vae")
    z = torch.randn(1, ref.config.z_dim, 6, 3, 5, generator=torch.Generator().manual_seed(1))
    calls = []
    hook = fast.decoder.register_forward_hook(lambda module, args, out: calls.append(out.shape[2]))
    try:
        chunks = vae_decode.iter_decode_frames(fast, z, chunk=2, bars=False)
        got = []
        for i, frames in enumerate(chunks):
            assert len(calls) == i + 1  # this chunk's call ran, the next one not yet
            got.append(frames)
    finally:
        hook.remove()
    sizes = [len(f) for f in got]
    assert sizes == [1, 8, 8, 4] and calls[0] == 1
    c = ref.config
    mean = torch.tensor(c.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(c.latents_std).view(1, -1, 1, 1, 1)
    with torch.no_grad():
        want = ref.decode(z * std + mean).sample[0]  # [3, T, H, W] in [-1, 1]
    want = ((want / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 3, 0).numpy()
    whole = np.concatenate(got)
    assert whole.shape == want.shape and int(np.abs(whole.astype(int) - want.astype(int)).max()) <= 1
    assert np.array_equal(whole, decode_frames(fast, z, chunk=2, bars=False))
