"""train's checkpoint: a one-network run interrupted and resumed computes what the uninterrupted run computes.

Route of the check, as for train_ensemble (tests/nets/test_ensemble_checkpoint.py): the same run twice in one
process — straight through, and stopped right after its k-th save (an exception raised from the save, as a
time limit or Ctrl-C would stop it), then called again with a freshly built model, optimizer, hooks and
transform — and the final parameters, buffers, loss history, end-of-epoch rows and test accuracy compared.

Tolerance.  The resumed run applies the same operations to the same operands in the same order as the
straight run (same process and thread count): the model, the optimizer state, BNP's statistics, the
augmentation's generator and torch's random state are restored bit for bit (``torch.save`` keeps every bit)
and the data order continues from the step count.  What may differ is where the restored tensors lie in
memory, so a BLAS may sum a dot product of k ≤ 64 terms in another order: k·u relative per product (Higham
§3.1), ≈ 7e-15 in float64, ≈ 4e-6 in float32, amplified by the ≤ 80 remaining steps by ≤ 10³ as in
test_ensemble.py: 1e-10 in float64; float32 (the ResNet) 1e-3 relative on losses and accuracies.  One step
changes the weights by ~1e-3 relative or more, so a lost, repeated or replayed-differently step, a stale
optimizer, preconditioner or generator state fails (each is shown to fail below).
"""
from __future__ import annotations

import functools
import importlib
import itertools
import math
import os
import warnings

import pytest
import torch
from torch import nn

import bnlab.nets._checkpoint as ck
from bnlab import _task_checkpoint
from bnlab.nets import train

from ._data import digits
from ._interrupt import REAL_WRITE as _REAL_WRITE
from ._interrupt import Stop as _Stop
from ._interrupt import disk_full
from ._models import dropout_bn_mlp
from ._interrupt import interrupt_after as _interrupt_after

torch.set_num_threads(1)
F64 = torch.float64


def _mlp(seed: int = 0) -> nn.Module:
    """A float64 BN network with dropout (torch's random state) and a bias before BN."""
    return dropout_bn_mlp(seed, width=24, p=0.1)


class _Counted:
    """Counts the training forward passes of a model (steps actually run), outside the run's own parts."""

    def __init__(self, model):
        self.steps = 0
        model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        if module.training:
            self.steps += 1


_OPTIMIZERS = {
    "sgd": functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9, weight_decay=1e-3),
    "adam": functools.partial(torch.optim.Adam, lr=3e-3, weight_decay=1e-4),
    "rmsprop": functools.partial(torch.optim.RMSprop, lr=1e-3, momentum=0.5),
}


def _run(opt="sgd", checkpoint=None, every=0.0, **extra):
    (xtr, ytr), (xte, yte) = digits()
    torch.manual_seed(123)  # dropout's numbers: the same start for both runs
    model = _mlp()
    counted = _Counted(model)
    kw = dict(optimizer=_OPTIMIZERS[opt], batch_size=50, epochs=3, test_data=(xte, yte), eval_every_epoch=True,
              seed=4, check_every=5, **extra)
    if checkpoint is not None:
        kw.update(checkpoint=checkpoint, checkpoint_every=every)
    res = train(model, (xtr, ytr), **kw)
    return model, res, counted.steps


def _assert_same(a, b, tol=1e-10):
    (ma, ra, _), (mb, rb, _) = a, b
    sa, sb = ma.state_dict(), mb.state_dict()
    for k in sa:
        scale = max(1.0, float(sa[k].abs().max())) if sa[k].is_floating_point() else 0.0
        assert float((sa[k].double() - sb[k].double()).abs().max()) <= tol * scale, k
    assert ra.steps == rb.steps and ra.diverged == rb.diverged and ra.diverged_at_step == rb.diverged_at_step
    assert ra.history == pytest.approx(rb.history, rel=2e-7, abs=0)  # losses kept in float32
    assert len(ra.epochs) == len(rb.epochs)
    for x, y in zip(ra.epochs, rb.epochs):
        assert x["epoch"] == y["epoch"] and x["train_loss"] == pytest.approx(y["train_loss"], rel=2e-7)
        assert x["test_accuracy"] == y["test_accuracy"]
    assert ra.test_accuracy == rb.test_accuracy
    assert ra.final_train_loss == pytest.approx(rb.final_train_loss, rel=2e-7)


@pytest.mark.parametrize("opt", sorted(_OPTIMIZERS))
def test_a_resumed_run_equals_the_straight_run(tmp_path, monkeypatch, opt):
    # 28 steps an epoch, 84 in all; a save at every check (every 5 steps and at an epoch's end): stopped after
    # the 7th (step 30, in epoch 2, after one end-of-epoch test), resumed with a new model and optimizer
    straight = _run(opt)
    assert straight[2] == 84
    path = tmp_path / "run.pt"
    saves = _interrupt_after(monkeypatch, 7)
    with pytest.raises(_Stop):
        _run(opt, path)
    assert saves == [5, 10, 15, 20, 25, 28, 30] and path.exists()
    monkeypatch.setattr(ck, "write", _REAL_WRITE)
    resumed = _run(opt, path, every=1e9)
    assert resumed[2] == 84 - 30  # the resumed run does not start over
    _assert_same(straight, resumed)
    assert not path.exists()  # removed once the run has ended


def test_the_comparison_sees_a_lost_step_a_restarted_order_and_a_lost_random_state(tmp_path, monkeypatch):
    # the tolerance above is not vacuous: each of these mistakes of a resume gives other weights
    train_module = importlib.import_module("bnlab.nets.train")  # the module (bnlab.nets.train is the function)

    straight = _run()
    path = tmp_path / "run.pt"
    _interrupt_after(monkeypatch, 3)
    with pytest.raises(_Stop):
        _run(checkpoint=path)
    monkeypatch.undo()
    good = torch.load(path, weights_only=True)
    mistakes = {
        "restarted data order": lambda: monkeypatch.setattr(
            train_module, "_batches", functools.partial(_restarted, train_module._batches)),
        "a step lost": lambda: torch.save(dict(good, done=good["done"] + 1, history=torch.cat(
            [good["history"], good["history"][-1:]])), path),
        "random state not restored": lambda: monkeypatch.setattr(ck.Checkpointer, "restore_rng",
                                                                 lambda self, saved, dev: None),
        "momentum not restored": lambda: torch.save(dict(good, optimizer=dict(good["optimizer"], state={})), path),
    }
    for what, make in mistakes.items():
        torch.save(good, path)
        make()
        resumed = _run(checkpoint=path, every=1e9)
        with pytest.raises(AssertionError):
            _assert_same(straight, resumed)
        monkeypatch.undo()


def _restarted(real, n, batch_size, steps, gen, device, start=0):
    """The remaining steps' batches taken from the start of the data order (a resume that forgot its position)."""
    return itertools.islice(real(n, batch_size, steps, gen, device, start=0), steps - start)


def _images(n: int, split: str, seed: int):
    """8×8×3 images of 4 classes: noise plus a bright channel that tells the class (a learnable task)."""
    from bnlab.data import Dataset

    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=g)
    x = torch.rand(n, 3, 8, 8, generator=g) * 0.3
    x[torch.arange(n), y % 3] += 0.5 * (1 + y // 3).view(-1, 1, 1)
    return Dataset("blobs", split, x, y, 4, ("a", "b", "c", "d"))


def _resnet_run(checkpoint=None, every=0.0, method="bnp"):
    from bnlab.optim import train_resnet

    train_set, test_set = _images(48, "train", 0), _images(16, "test", 1)
    extra = {} if checkpoint is None else dict(checkpoint=checkpoint, checkpoint_every=every)
    return train_resnet(method=method, dataset=(train_set, test_set), depth=20, batch_size=8, epochs=3,
                        milestones=(2,), warmup="linear", warmup_epochs=1, init_scale=0.5, seed=2, **extra)


def _same_resnet(a, b, rel=1e-3):
    assert a.steps == b.steps and a.diverged == b.diverged and len(a.epochs) == len(b.epochs)
    for x, y in zip(a.epochs, b.epochs):
        assert x["epoch"] == y["epoch"]
        assert x["train_loss"] == pytest.approx(y["train_loss"], rel=rel)
        assert x["test_accuracy"] == pytest.approx(y["test_accuracy"], abs=1e-12)
    assert a.final_train_loss == pytest.approx(b.final_train_loss, rel=rel)


def test_a_resumed_resnet_with_bnp_augmentation_and_a_schedule_equals_the_straight_run(tmp_path, monkeypatch):
    # train_resnet: BNP's running statistics (a hook), the crops' generator (the transform), the warm-up and
    # the step decay (a callback; the rate lives in the optimizer's param_groups), SGD's momentum
    straight = _resnet_run()
    path = tmp_path / "resnet.pt"
    saves = _interrupt_after(monkeypatch, 1)
    monkeypatch.setattr(ck.TrainCheckpointer, "due", lambda self: True)
    with pytest.raises(_Stop):
        _resnet_run(path)
    assert saves == [6] and path.exists()  # check_every is train's 10: the check at the end of epoch 1
    monkeypatch.undo()
    resumed = _resnet_run(path, every=1e9)
    _same_resnet(straight, resumed)
    # and without BNP's statistics or the crops' generator restored, the run is another
    from bnlab.data import RandomCropFlip
    from bnlab.optim.training import _PreconditionerStep

    for cls in (_PreconditionerStep, RandomCropFlip):
        monkeypatch.setattr(ck, "write", _REAL_WRITE)
        _interrupt_after(monkeypatch, 1)
        monkeypatch.setattr(ck.TrainCheckpointer, "due", lambda self: True)
        with pytest.raises(_Stop):
            _resnet_run(path)
        monkeypatch.undo()
        monkeypatch.setattr(cls, "load_state_dict", lambda self, sd: None)
        other = _resnet_run(path, every=1e9)
        monkeypatch.undo()
        with pytest.raises(AssertionError):
            _same_resnet(straight, other)


def test_a_callback_without_state_is_refused_with_a_checkpoint(tmp_path):
    (xtr, ytr), _ = digits()
    model = _mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"callbacks\[0\].*not allowed with checkpoint.*state_dict"):
        train(model, (xtr, ytr), optimizer=_OPTIMIZERS["sgd"], batch_size=50, steps=5,
              callbacks=[lambda info: None], checkpoint=tmp_path / "run.pt")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="hooks"):
        train(model, (xtr, ytr), optimizer=_OPTIMIZERS["sgd"], batch_size=50, steps=5,
              hooks=[lambda m: None], checkpoint=tmp_path / "run.pt")
    for bad, match in ((-1.0, "checkpoint_every"), (math.nan, "checkpoint_every")):
        with pytest.raises(ValueError, match=match):
            train(model, (xtr, ytr), optimizer=_OPTIMIZERS["sgd"], batch_size=50, steps=5,
                  checkpoint=tmp_path / "run.pt", checkpoint_every=bad)
    assert not (tmp_path / "run.pt").exists()


def _saved_run(tmp_path, monkeypatch, saves=2):
    path = tmp_path / "run.pt"
    _interrupt_after(monkeypatch, saves)
    with pytest.raises(_Stop):
        _run(checkpoint=path)
    monkeypatch.undo()
    return path, torch.load(path, weights_only=True)


def _forgeries(good: dict) -> dict[str, dict]:
    opt = good["optimizer"]
    state0 = dict(opt["state"][0], momentum_buffer=torch.zeros(3, dtype=F64))
    return {
        "step count": dict(good, done=10_000),
        "history": dict(good, history=good["history"].double()),
        "chance": dict(good, chance=2.0),
        "stop flag": dict(good, stopped="no"),
        "first bad step": dict(good, diverged_at=good["done"] + 3),
        "epoch rows": dict(good, epoch_rows=[{"epoch": 5, "train_loss": 1.0, "test_accuracy": 0.5}]),
        "optimizer groups": dict(good, optimizer=dict(opt, param_groups=opt["param_groups"] * 2)),
        "optimizer state shape": dict(good, optimizer=dict(opt, state={**opt["state"], 0: state0})),
        "optimizer parameter": dict(good, optimizer=dict(opt, state={**opt["state"], 99: {}})),
        "parts": dict(good, parts=[{}]),
        "random state": dict(good, rng_cpu=torch.zeros(3, dtype=torch.uint8)),
        "model entry": dict(good, models=[{k: v[..., :1] if v.ndim else v for k, v in good["models"][0].items()}]),
    }


def test_a_forged_checkpoint_is_refused_and_leaves_the_model_as_given(tmp_path, monkeypatch):
    # a file with this run's fingerprint but entries that do not fit the run: a ValueError naming checkpoint,
    # and the model (and optimizer) as they were given
    path, good = _saved_run(tmp_path, monkeypatch)
    (xtr, ytr), (xte, yte) = digits()
    for what, forged in _forgeries(good).items():
        torch.save(forged, path)
        model = _mlp()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        opt = _OPTIMIZERS["sgd"](model.parameters())
        with pytest.raises(ValueError, match="checkpoint=") as err:
            train(model, (xtr, ytr), optimizer=opt, batch_size=50, epochs=3, test_data=(xte, yte),
                  eval_every_epoch=True, seed=4, check_every=5, checkpoint=path)
        assert isinstance(err.value, ck.CheckpointError), what
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), what
        assert not opt.state, what


def test_a_checkpoint_of_another_run_a_link_and_a_non_checkpoint_are_refused(tmp_path, monkeypatch):
    path, good = _saved_run(tmp_path, monkeypatch)
    (xtr, ytr), (xte, yte) = digits()

    def call(p, **over):
        kw = dict(optimizer=_OPTIMIZERS["sgd"], batch_size=50, epochs=3, test_data=(xte, yte), eval_every_epoch=True,
                  seed=4, check_every=5, checkpoint=p)
        kw.update(over)
        return train(_mlp(), (xtr, ytr), **kw)

    for over in (dict(seed=5), dict(batch_size=40), dict(optimizer=_OPTIMIZERS["adam"]),
                 dict(optimizer=functools.partial(torch.optim.SGD, lr=0.06, momentum=0.9, weight_decay=1e-3))):
        with pytest.raises(ValueError, match="another run"):
            call(path, **over)
    link = tmp_path / "link.pt"
    os.symlink(path, link)
    with pytest.raises(ValueError, match="symbolic link"):
        call(link)
    ensemble_file = tmp_path / "ensemble.pt"
    torch.save({"format": ck.FORMATS["train_ensemble"], "version": ck.VERSION, "fingerprint": "x"}, ensemble_file)
    with pytest.raises(ValueError, match="not a train checkpoint"):
        call(ensemble_file)
    (tmp_path / "junk.pt").write_bytes(b"not torch")
    with pytest.raises(ValueError, match="not a readable checkpoint"):
        call(tmp_path / "junk.pt")


def test_in_a_task_a_bad_file_is_set_aside_and_a_stateless_callback_keeps_none(tmp_path, monkeypatch):
    straight = _run()
    folder = tmp_path / "ck"
    folder.mkdir()
    path, good = _saved_run(tmp_path, monkeypatch)
    torch.save(dict(good, done=10_000), folder / "task-0.pt")  # refused after the model was loaded
    with _task_checkpoints(folder), pytest.warns(RuntimeWarning, match="removed and the run starts from step 0"):
        again = _run()
    assert again[2] == 84
    _assert_same(straight, again)
    # a run with a callback that keeps no state: no checkpoint for that call (its task resumes at whole cells)
    (xtr, ytr), _ = digits()
    writes = _interrupt_after(monkeypatch, 10_000)
    with _task_checkpoints(folder, every=0.0):
        train(_mlp(), (xtr, ytr), optimizer=_OPTIMIZERS["sgd"], batch_size=50, steps=40, check_every=5,
              callbacks=[lambda info: None])
    assert writes == [] and not list(folder.iterdir())


class _NaNAfter(nn.Module):
    """A BN network whose training output turns NaN after ``k`` training forward passes (counted in a buffer,
    so the count is part of its state): a divergence at a step the test chooses."""

    def __init__(self, k: int):
        super().__init__()
        self.body, self.k = _mlp(), k
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        out = self.body(x)
        if self.training:
            self.calls += 1
            if int(self.calls) > self.k:
                out = out * float("nan")
        return out


def test_a_task_s_run_that_diverged_at_an_epoch_s_end_resumes_at_its_end(tmp_path, monkeypatch):
    # 28 steps an epoch, checks every 14: saved at step 14, NaN from step 21, found at the check of step 28
    # (the end of epoch 1, whose test the divergence skips); its final state has no epoch row and is resumed
    # as it is (not set aside as a file that does not fit the run)
    (xtr, ytr), (xte, yte) = digits()

    def run():
        model = _NaNAfter(20)
        counted = _Counted(model)
        res = train(model, (xtr, ytr), optimizer=_OPTIMIZERS["sgd"], batch_size=50, epochs=3, test_data=(xte, yte),
                    eval_every_epoch=True, seed=4, check_every=14)
        return res, counted.steps

    straight, steps = run()
    assert straight.diverged and straight.diverged_at_step == 20 and straight.steps == 28 and not straight.epochs
    folder = tmp_path / "ck"
    folder.mkdir()
    with _task_checkpoints(folder, every=0.0):
        run()
    assert [p.name for p in folder.iterdir()] == ["task-0.pt"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a file set aside warns
        with _task_checkpoints(folder):
            again, steps = run()
    assert steps == 0 and again.diverged_at_step == 20 and again.steps == 28 and again.epochs == []


def _task_checkpoints(folder, every=1e9):
    return _task_checkpoint.task_checkpoints(folder, "task", every)


def test_a_task_s_finished_run_keeps_its_final_state_and_a_later_run_resumes(tmp_path, monkeypatch):
    # a task training twice in turn, interrupted in the second run: on the rerun the first resumes at its end
    # (no step run again) and the second from its save — each equal to its straight run
    first_straight, second_straight = _run(), _run("adam")
    folder = tmp_path / "ck"
    folder.mkdir()
    # 19 saves in the first run (every 5 steps and at the ends of epochs 1 and 2, then its final state); the
    # 22nd is the second run's 3rd
    saves = _interrupt_after(monkeypatch, 22)
    with _task_checkpoints(folder, every=0.0), pytest.raises(_Stop):
        _run()
        _run("adam")
    assert saves[18:] == [84, 5, 10, 15]
    assert sorted(p.name for p in folder.iterdir()) == ["task-0.pt", "task-1.pt"]
    monkeypatch.undo()
    with _task_checkpoints(folder):
        first, second = _run(), _run("adam")
    assert first[2] == 0 and second[2] == 84 - saves[-1]
    _assert_same(first_straight, first)
    _assert_same(second_straight, second)
    # both hold their final state until the engine discards the task's files
    assert _task_checkpoint.discard(folder, "task") == 2


def test_a_save_that_cannot_be_written_warns_and_the_run_goes_on(tmp_path, monkeypatch):
    straight = _run()
    tries = disk_full(monkeypatch)
    with pytest.warns(RuntimeWarning, match="No space left on device"):
        resumed = _run(checkpoint=tmp_path / "run.pt")
    assert tries == [5]
    _assert_same(straight, resumed)


def test_a_run_that_never_saves_never_hashes(tmp_path, monkeypatch):
    # the fingerprint (a hash of the data) is computed only for a save or a resume
    calls = []
    real = ck.fingerprint
    monkeypatch.setattr(ck, "fingerprint", lambda *a, **k: calls.append(1) or real(*a, **k))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _run(checkpoint=tmp_path / "run.pt", every=1e9)
    assert calls == [] and not (tmp_path / "run.pt").exists()


def test_a_run_resumed_on_the_compiled_route_equals_the_straight_eager_run(tmp_path, monkeypatch):
    # step_mode="compile" (Dynamo with the aot_eager backend: the compiled loss and optimizer step, not
    # Inductor's code generation, which the compile tests of train cover): the resumed run starts with a
    # loaded optimizer state, so its first optimizer step is compiled at once (no eager first step)
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, backend="aot_eager",
                                                                        dynamic=kw.get("dynamic"), fullgraph=False))
    straight = _run("adam")
    path = tmp_path / "run.pt"
    _interrupt_after(monkeypatch, 4)
    with pytest.raises(_Stop):
        _run("adam", path, step_mode="compile")
    monkeypatch.setattr(ck, "write", _REAL_WRITE)
    resumed = _run("adam", path, every=1e9, step_mode="compile")
    assert resumed[2] == 84 - 20
    # the compiled graphs' decompositions may order a float64 sum otherwise than the eager kernels: u ≈ 1e-16
    # per operation over 84 steps amplified by ≤ 10³ (module docstring), so 1e-9 with a factor 10 to spare
    _assert_same(straight, resumed, tol=1e-9)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_resumed_run_on_cuda_equals_the_straight_run(tmp_path, monkeypatch):
    # the model, the optimizer state and the data on the GPU, dropout drawing from the CUDA generator (its
    # state saved and restored beside the CPU one); cuBLAS may pick other kernels for restored tensors, so
    # the module docstring's argument with a factor 100 to spare: 1e-8
    def on_cuda(checkpoint=None, every=0.0):
        torch.cuda.manual_seed(7)
        return _run("sgd", checkpoint, every, device="cuda")

    straight = on_cuda()
    path = tmp_path / "run.pt"
    _interrupt_after(monkeypatch, 3)
    with pytest.raises(_Stop):
        on_cuda(path)
    monkeypatch.setattr(ck, "write", _REAL_WRITE)
    resumed = on_cuda(path, every=1e9)
    assert resumed[2] == 84 - 15
    _assert_same(straight, resumed, tol=1e-8)
