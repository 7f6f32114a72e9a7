"""The layering of ``bnlab.theory`` (issue 25, item 1): a floor of quadrature rules under everything, no import
circle, no import back up, no function-local import of a bnlab module.

The modules are parsed with ``ast`` (nothing is imported), as in tests/test_architecture.py.  Printing the floors:
``python -m pytest tests/theory/test_structure.py -q -s -k floors``.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
THEORY = ROOT / "bnlab" / "theory"

#: the floor: quadrature rules, grids and weights (and the linear algebra and B checks beside them); it imports
#: nothing else from bnlab.theory
FLOOR = ("bnlab.theory._quadrature", "bnlab.theory._linalg", "bnlab.theory._checks")


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(THEORY.rglob("*.py"))}


def _resolve(importer: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(sources: dict[str, str], packages: set[str]) -> dict[str, set[str]]:
    """module -> the bnlab.theory modules it imports (a package's ``__init__`` stands for the package)."""
    known = set(sources)
    graph: dict[str, set[str]] = {m: set() for m in sources}
    for mod, src in sources.items():
        for node in ast.walk(ast.parse(src)):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(mod, node, mod in packages)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            for target in targets:
                if target in known and target != mod:
                    graph[mod].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A list of modules that import each other in a loop, or None (depth-first search)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """Floor 1: imports nothing of the graph; otherwise one above the highest floor it imports (acyclic graph)."""
    out: dict[str, int] = {}

    def level(m: str) -> int:
        if m not in out:
            out[m] = 1 + max((level(n) for n in graph[m]), default=0)
        return out[m]

    for m in graph:
        level(m)
    return out


def _theory_graph() -> dict[str, set[str]]:
    mods = _modules()
    packages = {m for m, p in mods.items() if p.name == "__init__.py"}
    sources = {m: p.read_text(encoding="utf-8") for m, p in mods.items()}
    graph = import_graph(sources, packages)
    # the package face bnlab/theory/__init__.py re-exports everything: it is the roof, not part of the layering
    graph.pop("bnlab.theory", None)
    for deps in graph.values():
        deps.discard("bnlab.theory")
    return graph


def _in_floor(m: str) -> bool:
    return any(m == f or m.startswith(f + ".") for f in FLOOR)


def test_no_import_circle_in_theory():
    # on main before issue 25 this found _dynamics_common -> fixed_point -> batchnorm_map -> fourier -> spherical
    # -> _kinks -> _dynamics_common
    cycle = find_cycle(_theory_graph())
    assert cycle is None, " -> ".join(cycle)


def test_the_floor_imports_nothing_above_it():
    graph = _theory_graph()
    broken = [f"{m} imports {n}" for m, deps in graph.items() if _in_floor(m) for n in deps
              if not (n.startswith("bnlab.theory._quadrature") and m.startswith("bnlab.theory._quadrature"))]
    assert not broken, broken


def test_every_route_module_stands_on_the_floor():
    # the quadrature floor is the lowest storey: every module that integrates takes its rules from it
    graph = _theory_graph()
    fl = floors(graph)
    assert all(fl[m] <= 2 for m in graph if m.startswith("bnlab.theory._quadrature")), {m: fl[m] for m in graph if _in_floor(m)}
    for m in ("bnlab.theory.gegenbauer", "bnlab.theory.spherical", "bnlab.theory.fourier", "bnlab.theory.vphi",
              "bnlab.theory.forward", "bnlab.theory.backward", "bnlab.theory.cross_batch", "bnlab.theory.epsilon"):
        reached = set()
        todo = [m]
        while todo:
            for n in graph[todo.pop()]:
                if n not in reached:
                    reached.add(n)
                    todo.append(n)
        assert any(n.startswith("bnlab.theory._quadrature") for n in reached), m


def function_local_bnlab_imports(source: str) -> list[tuple[int, str, str]]:
    """(line, function, module) of every ``bnlab`` import (absolute or relative) inside a function body."""
    hits = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] if not node.level else ["." * node.level + (node.module or "")]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            hits += [(node.lineno, fn.name, n) for n in names if n == "bnlab" or n.startswith(("bnlab.", "."))]
    return hits


def test_no_function_local_import_of_bnlab_in_theory():
    # a function-local import hides an arrow (and used to hide an import circle); only third-party modules that
    # are slow to import (scipy.stats, scipy.optimize, scipy.linalg) are imported where they are needed
    hits = [f"{mod}:{line} ({fn}) imports {name}" for mod, path in _modules().items()
            for line, fn, name in function_local_bnlab_imports(path.read_text(encoding="utf-8"))]
    assert not hits, hits


def test_floors(capsys):
    graph = _theory_graph()
    fl = floors(graph)
    with capsys.disabled():
        for m in sorted(graph, key=lambda m: (-fl[m], m)):
            print(f"floor {fl[m]:2d}  {m}  -> {', '.join(sorted(n.removeprefix('bnlab.theory.') for n in graph[m]))}")
    assert max(fl.values()) <= 10


# --- the checkers can fail ------------------------------------------------------------------------------------

def test_cycle_finder_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("source, target", [
    ("from bnlab.theory.forward import x", "bnlab.theory.forward"),
    ("from .forward import x", "bnlab.theory.forward"),
    ("from bnlab.theory._quadrature.rules import tanh_sinh_rule", "bnlab.theory._quadrature.rules"),
    ("def f():\n    from bnlab.theory import forward\n", "bnlab.theory.forward"),
])
def test_import_graph_sees_every_form_of_import(source, target):
    known = {"bnlab.theory.mod": source, "bnlab.theory.forward": "", "bnlab.theory._quadrature.rules": "",
             "bnlab.theory": ""}
    graph = import_graph(known, {"bnlab.theory"})
    assert target in graph["bnlab.theory.mod"]


@pytest.mark.parametrize("source, found", [
    ("def f():\n    from bnlab.theory.forward import x\n", True),
    ("def f():\n    import bnlab.activations\n", True),
    ("def f():\n    from . import forward\n", True),
    ("class A:\n    def m(self):\n        if True:\n            from bnlab import theory\n", True),
    ("from bnlab.theory.forward import x\ndef f():\n    return x\n", False),
    ("def f():\n    from scipy.optimize import brentq\n", False),
])
def test_function_local_import_finder(source, found):
    assert bool(function_local_bnlab_imports(source)) is found
