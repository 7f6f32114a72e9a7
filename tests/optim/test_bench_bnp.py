"""Smoke test of benchmarks/bench_bnp.py (timings are measured and printed, never asserted)."""
from __future__ import annotations

from benchmark_loader import load_benchmark


def test_bench_quick_runs(capsys):
    bench = load_benchmark("bench_bnp")
    assert bench.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "BNP/SGD" in out and "BNP/BN" in out and "floor/SGD" in out and "auto/SGD" in out
    assert "phases" in out


def test_bench_batch_size_one_has_no_bn_column(capsys):
    # BN cannot run on one sample: at B = 1 the BN variant is left out and its ratios print as nan.
    bench = load_benchmark("bench_bnp")
    assert bench.main(["--quick", "--json"]) == 0
    import json

    rows = json.loads(capsys.readouterr().out)["rows"]
    one = next(r for r in rows if r["batch_size"] == 1)
    assert "bn" not in one["step_s"] and "bnp/bn" not in one["ratios"] and one["ratios"]["bnp/sgd"] > 0
    assert "bn" in next(r for r in rows if r["batch_size"] == 4)["step_s"]


def test_json_has_the_ratios_and_operator_counts_a_gpu_check_reads(capsys):
    """--json carries bnp_over_sgd / bnp_over_bn (batch size -> ratio, default route) and ops_per_step
    (variant -> aten operators per step); the counts are those of a TorchDispatchMode: the eager BNP
    step dispatches more operators than SGD's, SGD's own count does not depend on BNP."""
    import json

    bench = load_benchmark("bench_bnp")
    assert bench.main(["--quick", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["bnp_over_sgd"]) == {"1", "4", "32"} and set(out["bnp_over_bn"]) == {"4", "32"}
    assert all(r > 0 for r in out["bnp_over_sgd"].values())
    ops = out["ops_per_step"]
    assert out["ops_batch_size"] == 1 and {"sgd", "bnp", "bnp_fused", "floor"} <= set(ops)
    assert ops["bnp"] > ops["sgd"] > 0
    assert all(r["ops_per_step"]["sgd"] == ops["sgd"] for r in out["rows"])


def test_compiled_call_is_counted_outside_the_dispatch_mode(monkeypatch):
    """The compiled route's call runs outside the counting mode (a dispatch mode makes torch.compile
    fall back to eager) and is counted from its profile: once per step, as its top-level operators
    and kernels.  (The uncompiled core stands in for the compiled one: no C++ build here.)"""
    import torch

    from bnlab.optim import _compiled
    from bnlab.optim import _functional as F

    monkeypatch.setattr(_compiled, "_STATE", {"fn": F.dense_steps_})
    calls = []
    real = _compiled.dense_steps_
    monkeypatch.setattr(_compiled, "dense_steps_", lambda *a: calls.append(
        bool(torch.utils._python_dispatch._get_current_dispatch_mode_stack())) or real(*a))
    bench = load_benchmark("bench_bnp")
    model, opt, pre = bench.build("bnp_compiled", 64, 16, 2, "cpu")
    step = bench.make_step(model, opt, pre)
    x, y = torch.randn(4, 64), torch.randint(0, 10, (4,))
    step(x, y)
    calls.clear()
    compiled_ops = bench.ops_per_step(step, x, y)
    assert calls == [False]  # one call per step, outside the dispatch mode
    sgd = bench.make_step(*bench.build("sgd", 64, 16, 2, "cpu"))
    sgd(x, y)
    assert compiled_ops > bench.ops_per_step(sgd, x, y)
    a = torch.randn(3)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.add(a, a)
        torch.mul(a, a).sum()
    assert bench._region_ops(prof) == 3  # top-level operators only (add, mul, sum)


def test_json_reports_the_compiled_routes_checks_for_gpu_check(capsys):
    """compiled_check_worst: the worst ratio of the compiled dense step's checks against the core
    (bnlab.optim._compiled) — None when none ran (the quick CPU run: eager), JSON-safe otherwise."""
    import json

    bench = load_benchmark("bench_bnp")
    assert bench.worst_check([]) is None
    assert bench.worst_check([{"worst": 0.00123456}, {"worst": 0.5}]) == 0.5
    assert bench.worst_check([{"worst": 1.0004}]) == 1.0004  # not rounded to an apparent pass
    assert bench.worst_check([{"worst": float("inf")}]) == "inf"
    assert bench.main(["--quick", "--json"]) == 0
    assert "compiled_check_worst" in json.loads(capsys.readouterr().out)
