"""Rules of the source tree: no import cycles inside fastwan, environment variables read only in fastwan/envs.py,
no ``global`` statements, no source file over 500 lines, no ``sys.path`` edits, and the library never imports
the test suite."""
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


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the fastwan modules it imports anywhere in its body (function-level imports too)."""
    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {m: set() for m in mods}
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fastwan"):
                names = [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("fastwan")]
            for name in names:
                target = owner(name)
                if target and target != mod:
                    graph[mod].add(target)
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
