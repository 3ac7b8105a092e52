"""``vae="tiny"`` end to end and its weight file's rules (:mod:`fastwan.vae.tiny_weights`): a file with the other
checkpoint's channel count (16 vs 48), a missing or extra ``decoder.`` key, a wrong shape, a non-float or non-finite
tensor, a pickle without ``allow_pickle`` and the option pairs (``vae_path`` without ``vae="tiny"`` and the reverse)
are refused naming the file and the key, before any weight loads; the published .pth form loads with
``allow_pickle`` and equals the safetensors one; a tiny generate decodes with the tiny decoder: the video has the
full VAE's frame count and size and equals the reference decode of its latents; the automatic file name tells the
decoders apart."""
from __future__ import annotations

import re
from pathlib import Path

import imageio.v2 as imageio
import pytest
import torch

from fastwan import VideoGenerator
from fastwan.errors import CheckpointError, InvalidArgument, MissingFileError
from fastwan.fields import from_json, to_json
from fastwan.pipelines.load_options import LoadOptions
from fastwan.vae.tiny_weights import read_tiny_for
from tests.pipelines.latents import generate_with_latents
from tests.vae.taehv_reference import CHANNELS_PATCH, random_state, reference_decode, write_state

SMALL = dict(height=32, width=32, num_frames=5, num_inference_steps=2, seed=3)


@pytest.fixture(scope="module")
def states():
    return {name: random_state(*CHANNELS_PATCH[name], seed=i) for i, name in enumerate(CHANNELS_PATCH)}


@pytest.fixture
def no_loading(monkeypatch):
    """Loading any weights fails the test: the tiny decoder's file is checked first."""
    from fastwan.pipelines import generator

    def boom(*a, **k):
        raise AssertionError("weights loaded before the tiny decoder's file was checked")
    monkeypatch.setattr(generator, "load_transformer", boom)


def load(ckpt, path, **kw):
    return VideoGenerator.from_pretrained(ckpt, device="cpu", dtype=torch.float32, vae="tiny", vae_path=path, **kw)


@pytest.mark.parametrize("variant, wrong", [("wan2.1", "taew2_2"), ("wan2.2-ti2v", "taew2_1")])
def test_the_other_checkpoints_file_is_refused(tiny_ckpts, states, tmp_path, no_loading, variant, wrong):
    path = write_state(tmp_path / "decoder.safetensors", states[wrong])  # the name says nothing: the message does
    right = "taew2_1" if wrong == "taew2_2" else "taew2_2"
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(path))}.*{wrong}.*'decoder\.1\.weight'.*use "
                                              rf"{right}\.safetensors"):
        load(tiny_ckpts[variant], path)


@pytest.mark.parametrize("change, says", [
    (lambda s: s.pop("decoder.13.conv.weight"), r"lacks key 'decoder\.13\.conv\.weight'"),
    (lambda s: s.pop("decoder.1.weight"), r"lacks key 'decoder\.1\.weight'"),
    (lambda s: s.__setitem__("decoder.8.bias", torch.zeros(128)), r"unexpected key 'decoder\.8\.bias'"),
    (lambda s: s.__setitem__("decoder.23.weight", torch.zeros(3)), r"unexpected key 'decoder\.23\.weight'"),
    (lambda s: s.__setitem__("extra", torch.zeros(3)), r"unexpected key 'extra'"),
    (lambda s: s.__setitem__("decoder.7.conv.weight", torch.zeros(512, 256, 1, 1)),
     r"key 'decoder\.7\.conv\.weight' has shape \(512, 256, 1, 1\).*\(256, 256, 1, 1\)"),
    (lambda s: s.__setitem__("decoder.22.weight", torch.zeros(12, 64, 3, 3)),
     r"key 'decoder\.22\.weight' has shape \(12, 64, 3, 3\).*\(3, 64, 3, 3\)"),
    (lambda s: s.__setitem__("decoder.1.weight", torch.zeros(256, 16)), r"'decoder\.1\.weight' has shape \(256, 16\)"),
    (lambda s: s.__setitem__("decoder.4.conv.2.bias", torch.zeros(256, dtype=torch.int64)),
     r"key 'decoder\.4\.conv\.2\.bias' is int64"),
    (lambda s: s["decoder.10.conv.0.weight"].view(-1).__setitem__(5, float("nan")),
     r"'decoder\.10\.conv\.0\.weight' holds 1 NaN"),
])
def test_wrong_keys_and_shapes_are_refused(tiny_ckpts, states, tmp_path, no_loading, change, says):
    state = {k: v.clone() for k, v in states["taew2_1"].items()}
    change(state)
    path = write_state(tmp_path / "taew2_1.safetensors", state)
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(path))}.*{says}"):
        load(tiny_ckpts["wan2.1"], path)


def test_option_rules(tiny_ckpts, states, tmp_path, no_loading):
    path = write_state(tmp_path / "taew2_1.safetensors", states["taew2_1"])
    with pytest.raises(InvalidArgument, match=r"vae='tiny' needs the tiny decoder's weight file: vae_path="):
        LoadOptions(model="tiny", vae="tiny")
    with pytest.raises(InvalidArgument, match=r"read only with vae='tiny'"):
        LoadOptions(model="tiny", vae_path=str(path))
    with pytest.raises(InvalidArgument, match=r"vae='small' must be one of \('full', 'tiny'\)"):
        LoadOptions(model="tiny", vae="small")
    with pytest.raises(MissingFileError, match=r"vae_path=.*nothing\.safetensors' does not exist"):
        LoadOptions(model="tiny", vae="tiny", vae_path=str(tmp_path / "nothing.safetensors"))
    with pytest.raises(InvalidArgument, match=r"is not a file"):
        LoadOptions(model="tiny", vae="tiny", vae_path=str(tmp_path))
    pth = write_state(tmp_path / "taew2_1.pth", states["taew2_1"])
    with pytest.raises(InvalidArgument, match=r"PyTorch pickle file \(\.pth\).*allow_pickle=True"):
        LoadOptions(model="tiny", vae="tiny", vae_path=str(pth))
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(bad))}.*not a valid safetensors file"):
        load(tiny_ckpts["wan2.1"], bad)
    o = LoadOptions(model="tiny", vae="tiny", vae_path=path)
    assert from_json(LoadOptions, to_json(o)) == LoadOptions(model="tiny", vae="tiny", vae_path=str(path))


def test_pth_with_allow_pickle_equals_safetensors(tiny_ckpts, states, tmp_path):
    folder = tiny_ckpts["wan2.1"] / "vae"
    st = read_tiny_for(write_state(tmp_path / "taew2_1.safetensors", states["taew2_1"]), folder)
    pth = read_tiny_for(write_state(tmp_path / "taew2_1.pth", states["taew2_1"]), folder, allow_pickle=True)
    assert st.state.keys() == pth.state.keys() and all(torch.equal(st.state[k], pth.state[k]) for k in st.state)
    assert not any(k.startswith("encoder.") for k in st.state)  # the encoder's keys are not read


@pytest.mark.parametrize("variant, name", [("wan2.1", "taew2_1"), ("wan2.2-ti2v", "taew2_2")])
def test_tiny_generate_decodes_with_the_tiny_decoder(tiny_ckpts, states, tmp_path, variant, name):
    path = write_state(tmp_path / f"{name}.safetensors", states[name])
    gen = load(tiny_ckpts[variant], path)
    result, latents = generate_with_latents(gen, "a fox", output_path=tmp_path / "out", **SMALL)
    frames = result.frames
    assert frames.shape == (SMALL["num_frames"], SMALL["height"], SMALL["width"], 3)
    want = (reference_decode(states[name], latents)[0] * 255).round().permute(1, 2, 3, 0).numpy()
    assert abs(frames.astype(int) - want.astype(int)).max() <= 1
    video = imageio.mimread(result.video_path)
    assert len(video) == SMALL["num_frames"] and video[0].shape == (SMALL["height"], SMALL["width"], 3)
    full = VideoGenerator.from_pretrained(tiny_ckpts[variant], device="cpu", dtype=torch.float32)
    other = full.generate_video("a fox", output_path=tmp_path / "full", **SMALL)
    assert other.frames.shape == frames.shape  # the full VAE's frame count and size
    name = Path(result.video_path).name
    assert Path(other.video_path).name != name  # the decoder is part of the video's identity (its file name)
