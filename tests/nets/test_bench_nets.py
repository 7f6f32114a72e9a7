"""Smoke test of benchmarks/bench_nets.py --quick (the ratios are measured and printed, never asserted)."""
import torch

from bnlab.nets import NORMALIZATIONS
from benchmark_loader import load_benchmark


def test_bench_quick_runs_and_times_every_normalization(capsys):
    module = load_benchmark("bench_nets")
    threads = torch.get_num_threads()
    module.main(["--quick"])
    assert torch.get_num_threads() == threads
    out = capsys.readouterr().out
    for name in NORMALIZATIONS:
        assert f"\n{name} " in out
    assert "matmuls" in out and "train() loop" in out
