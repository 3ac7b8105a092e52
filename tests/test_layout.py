"""Rules of the source tree: imports run down the declared layers (:data:`LAYERS`) and form no cycle inside
fastwan, environment variables read only in fastwan/envs.py, no ``global`` statements, no source file over 500
lines, no ``sys.path`` edits, the library never imports the test suite, and test files are named for what they
test and sit in its folder."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fastwan"
MAX_LINES = 500


def module_names() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _lazy_export_nodes(tree: ast.Module) -> set[int]:
    """The nodes inside a module-level ``__getattr__`` (PEP 562 lazy re-exports: the names a package hands on when
    first asked for, which its own code does not use)."""
    return {id(n) for top in tree.body if isinstance(top, ast.FunctionDef) and top.name == "__getattr__"
            for n in ast.walk(top)}


def _imported(nodes, mods: dict[str, Path], mod: str) -> set[str]:
    """The fastwan modules (keys of ``mods``) other than ``mod`` that the import statements among ``nodes`` name."""
    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    out = set()
    for node in nodes:
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fastwan"):
            names = [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("fastwan")]
        out |= {target for target in map(owner, names) if target and target != mod}
    return out


def import_graph(mods: dict[str, Path], *, lazy_exports: bool = True) -> dict[str, set[str]]:
    """module -> the fastwan modules it imports anywhere in its body (function-level imports too; those of a
    module-level ``__getattr__`` only with ``lazy_exports``)."""
    graph = {}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text())
        skip = set() if lazy_exports else _lazy_export_nodes(tree)
        graph[mod] = _imported((n for n in ast.walk(tree) if id(n) not in skip), mods, mod)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    assert cycles(import_graph(module_names())) == []


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# The layers of fastwan, lowest first: a module may import from its own layer and the ones below, never from one
# above. A module belongs to the entry naming it or its closest package ("fastwan" alone: the package's own
# __init__). Checkpoint I/O spans two layers: its file and safetensors readers sit below the models, which load
# through them; resolving a checkpoint reads the models' configs, so it sits above them.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("fastwan", "fastwan.errors", "fastwan.values", "fastwan.fields", "fastwan.hooks", "fastwan.quiet"),
    ("fastwan.envs",),
    ("fastwan.checkpoint.files", "fastwan.checkpoint.safetensors"),
    ("fastwan.kernels",),
    ("fastwan.options", "fastwan.cache", "fastwan.offload"),
    ("fastwan.attention",),
    ("fastwan.parallel",),
    ("fastwan.models",),
    ("fastwan.vae",),
    ("fastwan.lora",),
    ("fastwan.checkpoint",),
    ("fastwan.models.wan.export", "fastwan.offload.placement"),
    ("fastwan.pipelines",),
    ("fastwan.envinfo", "fastwan.profiler"),
    ("fastwan.cli", "fastwan.__main__", "fastwan.cli_reference", "fastwan.serve"),
)


def layer_of(module: str, layers=LAYERS) -> int | None:
    """The index in ``layers`` of the entry that names ``module`` or its closest package; None: undeclared."""
    best = None
    for i, entries in enumerate(layers):
        for entry in entries:
            if module == entry or (entry != "fastwan" and module.startswith(entry + ".")):
                if best is None or len(entry) > best[1]:
                    best = (i, len(entry))
    return None if best is None else best[0]


def layer_problems(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    """Every module no layer declares, and every import from a higher layer than the importer's."""
    problems = [f"{m}: in no layer; add it to LAYERS" for m in sorted(graph) if layer_of(m, layers) is None]
    for mod in sorted(graph):
        low = layer_of(mod, layers)
        problems += [f"{mod} (layer {low}) imports {t} (layer {layer_of(t, layers)}), a higher layer"
                     for t in sorted(graph[mod]) if low is not None and (layer_of(t, layers) or 0) > low]
    return problems


def test_imports_run_down_the_layers():
    assert layer_problems(import_graph(module_names(), lazy_exports=False)) == []


def test_layer_check_finds_upward_imports_and_undeclared_modules():
    layers = (("fastwan", "fastwan.errors"), ("fastwan.models", "fastwan.models.io"), ("fastwan.models.wan.export",),
              ("fastwan.pipelines",))
    graph = {"fastwan.errors": set(), "fastwan.models.io": {"fastwan.errors"},
             "fastwan.models.wan.export": {"fastwan.models.io", "fastwan.pipelines.checkpoint"},
             "fastwan.models.wan.config": {"fastwan.models.wan.export"}, "fastwan.pipelines.checkpoint": set(),
             "fastwan.extra": set()}
    assert layer_problems(graph, layers) == [
        "fastwan.extra: in no layer; add it to LAYERS",
        "fastwan.models.wan.config (layer 1) imports fastwan.models.wan.export (layer 2), a higher layer",
        "fastwan.models.wan.export (layer 2) imports fastwan.pipelines.checkpoint (layer 3), a higher layer",
    ]


def test_package_inits_import_lazily_across_their_layers():
    """Importing a module runs its packages' ``__init__`` first, so a package whose modules lie in several layers
    imports (at module level) nothing above its lowest module's layer."""
    mods = module_names()
    problems = []
    for pkg, path in mods.items():
        if path.name != "__init__.py":
            continue
        lowest = min(layer_of(m) or 0 for m in mods if m == pkg or m.startswith(pkg + "."))
        eager = _imported(ast.parse(path.read_text()).body, mods, pkg)  # module-level statements only
        problems += [f"{pkg}/__init__ imports {t} (layer {layer_of(t)}) at import time; its modules start at "
                     f"layer {lowest}" for t in sorted(eager) if (layer_of(t) or 0) > lowest]
    assert problems == []


def sources(*folders: str):
    for folder in folders:
        yield from (ROOT / folder).rglob("*.py")


def test_environment_read_only_in_envs():
    env = re.compile(r"os\.environ|os\.getenv|getenv\(")
    found = [f"{p.relative_to(ROOT)}:{i}" for p in sources("fastwan") if p.name != "envs.py"
             for i, line in enumerate(p.read_text().splitlines(), 1) if env.search(line)]
    assert found == []


@pytest.mark.parametrize("folder", ["fastwan", "benchmarks", "tests", "examples"])
def test_no_global_statements_no_path_edits_no_long_files(folder):
    problems = []
    for path in sources(folder):
        text = path.read_text()
        tree = ast.parse(text)
        problems += [f"{path.relative_to(ROOT)}:{n.lineno} global" for n in ast.walk(tree) if isinstance(n, ast.Global)]
        if "sys.path" in text and path != Path(__file__):
            problems.append(f"{path.relative_to(ROOT)}: sys.path")
        if len(text.splitlines()) > MAX_LINES:
            problems.append(f"{path.relative_to(ROOT)}: {len(text.splitlines())} lines")
    assert problems == []


def test_library_does_not_import_tests():
    graph_text = "\n".join(p.read_text() for p in sources("fastwan"))
    assert not re.search(r"^\s*(from|import) tests\b", graph_text, re.M)


# Rule: a test file is named for the capability it tests, never for an activity, and a capability with its own
# folder under tests/ keeps its test files there, not in tests/ or tests/pipelines/.
ACTIVITY_WORDS = ("audit", "robustness", "combos", "combinations", "misc")


def misnamed_tests(files: list[str], folders: set[str]) -> list[str]:
    """The paths (relative to tests/) among ``files`` that are named for an activity, or that sit in tests/ or
    tests/pipelines/ under the name of another folder of ``folders`` (its name or its singular first)."""
    problems = []
    for rel in files:
        parts = rel.split("/")
        words = parts[-1].removesuffix(".py").split("_")
        if words[0] != "test":
            continue
        problems += [f"{rel}: named for an activity ({w!r})" for w in words if w in ACTIVITY_WORDS]
        if len(parts) == 1 or parts[:-1] == ["pipelines"]:
            owner = next((f for f in sorted(folders) if len(words) > 1 and words[1] in (f, f.removesuffix("s"))
                          and f != parts[0]), None)
            if owner:
                problems.append(f"{rel}: belongs in tests/{owner}/")
    return problems


def test_test_files_are_named_for_a_capability_and_sit_in_its_folder():
    tests = ROOT / "tests"
    folders = {p.parent.name for p in tests.glob("*/__init__.py")}
    files = sorted(str(p.relative_to(tests)) for p in tests.rglob("test_*.py"))
    assert misnamed_tests(files, folders) == []


def test_test_name_rule_finds_activities_and_misplaced_files():
    folders = {"lora", "cli", "samplers", "pipelines"}
    files = ["test_cli.py", "test_envs_audit.py", "pipelines/test_lora_inputs.py", "pipelines/test_sampler_x.py",
             "pipelines/test_cfg.py", "lora/test_lora_robustness_combos.py", "lora/test_lora.py", "test_docs.py",
             "cli/helpers.py", "pipelines/test_pipelines_parity.py"]
    assert misnamed_tests(files, folders) == [
        "test_cli.py: belongs in tests/cli/",
        "test_envs_audit.py: named for an activity ('audit')",
        "pipelines/test_lora_inputs.py: belongs in tests/lora/",
        "pipelines/test_sampler_x.py: belongs in tests/samplers/",
        "lora/test_lora_robustness_combos.py: named for an activity ('robustness')",
        "lora/test_lora_robustness_combos.py: named for an activity ('combos')",
    ]
