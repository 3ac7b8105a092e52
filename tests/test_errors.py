"""Bad input raises a clear error before any compute or file write; a multi-line error reads as one line."""
import json
import re
import shutil

import pytest
import torch

from fastwan import VideoGenerator
from fastwan.errors import InvalidArgument, one_line


@pytest.fixture(scope="module")
def gen_ti2v(tiny_ckpts):
    return VideoGenerator.from_pretrained(tiny_ckpts["wan2.2-ti2v"], device="cpu", dtype=torch.float32)


GOOD = dict(height=64, width=64, num_frames=5, num_inference_steps=2)


@pytest.mark.parametrize("kw,exc,words", [
    (dict(height=72), ValueError, ["height=72", "multiple of 16", "64 or 80"]),
    (dict(width=100), ValueError, ["width=100", "multiple of 16"]),
    (dict(height=64.0), TypeError, ["height"]),
    (dict(num_frames=6), ValueError, ["num_frames=6", "4k+1", "5 or 9"]),
    (dict(num_frames=0), ValueError, ["num_frames"]),
    (dict(num_frames=5.0), TypeError, ["num_frames"]),
    (dict(height=0), ValueError, ["height=0", "positive int"]),
    (dict(num_inference_steps=2.0), TypeError, ["num_inference_steps"]),
    (dict(num_inference_steps=0), ValueError, ["num_inference_steps=0", ">= 1"]),
    (dict(guidance_scale=-1.0), ValueError, ["guidance_scale=-1.0"]),
    (dict(guidance_scale=float("inf")), ValueError, ["guidance_scale=inf", "finite"]),
    (dict(guidance_scale=float("nan")), ValueError, ["guidance_scale"]),
    (dict(guidance_scale_2=-2.0), ValueError, ["guidance_scale_2"]),
    (dict(seed=1.5), TypeError, ["seed=1.5", "int"]),
    (dict(seed="3"), TypeError, ["seed"]),
    (dict(fps=0), ValueError, ["fps"]),
    (dict(fps=2**31), ValueError, ["fps=2147483648", "[1, 1000]"]),
])
def test_bad_generation_args(no_compute, tmp_path, kw, exc, words):
    out = tmp_path / "o"
    with pytest.raises(exc) as e:
        no_compute.generate_video("a cat", output_path=out, **{**GOOD, **kw})
    for w in words:
        assert w in str(e.value)
    assert not out.exists()


@pytest.mark.parametrize("prompt,exc", [("", ValueError), ("   ", ValueError), (None, TypeError), (["a"], TypeError),
                                        (3, TypeError)])
def test_bad_prompt(no_compute, prompt, exc):
    with pytest.raises(exc, match="prompt"):
        no_compute.generate_video(prompt, **GOOD)


def test_bad_negative_prompt(no_compute):
    with pytest.raises(TypeError, match="negative_prompt"):
        no_compute.generate_video("a cat", negative_prompt=5, **GOOD)


def test_ti2v_needs_multiples_of_32(gen_ti2v):
    with pytest.raises(ValueError, match="multiple of 32"):
        gen_ti2v.generate_video("a cat", height=48, width=64, num_frames=5, num_inference_steps=1, save_video=False)


def test_unknown_model_id():
    with pytest.raises(FileNotFoundError, match="not-a-real-model"):
        VideoGenerator.from_pretrained("./not-a-real-model", device="cpu")


def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing"):
        VideoGenerator.from_pretrained(str(tmp_path / "missing" / "x"), device="cpu")


def test_hub_id_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    import huggingface_hub.constants as c
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError, match="nobody/no-such-wan"):
        VideoGenerator.from_pretrained("nobody/no-such-wan", device="cpu")


def copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_component(tiny_ckpts, tmp_path):
    p = copy(tiny_ckpts["wan2.1"], tmp_path / "c")
    shutil.rmtree(p / "vae")
    with pytest.raises(FileNotFoundError, match="vae"):
        VideoGenerator.from_pretrained(p, device="cpu")


def test_non_wan_config(tiny_ckpts, tmp_path):
    p = copy(tiny_ckpts["wan2.1"], tmp_path / "c")
    cfg = json.loads((p / "transformer" / "config.json").read_text())
    cfg["_class_name"] = "FluxTransformer2DModel"
    (p / "transformer" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="not a Wan DiT"):
        VideoGenerator.from_pretrained(p, device="cpu")


def test_non_wan_pipeline(tiny_ckpts, tmp_path):
    p = copy(tiny_ckpts["wan2.1"], tmp_path / "c")
    idx = json.loads((p / "model_index.json").read_text())
    idx["_class_name"] = "StableDiffusionPipeline"
    (p / "model_index.json").write_text(json.dumps(idx))
    with pytest.raises(ValueError, match="not a Wan pipeline"):
        VideoGenerator.from_pretrained(p, device="cpu")


def test_pickle_only_weights_refused(tiny_ckpts, tmp_path):
    from safetensors.torch import load_file
    p = copy(tiny_ckpts["wan2.1"], tmp_path / "c")
    f = p / "transformer" / "diffusion_pytorch_model.safetensors"
    torch.save(load_file(f), p / "transformer" / "diffusion_pytorch_model.bin")
    f.unlink()
    with pytest.raises(ValueError, match="pickle") as e:
        VideoGenerator.from_pretrained(p, device="cpu")
    assert "allow_pickle=True" in str(e.value)
    # explicitly allowed: it loads and runs
    gen = VideoGenerator.from_pretrained(p, device="cpu", dtype=torch.float32, allow_pickle=True)
    res = gen.generate_video("a cat", save_video=False, height=32, width=32, num_frames=1, num_inference_steps=1)
    assert res.frames.shape == (1, 32, 32, 3)


def _shard(p):
    """Split the transformer weights into two shards + index; return the index path."""
    from safetensors.torch import load_file, save_file
    d = p / "transformer"
    sd = load_file(d / "diffusion_pytorch_model.safetensors")
    (d / "diffusion_pytorch_model.safetensors").unlink()
    keys = sorted(sd)
    half = len(keys) // 2
    names = ["diffusion_pytorch_model-00001-of-00002.safetensors", "diffusion_pytorch_model-00002-of-00002.safetensors"]
    save_file({k: sd[k] for k in keys[:half]}, d / names[0])
    save_file({k: sd[k] for k in keys[half:]}, d / names[1])
    idx = {"metadata": {}, "weight_map": {k: names[0] if i < half else names[1] for i, k in enumerate(keys)}}
    path = d / "diffusion_pytorch_model.safetensors.index.json"
    path.write_text(json.dumps(idx))
    return path


def test_sharded_checkpoint_loads(tiny_ckpts, tmp_path):
    p = copy(tiny_ckpts["wan2.1"], tmp_path / "c")
    _shard(p)
    a = VideoGenerator.from_pretrained(p, device="cpu", dtype=torch.float32)
    b = VideoGenerator.from_pretrained(tiny_ckpts["wan2.1"], device="cpu", dtype=torch.float32)
    kw = dict(height=32, width=32, num_frames=1, num_inference_steps=2, save_video=False, seed=0)
    assert (a.generate_video("x", **kw).frames == b.generate_video("x", **kw).frames).all()


def test_shard_index_outside_folder(tiny_ckpts, tmp_path):
    p = copy(tiny_ckpts["wan2.1"], tmp_path / "c")
    index = _shard(p)
    idx = json.loads(index.read_text())
    k = next(iter(idx["weight_map"]))
    idx["weight_map"][k] = "../../vae/diffusion_pytorch_model.safetensors"
    index.write_text(json.dumps(idx))
    with pytest.raises(ValueError, match="outside"):
        VideoGenerator.from_pretrained(p, device="cpu")


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_safetensors(tiny_ckpts, tmp_path, damage):
    p = copy(tiny_ckpts["wan2.1"], tmp_path / "c")
    f = p / "transformer" / "diffusion_pytorch_model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x13\x00" + data[2:])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        VideoGenerator.from_pretrained(p, device="cpu")


def test_unknown_backend_argument(tiny_ckpts):
    with pytest.raises(ValueError, match="TORCH_SDPA"):
        VideoGenerator.from_pretrained(tiny_ckpts["wan2.1"], device="cpu", attention_backend="FAST_MAGIC")


def test_unknown_backend_env(tiny_ckpts, monkeypatch):
    monkeypatch.setenv("FASTVIDEO_ATTENTION_BACKEND", "FAST_MAGIC")
    with pytest.raises(ValueError, match="FAST_MAGIC"):
        VideoGenerator.from_pretrained(tiny_ckpts["wan2.1"], device="cpu")


def test_bad_cfg_mode(tiny_ckpts):
    with pytest.raises(ValueError, match="cfg_mode"):
        VideoGenerator.from_pretrained(tiny_ckpts["wan2.1"], device="cpu", cfg_mode="parallel")


@pytest.mark.parametrize("value,exc,words", [
    ("yes", TypeError, "vae_tiling='yes' must be True, False or a dict"),
    ({"tile_size": 256}, ValueError, "unknown keys ['tile_size']"),
    ({"tile_sample_min_height": 100}, ValueError, "must be a positive multiple of the VAE's spatial factor 8"),
    ({"tile_sample_min_width": 0}, ValueError, "tile_sample_min_width']=0 must be a positive multiple"),
    ({"tile_sample_min_height": 64, "tile_sample_stride_height": 128}, ValueError,
     "tile_sample_stride_height=128 exceeds tile_sample_min_height=64"),
    ({"tile_sample_stride_width": 512}, ValueError,  # against diffusers' default tile of 256
     "tile_sample_stride_width=512 exceeds tile_sample_min_width=256"),
])
def test_bad_vae_tiling(tiny_ckpts, monkeypatch, value, exc, words):
    from fastwan.pipelines import generator

    def no_load(*a, **k):  # checked before anything is loaded (the DiT is loaded first)
        raise AssertionError("a component was loaded before vae_tiling was checked")

    monkeypatch.setattr(generator, "load_transformer", no_load)
    with pytest.raises(exc, match=re.escape(words)):
        VideoGenerator.from_pretrained(tiny_ckpts["wan2.1"], device="cpu", vae_tiling=value)


@pytest.mark.parametrize("value", [0, -2, 1.5, "fast", None, True])
def test_bad_vae_chunk_frames(tiny_ckpts, monkeypatch, value):
    from fastwan.pipelines import generator

    def no_load(*a, **k):
        raise AssertionError("a component was loaded before vae_chunk_frames was checked")

    monkeypatch.setattr(generator, "load_transformer", no_load)
    with pytest.raises(ValueError, match=re.escape(f"vae_chunk_frames={value!r} must be 'auto' or an int >= 1")):
        VideoGenerator.from_pretrained(tiny_ckpts["wan2.1"], device="cpu", vae_chunk_frames=value)


def test_vae_tiling_factor_follows_the_checkpoint(tiny_ckpts):
    """Wan2.2 TI2V's VAE compresses 16x in space: 40 px tiles are refused there."""
    with pytest.raises(ValueError, match="spatial factor 16"):
        VideoGenerator.from_pretrained(tiny_ckpts["wan2.2-ti2v"], device="cpu",
                                       vae_tiling={"tile_sample_min_width": 40})


def test_one_line_drops_bullets_but_keeps_flags_and_negative_numbers():
    exc = InvalidArgument("cannot run:\n  - --step-index -1 is negative\n  - -0.5 is below 0\n--sp 3 needs 3 GPUs")
    assert one_line(exc) == "cannot run: --step-index -1 is negative; -0.5 is below 0; --sp 3 needs 3 GPUs"
