"""Bad LoRA inputs raise a user error naming the value before any weight changes, and before the model loads where
the check can run then (``from_pretrained(lora=...)``, ``--lora``): alphas that are not one finite number, scales
that are not finite, experts that are not ints, files that are not valid safetensors, directories. Valid edge
cases (a 1-element alpha of shape (1,), a numpy int expert) still merge, compared with a hand-computed update."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from fastwan import VideoGenerator, cli
from fastwan.errors import CheckpointError, InvalidArgument, InvalidArgumentType, UserError

MODULES = {"self_attn.q": "attn1.to_q", "ffn.0": "ffn.net.0.proj"}  # original Wan name -> the model's
RANK = 4


def wan_lora(model, last_alpha=None, seed=0) -> dict:
    """An original-Wan-key LoRA (alpha 2.0 each) on two modules of every block; ``last_alpha``: the alpha of the
    last block's ffn.0 instead (the last module merged, so a late failure would leave the others changed)."""
    g = torch.Generator().manual_seed(seed)
    mods = dict(model.named_modules())
    out = {}
    for i in range(len(model.blocks)):
        for wan, ours in MODULES.items():
            w = mods[f"blocks.{i}.{ours}"].weight
            key = f"diffusion_model.blocks.{i}.{wan}"
            out[f"{key}.lora_down.weight"] = torch.randn(RANK, w.shape[1], generator=g) * 0.3
            out[f"{key}.lora_up.weight"] = torch.randn(w.shape[0], RANK, generator=g) * 0.3
            out[f"{key}.alpha"] = torch.tensor(2.0)
    if last_alpha is not None:
        out[f"diffusion_model.blocks.{len(model.blocks) - 1}.ffn.0.alpha"] = last_alpha
    return out


def snapshot(g):
    return [{k: v.clone() for k, v in t.state_dict().items()} for t in g.transformers]


def unchanged(g, before) -> bool:
    return all(torch.equal(b[k], v) for t, b in zip(g.transformers, before) for k, v in t.state_dict().items())


def load(tiny_ckpts, lora):
    return VideoGenerator.from_pretrained(tiny_ckpts["wan2.1"], device="cpu", dtype=torch.float32, lora=lora)


@pytest.fixture
def no_loading(monkeypatch):
    """Any DiT load fails the test: what is checked must be checked before loading."""
    def boom(*a, **k):
        raise AssertionError("the model started loading before the LoRA checks finished")
    monkeypatch.setattr("fastwan.pipelines.generator.load_transformer", boom)


@pytest.fixture(scope="module")
def good(gen, tmp_path_factory):
    path = tmp_path_factory.mktemp("lora") / "good.safetensors"
    save_file(wan_lora(gen.transformers[0]), str(path))
    return path


BAD_ALPHAS = {"two elements": torch.tensor([2.0, 3.0]), "empty": torch.zeros(0), "nan": torch.tensor(float("nan")),
              "inf": torch.tensor(float("inf")), "-inf 1-element": torch.tensor([float("-inf")])}


@pytest.mark.parametrize("case", BAD_ALPHAS)
def test_bad_alpha_raises_naming_the_key_before_any_change(gen, tiny_ckpts, tmp_path, no_loading, case):
    path = tmp_path / "alpha.safetensors"
    save_file(wan_lora(gen.transformers[0], BAD_ALPHAS[case]), str(path))
    key = r"diffusion_model\.blocks\.1\.ffn\.0\.alpha"
    before = snapshot(gen)
    with pytest.raises(InvalidArgument, match=key + ".*one finite number"):
        gen.load_lora(path)
    assert unchanged(gen, before)
    assert all(not s.loaded for s in gen._loras)
    with pytest.raises(InvalidArgument, match=key):  # from_pretrained: before the model loads
        load(tiny_ckpts, path)


def test_one_element_alpha_of_shape_1_merges_as_its_value(gen, tmp_path):
    """alpha stored as shape (1,) (some trainers write it so): W + (alpha / rank) B @ A, computed here by hand."""
    lora = wan_lora(gen.transformers[0], torch.tensor([3.0]))
    path = tmp_path / "alpha1.safetensors"
    save_file(lora, str(path))
    lin = dict(gen.transformers[0].named_modules())["blocks.1.ffn.net.0.proj"]
    w0 = lin.weight.detach().clone()
    gen.load_lora(path, 0.5)
    try:
        key = "diffusion_model.blocks.1.ffn.0"
        a, b = lora[f"{key}.lora_down.weight"], lora[f"{key}.lora_up.weight"]
        want = w0.double() + 0.5 * (3.0 / RANK) * (b.double() @ a.double())
        torch.testing.assert_close(lin.weight.double(), want, rtol=0, atol=1e-5)
    finally:
        gen.unload_lora()


@pytest.mark.parametrize("scale", [float("inf"), float("-inf"), float("nan"), pytest.param(10 ** 400, id="int 1e400")])
def test_non_finite_scale_raises_before_any_change(gen, tiny_ckpts, good, no_loading, scale):
    before = snapshot(gen)
    with pytest.raises(InvalidArgument, match="scale=.*finite"):
        gen.load_lora(good, scale)
    with pytest.raises(InvalidArgument, match=f"{good.name}.*finite"):  # before the model loads
        load(tiny_ckpts, (good, scale))
    with pytest.raises(InvalidArgument, match="finite"):
        load(tiny_ckpts, [good, (good, scale)])
    assert unchanged(gen, before)


@pytest.mark.parametrize("text", ["inf", "-inf", "nan", "1e309"])
def test_cli_non_finite_lora_scale_is_a_user_error_before_loading(tiny_ckpts, good, tmp_path, capsys, no_loading,
                                                                  text):
    args = ["generate", "--prompt", "a kite", "--model", str(tiny_ckpts["wan2.1"]), "--height", "64", "--width",
            "64", "--num-frames", "5", "--steps", "1", "--device", "cpu", "--output", str(tmp_path / "out"),
            "--lora", f"{good}:{text}"]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastwan: error: ") and "finite" in err and good.name in err, err


@pytest.mark.parametrize("expert", [0.0, 1.0, "0", True, False])
def test_expert_must_be_an_int(gen, good, expert):
    before = snapshot(gen)
    with pytest.raises(InvalidArgumentType, match=f"expert={expert!r} must be an int"):
        gen.load_lora(good, expert=expert)
    assert unchanged(gen, before)


def test_numpy_int_expert_merges_like_a_python_int(tiny_ckpts, tmp_path):
    g = VideoGenerator.from_pretrained(tiny_ckpts["wan2.2-a14b"], device="cpu", dtype=torch.float32)
    path = tmp_path / "l.safetensors"
    save_file(wan_lora(g.transformers[1]), str(path))
    g.load_lora(path, expert=1)
    want = snapshot(g)
    g.unload_lora()
    g.load_lora(path, expert=np.int64(1))
    assert unchanged(g, want)
    assert [s.loaded for s in g._loras] == [[], [(str(path), 1.0)]]


def test_numpy_float_scale_merges_like_a_python_float(gen, good):
    """``load_lora`` takes the NumPy numbers ``from_pretrained(lora=[(path, np.float32(...))])`` takes."""
    gen.load_lora(good, 0.5)
    want = snapshot(gen)
    gen.unload_lora()
    gen.load_lora(good, np.float32(0.5))
    try:
        assert unchanged(gen, want)
        assert [s.loaded for s in gen._loras] == [[(str(good), 0.5)]]
    finally:
        gen.unload_lora()


def corrupt_files(good, tmp_path) -> dict:
    data = good.read_bytes()
    files = {"truncated header": data[:500], "truncated data": data[:-100], "empty": b"",
             "garbage": b"\x00" * 64}
    out = {}
    for name, content in files.items():
        out[name] = tmp_path / f"{name.replace(' ', '_')}.safetensors"
        out[name].write_bytes(content)
    out["pickle"] = tmp_path / "pickle.safetensors"
    torch.save({"diffusion_model.blocks.0.self_attn.q.lora_down.weight": torch.zeros(RANK, 8)}, out["pickle"])
    return out


def test_invalid_safetensors_file_is_a_user_error(gen, tiny_ckpts, good, tmp_path, no_loading):
    before = snapshot(gen)
    for case, path in corrupt_files(good, tmp_path).items():
        with pytest.raises(CheckpointError, match=f"{path.name}.*not a valid safetensors file.*download") as e:
            gen.load_lora(path)
        assert isinstance(e.value, UserError), case
        with pytest.raises(CheckpointError, match=path.name):  # before the model loads
            load(tiny_ckpts, path)
    assert unchanged(gen, before)


def test_directory_is_reported_as_a_directory(gen, tiny_ckpts, good, tmp_path, no_loading):
    for folder in (tmp_path / "loras", tmp_path / "named.safetensors"):
        folder.mkdir()
        (folder / "style.safetensors").write_bytes(good.read_bytes())
        with pytest.raises(InvalidArgument, match=f"{folder.name}' is a directory.*style.safetensors"):
            gen.load_lora(folder)
        with pytest.raises(InvalidArgument, match="is a directory"):
            load(tiny_ckpts, folder)
