"""LoRA files that diffusers users have: a diffusers / PEFT LoRA's alphas saved in its safetensors metadata merge
as diffusers' ``load_lora_adapter`` + ``fuse_lora`` do (the reference: diffusers' fused weights); a file giving one
module the same part twice, holding another adapter kind (kohya's DoRA dora_scale, LyCORIS), or a PEFT DoRA that
diffusers / PEFT would not merge (a magnitude that does not fit, without lora_A / lora_B, with lora_B.bias, or
contradicting the metadata's use_dora), is refused before any weight changes; norm deltas with values are named."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from fastwan.errors import CheckpointError, InvalidArgument
from fastwan.lora import LoraState, apply_lora
from fastwan.models.wan.loading import load_transformer
from fastwan.checkpoint.tiny import tiny_checkpoint

pytest.importorskip("peft")
MODULES = ("blocks.0.attn1.to_q", "blocks.0.attn2.to_out.0", "blocks.1.ffn.net.0.proj")


@pytest.fixture(scope="module")
def folder():
    return tiny_checkpoint("wan2.1") / "transformer"


def ours(folder):
    return load_transformer(folder, dtype=torch.float32, device="cpu")


def peft_lora(model, prefix: str, rank: int = 4) -> dict:
    g = torch.Generator().manual_seed(0)
    mods = dict(model.named_modules())
    out = {}
    for name in MODULES:
        w = mods[name].weight
        out[f"{prefix}{name}.lora_A.weight"] = torch.randn(rank, w.shape[1], generator=g) * 0.3
        out[f"{prefix}{name}.lora_B.weight"] = torch.randn(w.shape[0], rank, generator=g) * 0.3
    return out


def diffusers_fused(folder, path, prefix, scale):
    from diffusers import WanTransformer3DModel

    ref = WanTransformer3DModel.from_pretrained(folder, torch_dtype=torch.float32)
    ref.load_lora_adapter(str(path), prefix=prefix, adapter_name="x", low_cpu_mem_usage=False, use_safetensors=True)
    ref.fuse_lora(lora_scale=scale)
    ref.unload_lora()
    return ref.state_dict()


@pytest.mark.parametrize("prefix, config, scale", [
    ("transformer", {"lora_alpha": 8}, 1.0),  # a pipeline save (save_lora_weights): "transformer." entries
    ("transformer", {"lora_alpha": 8, "alpha_pattern": {"blocks.1.ffn.net.0.proj": 2}}, 0.5),
    ("transformer", {"lora_alpha": 3, "use_rslora": True}, 1.0),  # alpha / sqrt(rank)
    (None, {"lora_alpha": 16, "alpha_pattern": {"to_out.0": 1}}, 1.0),  # a model save: unprefixed entries
    ("transformer", {"alpha_pattern": {"blocks.1.ffn.net.0.proj": 2}}, 1.0),  # no lora_alpha: PEFT's default, 8
    ("transformer", {"lora_alpha": 4, "lora_bias": True, "rank_pattern": {"to_q": 4}}, 1.0),  # lora_B.bias kept
])
def test_metadata_alphas_merge_as_diffusers_fuses_them(folder, tmp_path, prefix, config, scale):
    model = ours(folder)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    lead = f"{prefix}." if prefix else ""
    config = {"r": 4, "target_modules": list(MODULES), "use_dora": False, "use_rslora": False, **config}
    path = tmp_path / "lora.safetensors"
    lora = peft_lora(model, lead)
    if config.get("lora_bias"):
        lora[f"{lead}{MODULES[0]}.lora_B.bias"] = torch.linspace(-1.0, 1.0, 24)
    save_file(lora, str(path), metadata={
        "format": "pt", "lora_adapter_metadata": json.dumps({f"{lead}{k}": v for k, v in config.items()})})
    apply_lora([model], [LoraState()], path, scale)
    want = diffusers_fused(folder, path, prefix, scale)
    for name in MODULES:
        key = name + ".weight"
        got_delta, want_delta = model.state_dict()[key] - before[key], want[key] - before[key]
        assert want_delta.abs().max() > 0.1
        torch.testing.assert_close(got_delta, want_delta, rtol=1e-5, atol=1e-6)
    if config.get("lora_bias"):  # the bias delta: lora_B.bias x alpha / rank x scale
        key = MODULES[0] + ".bias"
        assert (want[key] - before[key]).abs().max() > 0.1
        torch.testing.assert_close(model.state_dict()[key], want[key], rtol=1e-5, atol=1e-6)


def refused_before_any_change(folder, path, error, match):
    model = ours(folder)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(error, match=match):
        apply_lora([model], [LoraState()], path)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_one_module_twice_in_one_file_is_refused(folder, tmp_path):
    """The same LoRA in the diffusers and the original Wan names: merging both (or silently one) is wrong."""
    model = ours(folder)
    lora = peft_lora(model, "transformer.")
    for part, wan_part in (("A", "down"), ("B", "up")):
        lora[f"diffusion_model.blocks.0.self_attn.q.lora_{wan_part}.weight"] = \
            lora[f"transformer.blocks.0.attn1.to_q.lora_{part}.weight"].clone()
    path = tmp_path / "mixed.safetensors"
    save_file(lora, str(path))
    refused_before_any_change(folder, path, InvalidArgument,
                              r"diffusion_model\.blocks\.0\.self_attn\.q\.lora_down\.weight and transformer\.blocks\."
                              r"0\.attn1\.to_q\.lora_A\.weight both give the lora_A / lora_down of blocks\.0\.attn1")


@pytest.mark.parametrize("extra, kind", [  # a PEFT DoRA's lora_magnitude_vector merges (test_lora_formats)
    ("lora_unet_blocks_0_self_attn_q.dora_scale", r"kohya DoRA \(dora_scale\)"),  # diffusers: refused
    ("transformer.blocks.0.attn1.to_q.dora_scale", r"kohya DoRA \(dora_scale\)"),  # diffusers: dropped
    ("lora_unet_blocks_0_self_attn_q.hada_w1_a", "LyCORIS LoHa"),
    ("lora_unet_blocks_0_self_attn_q.lokr_w1", "LyCORIS LoKr"),
])
def test_other_adapter_kinds_are_refused(folder, tmp_path, extra, kind):
    """Their updates are not B @ A: merging the B @ A part alone (or nothing) would be silently wrong."""
    lora = {**peft_lora(ours(folder), "transformer."), extra: torch.ones(24)}
    path = tmp_path / "other.safetensors"
    save_file(lora, str(path))
    refused_before_any_change(folder, path, InvalidArgument, rf"{extra} is a {kind} tensor; fastwan merges plain")


@pytest.mark.parametrize("meta, error, match", [
    ("{not json", CheckpointError, "is not a JSON object"),
    (json.dumps({"transformer.lora_alpha": "8"}), CheckpointError, r"metadata lora_alpha is '8'"),
    (json.dumps({"transformer.lora_alpha": 8, "transformer.alpha_pattern": {"to_q(": 2}}), CheckpointError,
     "not a valid pattern"),
    (json.dumps({"transformer.lora_alpha": 8, "transformer.use_dora": True}), CheckpointError,
     r"sets use_dora but transformer\.blocks\.0\.attn1\.to_q \(and 2 more\) has no lora_magnitude_vector"),
    # diffusers builds LoraConfig(**metadata): its modules would get another rank (r's default is 8) and no bias
    (json.dumps({"transformer.lora_alpha": 8}), CheckpointError,
     r"metadata gives blocks\.0\.attn1\.to_q rank 8, but transformer\.blocks\.0\.attn1\.to_q\.lora_A\.weight has "
     r"rank 4"),
    (json.dumps({"transformer.r": 4, "transformer.rank_pattern": {"to_out.0": 2}}), CheckpointError,
     r"metadata gives blocks\.0\.attn2\.to_out\.0 rank 2, but"),
    (json.dumps({"transformer.r": 4, "bias": True}), CheckpointError,
     r"does not set lora_bias but transformer\.blocks\.0\.attn1\.to_q\.lora_B\.bias is a lora_B bias"),
])
def test_bad_metadata_is_refused(folder, tmp_path, meta, error, match):
    path = tmp_path / "meta.safetensors"
    lora = peft_lora(ours(folder), "transformer.")
    if '"bias"' in meta:
        lora["transformer.blocks.0.attn1.to_q.lora_B.bias"] = torch.ones(24)
    save_file(lora, str(path), metadata={"lora_adapter_metadata": meta})
    refused_before_any_change(folder, path, error, match)


def magnitude(n):
    return torch.linspace(1.0, 2.0, n)


@pytest.mark.parametrize("extra, meta, error, match", [
    ({"transformer.blocks.0.attn1.to_q.lora_magnitude_vector": magnitude(23)}, None, InvalidArgument,
     r"transformer\.blocks\.0\.attn1\.to_q\.lora_magnitude_vector \(23,\) does not fit blocks\.0\.attn1\.to_q "
     r"\(weight \(24, 24\): a DoRA magnitude must be \[24\]"),
    ({"transformer.patch_embedding.lora_magnitude_vector": magnitude(24)}, None, InvalidArgument,
     r"patch_embedding\.lora_magnitude_vector is a DoRA magnitude, .* but patch_embedding has no lora_A / lora_B"),
    ({"transformer.blocks.0.attn1.to_q.lora_magnitude_vector": magnitude(24),
      "transformer.blocks.0.attn1.to_q.lora_B.bias": magnitude(24)}, None, InvalidArgument,
     r"blocks\.0\.attn1\.to_q has lora_B\.bias; .*PEFT refuses a DoRA with lora_B\.bias"),
    ({"transformer.blocks.0.attn1.to_q.lora_magnitude_vector": magnitude(24)},
     {"transformer.lora_alpha": 8, "transformer.use_dora": False}, CheckpointError,
     r"does not set use_dora but transformer\.blocks\.0\.attn1\.to_q has a DoRA lora_magnitude_vector"),
])
def test_dora_that_diffusers_would_not_merge_is_refused(folder, tmp_path, extra, meta, error, match):
    """What diffusers would refuse (a magnitude of the wrong shape, a DoRA with lora_bias), or merge as something
    else (a magnitude its metadata's use_dora leaves out; a magnitude with no LoRA), names the key before any
    change."""
    path = tmp_path / "dora.safetensors"
    save_file({**peft_lora(ours(folder), "transformer."), **extra}, str(path),
              metadata=None if meta is None else {"lora_adapter_metadata": json.dumps(meta)})
    refused_before_any_change(folder, path, error, match)


@pytest.mark.parametrize("value, warned", [(0.0, False), (0.01, True)])
def test_norm_deltas_with_values_are_named_not_skipped_silently(folder, tmp_path, caplog, value, warned):
    """Norm deltas are not merged (as in diffusers, which drops them): zeros (what trainers save) pass quietly;
    non-zero ones are named in a warning, and the linear layers still merge."""
    import logging

    model = ours(folder)
    dim = model.blocks[0].norm2.weight.shape[0]
    lora = peft_lora(model, "transformer.")
    lora["diffusion_model.blocks.0.norm3.diff"] = torch.full((dim,), value)
    path = tmp_path / "norms.safetensors"
    save_file(lora, str(path))
    caplog.set_level(logging.WARNING, logger="fastwan")
    assert apply_lora([model], [LoraState()], path) == len(MODULES)
    assert ("norm deltas hold non-zero values" in caplog.text) == warned
    assert ("blocks.0.norm3.diff" in caplog.text) == warned
