"""bench/ keeps the house rules: one package whose modules import without TRL, no `sys.path` edits,
no import cycle, modules of at most 400 lines and functions of at most 50."""

import ast
import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
MODULES = sorted(p.stem for p in BENCH.glob("*.py") if p.stem != "__init__")


def bench_imports(path: Path) -> set[str]:
    """The bench modules a file imports (at any depth)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("bench."):
            out.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[1] for a in node.names if a.name.startswith("bench.")}
    return out


@pytest.mark.parametrize("name", MODULES)
def test_every_module_imports_without_trl(name):
    importlib.import_module(f"bench.{name}")


def test_no_path_edits_and_sizes_within_the_house_limits():
    bad = []
    for path in sorted(BENCH.glob("*.py")):
        text = path.read_text()
        if "sys.path" in text:
            bad.append(f"{path.name} edits sys.path")
        if len(text.splitlines()) > 400:
            bad.append(f"{path.name}: {len(text.splitlines())} lines > 400")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 50:
                bad.append(f"{path.name}:{node.lineno} {node.name}() is {node.end_lineno - node.lineno + 1} lines")
    assert not bad, "\n".join(bad)


def test_no_import_cycle():
    graph = {name: bench_imports(BENCH / f"{name}.py") - {name} for name in MODULES}

    def reaches(start: str, goal: str, seen: set) -> bool:
        return any(nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})) for nxt in graph[start])

    cycles = [name for name in MODULES if reaches(name, name, {name})]
    assert not cycles, f"bench modules in an import cycle: {cycles}"
