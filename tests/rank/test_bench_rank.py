"""Smoke test of benchmarks/bench_rank.py (timings are measured and printed, never asserted)."""

import pytest

from benchmark_loader import load_benchmark


def test_stack_benchmark_reports_every_function():
    bench = load_benchmark("bench_rank")
    out = bench.bench_stack(8, 6, 5, "cpu", repeats=1)
    for name in ("rank_measures", "soft_rank", "rank_lower_bound"):
        assert out[name]["batched_s"] > 0 and out[name]["loop_s"] > 0


@pytest.mark.slow  # a fresh interpreter importing torch: ~10–20 s on a busy 2-core machine
def test_depth_run_in_a_subprocess():
    out = load_benchmark("bench_rank").bench_depth(50, "cpu", 1, 1)
    assert out["depth"] == 50 and out["wall_s"] > 0 and out["mean_soft_rank"] >= 1
