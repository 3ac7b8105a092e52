"""The documentation as a user reads it, checked against what the code does, so that either side drifting fails
here: README.md (short, its Python block runs, the test command CI runs, a link to every guide), docs/cli.md (exactly
what ``python -m fastwan.cli_reference`` renders from the commands' parsers and the request's fields),
docs/environment.md (every variable fastwan/envs.py reads, with the values it accepts), docs/architecture.md (every
folder and module of the package and every test folder named), and every relative link and named path of
README.md and docs/*.md. Each guide's own facts: tests/test_guides.py."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import numpy as np
import pytest

from fastwan import cli, envs
from fastwan.checkpoint.tiny import TINY_IDS
from fastwan.errors import InvalidArgument
from fastwan.profiler import cli as profiler_cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = {p.relative_to(ROOT).as_posix(): p.read_text(encoding="utf-8")
        for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}
README = DOCS["README.md"]
GUIDES = {name: text for name, text in DOCS.items() if name.startswith("docs/")}


def section(text: str, title: str) -> str:
    """``text``'s part under the heading ``## title`` (up to the next ``## `` heading)."""
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def flat(text: str) -> str:
    return " ".join(text.split())


def code_blocks(text: str, lang: str | None = None) -> list[str]:
    """The fenced code blocks of ``text`` (of language ``lang`` when given), in order."""
    return [body for tag, body in re.findall(r"^```(\w*)\n(.*?)^```[ \t]*$", text, re.S | re.M)
            if lang is None or tag == lang]


def table_rows(text: str) -> list[list[str]]:
    """The body rows of the first Markdown table in ``text``, as stripped cells."""
    lines = text[text.index("\n|") + 1:].split("\n\n")[0].splitlines()
    return [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in lines[2:]]


def help_flags(argv: list[str], capsys, main=cli.main) -> set[str]:
    """The long options ``argv``'s --help output lists (the option columns, help texts left out)."""
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    columns = [ln.strip().split("  ")[0] for ln in capsys.readouterr().out.splitlines() if ln.startswith("  -")]
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", " ".join(columns))) - {"--help"}


# ---- README ------------------------------------------------------------------------------------------------


def test_readme_is_short_and_keeps_the_test_command():
    assert len(README.splitlines()) <= 150
    (block,) = code_blocks(section(README, "Run the tests"), "bash")
    assert block.splitlines() == ['pip install -e ".[test]"', "python -m pytest -q"]  # what CI runs


def test_readme_links_every_guide():
    linked = set(re.findall(r"\]\((docs/[\w.-]+\.md)", README))
    assert linked == set(GUIDES), sorted(set(GUIDES) ^ linked)


def test_readme_python_api_block_runs_as_written(tiny_ckpts, tmp_path, monkeypatch):
    """The README's Python block with a tiny checkpoint for the Hub id (and a small video): every line runs, and the
    result fields hold what the comments say."""
    block = code_blocks(section(README, "Python API"), "python")[0]
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


# ---- links and names ---------------------------------------------------------------------------------------


def anchors(text: str) -> set[str]:
    """The anchors of ``text``'s headings as GitHub makes them (lower case, punctuation dropped, spaces to '-')."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", text, flags=re.S), re.M)}


def test_anchor_rule():
    assert anchors("# A `python -m x.y` b\n## What has run, and what not?\n") == {
        "a-python--m-xy-b", "what-has-run-and-what-not"}


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_relative_links_resolve(doc):
    here = (ROOT / doc).parent
    for target in re.findall(r"\]\(([^)\s]+)\)", DOCS[doc]):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (here / path).resolve() if path else ROOT / doc
        assert dest.exists(), f"{doc} links {target}: {dest} does not exist"
        if anchor:
            assert anchor in anchors(dest.read_text(encoding="utf-8")), f"{doc} links {target}: no such heading"


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_documented_paths_and_names_exist(doc):
    import importlib

    text = DOCS[doc]
    for path in set(re.findall(r"\b(?:fastwan|benchmarks|examples|docs|tests)/[\w/.-]*\w", text)):
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


def test_architecture_names_every_folder_and_module():
    text = DOCS["docs/architecture.md"]
    package = ROOT / "fastwan"
    folders = [p.parent.relative_to(ROOT).as_posix() + "/" for p in package.rglob("__init__.py") if p.parent != package]
    modules = [p.relative_to(ROOT).as_posix() for p in package.glob("*.py") if p.name != "__init__.py"]
    tests = [f"tests/{p.parent.name}/" for p in (ROOT / "tests").glob("*/__init__.py")]
    missing = [name for name in folders + modules + tests if f"`{name}`" not in text]
    assert not missing, f"docs/architecture.md does not name {missing}"
    for name in ("GenerationRequest", "resolve_request", "gen.generate", "LoadOptions", "VideoGenerator.load"):
        assert name in text  # where the options enter


# ---- the command-line reference ----------------------------------------------------------------------------


def test_cli_reference_is_the_generated_one():
    from fastwan.cli_reference import REGENERATE, render

    assert DOCS["docs/cli.md"] == render(), f"docs/cli.md is stale: run `{REGENERATE}`"


def reference_rows(command: str) -> dict[str, str]:
    """docs/cli.md's rows under ``command``'s heading: {each long flag of the first cell: the whole row}."""
    rows = {}
    for line in section(DOCS["docs/cli.md"], f"`{command}`").splitlines():
        if line.startswith("| `-"):
            for flag in re.findall(r"--[a-z][a-z0-9-]*", line.split(" | ")[0]):
                rows[flag] = line
    return rows


@pytest.mark.parametrize("command, argv, main", [
    ("fastwan generate", ["generate"], cli.main), ("fastwan quantize", ["quantize"], cli.main),
    ("fastwan env", ["env"], cli.main), ("python -m fastwan.profiler", [], profiler_cli.main)])
def test_cli_reference_lists_exactly_the_flags_of_each_command(command, argv, main, capsys):
    documented, real = set(reference_rows(command)), help_flags(argv, capsys, main)
    assert documented == real, f"only in docs/cli.md: {sorted(documented - real)}; only in --help: " \
                               f"{sorted(real - documented)}"
    assert len(real) > 3


def test_cli_reference_rows_hold_each_field_help_and_name():
    """A field's help edited without regenerating docs/cli.md fails here as well as above."""
    from fastwan.fields import options
    from fastwan.pipelines.load_options import LoadOptions
    from fastwan.pipelines.params import GenerationRequest

    rows = reference_rows("fastwan generate")
    for cls in (GenerationRequest, LoadOptions):
        for f, opt in options(cls):
            if opt.flag is not None:
                assert flat(opt.help).replace("|", "\\|") in rows[opt.flag], (cls.__name__, f.name)
                assert f"`{cls.__name__}.{f.name}`" in rows[opt.flag]


def test_model_help_names_every_tiny_model():
    from fastwan.fields import options
    from fastwan.pipelines.load_options import LoadOptions

    (model,) = [opt for f, opt in options(LoadOptions) if f.name == "model"]
    assert set(re.findall(r"tiny[\w.-]*", model.help)) == set(TINY_IDS)


def test_attention_config_help_says_inline_json_works():
    # the guides: attention_config is a dict, JSON string or file; the CLI passes the text on (inline JSON works)
    from fastwan.fields import options
    from fastwan.pipelines.load_options import LoadOptions

    (config,) = [opt for f, opt in options(LoadOptions) if f.name == "attention_config"]
    assert "inline" in config.help or "JSON string" in config.help, config.help


# ---- environment variables ---------------------------------------------------------------------------------
ENVIRONMENT = DOCS["docs/environment.md"]


def env_rows() -> dict[str, str]:
    """docs/environment.md's table: {variable named in the first column: its meaning}."""
    out = {}
    for first, meaning in table_rows(ENVIRONMENT):
        for name in re.findall(r"`([A-Z][A-Z0-9_]+)`", first):
            out[name] = meaning
    return out


def test_every_variable_envs_reads_is_documented():
    """Every variable name in envs.py's code (its string constants) has a row, and the table names no other."""
    tree = ast.parse((ROOT / "fastwan" / "envs.py").read_text(encoding="utf-8"))
    named = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
             and re.fullmatch(r"[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)*", n.value) and len(n.value) > 3}
    assert set(envs.KNOWN_VARIABLES) <= named
    assert set(env_rows()) == named, sorted(set(env_rows()) ^ named)
    assert envs.torchrun_env({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}) == (1, 1, 2)
    assert envs.torchrun_env({"WORLD_SIZE": "2", "RANK": "1"}) == (1, 1, 2)  # LOCAL_RANK defaults to RANK
    assert set(envs.NO_MULTICAST) <= set(env_rows())


def test_env_table_values_are_the_ones_envs_accepts():
    from fastwan.attention.registry import BACKENDS, create_backend

    rows = env_rows()
    backends = set(re.findall(r"`([A-Z][A-Z0-9_]+)`", rows["FASTVIDEO_ATTENTION_BACKEND"].split(".")[0]))
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
    for word in re.findall(r"(\w+)/(\w+)", rows["FASTVIDEO_NVFP4_FA4"].split("A boolean:")[1]):
        assert [envs.nvfp4_fa4({"FASTWAN_NVFP4_FA4": w}) for w in word] == [True, False]
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
    # the multicast switches: the values the table gives
    values = re.findall(r"`(\d)`", rows["NCCL_NVLS_ENABLE"])
    assert dict(zip(envs.NO_MULTICAST, values)) == envs.NO_MULTICAST
