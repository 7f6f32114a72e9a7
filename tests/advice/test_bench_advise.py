"""Smoke test of benchmarks/bench_advise.py (timings are measured and printed, never asserted)."""
import torch

from benchmark_loader import load_benchmark
from bnlab.nets import MLP


def test_a_case_reports_every_part_and_its_cpu_time():
    bench = load_benchmark("bench_advise")
    g = torch.Generator().manual_seed(0)
    data = (torch.randn(64, 12, generator=g), torch.randint(0, 3, (64,), generator=g))
    row = bench.run_case("tiny", lambda: MLP(12, [8, 8], 3, norm="bn", seed=0), data)
    assert set(row["cpu_s"]) == {"structure", "gradients", "learning_rate", "rank", "batch_size"}
    assert row["cpu_total_s"] > 0 and row["parameters"] > 0 and row["matvecs"] > 0
    assert set(bench.cases()) == {"bn-mlp", "small-cnn", "resnet20", "user-module"}
