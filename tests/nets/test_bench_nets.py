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


def test_bench_nets_checkpoint_ab_quick_runs(capsys):
    # the plumbing of the A/B: the run that keeps checkpoints saves at every check (20 steps, every 10: one
    # save, the run's end removes the file) and both times are printed
    module = load_benchmark("bench_nets")
    r = module.checkpoint_ab(16, 1, 8, 3, 1, 1, "float32")
    assert r["steps"] == 20 and r["saves"] == 1 and r["file_mb"] > 0 and r["with_s"] > 0 and r["without_s"] > 0
    module.main(["--quick", "--checkpoint-ab"])
    assert "per save" in capsys.readouterr().out


def test_bench_ensemble_buffer_reuse_ab_quick_runs(monkeypatch):
    # the plumbing of the A/B (both option sets used, rows, ratio) with torch.compile as the identity:
    # the comparison itself (two Inductor compilations) is the benchmark's, not the suite's
    import bnlab._inductor as inductor_options
    import bnlab.nets._ensemble_step as step_mod

    seen = []
    monkeypatch.setattr(step_mod.torch, "compile", lambda fn, **kw: seen.append(kw["options"]) or fn)
    out = load_benchmark("bench_ensemble").main(["--buffer-reuse-ab", "--quick", "--json"])
    rows = out["buffer_reuse_ab"]
    assert [r["options"].split()[0] for r in rows] == ["bnlab", "Inductor"]
    assert all(r["step_ms"] > 0 for r in rows) and rows[0]["ratio_to_default"] > 0
    ours = dict(inductor_options.COMPILE_OPTIONS)
    assert ours["allow_buffer_reuse"] is False
    assert ours in seen and {k: v for k, v in ours.items() if k != "allow_buffer_reuse"} in seen
    assert inductor_options.COMPILE_OPTIONS == ours  # restored


def test_bench_ensemble_bn_ab_quick_runs():
    # the native BN kernel against ATen's operators, both routes really taken: the kernel's step dispatches
    # fewer operators (a count, not a time); the kernel state is restored afterwards
    import pytest

    from bnlab.nets import _native_bn

    if _native_bn.kernel() is None:
        pytest.skip("no C compiler: the kernel cannot be built here")
    before = dict(_native_bn._STATE)
    out = load_benchmark("bench_ensemble").main(["--bn-ab", "--quick", "--json"])
    rows = out["bn_ab"]
    assert len(rows) == 4 and all(r["aten_ms"] > 0 and r["native_ms"] > 0 for r in rows)
    assert all(r["native_ops_per_step"] < r["aten_ops_per_step"] for r in rows)
    assert _native_bn._STATE == before
