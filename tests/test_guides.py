"""The guides in docs/, checked against what the code does: each capability's facts (the presets a checkpoint
resolves to, signatures, defaults, what the CLI passes on), and their code blocks run as written on tiny
checkpoints. README.md, docs/cli.md, docs/environment.md, docs/architecture.md and the links: tests/test_docs.py."""
from __future__ import annotations

import ast
import inspect
import json
import re
import shutil

import numpy as np
import pytest

from fastwan import cli
from fastwan.checkpoint.tiny import TINY_IDS, tiny_checkpoint
from fastwan.errors import InvalidArgument
from fastwan.profiler import cli as profiler_cli
from tests.test_docs import DOCS, code_blocks, flat, help_flags, section, table_rows


# ---- models and presets ------------------------------------------------------------------------------------
MODELS = DOCS["docs/models.md"]


def test_model_guide_names_every_tiny_model():
    listed = flat(section(MODELS, "Naming a model")).split("a tiny random checkpoint:", 1)[1].split(". ")[0]
    assert set(re.findall(r"`(tiny[\w.-]*)`", listed)) == set(TINY_IDS)


# preset rows of real models -> (tiny checkpoint of that kind, folder name it is loaded from): a copy of a tiny
# checkpoint loaded by path (not by tiny name) gets the real model's preset, as a downloaded one would
REAL_ROWS = {
    "Wan2.1 T2V": ("tiny", "Wan2.1-T2V-1.3B-Diffusers"),
    "Wan2.2 T2V-A14B": ("tiny-wan2.2-a14b", "Wan2.2-T2V-A14B-Diffusers"),
    "Wan2.2 TI2V-5B": ("tiny-wan2.2-ti2v", "Wan2.2-TI2V-5B-Diffusers"),
    "Wan2.1 I2V 480P": ("tiny-wan2.1-i2v", "Wan2.1-I2V-14B-480P-Diffusers"),
    "Wan2.1 I2V 720P": ("tiny-wan2.1-i2v", "Wan2.1-I2V-14B-720P-Diffusers"),
    "Wan2.1 FLF2V": ("tiny-wan2.1-flf2v", "Wan2.1-FLF2V-14B-720P-Diffusers"),
    "Wan2.2 I2V-A14B": ("tiny-wan2.2-i2v-a14b", "Wan2.2-I2V-A14B-Diffusers"),
    "FastWan 2.1": ("tiny-fastwan2.1", "FastWan2.1-T2V-1.3B-Diffusers"),
    "Wan2.2 Animate-14B": ("tiny-wan2.2-animate", "Wan2.2-Animate-14B-Diffusers"),
}


def documented_preset(row: list[str]) -> tuple:
    """A preset table row -> (height, width, frames, steps, guidance, guidance_2, fps)."""
    _, size, frames, steps, guidance, fps = row
    h, w = (int(x) for x in size.split("×"))
    g = [float(x) for x in guidance.split("/")]
    return h, w, int(frames), int(steps), g[0], g[1] if len(g) > 1 else None, int(fps)


def actual(preset) -> tuple:
    return (preset.height, preset.width, preset.num_frames, preset.num_inference_steps, preset.guidance_scale,
            preset.guidance_scale_2, preset.fps)


def test_preset_table_is_what_checkpoints_resolve_to(tmp_path):
    from fastwan.checkpoint.presets import PRESETS, PUBLISHED_MIN_WIDTH, checkpoint_preset
    from fastwan.checkpoint.resolver import resolve

    rows = table_rows(section(MODELS, "Presets"))
    real = {r[0]: r for r in rows if not r[0].startswith("`")}
    tiny = [r for r in rows if r[0].startswith("`")]
    assert set(real) == set(REAL_ROWS)
    resolved = {}
    for label, (name, folder) in REAL_ROWS.items():
        path = tmp_path / folder
        shutil.copytree(tiny_checkpoint(TINY_IDS[name]), path)
        ckpt = resolve(path)  # its kind; a tiny DiT keeps its tiny preset under any name, so the published one is
        # what the same kind gets at a published width, under the published repository's name
        resolved[label] = checkpoint_preset(ckpt.variant, PUBLISHED_MIN_WIDTH, folder.lower(), ckpt.distilled)
        assert documented_preset(real[label]) == actual(resolved[label]), label
    # every preset fastwan has is a row (FastWan's is Wan2.1's with DMD settings)
    assert {p for label, p in resolved.items() if label != "FastWan 2.1"} == set(PRESETS.values())
    fastwan = resolved["FastWan 2.1"]
    assert (fastwan.sampler, fastwan.timesteps, fastwan.flow_shift) == ("dmd", (1000.0, 757.0, 522.0), 8.0)
    named = [n for r in tiny for n in re.findall(r"`([\w.-]+)`", r[0])]
    assert sorted(named) == sorted(TINY_IDS)  # each tiny model in exactly one row
    for r in tiny:
        for name in re.findall(r"`([\w.-]+)`", r[0]):
            assert documented_preset(r) == actual(resolve(name).preset), name


def test_attention_guide_profiler_line_names_real_flags(capsys):
    block = next(b for b in code_blocks(DOCS["docs/attention.md"]) if "python -m fastwan.profiler" in b)
    documented = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", "\n".join(ln.split("#")[0] for ln in
                                                                          block.splitlines())))
    real = help_flags([], capsys, main=profiler_cli.main)
    assert documented and documented <= real, sorted(documented - real)


def test_profiler_num_steps_alone_is_accepted(capsys):
    # `--num-steps 3` alone asks for sparse backends timed at a step of a 3-step run; the step index the user
    # did not give must not make it an error (the help documents no default for --step-index)
    argv = ["-i", "2", "4", "4", "-n", "2", "-d", "16", "--dtype", "fp32", "--device", "cpu", "--dry-run",
            "--backend", "TORCH_SDPA", "--num-steps", "3"]
    assert profiler_cli.main(argv) == 0


def test_profiler_config_error_names_the_flag(tmp_path, capsys):
    argv = ["-i", "2", "4", "4", "--device", "cpu", "--dry-run", "--backend", "SLIDING_TILE_ATTN",
            "--config", f"SLIDING_TILE_ATTN={tmp_path / 'missing.json'}"]
    with pytest.raises(SystemExit) as e:
        profiler_cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "FASTWAN_ATTENTION_CONFIG" not in err and "--config" in err, err



# ---- the guides' facts -------------------------------------------------------------------------------------


def test_every_public_parameter_is_in_a_guide():
    from fastwan import VideoGenerator

    text = "\n".join(t for name, t in DOCS.items() if name != "docs/cli.md")  # the prose, not the generated list
    for fn in (VideoGenerator.from_pretrained, VideoGenerator.generate_video, VideoGenerator.load_lora):
        missing = [p for p in inspect.signature(fn).parameters
                   if p not in ("self", "cls", "model", "prompt", "path") and not re.search(rf"\b{p}\b", text)]
        assert not missing, f"{fn.__name__}: {missing}"


def test_usage_guide_json_block_runs_as_written(tiny_ckpts, tmp_path, monkeypatch):
    """The request-as-JSON block with a tiny checkpoint and a small video: the request read back from its JSON text
    makes the frames generate_video makes for the same arguments, and the schema is the request's."""
    block = code_blocks(section(DOCS["docs/usage.md"], "Requests as objects and JSON"), "python")[0]
    small = "height=32, width=32, num_frames=5, num_inference_steps=2"
    assert '"Wan-AI/Wan2.1-T2V-1.3B-Diffusers"' in block and "seed=0)" in block
    block = block.replace('"Wan-AI/Wan2.1-T2V-1.3B-Diffusers"', json.dumps(str(tiny_ckpts["wan2.1"])))
    block = block.replace("seed=0)", f"seed=0, {small})")
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(block, "docs/usage.md", "exec"), scope)
    same = scope["gen"].generate_video("a cat surfing a wave at sunset", seed=0, height=32, width=32, num_frames=5,
                                       num_inference_steps=2, save_video=False)
    assert np.array_equal(scope["res"].frames, same.frames)
    assert scope["schema"]["title"] == "GenerationRequest" and "prompt" in scope["schema"]["required"]


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_every_python_block_is_python(doc):
    for block in code_blocks(DOCS[doc], "python"):
        compile(block, doc, "exec")


def test_sparse_attention_block_runs_as_written(tiny_ckpts):
    (block,) = code_blocks(section(DOCS["docs/attention.md"], "Sparse video attention"), "python")
    scope = {"model": str(tiny_ckpts["wan2.1"])}
    exec(compile("from fastwan import VideoGenerator\n" + block, "docs/attention.md", "exec"), scope)
    res = scope["gen"].generate_video("a fox", seed=0, height=32, width=48, num_frames=5, num_inference_steps=1,
                                      save_video=False)
    assert res.attention_backend.startswith("SLIDING_TILE_ATTN") and res.frames.shape == (5, 32, 48, 3)


class Stop(Exception):
    pass


def test_cli_process_counts(monkeypatch, tmp_path):
    """docs/parallel.md: --sp N is num_gpus=N; --sp S --cfg-parallel is num_gpus=2*S; --cfg-parallel alone 2."""
    from fastwan import VideoGenerator

    seen = {}

    def fake_load(options):
        seen.update(num_gpus=options.num_gpus, cfg_parallel=options.cfg_parallel)
        raise Stop

    assert ("`--sp S --cfg-parallel` is `num_gpus=2*S, cfg_parallel=True`, and `--cfg-parallel` alone `num_gpus=2`"
            in flat(DOCS["docs/parallel.md"]))
    monkeypatch.setattr(VideoGenerator, "load", staticmethod(fake_load))
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for extra, expected in ((["--sp", "3"], (3, False)), (["--sp", "2", "--cfg-parallel"], (4, True)),
                            (["--cfg-parallel"], (2, True)), ([], (None, False))):
        with pytest.raises(Stop):
            cli.main(["generate", "--prompt", "x", "--output", str(tmp_path), *extra])
        assert (seen["num_gpus"], seen["cfg_parallel"]) == expected, extra


def test_vae_chunk_auto_values():
    from fastwan.vae.decode import auto_chunk_frames

    assert "2 at 480p and 1 from 720p" in flat(DOCS["docs/speed.md"])
    assert auto_chunk_frames(480, 832, 4) == 2
    assert auto_chunk_frames(720, 1280, 4) == 1


def test_memory_plan_is_printed_by_the_cli_and_kept_in_python(monkeypatch, tmp_path, capsys):
    from fastwan import VideoGenerator
    from fastwan.offload.plan import OffloadPlan

    assert "`gen.memory_plan.describe()`" in DOCS["docs/memory.md"] and callable(OffloadPlan.describe)

    class Plan:
        def describe(self):
            return "PLAN: text encoder offloaded"

    class Fake:  # a generator loaded with a budget: load set memory_plan
        memory_plan, parallel = Plan(), None

        def generate(self, request):
            raise InvalidArgument("stop here")

    monkeypatch.setattr(VideoGenerator, "load", staticmethod(lambda options: Fake()))
    assert cli.main(["generate", "--prompt", "x", "--output", str(tmp_path)]) == 2
    assert "PLAN: text encoder offloaded" in capsys.readouterr().out.splitlines()


def test_cache_signatures_match_the_classes():
    import dataclasses

    import fastwan.cache

    documented = re.findall(r"`(FirstBlockCache|MagCache|TeaCache|TaylorSeer|SkipSteps)\(([^`]*)\)`",
                            flat(DOCS["docs/step-caching.md"]))
    assert {name for name, _ in documented} == {"FirstBlockCache", "MagCache", "TeaCache", "TaylorSeer", "SkipSteps"}
    for name, args in documented:
        fields = {f.name: f.default for f in dataclasses.fields(getattr(fastwan.cache, name))}
        for arg in args.split(","):
            key, _, default = (s.strip() for s in arg.partition("="))
            assert key in fields, f"docs' {name}({args}): {name} has no {key!r}"
            if default and name + key != "MagCachecalibrate":  # calibrate=True is an example, not the default
                assert fields[key] == ast.literal_eval(default), f"{name}.{key}: {fields[key]!r}, docs {default}"


def test_cache_guide_string_forms_parse():
    from fastwan.cache import parse_cache

    text = flat(DOCS["docs/step-caching.md"])
    types = "first_block|teacache|magcache|taylorseer|skip_steps"
    forms = re.findall(rf"[`\"](?:--cache )?((?:{types}):[^`\"@]+)[`\"]", text)
    assert len(forms) >= 3, forms
    for form in forms:
        assert parse_cache(form) is not None, form


def test_error_classes_are_the_builtins_the_guide_names():
    import builtins

    import fastwan.errors

    text = flat(DOCS["docs/usage.md"])
    pairs = re.findall(r"`(\w+)`(?: and `(\w+)`)? an? `(\w+Error)`", text.split("Bad input raises", 1)[1][:600])
    named = {cls for a, b, _ in pairs for cls in (a, b) if cls}
    assert {"InvalidArgument", "InvalidArgumentType", "CheckpointError", "MissingFileError", "OutputPathError",
            "OutputExistsError"} <= named
    for a, b, builtin in pairs:
        for cls in filter(None, (a, b)):
            assert issubclass(getattr(fastwan.errors, cls), getattr(builtins, builtin)), (cls, builtin)
            assert issubclass(getattr(fastwan.errors, cls), fastwan.errors.UserError)


def test_image_sizes_round_down_to_the_latent_multiple():
    from PIL import Image

    from fastwan.pipelines.image import default_size

    assert "sides rounded down to multiples of 16 (32 for # TI2V-5B)" in flat(DOCS["docs/image-to-video.md"])
    image = Image.new("RGB", (200, 100))  # 2:1 (width x height)
    area = 480 * 832
    h, w = (area / 2) ** 0.5, (area * 2) ** 0.5  # 446.9 x 893.7 keeps the area and the aspect ratio
    assert default_size(image, area, 16) == (432, 880)  # rounded down, not to the nearest (448, 896)
    assert default_size(image, area, 32) == (416, 864)
    assert (432, 880) == (h // 16 * 16, w // 16 * 16) and (416, 864) == (h // 32 * 32, w // 32 * 32)
