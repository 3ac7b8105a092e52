"""The documentation as a user runs it: README.md's command synopsis, preset table, model list, environment
variable table and Python API block are checked against what the code does (the argparse parsers' usage, the
presets a checkpoint resolves to, fastwan/envs.py's parsers, the generator's signatures and results), so that
either side drifting fails here."""
from __future__ import annotations

import inspect
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from fastwan import cli, envs
from fastwan.errors import InvalidArgument
from fastwan.profiler import cli as profiler_cli
from fastwan.checkpoint.tiny import TINY_IDS, tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def section(title: str) -> str:
    """README's text under the heading ``## title`` (up to the next ``## `` heading)."""
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end if end >= 0 else None]


def code_blocks(text: str, lang: str = "") -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def table_rows(text: str) -> list[list[str]]:
    """The body rows of the first Markdown table in ``text``, as stripped cells."""
    lines = text[text.index("\n|") + 1:].split("\n\n")[0].splitlines()
    return [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in lines[2:]]


def usage_flags(argv: list[str], capsys, main=cli.main) -> set[str]:
    """The long options in the ``usage:`` part of ``argv``'s --help output (help texts left out)."""
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    usage = capsys.readouterr().out.split("\n\n")[0]
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", usage)) - {"--help"}


def synopsis() -> dict[str, set[str]]:
    """README's "Command line" block: {command: its long options}, comments left out."""
    (block,) = code_blocks(section("Command line"))
    out: dict[str, set[str]] = {}
    command = None
    for line in block.splitlines():
        line = line.split("#")[0]
        m = re.match(r"(fastwan \w+|python -m fastwan\.profiler)", line)
        if m:
            command = m.group(1)
        out.setdefault(command, set()).update(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", line))
    return out


# ---- command line ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["generate", "quantize", "env"])
def test_readme_synopsis_lists_exactly_the_cli_flags(command, capsys):
    documented = synopsis()[f"fastwan {command}"]
    real = usage_flags([command], capsys)
    assert documented == real, (f"only in README: {sorted(documented - real)}; "
                                f"only in `fastwan {command} --help`: {sorted(real - documented)}")


def test_readme_profiler_line_names_real_flags(capsys):
    documented = synopsis()["python -m fastwan.profiler"]
    real = usage_flags([], capsys, main=profiler_cli.main)
    assert documented and documented <= real, sorted(documented - real)


def test_cli_model_help_names_every_tiny_model(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # help lines unwrapped (argparse breaks lines at hyphens)
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    listed = set(re.findall(r"tiny[\w.-]*", text.split("--model MODEL", 2)[2].split("--revision")[0]))
    assert listed == set(TINY_IDS)


def test_cli_attention_config_help_says_inline_json_works(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")
    # README: attention_config is a dict, JSON string or file; the CLI passes the text on (inline JSON works)
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    help_text = text.split("--attention-config ATTENTION_CONFIG", 2)[2].split("--compile")[0]
    assert "inline" in help_text or "JSON string" in help_text, help_text


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


# ---- models and presets ------------------------------------------------------------------------------------


def test_readme_model_list_names_every_tiny_model():
    text = " ".join(section("Real weights").split())
    listed = text.split("or a tiny random checkpoint:", 1)[1].split(". ")[0]
    assert set(re.findall(r"`(tiny[\w.-]*)`", listed)) == set(TINY_IDS)


# README preset rows of real models -> (tiny checkpoint of that kind, folder name it is loaded from): a copy of
# a tiny checkpoint loaded by path (not by tiny name) gets the real model's preset, as a downloaded one would
REAL_ROWS = {
    "Wan2.1 T2V": ("tiny", "Wan2.1-T2V-1.3B-Diffusers"),
    "Wan2.2 T2V-A14B": ("tiny-wan2.2-a14b", "Wan2.2-T2V-A14B-Diffusers"),
    "Wan2.2 TI2V-5B": ("tiny-wan2.2-ti2v", "Wan2.2-TI2V-5B-Diffusers"),
    "Wan2.1 I2V 480P": ("tiny-wan2.1-i2v", "Wan2.1-I2V-14B-480P-Diffusers"),
    "Wan2.1 I2V 720P": ("tiny-wan2.1-i2v", "Wan2.1-I2V-14B-720P-Diffusers"),
    "Wan2.1 FLF2V": ("tiny-wan2.1-flf2v", "Wan2.1-FLF2V-14B-720P-Diffusers"),
    "Wan2.2 I2V-A14B": ("tiny-wan2.2-i2v-a14b", "Wan2.2-I2V-A14B-Diffusers"),
    "FastWan 2.1": ("tiny-fastwan2.1", "FastWan2.1-T2V-1.3B-Diffusers"),
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


def test_readme_preset_table_is_what_checkpoints_resolve_to(tmp_path):
    from fastwan.checkpoint.presets import PRESETS, PUBLISHED_MIN_WIDTH, checkpoint_preset
    from fastwan.checkpoint.resolver import resolve

    rows = table_rows(README.split("Presets (used for every argument left at `None`", 1)[1])
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


# ---- environment variables ---------------------------------------------------------------------------------


def env_rows() -> dict[str, str]:
    """README's environment table: {variable named in the first column: its meaning}."""
    out = {}
    for first, meaning in table_rows(section("Environment variables")):
        for name in re.findall(r"`([A-Z][A-Z0-9_]+)`", first):
            out[name] = meaning
    return out


def test_readme_env_table_is_the_variables_envs_reads():
    rows = env_rows()
    mentioned = set(re.findall(r"[A-Z][A-Z0-9]+(?:_[A-Z0-9]+)+", " ".join(rows.values()))) | set(rows)
    assert set(envs.KNOWN_VARIABLES) <= mentioned, sorted(set(envs.KNOWN_VARIABLES) - mentioned)
    fastwan_vars = {n for n in rows if n.startswith(("FASTWAN_", "FASTVIDEO_"))}
    assert fastwan_vars == {n for n in envs.KNOWN_VARIABLES if n.startswith(("FASTWAN_", "FASTVIDEO_"))}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):  # torchrun's, parsed by envs.torchrun_env
        assert name in rows
    assert envs.torchrun_env({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}) == (1, 1, 2)


def test_readme_env_table_values_are_the_ones_envs_accepts():
    from fastwan.attention.registry import BACKENDS, create_backend

    rows = env_rows()
    backends = set(re.findall(r"`([A-Z_]+)`", rows["FASTVIDEO_ATTENTION_BACKEND"].split(".")[0]))
    assert backends == set(BACKENDS)
    for name in backends:
        assert create_backend(envs.attention_backend({"FASTWAN_ATTENTION_BACKEND": name.lower()})).name == name
    kernels = re.findall(r"`(\w+)`", rows["FASTWAN_SDPA_KERNEL"].split(" for ")[0])
    assert tuple(kernels) == envs.SDPA_KERNELS
    for k in kernels:
        assert envs.sdpa_kernel({"FASTWAN_SDPA_KERNEL": k}) == k
    assert [envs.flash_attn_version({"FASTWAN_FLASH_ATTN_VERSION": v}) for v in "234"] == [2, 3, 4]
    with pytest.raises(InvalidArgument, match="FASTWAN_FLASH_ATTN_VERSION='1'"):
        envs.flash_attn_version({"FASTWAN_FLASH_ATTN_VERSION": "1"})
    # a fraction in [0, 1] under either spelling; both spellings set to different values is an error
    assert envs.cfg_gate_step({"FASTWAN_CFG_GATE_STEP": "0.25"}) == 0.25
    assert envs.cfg_gate_step({"FASTVIDEO_CFG_GATE_STEP": "1"}) == 1.0
    with pytest.raises(InvalidArgument):
        envs.cfg_gate_step({"FASTWAN_CFG_GATE_STEP": "1.5"})
    with pytest.raises(InvalidArgument):
        envs.attention_backend({"FASTVIDEO_ATTENTION_BACKEND": "TORCH_SDPA", "FASTWAN_ATTENTION_BACKEND": "SAGE_ATTN"})
    # an empty value means unset
    assert envs.attention_backend({"FASTVIDEO_ATTENTION_BACKEND": " "}) is None
    assert envs.sdpa_kernel({"FASTWAN_SDPA_KERNEL": ""}) == "auto"
    # FASTWAN_CACHE, else $XDG_CACHE_HOME/fastwan, else ~/.cache/fastwan
    assert envs.cache_dir({"FASTWAN_CACHE": "/a/b", "XDG_CACHE_HOME": "/x"}) == "/a/b"
    assert envs.cache_dir({"XDG_CACHE_HOME": "/x"}) == "/x/fastwan"
    assert envs.cache_dir({}) == str(Path("~/.cache/fastwan").expanduser())


# ---- Python API --------------------------------------------------------------------------------------------


def test_every_public_parameter_is_documented():
    from fastwan import VideoGenerator

    text = README
    for fn in (VideoGenerator.from_pretrained, VideoGenerator.generate_video, VideoGenerator.load_lora):
        missing = [p for p in inspect.signature(fn).parameters
                   if p not in ("self", "cls", "model", "prompt", "path") and not re.search(rf"\b{p}\b", text)]
        assert not missing, f"{fn.__name__}: {missing}"


def test_readme_python_api_block_runs_as_written(tiny_ckpts, tmp_path, monkeypatch):
    """The README's first Python block with a tiny checkpoint for the Hub id (and a small video): every line runs,
    and the result fields hold what the comments say."""
    block = code_blocks(section("Python API"), "python")[0]
    assert '"Wan-AI/Wan2.1-T2V-1.3B-Diffusers"' in block and 'output_path="outputs/")' in block
    block = block.replace('"Wan-AI/Wan2.1-T2V-1.3B-Diffusers"', repr(str(tiny_ckpts["wan2.1"])))
    block = block.replace('output_path="outputs/")',
                          'output_path="outputs/", height=32, width=32, num_frames=5, num_inference_steps=2)')
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)
    res = scope["res"]
    assert res.seed == 0
    assert res.frames.dtype == np.uint8 and res.frames.shape == (5, 32, 32, 3)
    video = Path(res.video_path)
    assert video.suffix == ".mp4" and video.parent.resolve() == (tmp_path / "outputs").resolve() and video.is_file()
    documented = re.search(r"res\.timings\s+# seconds: ([\w, ]+)", block).group(1).split(", ")
    assert list(res.timings) == documented
    assert all(isinstance(v, float) and v >= 0 for v in res.timings.values())
    assert res.timings["total"] >= res.timings["denoising"] + res.timings["decoding"]
    assert res.attention_backend.startswith("TORCH_SDPA")  # the kernel that ran on a CPU
    assert res.peak_memory is None  # on CPU


# ---- names the documents point at --------------------------------------------------------------------------

DOCS = {p.relative_to(ROOT).as_posix(): p.read_text(encoding="utf-8")
        for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_documented_paths_and_names_exist(doc):
    import importlib

    text = DOCS[doc]
    for path in set(re.findall(r"\b(?:fastwan|benchmarks|examples|docs)/[\w/.-]*\w", text)):
        assert (ROOT / path).exists(), f"{doc} names {path}, which does not exist"
    for dotted in set(re.findall(r"`(fastwan(?:\.\w+)+)`", text)):
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):  # the longest importable module, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            for name in parts[cut:]:
                assert hasattr(obj, name), f"{doc} names {dotted}: {'.'.join(parts[:cut])} has no {name}"
                obj = getattr(obj, name)
            break


def test_readme_sparse_attention_block_runs_as_written(tiny_ckpts):
    (block,) = code_blocks(section("Sparse video attention"), "python")
    scope = {"model": str(tiny_ckpts["wan2.1"])}
    exec(compile("from fastwan import VideoGenerator\n" + block, "README.md", "exec"), scope)
    res = scope["gen"].generate_video("a fox", seed=0, height=32, width=48, num_frames=5, num_inference_steps=1,
                                      save_video=False)
    assert res.attention_backend.startswith("SLIDING_TILE_ATTN") and res.frames.shape == (5, 32, 48, 3)


def test_readme_cli_process_counts(monkeypatch, tmp_path):
    """README "Several GPUs": --sp N is num_gpus=N; --sp S --cfg-parallel is num_gpus=2*S; --cfg-parallel alone 2."""
    from fastwan import VideoGenerator

    class Stop(Exception):
        pass

    seen = {}

    def fake_from_pretrained(model, **kw):
        seen.update(kw)
        raise Stop

    text = " ".join(README.split())
    assert ("`--sp S --cfg-parallel` is `num_gpus=2*S, cfg_parallel=True`, and `--cfg-parallel` alone `num_gpus=2`"
            in text)
    monkeypatch.setattr(VideoGenerator, "from_pretrained", fake_from_pretrained)
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for extra, expected in ((["--sp", "3"], (3, False)), (["--sp", "2", "--cfg-parallel"], (4, True)),
                            (["--cfg-parallel"], (2, True)), ([], (None, False))):
        with pytest.raises(Stop):
            cli.main(["generate", "--prompt", "x", "--output", str(tmp_path), *extra])
        assert (seen["num_gpus"], seen["cfg_parallel"]) == expected, extra


def test_readme_vae_chunk_auto_values():
    from fastwan.vae.decode import auto_chunk_frames

    text = " ".join(README.split())
    assert "2 at 480p and 1 from 720p" in text
    assert auto_chunk_frames(480, 832, 4) == 2
    assert auto_chunk_frames(720, 1280, 4) == 1


def test_readme_memory_plan_is_printed_by_the_cli_and_kept_in_python(monkeypatch, tmp_path, capsys):
    from fastwan import VideoGenerator
    from fastwan.offload.plan import OffloadPlan

    assert "`gen.memory_plan.describe()`" in README and callable(OffloadPlan.describe)

    class Plan:
        def describe(self):
            return "PLAN: text encoder offloaded"

    class Fake:  # a generator built with a budget: from_pretrained set memory_plan
        memory_plan, parallel = Plan(), None

        def generate_video(self, prompt, **kw):
            raise InvalidArgument("stop here")

    monkeypatch.setattr(VideoGenerator, "from_pretrained", lambda model, **kw: Fake())
    assert cli.main(["generate", "--prompt", "x", "--output", str(tmp_path)]) == 2
    assert "PLAN: text encoder offloaded" in capsys.readouterr().out.splitlines()


def test_readme_cache_signatures_match_the_classes():
    import ast
    import dataclasses

    import fastwan.cache

    text = " ".join(README.split())
    documented = re.findall(r"`(FirstBlockCache|MagCache|TeaCache|SkipSteps)\(([^`]*)\)`", text)
    assert {name for name, _ in documented} == {"FirstBlockCache", "MagCache", "TeaCache", "SkipSteps"}
    for name, args in documented:
        fields = {f.name: f.default for f in dataclasses.fields(getattr(fastwan.cache, name))}
        for arg in args.split(","):
            key, _, default = (s.strip() for s in arg.partition("="))
            assert key in fields, f"README's {name}({args}): {name} has no {key!r}"
            if default and name + key != "MagCachecalibrate":  # calibrate=True is an example, not the default
                assert fields[key] == ast.literal_eval(default), f"{name}.{key}: {fields[key]!r}, README {default}"


def test_readme_error_classes_are_the_builtins_it_names():
    import builtins

    import fastwan.errors

    text = " ".join(README.split())
    pairs = re.findall(r"`(\w+)`(?: and `(\w+)`)? an? `(\w+Error)`", text.split("Bad input raises", 1)[1][:600])
    named = {cls for a, b, _ in pairs for cls in (a, b) if cls}
    assert {"InvalidArgument", "InvalidArgumentType", "CheckpointError", "MissingFileError", "OutputPathError",
            "OutputExistsError"} <= named
    for a, b, builtin in pairs:
        for cls in filter(None, (a, b)):
            assert issubclass(getattr(fastwan.errors, cls), getattr(builtins, builtin)), (cls, builtin)
            assert issubclass(getattr(fastwan.errors, cls), fastwan.errors.UserError)


def test_readme_image_sizes_round_down_to_the_latent_multiple():
    from PIL import Image

    from fastwan.pipelines.image import default_size

    assert "sides rounded down to multiples of 16 (32 for # TI2V-5B)" in " ".join(README.split())
    image = Image.new("RGB", (200, 100))  # 2:1 (width x height)
    area = 480 * 832
    h, w = (area / 2) ** 0.5, (area * 2) ** 0.5  # 446.9 x 893.7 keeps the area and the aspect ratio
    assert default_size(image, area, 16) == (432, 880)  # rounded down, not to the nearest (448, 896)
    assert default_size(image, area, 32) == (416, 864)
    assert (432, 880) == (h // 16 * 16, w // 16 * 16) and (416, 864) == (h // 32 * 32, w // 32 * 32)
