"""Smoke test of benchmarks/bench_trainability_groups.py (timings are measured and printed, never asserted)."""
from __future__ import annotations

import json

import pytest
from benchmark_loader import load_benchmark


def test_bench_quick_runs_both_sides_and_prints_the_ratios(capsys):
    out = load_benchmark("bench_trainability_groups").main(["--quick", "--json"])
    printed = json.loads(capsys.readouterr().out)
    assert set(printed["cpu_s"]) == {"one column at a time", "one ensemble"}
    assert all(v > 0 for v in printed["cpu_s"].values())
    assert printed["separate_over_ensemble"] == pytest.approx(
        printed["cpu_s"]["one column at a time"] / printed["cpu_s"]["one ensemble"])
    assert out["bmm_gflops"] > 0 and out["ensemble_over_bmm"] > 0


@pytest.mark.parametrize("arg", ["--steps=0", "--rounds=-1"])
def test_bad_counts_are_refused_naming_the_option(arg):
    with pytest.raises(SystemExit, match=arg.split("=")[0]):
        load_benchmark("bench_trainability_groups").main(["--quick", arg])
