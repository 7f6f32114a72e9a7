"""Smoke test of benchmarks/bench_bnp.py (timings are measured and printed, never asserted)."""
from __future__ import annotations

import importlib.util
import pathlib


def _load():
    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "bench_bnp.py"
    spec = importlib.util.spec_from_file_location("bench_bnp", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_quick_runs(capsys):
    bench = _load()
    assert bench.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "BNP/SGD" in out and "BNP/BN" in out and "floor/SGD" in out
