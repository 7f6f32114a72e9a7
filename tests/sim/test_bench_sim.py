"""Smoke test of benchmarks/bench_sim.py (the ratios themselves are measured, never asserted)."""

import torch

from benchmark_loader import load_benchmark


def test_bench_runs_and_records_every_matmul_of_the_simulator():
    bench_sim = load_benchmark("bench_sim")
    threads = torch.get_num_threads()
    r = bench_sim.bench(64, 3, 2, 4, 2, "float64", "cpu", 1)
    assert torch.get_num_threads() == threads
    for key in ("ratio_explicit", "ratio_conditional", "all_mm_explicit", "all_mm_conditional", "rng_share",
                "train_explicit", "train_conditional"):
        assert r[key] > 0
    # the recorder sees the layers' products: explicit weights, 3 layers forward + 2 backward at least
    with bench_sim._RecordMatmuls() as rec:
        from bnlab.sim import simulate
        torch.set_num_threads(1)
        try:
            simulate("relu", 4, 64, 3, 2, weight_sampling="explicit", num_batches=2)
        finally:
            torch.set_num_threads(threads)
    big = [shapes for _, shapes, _ in rec.calls if shapes[-1][-1] == 64 and shapes[-1][-2] == 64]
    assert len(big) >= 5
