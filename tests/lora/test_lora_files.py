"""What a LoRA file may hold and the scales it merges at, each refused case a user error naming the value, the
rule and the fix, raised before any weight changes (and, for ``from_pretrained(lora=...)``, before the model loads
where the check can run then): LoRA tensors that are not floating point (integer, bool), a bool alpha, rank 0, an
empty safetensors file, a scale that pushes a merged weight out of its dtype's range (inf weights, black videos),
one file given twice in ``lora=`` / ``--lora``. Pickle LoRA files load only when ``allow_pickle=True`` says so.
Scales are decided as diffusers decides them: any finite float, 0 and negatives included (frames against
``set_adapters`` weights), and a scale of 0 changes no bit."""
from __future__ import annotations

import os
import re

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from fastwan import VideoGenerator, cli
from fastwan.errors import CheckpointError, InvalidArgument, InvalidArgumentType
from tests.lora.helpers import bits, changed, random_lora
from tests.lora.test_lora import diffusers_frames, max_diff, ours

KEY = "diffusion_model.blocks.1.self_attn.q"  # a module of the tiny DiT, original Wan names
KEY_RE = re.escape(KEY)


def load(model="tiny", **kw) -> VideoGenerator:
    return VideoGenerator.from_pretrained(model, device="cpu", dtype=torch.float32, **kw)


@pytest.fixture
def gen():
    """A fresh tiny generator per test: a check that fails must not leave a half-merged one to the next test."""
    return load()


@pytest.fixture(scope="module")
def lora() -> dict[str, torch.Tensor]:
    return random_lora(load().transformers[0], "wan", alpha=4.0)


@pytest.fixture(scope="module")
def good(lora, tmp_path_factory):
    path = tmp_path_factory.mktemp("lora") / "good.safetensors"
    save_file(lora, str(path))
    return path


@pytest.fixture
def no_loading(monkeypatch):
    """Any DiT load fails the test: what is checked must be checked before loading."""
    def boom(*a, **k):
        raise AssertionError("the model started loading before the LoRA checks finished")
    monkeypatch.setattr("fastwan.pipelines.generator.load_transformer", boom)


def edited(lora, tmp_path, name, **changes):
    """``lora`` with ``changes`` (key -> tensor, None to drop it), saved as ``name``."""
    out = {k: v for k, v in lora.items() if changes.get(k, v) is not None}
    out.update({k: v for k, v in changes.items() if v is not None})
    path = tmp_path / f"{name}.safetensors"
    save_file(out, str(path))
    return path


def refused(g, path, error, match, **kw):
    """``g.load_lora(path)`` raises ``error`` matching ``match`` and leaves every weight and the LoRA record as they
    were; ``from_pretrained(lora=path)`` raises it too."""
    before = bits(g)
    with pytest.raises(error, match=match):
        g.load_lora(path, **kw)
    assert changed(before, bits(g)) == [] and all(not s.loaded for s in g._loras)


# -- the file's tensors ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("part,dtype", [("lora_down.weight", torch.int32), ("lora_up.weight", torch.int8),
                                        ("lora_down.weight", torch.bool), ("lora_up.weight", torch.uint8)])
def test_lora_tensors_that_are_not_floating_point_are_refused(gen, lora, tmp_path, no_loading, part, dtype):
    """diffusers would copy an integer tensor into its float LoRA layer as its values; a LoRA's weights are floats,
    so such a file (quantized by another tool, or not a LoRA) is refused, naming the key and its dtype."""
    key = f"{KEY}.{part}"
    path = edited(lora, tmp_path, "int", **{key: (lora[key] * 10).to(dtype)})
    name = str(dtype).replace("torch.", "")
    match = rf"{re.escape(key)} is a {name} tensor; LoRA weights are floating point.*re-export"
    refused(gen, path, InvalidArgument, match)
    with pytest.raises(InvalidArgument, match=match):
        load(lora=path)


def test_integer_diff_b_is_refused(gen, lora, tmp_path):
    key = "diffusion_model.blocks.0.cross_attn.o.diff_b"
    refused(gen, edited(lora, tmp_path, "diffb", **{key: lora[key].to(torch.int64)}), InvalidArgument,
            r"cross_attn\.o\.diff_b is a int64 tensor")


def test_bool_alpha_is_refused_and_an_integer_alpha_is_its_number(gen, lora, tmp_path):
    refused(gen, edited(lora, tmp_path, "bool", **{f"{KEY}.alpha": torch.tensor(True)}), InvalidArgument,
            rf"{KEY_RE}\.alpha is True.*one finite number")
    merged = []
    for name, alpha in (("int", torch.tensor(4, dtype=torch.int64)), ("float", torch.tensor(4.0))):
        gen.load_lora(edited(lora, tmp_path, name, **{f"{KEY}.alpha": alpha}), 0.5)
        merged.append(bits(gen))
        gen.unload_lora()
    assert changed(*merged) == []


def test_rank_0_is_refused_before_any_module_merges(gen, lora, tmp_path, no_loading):
    """Rank 0 (alpha / rank undefined) is refused by the checks, so no module merges, the last one in the file's
    order included."""
    key = "diffusion_model.blocks.1.ffn.2"  # the last module of the sorted keys
    a, b = lora[f"{key}.lora_down.weight"], lora[f"{key}.lora_up.weight"]
    path = edited(lora, tmp_path, "rank0", **{f"{key}.lora_down.weight": a[:0].contiguous(),
                                              f"{key}.lora_up.weight": b[:, :0].contiguous()})
    match = r"ffn\.2\.lora_down\.weight \(0, 32\) and .*lora_up\.weight \(24, 0\) have rank 0"
    refused(gen, path, InvalidArgument, match)
    with pytest.raises(InvalidArgument, match=match):
        load(lora=path)


def test_empty_safetensors_file_is_refused(gen, tmp_path, no_loading):
    path = tmp_path / "empty.safetensors"
    save_file({}, str(path))  # a valid safetensors file of no tensors
    refused(gen, path, InvalidArgument, r"empty\.safetensors': the file holds no tensors.*lora_A / lora_B")
    with pytest.raises(InvalidArgument, match="holds no tensors"):
        load(lora=path)


def test_lora_for_a_wider_model_names_the_key(gen, tmp_path):
    """A 14B-shaped LoRA (width 5120) on this model: the shape error names the key, both shapes and the fix."""
    path = tmp_path / "wide.safetensors"
    save_file({f"{KEY}.lora_down.weight": torch.zeros(4, 5120), f"{KEY}.lora_up.weight": torch.zeros(5120, 4)},
              str(path))
    refused(gen, path, InvalidArgument, rf"{KEY_RE}\.lora_down\.weight \(4, 5120\) .*\(5120, 4\) "
                                        r"do not fit blocks\.1\.attn1\.to_q .*another model")


# -- scales ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("q", [None, "fp8"])
@pytest.mark.parametrize("scale", [1e39, -1e39])
def test_scale_that_overflows_a_merged_weight_is_refused(lora, good, q, scale):
    """A finite scale whose merged weights leave fp32 (inf in the weights: black videos) raises naming the module,
    the scale and the fix, before any weight changes; on FP8 weights too (whose requantization raised a bare
    ValueError mid-merge); from_pretrained(lora=...) raises it as well."""
    g = load(quantization=q)
    refused(g, good, InvalidArgument, r"scale=[-]?1e\+39 the merged weight of blocks\.\d\.\S+ leaves the range of "
                                      r"float32.*inf.*smaller scale", scale=scale)
    with pytest.raises(InvalidArgument, match="leaves the range of float32"):
        load(quantization=q, lora=[(good, scale)])
    g.load_lora(good, 1e30)  # a large scale whose weights stay finite merges, as in diffusers
    assert all(torch.isfinite(v.float()).all() for v in g.transformers[0].state_dict().values())


def test_fp16_overflow_is_refused_at_the_fp16_range(good):
    g = VideoGenerator.from_pretrained("tiny", device="cpu", dtype=torch.float16)
    refused(g, good, InvalidArgument, r"scale=100000 the merged .* leaves the range of float16 \(\|values\| up to "
                                      r"6\.55e\+04\)", scale=1e5)


def test_overflow_in_the_second_expert_leaves_the_first_unchanged(tmp_path):
    """expert=None: every expert is checked before either changes (expert 1 holds one huge weight here, where the
    update pushes it past fp32's largest value)."""
    g = load("tiny-wan2.2-a14b")
    path = tmp_path / "l.safetensors"
    lora = random_lora(g.transformers[0], "diffusers")
    save_file(lora, str(path))
    name = "blocks.1.ffn.net.2"
    delta = lora[f"transformer.{name}.lora_B.weight"] @ lora[f"transformer.{name}.lora_A.weight"]
    i, j = divmod(int(delta.abs().argmax()), delta.shape[1])
    with torch.no_grad():
        g.transformers[1].blocks[1].ffn.net[2].weight[i, j] = 3.4e38 * float(delta[i, j].sign())
    refused(g, path, InvalidArgument, r"the merged weight of blocks\.1\.ffn\.net\.2 leaves the range", scale=1e37)
    g.load_lora(path, 1e37, expert=0)  # the first expert alone stays in range


@pytest.mark.parametrize("q", [None, "fp8"])
def test_scale_0_changes_no_bit(good, q):
    """diffusers' adapter weight 0 leaves the output as it is; a merge at scale 0 changes no tensor (no -0.0 turned
    +0.0, no FP8 row requantized), and is recorded as loaded."""
    g = load(quantization=q)
    before = bits(g)
    g.load_lora(good, 0.0)
    assert changed(before, bits(g)) == []
    assert g._loras[0].loaded == [(str(good), 0.0)]


@pytest.mark.parametrize("scale", [-0.7, 0.0])
def test_negative_and_zero_scales_give_diffusers_frames(gen, good, scale):
    """diffusers accepts any float adapter weight: a negative scale subtracts the update, 0 adds nothing."""
    gen.load_lora(good, scale)
    try:
        got = ours(gen)
    finally:
        gen.unload_lora()
    assert max_diff(got, diffusers_frames("wan2.1", good, scale)) <= 1
    if scale == 0:
        assert np.array_equal(got, ours(gen))


# -- files given twice -------------------------------------------------------------------------------------------
def test_one_file_twice_in_lora_is_refused_before_loading(good, tmp_path, no_loading, monkeypatch):
    link = tmp_path / "link.safetensors"
    os.symlink(good, link)
    monkeypatch.chdir(good.parent)
    for spec in ([good, good], [(good, 0.5), (str(good), 0.25)], [(good, 1.0), (link, 1.0)],
                 [(good.name, 1.0), (good, 1.0)]):
        with pytest.raises(InvalidArgument, match=r"(good|link)\.safetensors' is given twice, at scales .*give it"):
            load(lora=spec)


def test_one_file_per_expert_is_not_a_repeat(tmp_path):
    g = load("tiny-wan2.2-a14b")
    path = tmp_path / "l.safetensors"
    save_file(random_lora(g.transformers[0], "diffusers"), str(path))
    for spec in ([(path, 1.0, 0), (path, 1.0, None)], [(path, 1.0, 1), (path, 0.5, 1)]):
        with pytest.raises(InvalidArgument, match=r"given twice \(experts .*\)"):
            load("tiny-wan2.2-a14b", lora=spec)
    both = load("tiny-wan2.2-a14b", lora=[(path, 0.8, 0), (path, 0.8, 1)])
    every = load("tiny-wan2.2-a14b", lora=[(path, 0.8)])
    assert changed(bits(both), bits(every)) == []


def test_cli_repeated_lora_is_a_user_error_before_loading(good, tmp_path, capsys, no_loading):
    args = ["generate", "--prompt", "a kite", "--model", "tiny", "--height", "64", "--width", "64", "--num-frames",
            "5", "--steps", "1", "--device", "cpu", "--output", str(tmp_path / "out"), "--lora", str(good),
            "--lora", f"{good}:0.5"]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastwan: error: ") and "given twice" in err and "1.5" in err, err


def test_load_lora_of_a_merged_file_adds_it_again(gen, good):
    """load_lora is an explicit step: the same file again adds its update again (as two loads in a fresh
    generator do), and one unload restores the weights."""
    before = bits(gen)
    gen.load_lora(good, 0.5)
    gen.load_lora(good, 0.5)
    assert [s.loaded for s in gen._loras] == [[(str(good), 0.5), (str(good), 0.5)]]
    gen.unload_lora()
    assert changed(before, bits(gen)) == []


# -- pickle files ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("suffix", [".pt", ".bin", ".ckpt"])
def test_pickle_lora_loads_only_when_allowed(gen, good, tmp_path, no_loading, suffix):
    path = tmp_path / f"lora{suffix}"
    torch.save(load_file(str(good)), path)
    refused(gen, path, InvalidArgument, rf"lora\{suffix}' is a PyTorch pickle file.*safetensors only.*"
                                        r"allow_pickle=True")
    with pytest.raises(InvalidArgument, match="allow_pickle=True"):
        load(lora=path)
    with pytest.raises(InvalidArgumentType, match="allow_pickle='yes' must be True or False"):
        gen.load_lora(path, allow_pickle="yes")


def test_allowed_pickle_lora_merges_as_its_safetensors_copy(good, tmp_path):
    path = tmp_path / "lora.pt"
    torch.save(load_file(str(good)), path)
    want = bits(load(lora=[(good, 0.7)]))
    assert changed(bits(load(allow_pickle=True, lora=[(path, 0.7)])), want) == []
    g = load()
    g.load_lora(path, 0.7, allow_pickle=True)
    assert changed(bits(g), want) == []


def test_allowed_pickle_that_is_no_state_dict_is_a_checkpoint_error(gen, tmp_path):
    for name, obj in (("list.pt", [torch.zeros(2)]), ("nested.bin", {"state_dict": {"a": torch.zeros(2)}})):
        torch.save(obj, tmp_path / name)
        refused(gen, tmp_path / name, CheckpointError, rf"{re.escape(name)}' holds a (list|dict), not a state dict",
                allow_pickle=True)
    (tmp_path / "junk.bin").write_bytes(b"\x00junk")
    refused(gen, tmp_path / "junk.bin", CheckpointError, r"junk\.bin' cannot be read as a weights-only",
            allow_pickle=True)
