"""Smoke test of benchmarks/bench_nets.py --quick (the ratios are measured and printed, never asserted)."""
import importlib.util
import pathlib

import torch

from bnlab.nets import NORMALIZATIONS


def test_bench_quick_runs_and_times_every_normalization(capsys):
    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "bench_nets.py"
    spec = importlib.util.spec_from_file_location("bench_nets", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    module.main(["--quick"])
    assert torch.get_num_threads() == threads
    out = capsys.readouterr().out
    for name in NORMALIZATIONS:
        assert f"\n{name} " in out
    assert "matmuls" in out and "train() loop" in out
