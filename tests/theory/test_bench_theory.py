"""Smoke test of benchmarks/bench_theory.py --quick (the ratios are measured there, never asserted)."""
import os
import pathlib
import subprocess
import sys

import pytest


@pytest.mark.slow  # ≈ 30 s: Monte Carlo and autograd timings for two φ
def test_bench_theory_quick_runs():
    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "bench_theory.py"
    out = subprocess.run([sys.executable, str(path), "--quick"], capture_output=True, text=True,
                         env=dict(os.environ), timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "SIDE BY SIDE" in out.stdout and "relu(x+1)" in out.stdout
