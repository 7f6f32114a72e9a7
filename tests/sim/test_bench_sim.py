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
    assert r["ops_per_layer"]["explicit"] > 0 and r["ops_per_layer"]["conditional"] > 0
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


def test_replay_runs_every_product_in_groups_within_the_memory_budget():
    # The replay of the recorded products may not allocate every operand at once (134 GiB at
    # width 4096 × 64 networks on a GPU): groups of consecutive products, each within the budget.
    bench_sim = load_benchmark("bench_sim")
    from bnlab.sim import simulate

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with bench_sim._RecordMatmuls() as rec:
            simulate("relu", 4, 32, 4, 3, weight_sampling="explicit", num_batches=2)
    finally:
        torch.set_num_threads(threads)
    sizes = [bench_sim._call_bytes(shapes, dtype) for _, shapes, dtype in rec.calls]
    budget = 2 * max(sizes)
    groups = bench_sim._replay_groups(rec.calls, budget)
    assert [c for g in groups for c in g] == rec.calls  # every product once, in order
    assert len(groups) > 1
    assert all(sum(bench_sim._call_bytes(s, d) for _, s, d in g) <= budget for g in groups)
    # a product larger than the budget is a group of its own, not dropped
    assert [len(g) for g in bench_sim._replay_groups(rec.calls, 1)] == [1] * len(rec.calls)
    run = bench_sim._replay(rec.calls, "cpu", budget)
    assert run.groups == len(groups) and run() > 0
    # bmm (3, 8, 32) × (3, 32, 32): operands and result 3·(8·32 + 32·32 + 8·32) float64 numbers
    assert bench_sim._call_bytes([(3, 8, 32), (3, 32, 32)], torch.float64) == 8 * 3 * (256 + 1024 + 256)


def test_quick_json_reports_sim_over_bmm_for_the_gpu_check():
    # benchmarks/gpu_check.py reads sim_over_bmm: route -> t_bmm / t_sim of the largest configuration,
    # "auto" the ratio of the route the simulator picks there (auto_route)
    bench_sim = load_benchmark("bench_sim")
    out = bench_sim.main(["--quick", "--json", "--threads", "1"])
    s = out["sim_over_bmm"]
    assert set(s) >= {"explicit", "conditional", "auto", "auto_route"}
    assert s["auto_route"] in ("explicit", "conditional") and s["auto"] == s[s["auto_route"]]
    assert all(s[key] > 0 for key in ("explicit", "conditional"))
    # at width 64 with 8 rows (≤ 64/4) the CPU's automatic choice is conditional sampling
    assert s["auto_route"] == "conditional" and s["config"]["width"] == 64
