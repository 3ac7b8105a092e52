"""The streamed decode (:class:`fastwan.vae.stream.StreamDecoder`) against the whole-video decode of the same latents:
diffusers' ``AutoencoderKLWan`` as fastwan loads it (the tiny Wan2.1 and Wan2.2-TI2V checkpoints) against
``decode_frames``, TAEHV's tiny decoder (random weights in the published layout) against ``TinyDecoder.frames``.
Pushes of [1, 3, 3, 2] and [3, 3, 3] latent frames give each push's frame count and, where the stream's decoder calls
are the whole decode's (the same frames per call), the same frames bit for bit in fp32; other splits differ only by
the summation order of a larger call (at most one uint8 level, on few pixels). Two streams over one VAE, with a whole
decode between their pushes, each give their own video. Refusals: spatial tiling larger than the latent, chunks of
another shape, pushes after close or after a failed push."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fastwan.errors import InvalidArgument, InvalidArgumentType
from fastwan.pipelines.setup import load_vae
from fastwan.vae.decode import decode_frames
from fastwan.vae.stream import StreamDecoder
from fastwan.vae.tiny_weights import read_tiny
from tests.vae.taehv_reference import CHANNELS_PATCH, random_state, write_state

CPU = torch.device("cpu")
TINY_CONFIGS = {"taew2_1": {"z_dim": 16}, "taew2_2": {"z_dim": 48, "scale_factor_spatial": 16}}


@pytest.fixture(scope="module")
def wan_vaes(tiny_ckpts):
    return {v: load_vae(tiny_ckpts[v] / "vae", torch.float32, CPU, True, None, False)
            for v in ("wan2.1", "wan2.2-ti2v")}


@pytest.fixture(scope="module")
def tiny_vaes(tmp_path_factory):
    root = tmp_path_factory.mktemp("taehv-stream")
    out = {}
    for seed, (name, (channels, patch)) in enumerate(CHANNELS_PATCH.items()):
        path = write_state(root / f"{name}.safetensors", random_state(channels, patch, seed=seed))
        out[name] = read_tiny(path, TINY_CONFIGS[name]).load(torch.float32, "cpu")
    return out


def latents(channels: int, frames: int = 9, seed: int = 0) -> torch.Tensor:
    return torch.randn(1, channels, frames, 3, 5, generator=torch.Generator().manual_seed(seed))


def streamed(stream: StreamDecoder, z: torch.Tensor, sizes) -> np.ndarray:
    """Push ``z`` in chunks of ``sizes`` latent frames; checks each push's frame count; the frames concatenated."""
    outs, start = [], 0
    for f in sizes:
        out = stream.push(z[:, :, start:start + f])
        assert out.dtype == np.uint8 and out.shape[0] == (1 + 4 * (f - 1) if start == 0 else 4 * f), (sizes, f)
        outs.append(out)
        start += f
    assert stream.frames_decoded == start
    return np.concatenate(outs)


@pytest.mark.parametrize("variant", ["wan2.1", "wan2.2-ti2v"])
def test_wan_stream_equals_the_whole_decode(wan_vaes, variant):
    vae = wan_vaes[variant]
    z = latents(vae.config.z_dim)
    # the same decoder calls as the whole decode: frame 0, then (1, 4), (4, 7), (7, 9) / one frame a call
    with StreamDecoder(vae) as stream:
        got = streamed(stream, z, [1, 3, 3, 2])
    want = decode_frames(vae, z, 3, bars=False)
    assert want.shape == (33, 3 * vae.spatial_compression_ratio, 5 * vae.spatial_compression_ratio, 3)
    assert want.std() > 10 and np.array_equal(got, want)
    with StreamDecoder(vae, 1) as stream:
        assert np.array_equal(streamed(stream, z, [3, 3, 3]), decode_frames(vae, z, 1, bars=False))
    # other calls: the summation order of another frame count only
    want = decode_frames(vae, z, bars=False)
    for sizes, chunk in (([3, 3, 3], "auto"), ([2, 1, 1, 5], 2)):
        with StreamDecoder(vae, chunk) as stream:
            diff = np.abs(streamed(stream, z, sizes).astype(int) - want)
        assert diff.max() <= 1 and (diff > 0).mean() < 1e-3, (sizes, chunk)


@pytest.mark.parametrize("name", list(CHANNELS_PATCH))
def test_tiny_stream_equals_the_whole_decode(tiny_vaes, name):
    dec = tiny_vaes[name]
    z = latents(dec.latent_channels)
    for sizes, chunk in (([1, 3, 3, 2], 1), ([3, 3, 3], 3), ([3, 3, 3], "auto")):
        with StreamDecoder(dec, chunk) as stream:
            got = streamed(stream, z, sizes)
        want = dec.frames(z, chunk)
        assert want.shape == (33, 24 * dec.patch, 40 * dec.patch, 3) and 0 < want.mean() < 255
        assert np.array_equal(got, want), (sizes, chunk)


def test_streams_over_one_vae_keep_their_own_state(wan_vaes, tiny_vaes):
    for dec, channels in ((wan_vaes["wan2.1"], 16), (tiny_vaes["taew2_1"], 16)):
        # one latent frame per decoder call in both decodes: the same calls
        whole = (lambda z, d=dec: decode_frames(d, z, 1, bars=False)) if dec is wan_vaes["wan2.1"] else \
            (lambda z, d=dec: d.frames(z, 1))
        za, zb = latents(channels, 7, seed=1), latents(channels, 7, seed=2)
        a, b = StreamDecoder(dec, 1), StreamDecoder(dec, 1)
        outs_a, outs_b = [a.push(za[:, :, :1])], [b.push(zb[:, :, :1])]
        whole(latents(channels, 5, seed=3))  # a whole decode between the pushes
        for start in (1, 4):
            outs_b.append(b.push(zb[:, :, start:start + 3]))
            outs_a.append(a.push(za[:, :, start:start + 3]))
        a.close()
        b.close()
        assert np.array_equal(np.concatenate(outs_a), whole(za))
        assert np.array_equal(np.concatenate(outs_b), whole(zb))


def test_tiling_larger_than_the_latent_is_refused(tiny_ckpts):
    vae = load_vae(tiny_ckpts["wan2.1"] / "vae", torch.float32, CPU, True,
                   {"tile_sample_min_height": 32, "tile_sample_min_width": 32,
                    "tile_sample_stride_height": 16, "tile_sample_stride_width": 16}, False)
    with pytest.raises(InvalidArgument, match="vae_tiling.*vae_tiling=False"):
        StreamDecoder(vae, height=24, width=40)  # 40 pixels wide: more than a 32-pixel tile
    stream = StreamDecoder(vae)
    with pytest.raises(InvalidArgument, match="24x40 pixels cannot use vae_tiling"):
        stream.push(latents(16, 1))
    # a latent within one tile streams (the untiled decode)
    z = torch.randn(1, 16, 4, 3, 4, generator=torch.Generator().manual_seed(4))
    with StreamDecoder(vae, height=24, width=32) as stream:
        assert np.array_equal(streamed(stream, z, [1, 3]), decode_frames(vae, z, 3, bars=False))


def test_bad_chunks_are_refused(wan_vaes, tiny_vaes):
    for dec, channels in ((wan_vaes["wan2.1"], 16), (tiny_vaes["taew2_2"], 48)):
        stream = StreamDecoder(dec)
        for bad in (torch.zeros(2, channels, 1, 3, 5), torch.zeros(1, channels + 1, 1, 3, 5),
                    torch.zeros(1, channels, 0, 3, 5), torch.zeros(channels, 1, 3, 5)):
            with pytest.raises(InvalidArgument, match=rf"must be \[1, {channels}, f, h, w\]"):
                stream.push(bad)
        with pytest.raises(InvalidArgumentType, match="torch.Tensor"):
            stream.push(np.zeros((1, channels, 1, 3, 5), np.float32))
        stream.push(latents(channels, 1))
        with pytest.raises(InvalidArgument, match=r"latent size \(3, 4\) after chunks of \(3, 5\)"):
            stream.push(torch.zeros(1, channels, 1, 3, 4))
    with pytest.raises(InvalidArgument, match="give both or neither"):
        StreamDecoder(wan_vaes["wan2.1"], height=24)
    with pytest.raises(InvalidArgument, match="multiple of the VAE's spatial factor 8"):
        StreamDecoder(wan_vaes["wan2.1"], height=20, width=40)
    with pytest.raises(InvalidArgument, match="vae_chunk_frames=0"):
        StreamDecoder(wan_vaes["wan2.1"], 0)


def test_closed_or_failed_streams_refuse_pushes(wan_vaes, monkeypatch):
    vae = wan_vaes["wan2.1"]
    z = latents(16, 4)
    with StreamDecoder(vae) as stream:
        stream.push(z[:, :, :1])
    with pytest.raises(ValueError, match="closed stream"):
        stream.push(z[:, :, 1:])
    stream = StreamDecoder(vae)
    stream.push(z[:, :, :1])
    real = type(vae.decoder).forward

    def fail(*a, **k):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(type(vae.decoder), "forward", fail)
    with pytest.raises(RuntimeError, match="out of memory"):
        stream.push(z[:, :, 1:2])
    monkeypatch.setattr(type(vae.decoder), "forward", real)
    with pytest.raises(ValueError, match="failed inside the decoder"):
        stream.push(z[:, :, 1:2])
    stream.close()
    stream.close()  # idempotent


def _tensors_in(value, found: dict) -> None:
    if isinstance(value, torch.Tensor):
        found[id(value)] = value
    elif isinstance(value, (list, tuple)):
        for v in value:
            _tensors_in(v, found)
    elif isinstance(value, dict):
        for v in value.values():
            _tensors_in(v, found)


def test_state_tensors_are_what_the_next_push_reads(wan_vaes, tiny_vaes):
    """state_tensors (what a side CUDA stream marks as in use) lists every tensor the stream keeps between pushes,
    and they are what the next push reads: zeroed, its frames change."""
    for dec, channels in ((wan_vaes["wan2.1"], 16), (tiny_vaes["taew2_1"], 16)):
        z = latents(channels, 5, seed=4)
        with StreamDecoder(dec, 1) as ref, StreamDecoder(dec, 1) as hit:
            ref.push(z[:, :, :2])
            hit.push(z[:, :, :2])
            listed = {id(t) for t in hit.state_tensors()}
            kept: dict = {}
            _tensors_in({k: v for k, v in vars(hit).items() if k != "_vae"}, kept)
            assert listed and listed == set(kept)
            for t in hit.state_tensors():
                t.zero_()
            assert not np.array_equal(hit.push(z[:, :, 2:]), ref.push(z[:, :, 2:]))
