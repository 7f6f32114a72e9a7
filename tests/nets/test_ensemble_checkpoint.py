"""train_ensemble's checkpoint: a run interrupted and resumed computes what the uninterrupted run computes.

Route of the check: the same run twice in one process — once straight through, once stopped right after
its k-th save (an exception raised from the save, as a time limit or Ctrl-C would stop it) and resumed
with freshly built models — then every network's final parameters, buffers, loss history, first bad
step and test accuracy compared.

Tolerance.  The resumed run applies the same float64 operations to the same operands in the same order
as the straight run (same process, same thread count): the parameters, buffers and optimizer state are
restored bit for bit (``torch.save`` keeps every bit), the data order continues from the same
generator state.  What may differ is where the restored tensors lie in memory; a BLAS may pick another
kernel for other alignments and sum a dot product of k ≤ 64 terms in another order, k·u ≈ 7e-15
relative per product (Higham §3.1), amplified by the remaining ≤ 60 steps by ≤ 10³ (as in
test_ensemble.py), so the check is 1e-10 — 10⁶ below the ~1e-4 change one step makes, so a lost
or repeated step, a stale optimizer state or a wrong data position fails (each is also tested
to fail below).  Losses are float32 in the history: 2e-7 relative.
"""
from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import bnlab.nets._checkpoint as ck
import bnlab.nets.ensemble as ens
from bnlab import _task_checkpoint
from bnlab.nets import BNMLP, MLP, train_ensemble

from ._data import digits
from ._interrupt import REAL_WRITE as _REAL_WRITE
from ._interrupt import Stop as _Stop
from ._interrupt import disk_full
from ._interrupt import interrupt_after as _interrupt_after

torch.set_num_threads(1)
F64 = torch.float64


def _bnmlps():
    return [BNMLP(64, 10, depth=d, width=16, gamma=g, eps=e, seed=s, phi="tanh", dtype=F64)
            for d, g, e, s in [(3, 1.0, 1e-3, 0), (5, 0.5, 0.1, 1), (2, 1.0, 1e-3, 2)]]


class _DropoutMLP(nn.Module):
    """A generic module with dropout (vmap stack; random numbers drawn from torch's global generator)."""

    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.body = nn.Sequential(nn.Linear(64, 16, dtype=F64), nn.BatchNorm1d(16, dtype=F64), nn.Tanh(),
                                  nn.Dropout(0.2), nn.Linear(16, 10, dtype=F64))
        with torch.no_grad():
            for p in self.body.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=F64) * 0.3)

    def forward(self, x):
        return self.body(x)


def _generic():
    # three structures (a grouped stack), one with dropout; with ½‖f − e_y‖², momentum 0.9 and the rate 3
    # networks 1 and 4 pass diverge_above within the first steps: dropped at the first check, and the
    # group of network 4 (the only one of its structure) with it
    return [MLP(64, [16, 16], 10, norm="bn", seed=0, dtype=F64), MLP(64, [16, 16], 10, norm="bn", seed=1, dtype=F64),
            _DropoutMLP(2), _DropoutMLP(3), MLP(64, [12], 10, norm="bn", seed=4, dtype=F64)]


def _run(make, kw, path=None, **extra):
    models = make()
    torch.manual_seed(0)  # dropout draws from torch's generator: every run starts from the same state
    results = train_ensemble(models, *kw["args"], **kw["kwargs"], **extra,
                             **({} if path is None else {"checkpoint": path, "checkpoint_every": 0}))
    return models, results


def _assert_same(a, b):
    (ma, ra), (mb, rb) = a, b
    for x, y in zip(ra, rb):
        assert x.diverged == y.diverged and x.diverged_at_step == y.diverged_at_step and x.steps == y.steps
        assert x.test_accuracy == y.test_accuracy or (x.test_accuracy is None and y.test_accuracy is None) or \
            abs(x.test_accuracy - y.test_accuracy) <= 1e-12
        np.testing.assert_allclose(x.history, y.history, rtol=2e-7, atol=0)
    for m1, m2 in zip(ma, mb):
        for (k, p), q in zip(m1.state_dict().items(), m2.state_dict().values()):
            assert torch.allclose(p, q, rtol=1e-10, atol=1e-10), k


def _case(optimizer="sgd", loss="cross_entropy", momentum=0.0, weight_decay=0.0, steps=60, lr=(0.05, 0.02, 0.1)):
    (x, y), test = digits(np.float64)
    return {"args": [(x, y)], "kwargs": dict(lr=list(lr), batch_size=16, steps=steps, seeds=list(range(len(lr))),
                                             test_data=test, optimizer=optimizer, loss=loss, momentum=momentum,
                                             weight_decay=weight_decay)}


@pytest.mark.parametrize("optimizer, loss, momentum, weight_decay", [
    ("sgd", "cross_entropy", 0.0, 0.0),
    ("sgd", "mse", 0.9, 1e-3),
    ("rmsprop", "cross_entropy", 0.5, 0.0),
    ("rmsprop", "mse", 0.0, 1e-3),
])
def test_a_resumed_bnmlp_ensemble_equals_the_straight_run(tmp_path, monkeypatch, optimizer, loss, momentum,
                                                          weight_decay):
    kw = _case(optimizer, loss, momentum, weight_decay)
    straight = _run(_bnmlps, kw)
    path = tmp_path / "run.pt"
    saves = _interrupt_after(monkeypatch, 3)
    with pytest.raises(_Stop):
        _run(_bnmlps, kw, path)
    assert saves == [10, 20, 30] and path.is_file()
    monkeypatch.undo()
    resumed = _run(_bnmlps, kw, path)
    _assert_same(straight, resumed)
    assert not path.exists()  # a completed run removes its checkpoint


def test_a_resumed_run_goes_on_from_its_step(tmp_path, monkeypatch, caplog):
    # the resumed run trains only the steps after the save: 30 steps of 60, not 60 (a run that started over
    # would equal the straight run too, having the same models and data)
    kw = _case()
    path = tmp_path / "run.pt"
    _interrupt_after(monkeypatch, 3)
    with pytest.raises(_Stop):
        _run(_bnmlps, kw, path)
    monkeypatch.undo()
    steps = []
    real_step = ens._EnsembleRun.step

    def counted(self):
        steps.append(self.done)
        real_step(self)

    monkeypatch.setattr(ens._EnsembleRun, "step", counted)
    with caplog.at_level("INFO", logger="bnlab.nets"):
        _run(_bnmlps, kw, path)
    assert steps == list(range(30, 60))
    assert "resumes from" in caplog.text and "at step 30" in caplog.text


@pytest.mark.parametrize("window", [1024, 7])
def test_a_resumed_grouped_stack_with_dropped_networks_and_dropout_equals_the_straight_run(tmp_path, monkeypatch,
                                                                                          window):
    # a vmap stack of two structures (networks dropped at a check: the diverging rates; a group emptied),
    # dropout (torch's random state), and with a window of 7 every save falls inside a window of drawn batches
    monkeypatch.setattr(ens, "_MAX_WINDOW", window)
    kw = _case(momentum=0.9, loss="mse", lr=(0.05, 3.0, 0.1, 0.02, 3.0), steps=70)
    kw["kwargs"]["diverge_above"] = 50.0
    straight = _run(_generic, kw)
    assert [r.diverged for r in straight[1]] == [False, True, False, False, True]  # the case is what it claims
    path = tmp_path / "run.pt"
    saves = _interrupt_after(monkeypatch, 4)
    with pytest.raises(_Stop):
        _run(_generic, kw, path)
    assert saves == [10, 20, 30, 40]
    saved = torch.load(path, weights_only=True)
    assert len(saved["row_ids"]) < 5 and saved["dropped_first_bad"]  # saved after compaction
    if window == 7:
        assert saved["done"] % 7 and saved["drawn"] > saved["done"]
    monkeypatch.setattr(ck, "write", _REAL_WRITE)  # the window stays patched
    resumed = _run(_generic, kw, path)
    _assert_same(straight, resumed)


def test_a_lost_step_or_a_wrong_data_position_is_seen(tmp_path, monkeypatch):
    # the comparison can fail: a data order restarted, a step lost after the resume, or a stale (halved)
    # momentum buffer gives other weights than the straight run (so the tolerance above is not vacuous)
    kw = _case(momentum=0.9)
    straight = _run(_bnmlps, kw)
    path = tmp_path / "run.pt"
    _interrupt_after(monkeypatch, 2)
    with pytest.raises(_Stop):
        _run(_bnmlps, kw, path)
    monkeypatch.undo()
    good = torch.load(path, weights_only=True)
    real_orders = ens._EnsembleRun._data_orders
    monkeypatch.setattr(ens._EnsembleRun, "_data_orders", lambda self, start: real_orders(self, 0))
    resumed = _run(_bnmlps, kw, path)
    with pytest.raises(AssertionError):
        _assert_same(straight, resumed)
    monkeypatch.undo()
    torch.save(good, path)
    real_step, lost = ens._EnsembleRun.step, []

    def losing_one(self):
        if not lost:  # the first step after the resume counts but computes nothing
            lost.append(self.done)
            runner, self.runner = self.runner, lambda state: None
            try:
                real_step(self)
            finally:
                self.runner = runner
        else:
            real_step(self)

    monkeypatch.setattr(ens._EnsembleRun, "step", losing_one)
    resumed = _run(_bnmlps, kw, path)
    assert lost == [20]
    with pytest.raises(AssertionError):
        _assert_same(straight, resumed)
    monkeypatch.undo()
    for v in good["velocity"]:
        v.mul_(0.5)
    torch.save(good, path)
    resumed = _run(_bnmlps, kw, path)
    with pytest.raises(AssertionError):
        _assert_same(straight, resumed)


def _saved_checkpoint(tmp_path, monkeypatch, kw=None):
    kw = kw or _case()
    path = tmp_path / "run.pt"
    _interrupt_after(monkeypatch, 1)
    with pytest.raises(_Stop):
        _run(_bnmlps, kw, path)
    monkeypatch.undo()
    return path, kw


def test_a_checkpoint_of_another_run_is_refused_and_the_models_are_untouched(tmp_path, monkeypatch):
    path, kw = _saved_checkpoint(tmp_path, monkeypatch)
    other = _case(lr=(0.05, 0.02, 0.2))
    models = _bnmlps()
    before = [{k: v.clone() for k, v in m.state_dict().items()} for m in models]
    with pytest.raises(ValueError, match=r"checkpoint=.*another run"):
        train_ensemble(models, *other["args"], **other["kwargs"], checkpoint=path)
    for m, b in zip(models, before):
        assert all(torch.equal(v, b[k]) for k, v in m.state_dict().items())
    # other models (another seed) and other data are other runs too
    with pytest.raises(ValueError, match="another run"):
        train_ensemble(_bnmlps()[::-1], *kw["args"], **kw["kwargs"], checkpoint=path)
    (x, y), = kw["args"]
    with pytest.raises(ValueError, match="another run"):
        train_ensemble(_bnmlps(), (x * 1.0001, y), **kw["kwargs"], checkpoint=path)
    assert path.is_file()  # a caller's file is refused, never removed


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # torch.load on the planted pickle below
def test_files_that_are_not_checkpoints_are_refused(tmp_path, monkeypatch):
    kw = _case()
    path = tmp_path / "run.pt"

    def refused(match):
        with pytest.raises(ValueError, match=match):
            train_ensemble(_bnmlps(), *kw["args"], **kw["kwargs"], checkpoint=path)

    path.write_bytes(b"\x80\x04 not a torch file")
    refused(r"checkpoint=.*not a readable checkpoint")
    torch.save({"weights": torch.zeros(3)}, path)
    refused("not a train_ensemble checkpoint")
    torch.save({"format": ck.FORMATS["train_ensemble"], "version": 99, "fingerprint": "x"}, path)
    refused("layout version 99")

    class Payload:  # a pickle that would run code: weights_only refuses it
        def __reduce__(self):
            return (os.system, ("echo planted",))

    torch.save(Payload(), path)
    refused("not a readable checkpoint")
    # a truncated checkpoint (a save killed mid-write is renamed only when whole; a copy cut short is not)
    good, _ = _saved_checkpoint(tmp_path / "a", monkeypatch)
    path.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    refused("not a readable checkpoint")
    path.unlink()
    path.symlink_to(good)
    refused("symbolic link")
    path.unlink()
    path.mkdir()
    refused(r"checkpoint=.*is a directory")
    with pytest.raises(ValueError, match="checkpoint_every"):
        train_ensemble(_bnmlps(), *kw["args"], **kw["kwargs"], checkpoint=tmp_path / "b.pt", checkpoint_every=-1)


_FORGERIES = [
    ("models", lambda s: s["models"][1].update({"readout.weight": torch.zeros(3, 3, dtype=F64)})),
    ("velocity", lambda s: s.update(velocity=[torch.zeros(2)])),
    ("lr", lambda s: s.update(lr=torch.zeros(7, dtype=F64))),
    ("done", lambda s: s.update(done=10 ** 9)),
    ("drawn", lambda s: s.update(drawn=s["drawn"] + 1)),
    ("row_ids", lambda s: s.update(row_ids=torch.tensor([0, 0, 1]))),
    ("history", lambda s: s.update(history=torch.zeros(3, 3))),
    ("rng_cpu", lambda s: s.update(rng_cpu=torch.zeros(3, dtype=torch.uint8))),
]


def _forge(good: dict, forge) -> dict:
    forged = {k: (list(v) if isinstance(v, list) else v) for k, v in good.items()}
    forged["models"] = [dict(sd) for sd in good["models"]]
    forge(forged)
    return forged


@pytest.mark.parametrize("key, forge", _FORGERIES, ids=[k for k, _ in _FORGERIES])
def test_a_forged_checkpoint_is_refused_and_leaves_the_models_as_given(tmp_path, monkeypatch, key, forge):
    # the models' entries are checked before any model changes; the rest (vectors, counts, random state)
    # against the run built from the loaded models, after which the models get their given state back
    path, kw = _saved_checkpoint(tmp_path, monkeypatch)
    torch.save(_forge(torch.load(path, weights_only=True), forge), path)
    models = _bnmlps()
    before = [{k: v.clone() for k, v in m.state_dict().items()} for m in models]
    with pytest.raises(ValueError, match="checkpoint="):
        train_ensemble(models, *kw["args"], **kw["kwargs"], checkpoint=path)
    for m, b in zip(models, before):
        assert all(torch.equal(v, b[k]) for k, v in m.state_dict().items())


@pytest.mark.parametrize("key", ["lr", "drawn"])
def test_inside_a_task_a_checkpoint_refused_after_loading_its_models_starts_the_run_afresh(tmp_path, monkeypatch,
                                                                                          key):
    # refused once the models were set to it: in a sweep's task the run trains from step 0 with the models as
    # given — the straight run's numbers — and the file is removed
    kw = _case()
    straight = _run(_bnmlps, kw)
    path, _ = _saved_checkpoint(tmp_path, monkeypatch, kw)
    task_file = tmp_path / "t-0.pt"
    torch.save(_forge(torch.load(path, weights_only=True), dict(_FORGERIES)[key]), task_file)
    with _task_checkpoints(tmp_path, "t", 1e9), pytest.warns(RuntimeWarning, match="starts from step 0"):
        again = _run(_bnmlps, kw)
    _assert_same(straight, again)
    assert not task_file.exists()


def test_inside_a_task_the_engine_names_the_file_and_a_bad_one_is_set_aside(tmp_path, monkeypatch):
    kw = _case()
    straight = _run(_bnmlps, kw)
    # the n-th trainer call of a task gets <dir>/<task>-<n>.pt
    with _task_checkpoints(tmp_path, "t1", 0.0):
        assert _task_checkpoint.claim() == (tmp_path / "t1-0.pt", 0.0)
        assert _task_checkpoint.claim() == (tmp_path / "t1-1.pt", 0.0)
    assert _task_checkpoint.claim() is None
    # interrupted inside a task, resumed inside it
    _interrupt_after(monkeypatch, 2)
    with pytest.raises(_Stop), _task_checkpoints(tmp_path, "t2", 0.0):
        _run(_bnmlps, kw)
    monkeypatch.undo()
    assert (tmp_path / "t2-0.pt").is_file()
    with _task_checkpoints(tmp_path, "t2", 0.0):
        resumed = _run(_bnmlps, kw)
    _assert_same(straight, resumed)
    # a file the engine cannot resume from is removed with a warning, and the task trains from step 0
    (tmp_path / "t3-0.pt").write_bytes(b"garbage")
    with _task_checkpoints(tmp_path, "t3", 1e9), pytest.warns(RuntimeWarning, match="starts from step 0"):
        again = _run(_bnmlps, kw)
    _assert_same(straight, again)
    assert not (tmp_path / "t3-0.pt").exists()
    # a task that trains two ensembles in turn, interrupted in the second: resumed, the first (finished, its
    # final state kept) trains no step again and the second goes on from its save
    other = _case(lr=(0.03, 0.03, 0.03))
    straight_other = _run(_bnmlps, other)
    with _task_checkpoints(tmp_path, "t5", 0.0):
        _run(_bnmlps, kw)
        _interrupt_after(monkeypatch, 1)
        with pytest.raises(_Stop):
            _run(_bnmlps, other)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.glob("t5-*")) == ["t5-0.pt", "t5-1.pt"]
    ran = []
    real_step = ens._EnsembleRun.step
    monkeypatch.setattr(ens._EnsembleRun, "step", lambda self: (ran.append(self.done), real_step(self)))
    with _task_checkpoints(tmp_path, "t5", 0.0):
        first, second = _run(_bnmlps, kw), _run(_bnmlps, other)
    monkeypatch.undo()
    assert ran == list(range(10, 60))
    _assert_same(straight, first)
    _assert_same(straight_other, second)
    # discard removes a task's files and what a killed save left, nothing else
    for name in ("t4-0.pt", "t4-1.pt", ".t4-0.pt.abc.tmp.pt", "t40-0.pt", "other.pt"):
        (tmp_path / name).write_bytes(b"")
    assert _task_checkpoint.discard(tmp_path, "t4") == 3
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("t4", ".t4", "other"))) == \
        ["other.pt", "t40-0.pt"]


def _task_checkpoints(directory, task, every):
    return _task_checkpoint.task_checkpoints(directory, task, every)


def test_batches_from_a_start_are_the_rest_of_the_whole_sequence():
    from bnlab.nets.train import _batches

    cpu = torch.device("cpu")
    for n, b, steps in [(20, 3, 25), (20, 20, 5), (17, 4, 9)]:
        whole = list(_batches(n, b, steps, torch.Generator().manual_seed(5), cpu))
        for start in range(steps + 1):
            rest = list(_batches(n, b, steps, torch.Generator().manual_seed(5), cpu, start=start))
            assert len(rest) == steps - start
            assert all(torch.equal(u, v) for u, v in zip(rest, whole[start:]))


@pytest.mark.parametrize("make", [_bnmlps, _generic], ids=["bnmlp", "grouped-with-dropout"])
def test_a_run_resumed_on_the_compiled_route_equals_the_straight_eager_run(tmp_path, monkeypatch, make):
    # the compiled route keeps its state in the same tensors and restores into them; compiled here by Dynamo's
    # own backend "aot_eager" (the traced functional step without Inductor's code generation: seconds, and the
    # summation order of the eager kernels), so the 1e-10 argument above holds.  The grouped stack has dropout:
    # the compiled step draws the eager step's random numbers (StepRunner checks it from the same generator
    # state, and no probe of the compiled route draws from it), so its check passes.  The grouped case saves after
    # its stopped networks were dropped (the compiled route compacts once half the rows have stopped: 2 of 5
    # here does not, so the resumed run compacts at its own first check — the straight run did at step 10)
    import bnlab.nets._ensemble_step as step_mod

    real = torch.compile
    monkeypatch.setattr(step_mod.torch, "compile",
                        lambda fn, **kw: real(fn, backend="aot_eager", **{k: v for k, v in kw.items() if k != "options"}))
    kw = _case(momentum=0.9, loss="mse", lr=(0.05, 3.0, 0.1, 0.02, 3.0)[: len(make())], steps=40)
    kw["kwargs"]["diverge_above"] = 50.0
    straight = _run(make, kw, step_mode="eager")
    path = tmp_path / "run.pt"
    _interrupt_after(monkeypatch, 2)
    with pytest.raises(_Stop):
        _run(make, kw, path, step_mode="compile")
    monkeypatch.setattr(ck, "write", _REAL_WRITE)  # torch.compile stays patched
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a fallback to eager warns: fail on it
        resumed = _run(make, kw, path, step_mode="compile")
    _assert_same(straight, resumed)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_a_run_resumed_on_the_cuda_graph_route_equals_the_straight_eager_run(tmp_path, monkeypatch):
    # the CUDA-graph route (the default on a GPU for long runs) restores into the tensors it captured
    kw = _case(momentum=0.9, steps=40)
    kw["kwargs"]["device"] = "cuda"
    straight = _run(_bnmlps, kw, step_mode="eager")
    path = tmp_path / "run.pt"
    _interrupt_after(monkeypatch, 2)
    with pytest.raises(_Stop):
        _run(_bnmlps, kw, path, step_mode="cuda_graph")
    monkeypatch.undo()
    resumed = _run(_bnmlps, kw, path, step_mode="cuda_graph")
    # float64 on the GPU: cuBLAS sums in another order than the eager route's kernels may: the tolerance
    # of test_ensemble_step.py's GPU comparison (1e-10 of each tensor's scale) holds for SGD
    _assert_same(straight, resumed)


def test_a_save_that_cannot_be_written_warns_and_the_run_goes_on(tmp_path, monkeypatch):
    # a full disk while saving: the training the checkpoint protects is not lost for it
    kw = _case()
    straight = _run(_bnmlps, kw)
    tries = disk_full(monkeypatch)
    with pytest.warns(RuntimeWarning, match="No space left on device"):
        resumed = _run(_bnmlps, kw, tmp_path / "run.pt")
    assert tries == [10]  # one try, then no more saves
    _assert_same(straight, resumed)


def test_a_run_resumed_on_the_captured_route_equals_the_straight_eager_run_with_stand_in_graphs(tmp_path,
                                                                                               monkeypatch):
    # the captured route's Python on the CPU (tests/nets/_fake_cuda_graphs.py: a capture records the step, a
    # replay runs it on the captured state): the restored tensors are the ones captured, so the replays go on
    # from the save
    from . import _fake_cuda_graphs as fake_cuda_graphs

    kw = _case(momentum=0.9)
    straight = _run(_bnmlps, kw, step_mode="eager")
    events: list = []
    fake_cuda_graphs.install(monkeypatch, events)
    path = tmp_path / "run.pt"
    _interrupt_after(monkeypatch, 2)
    with pytest.raises(_Stop):
        _run(_bnmlps, kw, path, step_mode="cuda_graph")
    monkeypatch.setattr(ck, "write", _REAL_WRITE)  # the stand-in graphs stay
    events.clear()
    resumed = _run(_bnmlps, kw, path, step_mode="cuda_graph")
    assert events.count("capture") == 1 and events.count("replay") >= 30  # steps 20 … 59 on the captured route
    _assert_same(straight, resumed)
