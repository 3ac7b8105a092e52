"""Causal checkpoints load in each published layout, with their family's sampling rule, and the wrong ones are
refused by name: FastVideo's Diffusers layout (``WanCausalDMDPipeline``), and Self-Forcing's / CausVid's generator
files over a base Wan2.1 checkpoint (``causal_weights=``). The recipes expected here are typed from the published
configs (Self-Forcing configs/self_forcing_dmd.yaml, CausVid configs/wan_causal_dmd.yaml, FastVideo
SelfForcingWanT2V480PConfig), the names from diffusers' conversion of the original Wan layout."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from fastwan import VideoGenerator
from fastwan.checkpoint.causal import CausalRecipe
from fastwan.checkpoint.resolver import resolve
from fastwan.errors import CheckpointError, InvalidArgument, MissingFileError
from fastwan.pipelines.load_options import LoadOptions

SELF_FORCING = CausalRecipe(frames_per_chunk=3, timesteps=(1000, 750, 500, 250), warp=True, shift=5.0)
CAUSVID = CausalRecipe(frames_per_chunk=3, timesteps=(1000, 757, 522), warp=False, shift=8.0)
TOP = {"patch_embedding": "patch_embedding", "text_embedding.0": "condition_embedder.text_embedder.linear_1",
       "text_embedding.2": "condition_embedder.text_embedder.linear_2",
       "time_embedding.0": "condition_embedder.time_embedder.linear_1",
       "time_embedding.2": "condition_embedder.time_embedder.linear_2",
       "time_projection.1": "condition_embedder.time_proj", "head.head": "proj_out"}
BLOCK = {"self_attn.q": "attn1.to_q", "self_attn.k": "attn1.to_k", "self_attn.v": "attn1.to_v",
         "self_attn.o": "attn1.to_out.0", "self_attn.norm_q": "attn1.norm_q", "self_attn.norm_k": "attn1.norm_k",
         "cross_attn.q": "attn2.to_q", "cross_attn.k": "attn2.to_k", "cross_attn.v": "attn2.to_v",
         "cross_attn.o": "attn2.to_out.0", "cross_attn.norm_q": "attn2.norm_q", "cross_attn.norm_k": "attn2.norm_k",
         "norm3": "norm2", "ffn.0": "ffn.net.0.proj", "ffn.2": "ffn.net.2"}


def diffusers_name(original: str) -> str:
    """An original Wan DiT tensor name -> diffusers' (the renames of diffusers' convert_wan_to_diffusers.py)."""
    if original == "head.modulation":
        return "scale_shift_table"
    if original.startswith("blocks."):
        _, i, rest = original.split(".", 2)
        if rest == "modulation":
            return f"blocks.{i}.scale_shift_table"
        module, tensor = rest.rsplit(".", 1)
        return f"blocks.{i}.{BLOCK[module]}.{tensor}"
    module, tensor = original.rsplit(".", 1)
    return f"{TOP[module]}.{tensor}"


def load(model, **kw):
    return VideoGenerator.from_pretrained(str(model), device="cpu", dtype=torch.float32, **kw)


def assert_dit_holds(gen, written: dict, prefix: str = "model."):
    """Every tensor of the DiT equals the file's tensor written under its original name (and nothing is left)."""
    dit = gen.transformers[0].state_dict()
    expected = {diffusers_name(k.removeprefix(prefix)): v for k, v in written.items()}
    assert set(expected) == set(dit)
    for name, tensor in expected.items():
        assert torch.equal(dit[name], tensor.float()), name


# ---- FastVideo's Diffusers layout ---------------------------------------------------------------------------------
def test_fastvideo_layout_loads_with_fastvideo_recipe_and_its_own_weights(tiny_causal):
    gen = load(tiny_causal.fastvideo)
    assert gen.causal == SELF_FORCING and gen.checkpoint.causal == SELF_FORCING
    assert (gen.preset.num_inference_steps, gen.preset.guidance_scale, gen.preset.num_frames) == (4, 1.0, 21)
    written = load_file(str(tiny_causal.fastvideo / "transformer" / "diffusion_pytorch_model.safetensors"))
    dit = gen.transformers[0].state_dict()  # FastVideo saves diffusers' names: read as they are
    assert set(dit) == set(written) and all(torch.equal(dit[k], v.float()) for k, v in written.items())
    assert resolve(tiny_causal.base).causal is None and load(tiny_causal.base).causal is None
    # its scheduler, FastVideo's SelfForcingFlowMatchScheduler (shift 5), reads as diffusers' flow-matching Euler
    assert type(gen.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler" and gen.scheduler.config.shift == 5.0


def test_fastvideos_scheduler_class_is_read_only_in_a_causal_pipeline(tiny_causal, tmp_path):
    root = shutil.copytree(tiny_causal.base, tmp_path / "plain")
    shutil.copy(tiny_causal.fastvideo / "scheduler" / "scheduler_config.json", root / "scheduler")
    index = json.loads((root / "model_index.json").read_text())
    (root / "model_index.json").write_text(json.dumps({**index, "scheduler": [
        "diffusers", "SelfForcingFlowMatchScheduler"]}))
    with pytest.raises(CheckpointError, match='"SelfForcingFlowMatchScheduler" is not a diffusers scheduler class'):
        resolve(root)


def relabel(src, dst, **dit_keys):
    root = shutil.copytree(src, dst)
    path = root / "transformer" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **dit_keys}))
    return root


def test_fastvideo_causal_keys_set_chunk_window_and_sinks(tiny_causal, tmp_path):
    root = relabel(tiny_causal.fastvideo, tmp_path / "c", num_frames_per_block=4, local_attn_size=12, sink_size=2)
    assert resolve(root).causal == CausalRecipe(frames_per_chunk=4, timesteps=(1000, 750, 500, 250), warp=True,
                                                shift=5.0, window_frames=12, sink_frames=2)


@pytest.mark.parametrize("keys,named", [
    ({"local_attn_size": 0}, '"local_attn_size": 0'),
    ({"local_attn_size": "8"}, '"local_attn_size": "8"'),
    ({"sink_size": -1}, '"sink_size": -1'),
    ({"num_frames_per_block": 0}, '"num_frames_per_block": 0'),
    ({"num_frames_per_block": True}, '"num_frames_per_block": true'),
    ({"rope_cache_policy": "rotary"}, '"rope_cache_policy": "rotary"'),
    ({"local_attn_size": 12, "sink_size": 2, "rope_cache_policy": "relativistic"}, '"relativistic"'),
    ({"local_attn_size": 4}, '"local_attn_size": 4'),  # a window below two chunks
    ({"_class_name": "WanTransformer3DModel"}, '"_class_name": "WanTransformer3DModel"'),
])
def test_fastvideo_bad_causal_keys_are_refused_naming_them(tiny_causal, tmp_path, keys, named):
    root = relabel(tiny_causal.fastvideo, tmp_path / "c", **keys)
    with pytest.raises(CheckpointError, match="config.json") as e:
        resolve(root)
    assert named in str(e.value)


def test_fastvideo_two_experts_and_the_multistep_pipeline_are_refused(tiny_causal, tmp_path):
    root = shutil.copytree(tiny_causal.fastvideo, tmp_path / "two")
    shutil.copytree(root / "transformer", root / "transformer_2")
    index = json.loads((root / "model_index.json").read_text())
    (root / "model_index.json").write_text(json.dumps(
        {**index, "transformer_2": ["diffusers", "CausalWanTransformer3DModel"], "boundary_ratio": 0.875}))
    with pytest.raises(CheckpointError, match='"WanCausalDMDPipeline" with two experts \\("transformer_2"\\)'):
        resolve(root)
    (root / "model_index.json").write_text(json.dumps({**index, "_class_name": "WanCausalPipeline"}))
    with pytest.raises(CheckpointError, match="WanCausalPipeline: a full UniPC schedule per chunk"):
        resolve(root)


def test_a_causal_dit_in_a_plain_pipeline_is_refused(tiny_causal, tmp_path):
    root = shutil.copytree(tiny_causal.fastvideo, tmp_path / "plain")
    index = json.loads((root / "model_index.json").read_text())
    (root / "model_index.json").write_text(json.dumps({**index, "_class_name": "WanPipeline"}))
    with pytest.raises(CheckpointError, match='"CausalWanTransformer3DModel" is a causal Wan DiT.*"WanCausalDMDPip'):
        resolve(root)


# ---- Self-Forcing's and CausVid's generator files -----------------------------------------------------------------
def test_self_forcing_file_loads_its_ema_generator_over_the_base(tiny_causal):
    gen = load(tiny_causal.base, causal_weights=str(tiny_causal.self_forcing), allow_pickle=True)
    assert gen.causal == SELF_FORCING
    tree = torch.load(tiny_causal.self_forcing, weights_only=True)
    assert_dit_holds(gen, tree["generator_ema"])  # generator_ema preferred, as Self-Forcing's README runs it
    key = "model.blocks.0.self_attn.q.weight"
    assert not torch.equal(tree["generator"][key], tree["generator_ema"][key])
    base = load(tiny_causal.base)  # the rest of the pipeline is the base's
    assert all(torch.equal(a, b) for a, b in zip(base.vae.state_dict().values(), gen.vae.state_dict().values()))
    assert gen.preset.num_inference_steps == 4 and gen.preset.guidance_scale == 1.0


def test_causvid_file_loads_its_generator_with_causvid_recipe(tiny_causal):
    gen = load(tiny_causal.base, causal_weights=str(tiny_causal.causvid), allow_pickle=True, causal_recipe="causvid")
    assert gen.causal == CAUSVID and gen.preset.num_inference_steps == 3
    assert_dit_holds(gen, torch.load(tiny_causal.causvid, weights_only=True)["generator"])


def test_safetensors_files_load_without_pickle_flat_nested_or_unprefixed(tiny_causal, tmp_path):
    from fastwan.checkpoint.tiny import write_generator_file

    gen = load(tiny_causal.base, causal_weights=str(tiny_causal.flat))
    assert_dit_holds(gen, load_file(str(tiny_causal.flat)))
    nested = write_generator_file(tmp_path / "nested.safetensors", tiny_causal.base, seed=9)
    written = load_file(str(nested))
    assert_dit_holds(load(tiny_causal.base, causal_weights=str(nested)),
                     {k.removeprefix("generator_ema."): v for k, v in written.items()
                      if k.startswith("generator_ema.")})
    bare = write_generator_file(tmp_path / "bare.safetensors", tiny_causal.base, entries=(), prefix="", seed=10)
    assert_dit_holds(load(tiny_causal.base, causal_weights=str(bare)), load_file(str(bare)), prefix="")


def test_a_pickle_needs_the_users_permission(tiny_causal):
    with pytest.raises(InvalidArgument, match="is a torch pickle.*allow_pickle=True") as e:
        LoadOptions(str(tiny_causal.base), causal_weights=str(tiny_causal.self_forcing))
    assert str(tiny_causal.self_forcing) in str(e.value)


def test_generator_file_arguments_are_checked_before_loading(tiny_causal, tmp_path):
    with pytest.raises(MissingFileError, match="nope.pt"):
        LoadOptions(str(tiny_causal.base), causal_weights=str(tmp_path / "nope.pt"), allow_pickle=True)
    (tmp_path / "w.txt").write_text("x")
    with pytest.raises(InvalidArgument, match=r"\.safetensors or a torch pickle"):
        LoadOptions(str(tiny_causal.base), causal_weights=str(tmp_path / "w.txt"))
    with pytest.raises(InvalidArgument, match="causal_recipe='causvid'.*no"):
        LoadOptions(str(tiny_causal.base), causal_recipe="causvid")
    with pytest.raises(InvalidArgument, match="causal_recipe='lightx2v' must be one of 'self-forcing', 'causvid'"):
        LoadOptions(str(tiny_causal.base), causal_weights=str(tiny_causal.flat), causal_recipe="lightx2v")


def test_causal_load_options_round_trip_through_json(tiny_causal):
    from fastwan.fields import from_json, to_json

    own = CausalRecipe(frames_per_chunk=3, timesteps=(1000, 500), warp=False, shift=3.0, context_noise=10.0)
    for recipe in ("causvid", own):
        o = LoadOptions(str(tiny_causal.base), causal_weights=str(tiny_causal.flat), causal_recipe=recipe)
        assert from_json(LoadOptions, json.dumps(to_json(o))) == o
    gen = load(tiny_causal.base, causal_weights=str(tiny_causal.flat), causal_recipe=own)
    assert gen.causal == own


def rewritten(src, dst, change):
    tensors = load_file(str(src))
    change(tensors)
    save_file(tensors, str(dst))
    return dst


def test_a_diffusers_named_file_is_refused_as_the_wrong_layout(tiny_causal, tmp_path):
    dit = tiny_causal.base / "transformer" / "diffusion_pytorch_model.safetensors"
    with pytest.raises(CheckpointError, match=r"names its tensors as diffusers does \(blocks\.0\.attn1\.norm_k.*"
                                              "pipeline folder"):
        load(tiny_causal.base, causal_weights=str(shutil.copy(dit, tmp_path / "dit.safetensors")))


def test_another_models_keys_are_refused_naming_them(tiny_causal, tmp_path):
    other = tmp_path / "flux.safetensors"
    save_file({"model.double_blocks.0.img_attn.qkv.weight": torch.zeros(6, 2)}, str(other))
    with pytest.raises(CheckpointError, match=r"no original Wan DiT names \(model\.double_blocks\.0\.img_attn"):
        load(tiny_causal.base, causal_weights=str(other))


def test_a_missing_tensor_is_named(tiny_causal, tmp_path):
    short = rewritten(tiny_causal.flat, tmp_path / "short.safetensors",
                      lambda t: t.pop("model.blocks.1.cross_attn.k.bias"))
    with pytest.raises(CheckpointError, match=r"missing 1 tensors \[blocks\.1\.attn2\.to_k\.bias\]"):
        load(tiny_causal.base, causal_weights=str(short))
    extra = rewritten(tiny_causal.flat, tmp_path / "extra.safetensors",
                      lambda t: t.update({"model.blocks.7.ffn.0.weight": torch.zeros(2, 2)}))
    with pytest.raises(CheckpointError, match=r"1 tensors the DiT has no place for \[model\.blocks\.7\.ffn\.0\.weight"):
        load(tiny_causal.base, causal_weights=str(extra))


def test_a_shape_unlike_the_base_dit_is_refused_naming_both(tiny_causal, tmp_path):
    def widen(t):
        t["model.head.head.weight"] = torch.zeros(128, 24)

    wide = rewritten(tiny_causal.flat, tmp_path / "wide.safetensors", widen)
    with pytest.raises(CheckpointError, match=r"'model\.head\.head\.weight' has shape \(128, 24\).*\(64, 24\) at "
                                              r"'proj_out\.weight'"):
        load(tiny_causal.base, causal_weights=str(wide))


@pytest.mark.parametrize("base", ["fastvideo", "wan2.2-a14b"])
def test_a_base_that_is_not_plain_wan21_text_to_video_is_refused(tiny_causal, tiny_ckpts, base):
    model = tiny_causal.fastvideo if base == "fastvideo" else tiny_ckpts[base]
    with pytest.raises(InvalidArgument, match="replaces the DiT of a Wan2.1 text-to-video checkpoint") as e:
        load(model, causal_weights=str(tiny_causal.flat))
    assert ("already causal" if base == "fastvideo" else "wan2.2-a14b") in str(e.value)


def test_a_corrupt_pickle_is_refused_naming_the_file(tiny_causal, tmp_path):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a torch file")
    with pytest.raises(CheckpointError, match="bad.pt cannot be read as a weights-only torch checkpoint"):
        load(tiny_causal.base, causal_weights=str(bad), allow_pickle=True)


# ---- streaming takes causal checkpoints only ----------------------------------------------------------------------
def test_streaming_refuses_a_non_causal_checkpoint_naming_it(tiny_causal):
    from fastwan.pipelines.stream import stream_video

    with pytest.raises(InvalidArgument, match="is not a causal checkpoint") as e:
        stream_video(load(tiny_causal.base), "a fox", num_frames=9, seed=1)
    assert str(tiny_causal.base) in str(e.value)


@pytest.mark.parametrize("layout", ["fastvideo", "self_forcing"])
def test_each_causal_layout_streams(tiny_causal, layout):
    from fastwan.pipelines.stream import stream_video

    gen = (load(tiny_causal.fastvideo) if layout == "fastvideo" else
           load(tiny_causal.base, causal_weights=str(tiny_causal.self_forcing), allow_pickle=True))
    chunks = list(stream_video(gen, "a fox", num_frames=9, height=32, width=32, seed=1))
    assert sum(len(c.frames) for c in chunks) == 9


def test_the_cli_resolves_a_request_with_the_causal_checkpoints_defaults(tiny_causal):
    """The CLI resolves its request before loading: with --causal-weights, against the causal checkpoint (its steps,
    no CFG), not the base's preset."""
    from types import SimpleNamespace

    from fastwan import cli
    from fastwan.pipelines.params import GenerationRequest

    options = LoadOptions(str(tiny_causal.base), causal_weights=str(tiny_causal.flat), causal_recipe="causvid")
    args = SimpleNamespace(lora=[], stream=False)
    resolved = cli._resolve_early(args, GenerationRequest("a fox", save_video=False), options)
    s = resolved.settings
    assert (s.num_inference_steps, s.guidance_scale, s.num_frames) == (3, 1.0, 21)


def test_fastvideo_layout_missing_a_tensor_is_refused_naming_it(tiny_causal, tmp_path):
    root = shutil.copytree(tiny_causal.fastvideo, tmp_path / "short")
    dit = root / "transformer" / "diffusion_pytorch_model.safetensors"
    rewritten(dit, dit, lambda t: t.pop("blocks.1.attn1.norm_k.weight"))
    with pytest.raises(CheckpointError, match=r"missing 1 tensors \[blocks\.1\.attn1\.norm_k\.weight\]"):
        resolve(root)


def test_a_published_causal_checkpoints_preset_is_self_forcings_video():
    """Self-Forcing's inference video: 21 latent frames (81) of 480 x 832 at 16 fps, the recipe's steps, no CFG."""
    from fastwan.checkpoint.causal_layouts import causal_preset
    from fastwan.checkpoint.presets import PRESETS, PUBLISHED_MIN_WIDTH

    for recipe, steps in ((SELF_FORCING, 4), (CAUSVID, 3)):
        p = causal_preset(PRESETS["wan2.1"], recipe, PUBLISHED_MIN_WIDTH)
        assert (p.height, p.width, p.num_frames, p.fps, p.num_inference_steps, p.guidance_scale,
                p.guidance_scale_2) == (480, 832, 81, 16, steps, 1.0, None)


def test_the_automatic_file_name_tells_causal_generators_apart(tiny_causal):
    """Two generator files (or two recipes) over one base make different videos, so their automatic names differ;
    a plain checkpoint's name is what it was."""
    def identity(gen):
        return gen._identity("", {}, None)

    plain = load(tiny_causal.base)
    a = load(tiny_causal.base, causal_weights=str(tiny_causal.flat))
    b = load(tiny_causal.base, causal_weights=str(tiny_causal.causvid), allow_pickle=True)
    c = load(tiny_causal.base, causal_weights=str(tiny_causal.flat), causal_recipe="causvid")
    ids = [identity(g) for g in (plain, a, b, c)]
    assert all(x != y for i, x in enumerate(ids) for y in ids[i + 1:])
    assert "causal" not in ids[0]


def test_an_api_host_checks_requests_by_the_causal_generator_files_rules(tiny_causal):
    """``fastwan serve --role api --causal-weights FILE`` loads no model, but its request rules are the causal
    checkpoint's: a request with guidance is refused there, as the worker would refuse it."""
    from fastwan.pipelines.load_options import LoadOptions
    from fastwan.pipelines.params import GenerationRequest
    from fastwan.serve.server import _rules

    rules = _rules(LoadOptions(model=str(tiny_causal.base), causal_weights=str(tiny_causal.flat)))
    assert rules.checkpoint.causal is not None
    with pytest.raises(InvalidArgument, match="guidance_scale=5.0 does not apply to a causal checkpoint"):
        rules.resolve(GenerationRequest("a kite", guidance_scale=5.0))
