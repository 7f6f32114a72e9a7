"""benchmarks/bench_theory.py: its direct Monte Carlo baseline estimates the right quantities, and --quick runs.

The ratios are measured there, never asserted.  What is tested here is that the baseline is a fair one:
its per-sample statistics (exact traces from the network map's Jacobian) are unbiased estimators of the
quantities analyze returns, so the samples it needs for 1e-3 are those of the same quantities.
"""
import os
import pathlib
import subprocess
import sys

import pytest
from benchmark_loader import load_benchmark


@pytest.mark.parametrize("jacobian", ["autograd", "analytic"])
@pytest.mark.parametrize("spec,b", [(dict(phi="relu", beta=1.0), 8), (dict(phi="tanh"), 6)])
def test_direct_montecarlo_estimates_the_theory(spec, b, jacobian):
    # every estimate within 4 of its standard errors of analyze's value (routes accurate to ≤ 1e-9, far below
    # the standard errors of 4000 samples): P(|z| > 4) ≈ 6e-5 per quantity for the fixed seed's draw.  A wrong
    # trace (e.g. G∘G instead of G in the forward L trace: z = −88 for relu(x + 1) at B = 8) fails it
    from bnlab.activations import get_activation
    from bnlab.theory import analyze

    bench = load_benchmark("bench_theory")
    d = dict(spec)
    act = get_activation(d.pop("phi"), **d)
    res = analyze(act, b)
    rows, per_sample = bench.direct_montecarlo(act, b, res, 4000, seed=3, chunk=1000, jacobian=jacobian)
    assert per_sample > 0
    assert [r[0] for r in rows] == ["q*", "c*", "λ_L↑", "λ_M↑", "λ_G↓", "λ_L↓", "λ_M↓", "c_CB*", "λ_M̃"]
    for name, value, se, want, _ in rows:
        assert se > 0 or abs(want) < 1e-12, name
        assert abs(value - want) <= 4.0 * se + 1e-12, (name, value, want, se)


@pytest.mark.slow  # ≈ 30 s: analyze timings and Monte Carlo pilots for two φ
def test_bench_theory_quick_runs():
    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "bench_theory.py"
    out = subprocess.run([sys.executable, str(path), "--quick"], capture_output=True, text=True,
                         env=dict(os.environ), timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "SIDE BY SIDE" in out.stdout and "relu(x+1)" in out.stdout and "RATIO" in out.stdout
