"""The tiny VAE decoder (``vae="tiny"``, :mod:`fastwan.vae.tiny`) against a float64 reference of TAEHV's published
decoder written in the tests (:mod:`tests.vae.taehv_reference`: frame by frame, the memory-block rule spelled out),
with random weights in the published key layout read back from a file as ``vae="tiny"`` reads it: taew2_1 (16
channels) and taew2_2 (48 channels, pixel shuffle 2), batch 2, 1 and 3 latent frames, 1 to all of them per pass;
the full VAE's frame count (1 + 4 (F - 1)) and size; values in [0, 1]; the uint8 frames."""
from __future__ import annotations

import diffusers
import pytest
import torch

from fastwan.vae.tiny_weights import read_tiny, read_tiny_for
from tests.vae.taehv_reference import CHANNELS_PATCH, random_state, reference_decode, write_state

VAE_CONFIGS = {"taew2_1": {"z_dim": 16}, "taew2_2": {"z_dim": 48, "scale_factor_spatial": 16}}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """name -> (the state written, its safetensors file)."""
    root = tmp_path_factory.mktemp("taehv")
    out = {}
    for seed, name in enumerate(CHANNELS_PATCH):
        state = random_state(*CHANNELS_PATCH[name], seed=seed)
        out[name] = state, write_state(root / f"{name}.safetensors", state)
    return out


def decoder(files, name, dtype=torch.float64, channels_last=False):
    return read_tiny(files[name][1], VAE_CONFIGS[name]).load(dtype, "cpu", channels_last)


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("name", list(CHANNELS_PATCH))
def test_decode_equals_the_float64_reference(files, name, channels_last):
    state, _ = files[name]
    channels, patch = CHANNELS_PATCH[name]
    dec = decoder(files, name, channels_last=channels_last)
    g = torch.Generator().manual_seed(1)
    for batch, frames, h, w, chunks in [(1, 1, 3, 2, ("auto",)), (2, 3, 2, 3, (1, 2, "auto"))]:
        z = torch.randn(batch, channels, frames, h, w, generator=g, dtype=torch.float64)
        want = reference_decode(state, z)
        assert want.shape == (batch, 3, 1 + 4 * (frames - 1), 8 * patch * h, 8 * patch * w)
        assert 0.05 < float(want.std()) and float((want > 0).float().mean()) > 0.5  # not a dead output
        for chunk in chunks:
            got = dec.decode(z, chunk)
            assert got.dtype == torch.float64 and got.shape == want.shape
            assert float((got - want).abs().max()) < 1e-10, (batch, frames, chunk)


@pytest.mark.parametrize("name", list(CHANNELS_PATCH))
def test_float32_decode_and_uint8_frames(files, name):
    state, _ = files[name]
    channels, _ = CHANNELS_PATCH[name]
    z = torch.randn(1, channels, 2, 2, 3, generator=torch.Generator().manual_seed(2))
    want = reference_decode(state, z)
    got = decoder(files, name, torch.float32).decode(z)
    assert got.dtype == torch.float32 and float((got.double() - want).abs().max()) < 1e-4
    frames = decoder(files, name, torch.float32).frames(z)
    ref = (want[0] * 255).round().permute(1, 2, 3, 0).numpy()
    assert frames.dtype.name == "uint8" and frames.shape == ref.shape
    assert abs(frames.astype(int) - ref.astype(int)).max() <= 1  # float32 against float64: at most one step


@pytest.mark.parametrize("name", list(CHANNELS_PATCH))
def test_values_lie_in_0_1_and_reach_the_ends(files, name):
    channels, _ = CHANNELS_PATCH[name]
    z = 4 * torch.randn(1, channels, 3, 3, 3, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        dec = decoder(files, name, torch.float32)
        dec.decoder[22].bias.mul_(4).sub_(1)  # an output conv that overshoots both ends, to see the clamp
        video = dec.decode(z)
    assert float(video.min()) == 0.0 and float(video.max()) == 1.0
    assert 0.05 < float(((video > 0) & (video < 1)).float().mean())


@pytest.mark.parametrize("variant, name", [("wan2.1", "taew2_1"), ("wan2.2-ti2v", "taew2_2")])
def test_frame_count_and_size_equal_the_full_vae(tiny_ckpts, files, variant, name):
    folder = tiny_ckpts[variant] / "vae"
    full = diffusers.AutoencoderKLWan.from_pretrained(folder).eval()
    dec = read_tiny_for(files[name][1], folder).load(torch.float32, "cpu")
    for frames in (1, 2, 5):
        z = torch.randn(1, full.config.z_dim, frames, 2, 3)
        with torch.no_grad():
            want = full.decode(z).sample.shape
        assert want[2] == 1 + 4 * (frames - 1)
        assert dec.decode(z).shape == want, frames


def test_channels_last_decodes_in_the_frames_host_layout(files):
    """Channels-last (the CUDA default) keeps each frame [H, W, 3] in memory to the end: the uint8 frames of a
    video are [T, H, W, 3] with no copy, and equal the default layout's."""
    from fastwan.vae.tiny import uint8_tensor

    z = torch.randn(1, 16, 3, 4, 5, generator=torch.Generator().manual_seed(4))
    plain, last = (decoder(files, "taew2_1", torch.float32, cl) for cl in (False, True))
    assert last.decoder[1].weight.is_contiguous(memory_format=torch.channels_last)
    for chunk in (1, 2, "auto"):
        video = last.decode(z, chunk)
        assert uint8_tensor(video).is_contiguous(), chunk
        torch.testing.assert_close(video, plain.decode(z, chunk), rtol=0, atol=1e-4)  # fp32 summation order
    frames = last.frames(z)
    assert frames.flags.c_contiguous and abs(frames.astype(int) - plain.frames(z).astype(int)).max() <= 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the device path needs a GPU")
def test_on_cuda_host_frames_equal_the_device_frames():
    from fastwan.vae.decode import host_frames

    frames = torch.randint(0, 256, (5, 33, 17, 3), dtype=torch.uint8, device="cuda")
    for view in (frames, frames.permute(3, 0, 1, 2).contiguous().permute(1, 2, 3, 0)):
        out = host_frames(view)
        assert out.flags.c_contiguous and (out == frames.cpu().numpy()).all()
