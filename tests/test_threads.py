"""bnlab._threads: the intra-op thread count of small work, and its use at the entry points.

Thread counts are observed, never timed (benchmarks/bench_threads.py times them side by side)."""
import pytest
import torch
from torch import nn

from bnlab import _threads


@pytest.fixture
def two_threads(monkeypatch):
    """torch at 2 intra-op threads, unpinned, on an idle 2-core machine as the chooser sees it (no other
    runnable work), restored after (the chooser can only lower a count)."""
    monkeypatch.setattr(_threads, "busy_cores", lambda: 0)
    monkeypatch.setattr(_threads, "available_cores", lambda: 2)
    before = torch.get_num_threads()
    _threads.pin_threads(None)
    torch.set_num_threads(2)
    yield
    _threads.pin_threads(None)
    torch.set_num_threads(before)


def test_chooser_by_size_and_free_cores(monkeypatch):
    monkeypatch.setattr(_threads, "available_cores", lambda: 8)
    t = _threads.SMALL_WORK_FLOPS
    assert _threads.choose_threads(t / 2, 8, busy=0) == 1
    assert _threads.choose_threads(t, 8, busy=0) == 8 and _threads.choose_threads(100 * t, 3, busy=0) == 3
    # large work gets no more threads than the cores other work leaves free (at least one)
    assert _threads.choose_threads(100 * t, 8, busy=3) == 5
    assert _threads.choose_threads(100 * t, 8, busy=8) == 1 and _threads.choose_threads(100 * t, 8, busy=50) == 1
    assert _threads.choose_threads(None, 4, busy=50) == 4 and _threads.choose_threads(float("nan"), 4) == 4
    assert _threads.choose_threads(0.0, 1) == 1  # never above the count it is given
    monkeypatch.setattr(_threads, "busy_cores", lambda: None)  # not Linux: the size alone
    assert _threads.choose_threads(100 * t, 6) == 6


def test_busy_cores_reads_the_runnable_count(tmp_path, monkeypatch):
    import builtins

    real_open = builtins.open

    def fake(text):
        def opener(path, *args, **kwargs):
            if path == "/proc/loadavg":
                target = tmp_path / "loadavg"
                target.write_text(text)
                return real_open(target, *args, **kwargs)
            return real_open(path, *args, **kwargs)
        return opener

    monkeypatch.setattr(builtins, "open", fake("0.52 0.58 0.59 3/467 12345\n"))
    assert _threads.busy_cores() == 2  # three runnable, one of them the caller
    monkeypatch.setattr(builtins, "open", fake("0.00 0.00 0.00 1/100 1\n"))
    assert _threads.busy_cores() == 0
    monkeypatch.setattr(builtins, "open", fake("garbage"))
    assert _threads.busy_cores() is None


def test_context_sets_and_restores_and_respects_a_pin(two_threads):
    with _threads.small_work_threads(1e3) as n:
        assert n == 1 and torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with _threads.small_work_threads(1e12) as n:
        assert n == 2 and torch.get_num_threads() == 2
    with pytest.raises(RuntimeError):
        with _threads.small_work_threads(1e3):
            raise RuntimeError("restored on errors too")
    assert torch.get_num_threads() == 2
    _threads.pin_threads(2)  # the user's --threads: the chooser leaves it
    with _threads.small_work_threads(1e3) as n:
        assert n == 2 and torch.get_num_threads() == 2
    with _threads.pinned(1):
        assert torch.get_num_threads() == 1 and _threads.pinned_threads() == 1
    assert torch.get_num_threads() == 2 and _threads.pinned_threads() == 2


def test_sized_by_runs_the_function_with_the_chosen_count(two_threads):
    seen = []

    @_threads.sized_by(lambda a: a["flops"])
    def work(flops, *, scale=1.0):
        """docstring kept"""
        seen.append(torch.get_num_threads())
        if flops < 0:
            raise ValueError("flops must be >= 0")
        return flops * scale

    assert work(10.0, scale=2.0) == 20.0 and seen[-1] == 1
    assert work(1e12) == 1e12 and seen[-1] == 2
    assert work.__doc__ == "docstring kept"
    with pytest.raises(ValueError, match="flops must be"):
        work(-1.0)
    assert torch.get_num_threads() == 2
    # an estimate that fails leaves the count alone; the function reports its own bad arguments
    with pytest.raises(TypeError):
        work()


def test_training_size_estimate():
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(784, 100), nn.ReLU(), nn.Linear(100, 10))
    x = torch.zeros(10, 1, 28, 28)
    # the largest product: B × 784 × 100 multiply-adds
    assert _threads.training_flops_per_op(mlp, 1, (x, None)) == 2 * 784 * 100
    assert _threads.training_flops_per_op([mlp, mlp, mlp], 8, (x, None)) == 3 * 2 * 8 * 784 * 100

    class Data:  # a bnlab.data Dataset has .x
        x = torch.zeros(5, 3, 32, 32)

    cnn = nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU())
    # a convolution's weight times the input's positions (an upper bound for its output positions)
    assert _threads.training_flops_per_op(cnn, 2, Data()) == 2 * 2 * (16 * 3 * 3 * 3) * 32 * 32
    assert _threads.training_flops_per_op(nn.ReLU(), 4, (x, None)) is None


def test_batch_one_training_and_small_ensembles_run_on_one_thread(two_threads):
    from bnlab.nets import BNMLP, train, train_ensemble

    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(64, 20, generator=g), torch.randint(0, 3, (64,), generator=g)
    seen = []
    net = nn.Sequential(nn.Linear(20, 16), nn.ReLU(), nn.Linear(16, 3))
    train(net, (x, y), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), batch_size=1, steps=3,
          hooks=[lambda _m: seen.append(torch.get_num_threads())])
    assert seen == [1, 1, 1] and torch.get_num_threads() == 2
    # the user's count is kept
    _threads.pin_threads(2)
    seen.clear()
    train(net, (x, y), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), batch_size=1, steps=2,
          hooks=[lambda _m: seen.append(torch.get_num_threads())])
    assert seen == [2, 2]
    _threads.pin_threads(None)
    # a small ensemble (4·2·8·20·16 multiply-adds in its largest batched product): observed in its
    # per-step loss
    import bnlab.nets._ensemble_step as ensemble_step

    counts = []
    loss = ensemble_step.per_network_loss

    def spy(*args):
        counts.append(torch.get_num_threads())
        return loss(*args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ensemble_step, "per_network_loss", spy)
        train_ensemble([BNMLP(20, 3, depth=d, width=16, seed=d) for d in (2, 3, 4, 5)], (x, y), lr=0.1,
                       batch_size=4, steps=2)
        assert counts and set(counts) == {1}
        counts.clear()
        # 40 networks of width 1024 at batch 64: 40·2·64·1024² ≈ 5.4e9 FLOPs, all the threads
        big_x = torch.rand(128, 1024, generator=g)
        train_ensemble([BNMLP(1024, 3, depth=2, width=1024, seed=i) for i in range(40)],
                       (big_x, torch.randint(0, 3, (128,), generator=g)), lr=0.1, batch_size=64, steps=1)
        assert counts and set(counts) == {2}
    assert torch.get_num_threads() == 2


def test_rank_chain_at_small_width_runs_on_one_thread(two_threads, monkeypatch):
    from bnlab.rank import chains, run_chain

    seen = []
    step = chains._step

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return step(*args, **kwargs)

    monkeypatch.setattr(chains, "_step", spy)
    run_chain(32, 32, 5, seed=0)
    assert seen and set(seen) == {1}
    seen.clear()
    run_chain(1024, 32, 1, seed=0)  # 2·32·1024² ≈ 6.7e7 FLOPs per layer: all the threads
    assert seen and set(seen) == {2}
    assert torch.get_num_threads() == 2


def test_bench_threads_quick_runs():
    from benchmark_loader import load_benchmark

    before = torch.get_num_threads()
    # --threads 1: the smoke test runs no second thread (on a loaded machine a spinning one makes it minutes)
    out = load_benchmark("bench_threads").main(["--quick", "--json", "--threads", "1"])
    assert torch.get_num_threads() == before and _threads.pinned_threads() is None
    rows = {r["case"]: r for r in out["rows"]}
    assert set(rows) == {"matmul 32", "train B=1", "chain 32"}
    for r in rows.values():  # all three are small work: the chooser takes one thread
        assert r["chooser_threads"] == 1 and set(r["wall_s"]) == {"1", "chooser"}
        assert all(t > 0 for t in r["wall_s"].values())


BAD_THREADS = [(0, "threads=0 is not allowed"), (-1, "threads=-1 is not allowed"),
               ("abc", "threads='abc' is not allowed"), (1e9, "threads=1000000000 is not allowed"),
               (True, "threads=True is not allowed"), (2.5, "threads=2.5 is not allowed")]


@pytest.mark.parametrize("value,message", BAD_THREADS, ids=repr)
def test_bad_thread_counts_are_value_errors_naming_the_argument(value, message, two_threads):
    # every place a thread count enters the library: the check, the pin, the scoped pin
    with pytest.raises(ValueError, match=message):
        _threads.check_threads(value)
    with pytest.raises(ValueError, match=message):
        _threads.pin_threads(value)
    with pytest.raises(ValueError, match=message):
        with _threads.pinned(value):
            pytest.fail("the body must not run")
    # nothing changed on the way: torch's count and the (absent) pin
    assert torch.get_num_threads() == 2 and _threads.pinned_threads() is None


def test_good_thread_counts_are_accepted_as_ints(two_threads):
    assert _threads.check_threads(1) == 1 and _threads.check_threads(2.0) == 2
    assert _threads.check_threads(_threads.MAX_THREADS) == _threads.MAX_THREADS
    import numpy as np

    with _threads.pinned(np.int64(1)):
        assert torch.get_num_threads() == 1 and _threads.pinned_threads() == 1
    assert torch.get_num_threads() == 2 and _threads.pinned_threads() is None


@pytest.mark.parametrize("value,message", BAD_THREADS, ids=repr)
def test_bad_thread_counts_of_the_sweep_engine_fail_before_any_work(value, message, tmp_path, two_threads):
    # the engine's threads= (run_sweep, build_report, reproduce, open_client): refused up front — no
    # store, no report folder, no cluster
    from bnlab.experiments import build_report, run_sweep
    from bnlab.experiments.report import reproduce
    from bnlab.experiments.sweep import open_client

    with pytest.raises(ValueError, match=message):
        run_sweep("yang2019-theory", results_dir=tmp_path, serial=True, progress=False, threads=value)
    with pytest.raises(ValueError, match=message):
        build_report(tmp_path / "report", results_dir=tmp_path, experiments=[], serial=True, progress=False,
                     threads=value)
    with pytest.raises(ValueError, match=message):
        reproduce("yang2019-theory", out=tmp_path / "figures", results_dir=tmp_path, serial=True, progress=False,
                  threads=value)
    with pytest.raises(ValueError, match=message):
        with open_client(workers=1, threads=value):
            pytest.fail("no cluster may start")
    assert list(tmp_path.iterdir()) == []
    assert torch.get_num_threads() == 2 and _threads.pinned_threads() is None


def test_worker_share_is_cores_over_workers_at_least_one():
    from bnlab.experiments.sweep import _worker_share

    table = {(2, 1): 2, (2, 2): 1, (5, 2): 2, (16, 3): 5, (2, 3): 1, (1, 8): 1}
    assert {k: _worker_share(*k) for k in table} == table
