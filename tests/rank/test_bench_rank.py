"""Smoke test of benchmarks/bench_rank.py (timings are measured and printed, never asserted)."""
import importlib.util
import pathlib

import pytest


def _load():
    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "bench_rank.py"
    spec = importlib.util.spec_from_file_location("bench_rank", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stack_benchmark_reports_every_function():
    bench = _load()
    out = bench.bench_stack(8, 6, 5, "cpu", repeats=1)
    for name in ("rank_measures", "soft_rank", "rank_lower_bound"):
        assert out[name]["batched_s"] > 0 and out[name]["loop_s"] > 0


@pytest.mark.slow  # a fresh interpreter importing torch: ~10–20 s on a busy 2-core machine
def test_depth_run_in_a_subprocess():
    out = _load().bench_depth(50, "cpu", 1, 1)
    assert out["depth"] == 50 and out["wall_s"] > 0 and out["mean_soft_rank"] >= 1
