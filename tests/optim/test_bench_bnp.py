"""Smoke test of benchmarks/bench_bnp.py (timings are measured and printed, never asserted)."""
from __future__ import annotations

from benchmark_loader import load_benchmark


def test_bench_quick_runs(capsys):
    bench = load_benchmark("bench_bnp")
    assert bench.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "BNP/SGD" in out and "BNP/BN" in out and "floor/SGD" in out and "auto/SGD" in out
    assert "phases" in out
