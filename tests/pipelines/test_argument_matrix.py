"""The public API's arguments, value by value: wrong types and out-of-range values raise a user error naming the
argument before any work (no weight loads in ``from_pretrained``, no text encoding or denoising in
``generate_video``); NumPy scalars and 0-d arrays / tensors of the right kind are the Python numbers they hold (the
same video, the same automatic file name, plain ints and floats in ``result.settings``).

References: the same call with Python numbers; ``torch.compile`` itself for the compile kwargs it refuses; a LoRA
merge computed in float64 in the test.
"""
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from fastwan import VideoGenerator
from fastwan.errors import InvalidArgument, UserError
from fastwan.lora import parse_lora_spec
from fastwan.pipelines import generator
from fastwan.pipelines.image import default_size

SMALL = dict(height=64, width=64, num_frames=5, num_inference_steps=2, seed=0, save_video=False)
ONE_STEP = dict(height=16, width=16, num_frames=1, num_inference_steps=1, guidance_scale=1.0)  # one DiT forward
HUGE = 10**400  # an int no float holds


# ---- generate_video: values refused before any compute ---------------------------------------------------------
@pytest.mark.parametrize("kw", [
    dict(height="64"), dict(height=64.0), dict(height=64.7), dict(height=True), dict(height=[64]),
    dict(height=np.array([64])), dict(height=torch.tensor(64.0)), dict(height=0), dict(height=-64),
    dict(height=float("nan")), dict(width=np.float32(64)), dict(width=torch.tensor([64])),
    dict(num_frames="5"), dict(num_frames=5.0), dict(num_frames=True), dict(num_frames=0), dict(num_frames=6),
    dict(num_inference_steps=0), dict(num_inference_steps=2.0), dict(num_inference_steps=torch.tensor(True)),
    dict(guidance_scale="5"), dict(guidance_scale=True), dict(guidance_scale=-1.0), dict(guidance_scale=HUGE),
    dict(guidance_scale=float("inf")), dict(guidance_scale=torch.tensor([5.0])), dict(guidance_scale_2=3.0),
    dict(seed=-1), dict(seed=2**64), dict(seed=1.0), dict(seed=np.bool_(True)), dict(seed=torch.tensor(1.0)),
    dict(fps=0), dict(fps=8.0), dict(fps=1001), dict(fps=np.float64(8)),
    dict(flow_shift=0), dict(flow_shift=-1.0), dict(flow_shift=HUGE), dict(flow_shift="3"),
    dict(sampler="EULER"), dict(sampler="euler", timesteps=[1000, HUGE]), dict(sampler="euler", timesteps=[]),
    dict(sampler="euler", timesteps=torch.tensor(1000.0)), dict(output_path=""), dict(overwrite=1),
    dict(save_video=1), dict(return_frames=None), dict(cache=0.1),
])
def test_bad_values_are_refused_before_compute(no_compute, kw):
    name = list(kw)[-1]  # the argument the case is about
    with pytest.raises(UserError) as e:
        no_compute.generate_video("a cat", **{**SMALL, **kw})
    assert f"{name}=" in str(e.value)


def test_torch_and_numpy_scalars_are_their_python_numbers(gen, tmp_path):
    """0-d tensors / arrays and NumPy scalars make the video the Python numbers make, under the same automatic name
    (the second call takes the name's "-2" variant), with plain ints and floats in ``result.settings``."""
    py = gen.generate_video("a cat", seed=3, fps=8, flow_shift=3.0, output_path=tmp_path, **ONE_STEP)
    scalars = dict(height=torch.tensor(16), width=np.int64(16), num_frames=np.array(1),
                   num_inference_steps=torch.tensor(1), guidance_scale=np.float32(1.0))
    res = gen.generate_video("a cat", seed=torch.tensor(3), fps=np.int16(8), flow_shift=torch.tensor(3.0),
                             output_path=tmp_path, **scalars)
    np.testing.assert_array_equal(res.frames, py.frames)
    assert res.seed == 3 and type(res.seed) is int
    assert res.video_path == py.video_path[:-len(".mp4")] + "-2.mp4"
    assert res.settings == py.settings
    assert all(type(res.settings[k]) is type(py.settings[k]) for k in py.settings)


def test_image_side_from_a_torch_scalar():
    """One side given for an image: a 0-d tensor gives the other side as the Python int does."""
    image = Image.new("RGB", (96, 48))
    want = default_size(image, 64 * 64, 16, height=32)
    assert want == (32, 64)
    assert default_size(image, 64 * 64, 16, height=torch.tensor(32)) == want
    assert default_size(image, 64 * 64, 16, width=np.int64(64)) == want


# ---- from_pretrained: values refused before any weight loads ------------------------------------------------------
class Loaded(Exception):
    """Raised in place of loading the DiT: every check passed."""


@pytest.fixture
def no_loading(monkeypatch):
    def load(*a, **k):
        raise Loaded()
    monkeypatch.setattr(generator, "load_transformer", load)


@pytest.mark.parametrize("value", ["no", "False", 0, 1, None])
def test_allow_pickle_must_be_a_bool(tiny_ckpts, no_loading, value):
    """A truthy stand-in ("no") must not let pickle weights, which can run code, load."""
    with pytest.raises(UserError, match=f"allow_pickle={value!r} must be True or False"):
        VideoGenerator.from_pretrained(tiny_ckpts["wan2.1"], device="cpu", allow_pickle=value)


@pytest.mark.parametrize("value", [HUGE, -HUGE, float("nan"), 1.5], ids=["huge", "-huge", "nan", "1.5"])
def test_cfg_gate_step_out_of_range_is_a_user_error(tiny_ckpts, no_loading, value):
    with pytest.raises(UserError, match=r"cfg_gate_step=.* is outside \[0, 1\]"):
        VideoGenerator.from_pretrained(tiny_ckpts["wan2.1"], device="cpu", cfg_gate_step=value)


@pytest.mark.parametrize("kwargs", [{"bogus": 1}, {1: 2}, {"mode": "bogus"}, {"backend": "no-such-backend"},
                                    {"dynamic": 5}, {"options": 5}, {"options": {"no_such_option": 1}},
                                    {"mode": "max-autotune", "options": {}}, {"fullgraph": "no"}])
def test_compile_kwargs_are_checked_before_loading(tiny_ckpts, no_loading, kwargs):
    if kwargs != {"fullgraph": "no"}:  # reference: torch.compile refuses these itself (when it is called)
        with pytest.raises(Exception):  # noqa: B017 - torch raises TypeError, RuntimeError, AssertionError, ...
            torch.compile(lambda x: x, **kwargs)
    with pytest.raises(UserError, match="torch_compile_kwargs="):
        VideoGenerator.from_pretrained(tiny_ckpts["wan2.1"], device="cpu", enable_torch_compile=True,
                                       torch_compile_kwargs=kwargs)


@pytest.mark.parametrize("kw", [
    dict(enable_torch_compile=True, torch_compile_kwargs={"backend": "aot_eager", "fullgraph": True}),
    dict(cfg_gate_step=np.float32(0.5)), dict(cfg_gate_step=torch.tensor(0.5)),
    dict(vae_chunk_frames=np.int64(2)), dict(vae_chunk_frames=torch.tensor(2)),
    dict(lora=[], allow_pickle=False),
])
def test_good_values_reach_loading(tiny_ckpts, no_loading, kw):
    with pytest.raises(Loaded):
        VideoGenerator.from_pretrained(tiny_ckpts["wan2.1"], device="cpu", **kw)


# ---- LoRA ---------------------------------------------------------------------------------------------------------
def test_lora_scale_from_a_torch_scalar(gen, tmp_path):
    """load_lora(scale=tensor(0.5)) merges W + 0.5 * B @ A (computed here in float64), as scale=0.5 does."""
    lin = gen.transformers[0].blocks[0].attn1.to_q
    w0 = lin.weight.detach().clone()
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, w0.shape[1], generator=g), torch.randn(w0.shape[0], 2, generator=g)
    path = tmp_path / "q.safetensors"
    save_file({"blocks.0.attn1.to_q.lora_A.weight": a, "blocks.0.attn1.to_q.lora_B.weight": b}, str(path))
    want = (w0.double() + 0.5 * (b.double() @ a.double())).float()
    try:
        gen.load_lora(path, scale=torch.tensor(0.5), expert=np.int64(0))
        torch.testing.assert_close(lin.weight, want, rtol=1e-6, atol=1e-6)
    finally:
        gen.unload_lora()
    assert torch.equal(lin.weight, w0)
    assert parse_lora_spec([(path, torch.tensor(0.5))]) == [(str(path), 0.5, None)]


def test_empty_lora_path_is_named(gen):
    with pytest.raises(InvalidArgument, match="lora='' is an empty path"):
        gen.load_lora("")


def test_lora_path_with_a_tilde_is_the_home_folder(tmp_path, monkeypatch):
    """``~`` in a LoRA path is the home folder, as in image and output paths."""
    from safetensors.torch import save_file

    from fastwan.lora import read_lora

    monkeypatch.setenv("HOME", str(tmp_path))
    tensors = {"blocks.0.attn1.to_q.lora_A.weight": torch.ones(2, 4)}
    save_file(tensors, str(tmp_path / "style.safetensors"))
    got = read_lora("~/style.safetensors")
    assert got.keys() == tensors.keys() and torch.equal(got["blocks.0.attn1.to_q.lora_A.weight"], torch.ones(2, 4))
