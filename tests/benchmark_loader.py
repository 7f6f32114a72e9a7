"""Loading a benchmark script (benchmarks/bench_<part>.py is a script, not a package) for its smoke test."""
from __future__ import annotations

import importlib.util
import pathlib
from types import ModuleType

_BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """The module of ``benchmarks/<name>.py``, executed afresh (its ``main`` is not run)."""
    spec = importlib.util.spec_from_file_location(name, _BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
