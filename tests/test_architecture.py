"""The import rules of docs/architecture.md, enforced on the source.

Every module under bnlab/ is parsed with ``ast`` (nothing is imported, so the check costs
milliseconds and sees lazy imports inside functions too).  Each ``import``/``from … import``
that names a ``bnlab`` module is resolved to the module it reaches (relative imports included;
``from bnlab.sim import _linalg`` reaches ``bnlab.sim._linalg``) and checked against

* ``MAY_IMPORT``: which parts a part may import (the table in docs/architecture.md; a test
  below keeps the two identical);
* privacy: a name or module starting with ``_`` is private to its part — no other part imports
  it; inside ``reproductions`` each module is its own unit (a figure never imports another
  figure's private helpers).  ``bnlab._validation`` (the shared validation module) and
  ``bnlab._threads`` (the shared intra-op thread-count helper) are open to every part;
* ``NO_TORCH``: parts that are pure NumPy/SciPy and never import torch.

A subpackage's ``__init__`` may re-export anything inside its own folder (``bnlab.experiments``
re-exports ``build_report`` from the report part, which lives in that folder).

The checker is tested on synthetic sources that break each rule, so the rules can fail.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "bnlab"
DOC = ROOT / "docs" / "architecture.md"

#: part -> the parts it may import (besides itself and the shared ``_validation``).  The same table,
#: with the same words, is in docs/architecture.md ("What each part may import").
MAY_IMPORT: dict[str, frozenset[str]] = {
    "_validation": frozenset(),
    "_threads": frozenset(),
    "_vocabulary": frozenset(),
    "_run_length": frozenset(),
    "_inductor": frozenset(),
    "_kernel_cache": frozenset(),
    "_task_checkpoint": frozenset(),
    "activations": frozenset(),
    "theory": frozenset({"activations"}),
    "sim": frozenset({"activations"}),
    "data": frozenset(),
    "nets": frozenset({"activations", "data"}),
    "fisher": frozenset({"activations", "theory", "nets", "data"}),
    "rank": frozenset({"activations", "theory", "nets", "data"}),
    "optim": frozenset({"activations", "nets", "data"}),
    "compare": frozenset({"activations", "theory", "sim"}),
    "experiments": frozenset(),
    "advice": frozenset({"activations", "theory", "sim", "nets", "fisher", "rank", "optim", "data"}),
    "reproductions": frozenset({"activations", "theory", "sim", "nets", "fisher", "rank", "optim", "compare",
                                "data", "experiments", "advice"}),
    "claims": frozenset({"experiments"}),
    "report": frozenset({"experiments", "claims"}),
    "cli": frozenset({"activations", "theory", "sim", "nets", "fisher", "rank", "optim", "compare", "data",
                      "experiments", "reproductions", "report", "advice", "claims"}),
    "package": frozenset({"activations", "cli", "advice"}),  # bnlab/__init__.py (lazy subpackages) and __main__.py
}

#: Parts that are NumPy/SciPy only.  (``advice`` is torch, but owns no numerics: it calls the parts above.)
NO_TORCH = frozenset({"theory", "compare", "claims"})

#: Rules that hold once a pending move lands: (importer part, imported part) -> (file whose removal
#: completes the move, why).  While the file exists the rule's test is skipped with the reason.
PENDING: dict[tuple[str, str], tuple[str, str]] = {}

#: Private modules at the bottom that every part may import.
SHARED = frozenset({"bnlab._validation", "bnlab._threads", "bnlab._vocabulary", "bnlab._run_length",
                    "bnlab._inductor", "bnlab._kernel_cache", "bnlab._task_checkpoint"})


def part_of(module: str) -> str:
    """The part a dotted module name belongs to (``bnlab.experiments.report`` is the report part)."""
    bits = module.split(".")
    if len(bits) == 1 or bits[1] in ("__init__", "__main__"):
        return "package"
    if bits[1] == "experiments" and len(bits) > 2 and bits[2] == "report":
        return "report"
    if bits[1] == "_expression_kinks":  # the kink tracer of activations' expressions
        return "activations"
    return bits[1].removesuffix(".py")


def privacy_unit(module: str) -> str:
    """Private names are shared inside this unit: the part, or for reproductions the module itself."""
    part = part_of(module)
    return module if part == "reproductions" else part


@dataclass(frozen=True)
class Edge:
    importer: str  # dotted module doing the import
    target: str  # dotted module reached
    name: str | None  # the imported name (``from target import name``), if any
    line: int

    def __str__(self) -> str:
        what = f"{self.target}.{self.name}" if self.name else self.target
        return f"{self.importer}:{self.line} imports {what}"


def _is_package(module: str, known: set[str]) -> bool:
    return any(m.startswith(module + ".") for m in known)


def import_edges(module: str, source: str, known: set[str]) -> list[Edge]:
    """The bnlab modules (and names) ``module``'s source imports; ``known`` lists every bnlab module."""
    is_pkg = _is_package(module, known)
    package = module if is_pkg else module.rpartition(".")[0]
    edges: list[Edge] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "bnlab" or alias.name.startswith("bnlab."):
                    edges.append(Edge(module, alias.name, None, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not (target == "bnlab" or target.startswith("bnlab.")):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in known:  # ``from bnlab.sim import _linalg``: the module itself is reached
                    edges.append(Edge(module, sub, None, node.lineno))
                else:
                    edges.append(Edge(module, target, alias.name, node.lineno))
    return edges


def imports_torch(source: str) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "torch" for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "torch":
            lines.append(node.lineno)
    return lines


def _private(dotted: str) -> bool:
    return any(b.startswith("_") and not (b.startswith("__") and b.endswith("__")) for b in dotted.split(".")[1:])


def violations(edge: Edge, pending_ok: bool = True) -> list[str]:
    """Every rule ``edge`` breaks, as readable lines."""
    out = []
    src, dst = part_of(edge.importer), part_of(edge.target)
    if edge.target in SHARED or edge.target == "bnlab":
        return out
    if edge.target.startswith(edge.importer + ".") and _is_package(edge.importer, KNOWN):
        return out  # a subpackage's __init__ re-exports what lives inside it (experiments/ holds report)
    if dst != src and dst not in MAY_IMPORT[src]:
        if not (pending_ok and (src, dst) in PENDING and (ROOT / PENDING[(src, dst)][0]).exists()):
            out.append(f"{edge}: part {src!r} may not import part {dst!r} (allowed: {sorted(MAY_IMPORT[src])})")
    full = f"{edge.target}.{edge.name}" if edge.name else edge.target
    if privacy_unit(edge.importer) != privacy_unit(edge.target) and _private(full):
        out.append(f"{edge}: a private name of {privacy_unit(edge.target)!r} used outside it")
    return out


def _modules() -> dict[str, Path]:
    mods = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        bits = list(rel.parts)
        if bits[-1] == "__init__":
            bits = bits[:-1]
        mods[".".join(bits)] = path
    return mods


MODULES = _modules()
KNOWN = set(MODULES)
PARTS = sorted({part_of(m) for m in MODULES})


def _edges_of_part(part: str) -> list[Edge]:
    edges = []
    for mod, path in MODULES.items():
        if part_of(mod) == part:
            edges += import_edges(mod, path.read_text(encoding="utf-8"), KNOWN)
    return edges


def test_every_module_belongs_to_a_part_in_the_table():
    unknown = sorted(m for m in MODULES if part_of(m) not in MAY_IMPORT)
    assert not unknown, f"add these parts to MAY_IMPORT and docs/architecture.md: {unknown}"


@pytest.mark.parametrize("part", PARTS)
def test_part_imports_only_what_the_table_allows(part):
    broken = [v for e in _edges_of_part(part) for v in violations(e)]
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("rule", sorted(PENDING), ids=lambda r: f"{r[0]}-not-{r[1]}")
def test_pending_rules_once_their_move_landed(rule):
    path, why = PENDING[rule]
    if (ROOT / path).exists():
        pytest.skip(f"{path} still exists: {why}")
    src, dst = rule
    broken = [str(e) for e in _edges_of_part(src) if part_of(e.target) == dst]
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("part", sorted(NO_TORCH))
def test_numpy_parts_do_not_import_torch(part):
    hits = [f"{mod}:{line}" for mod, path in MODULES.items() if part_of(mod) == part
            for line in imports_torch(path.read_text(encoding="utf-8"))]
    assert not hits, f"{part} is NumPy/SciPy only; torch imported at {hits}"


def _doc_table() -> dict[str, frozenset[str]]:
    text = DOC.read_text(encoding="utf-8")
    section = text.split("## What each part may import", 1)[1].split("\n## ", 1)[0]
    table = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`") or set(cells[0]) <= set("-: "):
            continue
        part = cells[0].strip("`")
        allowed = frozenset(re.findall(r"`([a-z_]+)`", cells[1]))
        table[part] = allowed
    return table


def test_doc_table_mirrors_the_rules():
    assert _doc_table() == MAY_IMPORT


# --- the checker itself can fail: synthetic sources that break each rule -----------------------

FAKE_KNOWN = KNOWN | {"bnlab.reproductions.fig_a", "bnlab.reproductions.fig_b", "bnlab.nets", "bnlab.fisher"}


def _check(module: str, source: str) -> list[str]:
    return [v for e in import_edges(module, source, FAKE_KNOWN) for v in violations(e, pending_ok=False)]


@pytest.mark.parametrize("module, source, needle", [
    ("bnlab.sim.networks", "from bnlab.theory import analyze", "part 'sim' may not import part 'theory'"),
    ("bnlab.sim.networks", "def f():\n    import bnlab.theory.forward\n", "may not import part 'theory'"),
    ("bnlab.theory.forward", "from bnlab.nets import MLP", "part 'theory' may not import part 'nets'"),
    ("bnlab.theory.forward", "from bnlab.sim.networks import simulate", "may not import part 'sim'"),
    ("bnlab.nets", "from bnlab.fisher import spectrum", "part 'nets' may not import part 'fisher'"),
    ("bnlab.cli._cmd_theory", "from bnlab.theory._linalg import bsb", "private name of 'theory'"),
    ("bnlab.reproductions.fig_a", "from bnlab.reproductions.fig_b import _helper", "private name of"),
    ("bnlab.reproductions.fig_a", "from .fig_b import _helper", "private name of"),
    ("bnlab.cli._cmd_theory", "from bnlab.sim import _linalg", "private name of 'sim'"),
    ("bnlab.experiments.report", "from bnlab.theory import analyze", "part 'report' may not import part 'theory'"),
    ("bnlab.experiments.sweep", "from ..reproductions import yang2019_fig1", "'experiments' may not import"),
])
def test_checker_catches(module, source, needle):
    found = _check(module, source)
    assert any(needle in v for v in found), found


@pytest.mark.parametrize("module, source", [
    ("bnlab.sim.networks", "from bnlab._validation import check_int\nfrom bnlab.sim._linalg import gram"),
    ("bnlab.sim.networks", "from . import _linalg\nfrom .fit import fit_geometric_rate"),
    ("bnlab.reproductions.fig_a", "from bnlab.reproductions.trainability import heatmap"),
    ("bnlab.reproductions.fig_a", "from bnlab.theory import analyze\nfrom bnlab.experiments.spec import Experiment"),
    ("bnlab.cli._cmd_theory", "from bnlab.cli._common import print_json\nfrom bnlab import __version__"),
])
def test_checker_accepts(module, source):
    assert _check(module, source) == []


def test_torch_detector():
    assert imports_torch("import numpy\ndef f():\n    import torch.nn as nn\n") == [3]
    assert imports_torch("from torch import nn") == [1] and imports_torch("from .torchy import x") == []
