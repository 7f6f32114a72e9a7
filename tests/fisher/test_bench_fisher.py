"""Smoke test of benchmarks/bench_fisher.py (timings are measured, never asserted) and of its baseline."""

import pytest
import torch

from bnlab.fisher import build_model, curvature_spectrum
from benchmark_loader import load_benchmark


def test_power_iteration_baseline_finds_the_same_lambda_max():
    # the baseline is a correct (if slower) method: its stopping rule (value change < 1e-3) leaves
    # an error of that order, so 1e-2 relative against Lanczos at tol 1e-10 (float64) is its budget
    bench = load_benchmark("bench_fisher")
    model = build_model("fc:10-16-16-3", seed=0, dtype=torch.float64)
    x = torch.randn(16, 10, dtype=torch.float64)
    y = torch.arange(16) % 3
    lam, n = bench.power_iteration_lambda_max(model, x, y)
    ref = curvature_spectrum(model, x, y, curvature="hessian", loss="cross_entropy", bn_mode="eval", tol=1e-10)
    assert 1 <= n <= 100
    assert lam == pytest.approx(ref.lambda_max, rel=1e-2)


def test_bench_quick_runs(capsys):
    bench = load_benchmark("bench_fisher")
    bench.main(["--quick"])
    out = capsys.readouterr().out
    assert "power iteration" in out and "speed-up" in out
    bench.main(["--quick", "--gradient-start"])
    assert "speed-up" in capsys.readouterr().out
