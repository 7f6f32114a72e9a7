"""benchmarks/bench_bnp_epoch.py: it times the trainer's own epochs (timings are printed, never asserted)."""
from __future__ import annotations

import json

import pytest
import torch

from benchmark_loader import load_benchmark
from bnlab.optim.training import train_network


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_bnp_epoch")


@pytest.fixture(scope="module")
def mnist_small(bench):
    return bench.load_data("mnist", train_size=160, test_size=50)


@pytest.mark.parametrize("variant", ["sgd", "bn", "bnp"])
def test_epoch_is_the_one_bnlab_train_runs(bench, mnist_small, variant):
    # The benchmark rebuilds train_network's configuration (network, lr, BNP defaults, SGD, seed) to
    # let --bnp-kwargs through; the route it times must give train_network's numbers.  Same process,
    # same thread count, same operations: only rounding-level agreement is promised (1e-6 relative on
    # float32, as tests/nets/test_train.py); a different lr, init or a missing BNP hook moves the loss
    # of 10 steps by far more.
    tr, te, widths = mnist_small
    res, t = bench.run_epoch(variant, tr, te, batch_size=16, widths=widths)
    ref = train_network(norm=bench.NORMS[variant], dataset="mnist", batch_size=16, epochs=1, train_size=160,
                        test_size=50)
    assert res.steps == ref.steps == t["steps"] == 10
    assert res.final_train_loss == pytest.approx(ref.final_train_loss, rel=1e-6)
    assert res.epochs[0]["train_loss"] == pytest.approx(ref.epochs[0]["train_loss"], rel=1e-6)
    assert res.test_accuracy == ref.test_accuracy
    assert t["loop_s"] > 0 and t["total_s"] >= t["loop_s"] + sum(t["eval_s"])
    assert len(t["eval_s"]) >= 1  # the epoch's test pass was seen by the wrapper


def test_bnp_kwargs_reach_the_preconditioner_and_max_steps_runs_a_prefix(bench, mnist_small):
    tr, te, widths = mnist_small
    base, _ = bench.run_epoch("bnp", tr, te, batch_size=16, widths=widths, steps=4)
    same, _ = bench.run_epoch("bnp", tr, te, batch_size=16, widths=widths, steps=4, bnp_kwargs={"rho": 0.99})
    other, t = bench.run_epoch("bnp", tr, te, batch_size=16, widths=widths, steps=4, bnp_kwargs={"rho": 0.5})
    assert base.history == pytest.approx(same.history, rel=1e-6)
    # rho sets the running statistics that precondition every step after the first: the losses of
    # steps 2-4 must move (by far more than rounding) when it does
    assert other.history[1:] != pytest.approx(base.history[1:], rel=1e-4)
    assert base.steps == t["steps"] == 4 and len(t["eval_s"]) == 1  # no epoch end: only the final pass


def test_quick_run_prints_every_ratio_and_restores_threads(bench, capsys):
    threads = torch.get_num_threads()
    assert bench.main(["--quick"]) == 0
    assert torch.get_num_threads() == threads
    out = capsys.readouterr().out
    for text in ("BNP/SGD", "BNP/BN", "BN/SGD", "loop only", "timed:", "not timed", "[784, 100, 100, 100, 10]"):
        assert text in out


def test_quick_table1_json_with_max_steps(bench, capsys):
    assert bench.main(["--quick", "--network", "table1", "--max-steps", "4", "--json",
                       "--bnp-kwargs", '{"rho": 0.9}']) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["meta"]["network"] == [3072, 100, 100, 10] and data["meta"]["bnp_kwargs"] == {"rho": 0.9}
    assert [r["batch_size"] for r in data["rows"]] == [16, 64]
    assert [r["rounds"] for r in data["rows"]] == [2, 2]  # --quick: two rounds, no time floor
    for r in data["rows"]:
        assert r["steps_timed"] == 4 and r["steps_per_epoch"] == 640 // r["batch_size"]
        assert set(r["variants"]) == {"sgd", "bn", "bnp"} and set(r["ratios"]) == {"bnp/sgd", "bnp/bn", "bn/sgd"}
        for t in r["variants"].values():
            assert t["epoch_s"] == pytest.approx(t["loop_s"] + t["eval_s"])


@pytest.mark.parametrize("argv,match", [
    (["--bnp-kwargs", "[1]"], "--bnp-kwargs"),
    (["--bnp-kwargs", "{bad"], "--bnp-kwargs"),
    (["--bnp-kwargs", '{"no_such_option": 1}'], "no_such_option"),
    (["--bnp-kwargs", '{"rho": 2}'], "rho"),
    (["--batch-sizes", "0"], "--batch-sizes"),
    (["--max-steps", "-3"], "--max-steps"),
    (["--network", "cifar"], "--network"),
    (["--min-seconds", "-1"], "--min-seconds"),
    (["--min-seconds", "nan"], "--min-seconds"),
])
def test_bad_arguments_exit_2_naming_the_argument(bench, capsys, argv, match):
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2
    assert match in capsys.readouterr().err


def test_min_seconds_adds_rounds_until_every_variant_has_that_much_timed(bench, mnist_small, monkeypatch):
    # A fake clock, 1 ms per reading, makes the rounds deterministic: each 10-step epoch's timed loop
    # is one reading apart (step 0's and the last step's callback; the test pass runs after both),
    # i.e. 1 ms, so 3.5 ms per variant takes exactly 4 rounds (3 give 3 ms).
    readings = iter(range(10**9))
    monkeypatch.setattr(bench, "device_clock", lambda device: next(readings) * 1e-3)
    tr, te, widths = mnist_small
    row = bench.measure(16, tr, te, widths=widths, rounds=1, min_seconds=0.0035, variants=("sgd", "bnp"))
    assert row["rounds"] == 4
    for t in row["variants"].values():
        assert len(t["loop_s_rounds"]) == 4
        assert t["loop_s_rounds"] == pytest.approx([1e-3 / 9 * 10] * 4)  # steps 1 … 9 scaled to the epoch
