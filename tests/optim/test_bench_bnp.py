"""Smoke test of benchmarks/bench_bnp.py (timings are measured and printed, never asserted)."""
from __future__ import annotations

from benchmark_loader import load_benchmark


def test_bench_quick_runs(capsys):
    bench = load_benchmark("bench_bnp")
    assert bench.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "BNP/SGD" in out and "BNP/BN" in out and "floor/SGD" in out and "auto/SGD" in out
    assert "phases" in out


def test_bench_batch_size_one_has_no_bn_column(capsys):
    # BN cannot run on one sample: at B = 1 the BN variant is left out and its ratios print as nan.
    bench = load_benchmark("bench_bnp")
    assert bench.main(["--quick", "--json"]) == 0
    import json

    rows = json.loads(capsys.readouterr().out)["rows"]
    one = next(r for r in rows if r["batch_size"] == 1)
    assert "bn" not in one["step_s"] and "bnp/bn" not in one["ratios"] and one["ratios"]["bnp/sgd"] > 0
    assert "bn" in next(r for r in rows if r["batch_size"] == 4)["step_s"]
