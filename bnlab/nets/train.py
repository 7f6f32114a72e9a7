"""One training loop for every bnlab network, and the wrappers of Yang et al. 2019's experiments.

:func:`train` trains any ``nn.Module`` with any ``torch.optim`` optimizer (an instance or a factory
``params -> Optimizer``), runs *hooks* between ``loss.backward()`` and ``optimizer.step()`` (where a
gradient preconditioner rewrites ``.grad`` in place, as kfac-pytorch's ``precond.step()``), calls
*callbacks* after every step (returning True stops), detects divergence (a non-finite loss), keeps
the data order deterministic with a private ``torch.Generator`` and can evaluate once per epoch.

:func:`train_classifier` and :func:`layer_norm_trajectory` are the experiments of Yang et al. 2019
§4 (Figs. 3–5) on a :class:`~bnlab.nets.BNMLP`; :func:`train_classifier` is :func:`train` plus the
BN-MLP's argument checks, and gives the numbers the former ``bnlab.sim.train`` gave (the regression
test ``tests/regression`` holds them).

Optimizers are never chosen by name here: a caller that stores a name (a sweep's cell parameters,
the CLI) maps it to a factory itself, e.g. ``functools.partial(torch.optim.SGD, lr=0.1)``.
"""
from __future__ import annotations

import math
import os
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch
from torch import nn

import copy

from bnlab import _threads
from bnlab._inductor import compile_options
from bnlab._task_checkpoint import DEFAULT_EVERY
from bnlab._validation import check_choice, check_device, check_int, check_real, check_seed
from bnlab.nets._checkpoint import CheckpointError, TrainCheckpointer
from bnlab.nets._compile import compile_failure, fresh_function

__all__ = ["TrainResult", "StepInfo", "train", "train_classifier", "layer_norm_trajectory", "resolve_device",
           "half_squared_error", "TEST_BN_MODES", "TRAIN_STEP_MODES"]

#: how the test pass runs BatchNorm: ``"eval"`` (running statistics) or ``"train"`` (the statistics of
#: each test batch, running statistics left untouched)
TEST_BN_MODES = ("eval", "train")

#: how :func:`train` runs a step (``step_mode``): ``"eager"`` (op by op) or ``"compile"`` (the model and
#: loss, forward and backward, and the optimizer's step compiled by ``torch.compile``)
TRAIN_STEP_MODES = ("eager", "compile")


def half_squared_error(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """½‖f(x) − t‖² summed over the outputs, averaged over the batch; integer class labels become one-hot t.

    The loss of the Fisher paper's Gaussian conditional model p(y|x) ∝ exp(−½‖f(x) − y‖²) (Eq. 10):
    its Gauss–Newton matrix is exactly the Fisher information E_x[∇f ∇fᵀ] whose λmax sets η* (Eq. 7),
    and it is ``bnlab.fisher``'s ``loss="mse"``.  Not ``torch.nn.functional.mse_loss``, which also
    averages over the outputs (a factor of the output dimension in the curvature).
    """
    if not target.is_floating_point():
        target = nn.functional.one_hot(target, output.shape[-1]).to(output.dtype)
    if target.shape != output.shape:
        # broadcasting (N,) against (N, C) would silently compare every output with every target
        raise ValueError(
            f"target is not allowed: shape {tuple(target.shape)} does not match the output's {tuple(output.shape)}"
        )
    return 0.5 * ((output - target) ** 2).sum(dim=-1).mean(dim=-1)


def _test_chunks(n: int, eval_batch_size: int, bn_mode: str) -> list[slice]:
    """Test batches: consecutive chunks of ``eval_batch_size`` (eval mode), or in train mode as few
    near-equal chunks of at most ``eval_batch_size`` (one more sample when it is 2) and at least 2
    samples (a single sample cannot be normalized by its own statistics; the last chunk of a plain
    split could be one)."""
    if bn_mode == "eval":
        return [slice(i, min(i + eval_batch_size, n)) for i in range(0, n, eval_batch_size)]
    if n < 2:
        raise ValueError(f"test_data with {n} sample is not allowed with test_bn_mode='train': batch "
                         "statistics need at least 2 samples")
    k = min(math.ceil(n / eval_batch_size), n // 2)
    bounds = [round(i * n / k) for i in range(k + 1)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


def resolve_device(device: Any) -> torch.device:
    """``torch.device(device)`` ('cpu' or 'cuda'), or a ``ValueError`` naming ``device`` (also when CUDA is absent)."""
    return check_device("device", device)


@dataclass
class TrainResult:
    """Outcome of :func:`train` / :func:`train_classifier`.

    Attributes
    ----------
    test_accuracy:
        Fraction of correctly classified test samples; ``chance`` when diverged; None without test data
        or when the targets are not class labels.
    diverged:
        Whether the training loss (or the test logits) became NaN/inf.
    diverged_at_step:
        The step (0-based) whose loss was first non-finite (None if never).
    steps:
        Optimization steps taken (fewer than asked when diverged or stopped by a callback).
    final_train_loss:
        Mean training loss over the last ≤ 50 steps (NaN when diverged).
    chance:
        1/num_classes (classes = the model's output size), None when unknown.
    history:
        Per-step training losses.
    epochs:
        With ``eval_every_epoch``: one ``{"epoch", "train_loss", "test_accuracy"}`` per completed epoch
        (``train_loss`` is the mean over that epoch's steps).
    stopped_by_callback:
        Whether a callback ended the run.
    test_loss:
        Mean of the training loss function over the test set (BN as ``test_bn_mode`` says); None
        without test data or when diverged.
    """

    test_accuracy: float | None
    diverged: bool
    diverged_at_step: int | None
    steps: int
    final_train_loss: float
    chance: float | None
    history: list[float] = field(default_factory=list)
    epochs: list[dict] = field(default_factory=list)
    stopped_by_callback: bool = False
    test_loss: float | None = None

    def to_dict(self) -> dict:
        """JSON-ready summary: without the per-step history (and without ``epochs``/``stopped_by_callback``
        when they are empty/False, so stored results of the trainability sweeps keep their keys)."""
        d = asdict(self)
        d.pop("history")
        if not d["epochs"]:
            d.pop("epochs")
        if not d["stopped_by_callback"]:
            d.pop("stopped_by_callback")
        if d["test_loss"] is None:
            d.pop("test_loss")
        if not math.isfinite(d["final_train_loss"]):
            d["final_train_loss"] = None
        return d


@dataclass
class StepInfo:
    """What a callback sees after step ``step`` (0-based): the loss (a 0-d tensor, not yet synced to
    the host), the model and the optimizer; ``epoch`` is the (0-based) epoch of the step."""

    step: int
    loss: torch.Tensor
    model: nn.Module
    optimizer: torch.optim.Optimizer
    epoch: int


def _model_dtype(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.get_default_dtype()


def _all_finite(t: torch.Tensor) -> bool:
    """Whether every entry of the floating tensor ``t`` is finite.

    First by one sum: NaN and ±inf propagate through IEEE addition in any order (NaN + a = NaN,
    inf + finite = inf, inf − inf = NaN), so a finite sum proves every entry finite.  That reads
    ``t`` once with no temporary — 13 ms against 250 ms for ``isfinite(t).all()`` on MNIST's 47 M
    training pixels, one thread — and only a sum that is not finite (a NaN/inf entry, or finite
    entries whose sum overflows) takes the elementwise check.
    """
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def _as_tensors(name: str, data: Any, device: torch.device, dtype: torch.dtype):
    """(x, y) tensors from a bnlab.data Dataset (``.x``, ``.y``) or an (x, y) pair; sample shape kept."""
    if hasattr(data, "x") and hasattr(data, "y"):
        x, y = data.x, data.y
    elif isinstance(data, (tuple, list)) and len(data) == 2:
        x, y = data
    else:
        raise ValueError(
            f"{name}={type(data).__name__} is not allowed: expected a Dataset with .x/.y or an (x, y) pair"
        )
    x = torch.as_tensor(np.asarray(x) if not isinstance(x, torch.Tensor) else x)
    y = torch.as_tensor(np.asarray(y) if not isinstance(y, torch.Tensor) else y)
    if x.ndim < 2 or y.ndim < 1 or x.shape[0] != y.shape[0] or x.shape[0] == 0:
        raise ValueError(
            f"{name} is not allowed: expected x of shape (n, ...) and y of shape (n, ...) with n ≥ 1, "
            f"got {tuple(x.shape)} and {tuple(y.shape)}"
        )
    x = x.to(device=device, dtype=dtype)
    if not _all_finite(x):
        raise ValueError(f"{name} is not allowed: its inputs contain NaN or infinite values")
    if y.is_floating_point():
        if not _all_finite(y):
            raise ValueError(f"{name} is not allowed: its targets contain NaN or infinite values")
        return x, y.to(device=device, dtype=dtype)
    return x, y.to(device=device, dtype=torch.long)


def _batches(n: int, batch_size: int, steps: int, gen: torch.Generator, device: torch.device, start: int = 0):
    """Yield ``steps`` index batches: reshuffled epochs (a permutation drawn on the CPU from ``gen``),
    the last partial batch of each epoch dropped.  With ``start``, the first ``start`` batches are
    skipped (a resumed run): the permutations of the epochs before it are still drawn, so the batches
    that follow are those of the whole sequence."""
    per_epoch = n // batch_size
    done = 0
    while done < steps:
        take = min(per_epoch, steps - done)
        if done + take <= start:  # an epoch wholly skipped: its permutation only advances ``gen``
            torch.randperm(n, generator=gen)
        else:
            perm = torch.randperm(n, generator=gen).to(device)
            for i in range(max(0, start - done), take):
                yield perm[i * batch_size : (i + 1) * batch_size]
        done += take


def _build_optimizer(optimizer: Any, model: nn.Module) -> torch.optim.Optimizer:
    if isinstance(optimizer, torch.optim.Optimizer):
        own = {id(p) for p in model.parameters()}
        foreign = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in own]
        if foreign:
            raise ValueError(
                f"optimizer={type(optimizer).__name__} is not allowed: {len(foreign)} of its parameters are not "
                "parameters of the model (build it on model.parameters())"
            )
        return optimizer
    if callable(optimizer):
        opt = optimizer(model.parameters())
        if not isinstance(opt, torch.optim.Optimizer):
            raise ValueError(
                f"optimizer={optimizer!r} is not allowed: the factory returned {type(opt).__name__}, "
                "expected a torch.optim.Optimizer"
            )
        return opt
    raise ValueError(
        f"optimizer={optimizer!r} is not allowed: expected a torch.optim.Optimizer or a callable params -> Optimizer "
        "(e.g. functools.partial(torch.optim.SGD, lr=0.1))"
    )


def _callables(name: str, fns: Any) -> tuple[Callable, ...]:
    if fns is None:
        return ()
    if callable(fns):
        fns = (fns,)
    try:
        fns = tuple(fns)
    except TypeError:
        raise ValueError(f"{name}={fns!r} is not allowed: expected a sequence of callables") from None
    for f in fns:
        if not callable(f):
            raise ValueError(f"{name} is not allowed: {f!r} is not callable")
    return fns


@torch.no_grad()
def _evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, eval_batch_size: int, loss_fn: Callable,
              bn_mode: str = "eval") -> tuple[float, bool, float]:
    """Test accuracy, whether every logit was finite, and the mean test loss.

    ``bn_mode="eval"``: running statistics.  ``"train"``: batch statistics of each test chunk
    (:func:`_test_chunks`), on a copy, so the running statistics are not changed."""
    was_training = model.training
    if bn_mode == "train":
        net = copy.deepcopy(model).train()
    else:
        net = model
        model.eval()
    correct = torch.zeros((), dtype=torch.long, device=x.device)
    finite = torch.ones((), dtype=torch.bool, device=x.device)
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    for sl in _test_chunks(x.shape[0], eval_batch_size, bn_mode):
        logits = net(x[sl])
        finite &= torch.isfinite(logits).all()
        correct += (logits.argmax(dim=1) == y[sl]).sum()
        total += loss_fn(logits, y[sl]).double() * logits.shape[0]
    model.train(was_training)
    return correct.item() / x.shape[0], bool(finite.item()), total.item() / x.shape[0]


@_threads.sized_for_training("model")  # batch-1 training runs on one thread (bnlab._threads)
def train(
    model: nn.Module,
    train_data: Any,
    *,
    optimizer: torch.optim.Optimizer | Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
    batch_size: int,
    steps: int | None = None,
    epochs: float | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = nn.functional.cross_entropy,
    test_data: Any = None,
    hooks: Sequence[Callable[[nn.Module], Any]] = (),
    callbacks: Sequence[Callable[[StepInfo], Any]] = (),
    eval_every_epoch: bool = False,
    seed: int = 0,
    device: str | torch.device = "cpu",
    check_every: int = 10,
    eval_batch_size: int = 1000,
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
    diverge_above: float | None = None,
    test_bn_mode: str = "eval",
    step_mode: str = "eager",
    checkpoint: str | os.PathLike | None = None,
    checkpoint_every: float = DEFAULT_EVERY,
) -> TrainResult:
    """Train ``model`` by minibatch steps and (with ``test_data``) report its test accuracy.

    Each step: a batch of ``batch_size`` samples (epochs reshuffled by a private generator seeded with
    ``seed``, the last partial batch dropped), ``loss = loss_fn(model(x), y)``,
    ``optimizer.zero_grad(set_to_none=True)``, ``loss.backward()``, every ``hook(model)`` in order,
    ``optimizer.step()``, then every ``callback(StepInfo)``; a callback returning True stops training.

    Parameters
    ----------
    model:
        Any ``nn.Module`` (moved to ``device`` in place; left in training mode).  Inputs keep their
        sample shape — a model that wants flat vectors flattens itself.
    train_data, test_data:
        A ``bnlab.data`` Dataset (``.x``, ``.y``) or an ``(x, y)`` pair of arrays/tensors.  Integer
        targets are class labels (``long``); floating targets are cast to the model's dtype.
    optimizer:
        A ``torch.optim.Optimizer`` built on ``model.parameters()`` or a factory called once with
        ``model.parameters()`` (after the move to ``device``).
    batch_size:
        Samples per step (≥ 1, ≤ the training set).  BN layers in training mode reject a batch of one.
    steps, epochs:
        Training length, exactly one: ``epochs`` may be fractional (steps = round(epochs·⌊n/batch⌋), ≥ 1).
    loss_fn:
        ``loss_fn(output, target) -> 0-d tensor`` (cross-entropy by default).
    hooks:
        Callables ``hook(model)`` run after ``backward()`` and before ``step()``.
    callbacks:
        Callables ``cb(StepInfo)`` after every step; returning True stops.
    eval_every_epoch:
        Record ``{"epoch", "train_loss", "test_accuracy"}`` after every completed epoch (needs
        ``test_data``; one host sync per epoch).  A run that ends at an epoch's end takes its final
        test accuracy and loss from that epoch's pass (the model is unchanged; no second pass).
    seed:
        Seed of the data order.
    device:
        ``"cpu"``, ``"cuda"``, ….
    check_every:
        Losses are checked for NaN/inf every this many steps (each check is a host sync).
    eval_batch_size:
        Batch of the test passes (eval mode: running statistics, so it changes nothing beyond rounding).
    transform:
        ``transform(x) -> x'`` applied to every training batch (on ``device``) before the forward pass,
        e.g. data augmentation (:func:`bnlab.data.random_crop_flip`); test batches are not transformed.
        It draws its randomness from its own generator, so the data order stays that of ``seed``.
    diverge_above:
        A training loss above this also counts as divergence (as a non-finite one does), e.g. a
        parameter explosion in a learning-rate phase diagram (the Fisher paper, Fig. 2); None: only
        non-finite losses.
    test_bn_mode:
        ``"eval"`` (running statistics) or ``"train"`` (the statistics of each test batch of at most
        ``eval_batch_size``, running statistics untouched) for the test accuracy and ``test_loss``.
    step_mode:
        ``"eager"`` or ``"compile"``: from the second step on, ``loss_fn(model(x), y)`` is compiled by
        ``torch.compile`` (its backward by AOTAutograd) and so is ``optimizer.step()`` (torch's compiled
        optimizer: one fused update for all parameters); ``transform``, hooks and callbacks stay
        eager between them.  Same numbers to rounding; a model or optimizer that does not compile gives
        a warning and the eager step.  Worth it where a step is many small operations (small batches,
        a GPU); compiling takes seconds to minutes, once per call.
    checkpoint:
        A file to keep the run's state in, so that a run cut short (a batch job's time limit, a killed
        worker, Ctrl-C) goes on from its last save when called again with the same arguments: if the
        file exists, the model (given as for a fresh run), the optimizer, the hooks, callbacks and
        ``transform`` are set to the saved state and training goes on from the saved step; the state is
        saved after a divergence check once ``checkpoint_every`` seconds have passed since the last
        save; the file is removed when the run ends.  Every hook, callback and ``transform`` must keep
        its state the ``torch`` way (``state_dict()`` / ``load_state_dict()``; a stateless one returns
        ``{}``), else a ``ValueError``.  A file of another run (other model, data, optimizer or options),
        or anything but such a checkpoint, is a ``ValueError`` (``bnlab.nets._checkpoint`` says what a
        checkpoint holds and how it is checked).  Inside a sweep's task the engine names the file.
    checkpoint_every:
        Seconds between two saves (default 300; 0: at every check).

    Returns
    -------
    TrainResult
        A non-finite training loss (or one above ``diverge_above``) stops the run: ``diverged=True``,
        ``diverged_at_step`` the first bad step, ``test_accuracy = chance``.  Non-finite test logits
        also count as diverged.  ``test_loss`` is ``loss_fn`` over the test set (classifiers only).

    Notes
    -----
    Same model initialization, optimizer, ``seed`` and device → the same numbers (CPU kernels are
    deterministic for a fixed thread count; on CUDA cuBLAS may reorder sums).
    """
    run = _check_train_args(
        model, train_data, batch_size=batch_size, steps=steps, epochs=epochs, loss_fn=loss_fn, test_data=test_data,
        hooks=hooks, callbacks=callbacks, eval_every_epoch=eval_every_epoch, seed=seed, device=device,
        check_every=check_every, eval_batch_size=eval_batch_size, transform=transform, diverge_above=diverge_above,
        test_bn_mode=test_bn_mode, step_mode=step_mode,
    )
    claimed = TrainCheckpointer.claim(checkpoint, checkpoint_every, run)
    model.to(run.device).train()
    opt = _build_optimizer(optimizer, model)
    _check_hyperparameters(opt, run.dtype)
    saver = TrainCheckpointer.for_run(claimed, model, opt, run) if claimed is not None else None
    progress = _TrainProgress(losses=torch.empty(run.steps, device=run.device))
    saved = saver.resume([model], run.device) if saver is not None else None
    if saved is not None:
        try:
            saver.restore(opt, run, progress, saved, run.device)
        except CheckpointError as exc:  # the model is given back its state (raises, unless in a sweep's task)
            saver.abandon([model], exc)
            progress = _TrainProgress(losses=torch.empty(run.steps, device=run.device))
    _train_steps(model, opt, run, progress, saver)
    if saver is not None:
        saver.finish(model, opt, progress, run.device)
    return _train_result(model, run, progress)


@dataclass(frozen=True)
class _TrainRun:
    """The validated arguments of :func:`train`: the data on the device, the length in steps, the options."""

    device: torch.device
    dtype: torch.dtype
    x_train: torch.Tensor
    y_train: torch.Tensor
    test: tuple | None  # (x, y) on the device
    batch_size: int
    steps: int
    per_epoch: int  # steps per epoch, ⌊n/batch_size⌋
    seed: int
    check_every: int
    eval_batch_size: int
    loss_fn: Callable
    transform: Callable | None
    diverge_above: float | None
    test_bn_mode: str
    hooks: tuple
    callbacks: tuple
    eval_every_epoch: bool
    step_mode: str

    def evaluate(self, model: nn.Module) -> tuple[float, bool, float]:
        """:func:`_evaluate` on the test data (accuracy, all logits finite, mean loss)."""
        return _evaluate(model, self.test[0], self.test[1], self.eval_batch_size, self.loss_fn, self.test_bn_mode)


def _check_train_args(model, train_data, *, batch_size, steps, epochs, loss_fn, test_data, hooks, callbacks,
                      eval_every_epoch, seed, device, check_every, eval_batch_size, transform, diverge_above,
                      test_bn_mode, step_mode) -> _TrainRun:
    """Validate :func:`train`'s arguments (before the model is moved or an optimizer built)."""
    dev = resolve_device(device)
    if not isinstance(model, nn.Module):
        raise ValueError(f"model={type(model).__name__} is not allowed: expected a torch.nn.Module")
    dtype = _model_dtype(model)
    x_tr, y_tr = _as_tensors("train_data", train_data, dev, dtype)
    test = None if test_data is None else _as_tensors("test_data", test_data, dev, dtype)
    n = x_tr.shape[0]
    batch_size = check_int("batch_size", batch_size, minimum=1)
    if batch_size > n:
        raise ValueError(f"batch_size={batch_size} is not allowed: the training set has only {n} samples")
    seed = check_seed("seed", seed)
    check_every = check_int("check_every", check_every, minimum=1)
    eval_batch_size = check_int("eval_batch_size", eval_batch_size, minimum=1)
    if (epochs is None) == (steps is None):
        raise ValueError(f"epochs={epochs!r}, steps={steps!r} is not allowed: give exactly one of them")
    per_epoch = n // batch_size
    if epochs is not None:
        epochs = check_real("epochs", epochs, minimum=0.0, strict_minimum=True)
        steps = max(1, int(round(epochs * per_epoch)))
        _check_training_time("epochs", epochs, steps, model, batch_size, dev)
    steps = check_int("steps", steps, minimum=1)
    _check_training_time("steps", steps, steps, model, batch_size, dev)
    if transform is not None and not callable(transform):
        raise ValueError(f"transform={transform!r} is not allowed: expected None or a callable x -> x")
    if not callable(loss_fn):
        raise ValueError(f"loss_fn={loss_fn!r} is not allowed: expected a callable (output, target) -> loss")
    if diverge_above is not None:
        diverge_above = check_real("diverge_above", diverge_above)
    test_bn_mode = check_choice("test_bn_mode", test_bn_mode, TEST_BN_MODES)
    if test is not None:
        _test_chunks(test[0].shape[0], eval_batch_size, test_bn_mode)  # refuses a 1-sample test set in train mode
    hooks = _callables("hooks", hooks)
    callbacks = _callables("callbacks", callbacks)
    if eval_every_epoch and test is None:
        raise ValueError("eval_every_epoch=True is not allowed without test_data")
    step_mode = check_choice("step_mode", step_mode, TRAIN_STEP_MODES)
    return _TrainRun(dev, dtype, x_tr, y_tr, test, batch_size, steps, per_epoch, seed, check_every, eval_batch_size,
                     loss_fn, transform, diverge_above, test_bn_mode, hooks, callbacks, eval_every_epoch, step_mode)


@dataclass
class _TrainProgress:
    """What the step loop of :func:`train` leaves behind."""

    losses: torch.Tensor  # (steps,) on the device; the first ``done`` are filled
    done: int = 0  # steps taken
    diverged_at: int | None = None
    stopped: bool = False  # by a callback
    chance: float | None = None  # 1/classes, known after the first forward pass (None: not a classifier)
    epoch_rows: list = field(default_factory=list)
    # (steps done, _evaluate's result) of the latest end-of-epoch test pass: when training ends there,
    # the model is the one just evaluated, and the final result reuses that pass instead of a second one
    epoch_eval: tuple | None = None


def _train_steps(model: nn.Module, opt: torch.optim.Optimizer, run: _TrainRun, progress: _TrainProgress,
                 saver: TrainCheckpointer | None = None) -> _TrainProgress:
    """The step loop: batch, loss, backward, hooks, optimizer step, callbacks, divergence checks, epoch tests
    and saves; from ``progress.done`` on (a resumed run), unless that run had ended."""
    if progress.stopped or progress.diverged_at is not None or progress.done == run.steps:
        return progress
    step_fns = _StepFunctions(model, run.loss_fn, opt, run.step_mode)
    gen = torch.Generator().manual_seed(run.seed)
    x_tr, y_tr = run.x_train, run.y_train
    start = progress.done
    for step, idx in enumerate(_batches(x_tr.shape[0], run.batch_size, run.steps, gen, run.device, start=start),
                               start=start):
        xb = x_tr[idx]
        xb = xb if run.transform is None else run.transform(xb)
        if step == 0:  # eager: the labels are checked against the outputs before the loss sees them
            out = model(xb)
            progress.chance = _check_targets_once(out, y_tr, run.test)
            loss = run.loss_fn(out, y_tr[idx])
        else:
            loss = step_fns.loss(xb, y_tr[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for hook in run.hooks:
            hook(model)
        step_fns.optimizer_step()
        progress.losses[step] = loss.detach()
        progress.done = done = step + 1
        if run.callbacks and _callbacks_stop(run.callbacks, StepInfo(
                step=step, loss=loss.detach(), model=model, optimizer=opt, epoch=step // run.per_epoch)):
            progress.stopped = True
        last = done == run.steps or progress.stopped
        end_of_epoch = done % run.per_epoch == 0
        checked = done % run.check_every == 0 or last or (run.eval_every_epoch and end_of_epoch)
        if checked:
            progress.diverged_at = _first_bad_step(progress.losses, done, run.check_every, run.diverge_above)
            if progress.diverged_at is not None:
                break
        if run.eval_every_epoch and end_of_epoch:
            _test_epoch(model, run, progress)
        if progress.stopped:
            break
        if checked and not last and saver is not None and saver.due():
            saver.save(model, opt, progress, run.device)
    return progress


def _callbacks_stop(callbacks: tuple, info: StepInfo) -> bool:
    """Call every callback (all of them, even after one asked to stop); True if any returned true."""
    stop = False
    for cb in callbacks:
        ret = cb(info)
        if ret is not None and bool(ret):
            stop = True
    return stop


def _first_bad_step(losses: torch.Tensor, done: int, check_every: int, diverge_above: float | None) -> int | None:
    """The first step among the last ≤ ``check_every`` whose loss is non-finite or above ``diverge_above``
    (one host sync), or None."""
    window = losses[done - min(check_every, done) : done]
    bad_mask = ~torch.isfinite(window)
    if diverge_above is not None:
        bad_mask |= window > diverge_above
    if bad_mask.any():
        bad = bad_mask.nonzero()[0].item()
        return done - window.numel() + bad
    return None


def _test_epoch(model: nn.Module, run: _TrainRun, progress: _TrainProgress) -> None:
    """The end-of-epoch row of ``eval_every_epoch``: the epoch's mean training loss and the test accuracy."""
    done, per_epoch = progress.done, run.per_epoch
    acc, finite, test_loss = run.evaluate(model) if progress.chance is not None else (None, True, None)
    progress.epoch_eval = (done, (acc, finite, test_loss))
    progress.epoch_rows.append({"epoch": done // per_epoch,
                                "train_loss": float(progress.losses[done - per_epoch : done].mean().item()),
                                "test_accuracy": acc if finite else None})


def _train_result(model: nn.Module, run: _TrainRun, progress: _TrainProgress) -> TrainResult:
    """The :class:`TrainResult` of a finished loop (the final test pass unless the last epoch's is reusable)."""
    done, chance, epoch_rows, stopped = progress.done, progress.chance, progress.epoch_rows, progress.stopped
    history = progress.losses[:done].cpu().tolist()
    if progress.diverged_at is not None:
        return TrainResult(None if run.test is None else chance, True, progress.diverged_at, done, float("nan"),
                           chance, history, epoch_rows, stopped)
    final = float(np.mean(history[-50:]))
    if run.test is None:
        return TrainResult(None, False, None, done, final, chance, history, epoch_rows, stopped)
    if chance is None:  # not a classifier (floating targets): no accuracy to report
        return TrainResult(None, False, None, done, final, chance, history, epoch_rows, stopped)
    if progress.epoch_eval is not None and progress.epoch_eval[0] == done:
        acc, finite, test_loss = progress.epoch_eval[1]
    else:
        acc, finite, test_loss = run.evaluate(model)
    if not finite:
        return TrainResult(chance, True, None, done, final, chance, history, epoch_rows, stopped)
    return TrainResult(acc, False, None, done, final, chance, history, epoch_rows, stopped, test_loss)


def _check_hyperparameters(opt: torch.optim.Optimizer, dtype: torch.dtype) -> None:
    """Every number of the optimizer's parameter groups must be finite and representable in the parameters'
    dtype: torch raises "value cannot be converted to type float without overflow" at the first step for
    lr=1e308 on float32 parameters (a finite lr that only makes the loss explode is reported as divergence)."""
    big = float(torch.finfo(dtype).max) if dtype.is_floating_point else math.inf
    for group in opt.param_groups:
        for key, v in group.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            if not math.isfinite(v) or abs(v) > big:
                raise ValueError(
                    f"optimizer {key}={v!r} is not allowed: not a finite number representable in the parameters' "
                    f"{str(dtype).replace('torch.', '')} (at most {big:.3g})"
                )


#: A training run estimated (:func:`_training_seconds`) to take longer than this (a day) is refused up front.
MAX_TRAINING_SECONDS = 86400.0


def _training_seconds(steps: int, model: nn.Module, batch_size: int, device: torch.device) -> float:
    """A lower estimate of a run's time: per step 0.2 ms of Python, optimizer and kernel launches (a step of a
    100-unit MLP takes ~1 ms on one core of this project's CPUs) plus forward and backward at 6 flops per
    parameter and sample, at 1e11 flop/s (CPU) or 1e13 (CUDA)."""
    params = sum(p.numel() for p in model.parameters())
    rate = 1e13 if device.type == "cuda" else 1e11
    return float(steps) * (2e-4 + 6.0 * params * batch_size / rate)


def _check_training_time(name: str, value, steps: int, model: nn.Module, batch_size: int, device) -> None:
    secs = _training_seconds(steps, model, batch_size, device)
    if secs > MAX_TRAINING_SECONDS:
        raise ValueError(
            f"{name}={value!r} is not allowed: {steps:.3g} steps of batch {batch_size} would take at least "
            f"{secs:.3g} s ({secs / 86400:.3g} days), more than {MAX_TRAINING_SECONDS / 86400:g} day(s)"
        )


class _StepFunctions:
    """:func:`train`'s ``loss_fn(model(x), y)`` and ``optimizer.step()``, eager or compiled.

    Compiled: two ``torch.compile`` regions (the forward with the loss, whose backward AOTAutograd
    compiles; the optimizer's step), each on a private code object (``_compile.fresh_function``).  A
    compilation failure in either, raised before the compiled code runs, gives a warning and the eager
    function from then on.  The first optimizer step is eager (it creates the optimizer's state), then
    the state's step counts are made float64 (:func:`_count_steps_in_float64`) before the compiled
    step first runs."""

    def __init__(self, model: nn.Module, loss_fn: Callable, opt: torch.optim.Optimizer, mode: str):
        def forward_loss(x, y):
            return loss_fn(model(x), y)

        def optimizer_step():
            opt.step()

        self._opt = opt
        self._first_step = True
        self._eager = {"loss": forward_loss, "optimizer_step": opt.step}
        self._compiled: dict[str, Callable] = {}
        if mode == "compile":
            # dynamic=False: automatic dynamic shapes would carry a previous run's sizes over (Dynamo
            # keys them by the function's file, line and name, not by code object) and trace this run
            # with symbolic sizes
            self._compiled = {"loss": torch.compile(fresh_function(forward_loss), dynamic=False, options=compile_options()),
                              "optimizer_step": torch.compile(fresh_function(optimizer_step), dynamic=False,
                                                              options=compile_options())}

    def _call(self, name: str, *args):
        fn = self._compiled.get(name)
        if fn is None:
            return self._eager[name](*args)
        try:
            return fn(*args)
        except Exception as e:
            reason = compile_failure(e)
            if reason is None:
                raise
            warnings.warn(f"train: the compiled {name.replace('_', ' ')} failed to compile ({reason}); running it "
                          "eagerly instead", RuntimeWarning, stacklevel=3)
            del self._compiled[name]
            return self._eager[name](*args)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self._call("loss", x, y)

    def optimizer_step(self) -> None:
        if self._first_step and "optimizer_step" in self._compiled:
            self._first_step = False
            if not self._opt.state:  # Dynamo would create the state while tracing, with float32 counts
                self._eager["optimizer_step"]()
                _count_steps_in_float64(self._opt)
                return
            _count_steps_in_float64(self._opt)
        self._call("optimizer_step")


def _count_steps_in_float64(opt: torch.optim.Optimizer) -> None:
    """Make the optimizer's ``state[p]["step"]`` counts float64 (where a float32 count is not required).

    torch.optim keeps a step count as a float32 scalar tensor (float64 only under a float64 default
    dtype).  Its eager step reads it with ``.item()`` and evaluates Adam's bias corrections
    ``1 - beta**t`` in Python's double precision; its compiled step keeps the tensor and evaluates them
    in float32, where ``1 - 0.999`` at ``t = 1`` is 1.3e-5 off, the update 6.6e-6 off (relative) and
    the compiled run no longer the eager one to rounding.  Counted in float64 (exact, as the float32
    count is below 2**24 steps), the compiled step evaluates what the eager one does.  Fused steps
    (float32 counts by contract) and MPS (no float64) are left alone."""
    for group in opt.param_groups:
        if group.get("fused"):
            continue
        for p in group["params"]:
            step = opt.state.get(p, {}).get("step")
            if (isinstance(step, torch.Tensor) and step.is_floating_point() and step.dtype != torch.float64
                    and step.device.type != "mps"):
                opt.state[p]["step"] = step.to(torch.float64)


def _check_targets_once(out: torch.Tensor, y_tr: torch.Tensor, test) -> float | None:
    """Check class labels against the model's output size at the first step; return 1/classes."""
    if out.ndim == 2 and y_tr.is_floating_point() and y_tr.ndim == 1:
        # one float per sample for a model of C outputs: neither class indices (integers) nor regression
        # targets (N, C); cross-entropy would fail deep inside torch and a squared error would broadcast
        raise ValueError(
            f"train_data is not allowed: its targets are floats of shape {tuple(y_tr.shape)} for a model with "
            f"{out.shape[1]} outputs; give integer class labels or targets of shape (n, {out.shape[1]})"
        )
    if out.ndim != 2 or y_tr.is_floating_point():
        return None
    k = out.shape[1]
    ys = [y_tr] + ([] if test is None else [test[1]])
    for y in ys:
        if int(y.min()) < 0 or int(y.max()) >= k:
            raise ValueError(f"labels are not allowed: they must lie in [0, {k}) for a model with {k} outputs")
    return 1.0 / k


# --------------------------------------------------------------------------- Yang et al. 2019 wrappers
def _check_bnmlp(model, batch_size, n_train):
    batch_size = check_int("batch_size", batch_size, minimum=2)
    if batch_size > n_train:
        raise ValueError(f"batch_size={batch_size} is not allowed: the training set has only {n_train} samples")
    if model.sub_batch_size is not None and batch_size % model.sub_batch_size:
        raise ValueError(
            f"batch_size={batch_size} is not allowed: it must be a multiple of the model's "
            f"sub_batch_size={model.sub_batch_size}"
        )
    return batch_size


def _flat_features(name, data, model, dev):
    x, y = _as_tensors(name, data, dev, model.readout.weight.dtype)
    x = x.reshape(x.shape[0], -1)
    if x.shape[1] != model.in_features:
        raise ValueError(f"{name} with {x.shape[1]} features is not allowed: the model expects {model.in_features}")
    if y.is_floating_point() or y.ndim != 1 or int(y.min()) < 0 or int(y.max()) >= model.num_classes:
        raise ValueError(f"labels are not allowed: they must be integers in [0, {model.num_classes})")
    return x, y


def train_classifier(
    model,
    train_data: Any,
    test_data: Any,
    *,
    optimizer: torch.optim.Optimizer | Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
    batch_size: int,
    epochs: float | None = None,
    steps: int | None = None,
    seed: int = 0,
    device: str | torch.device = "cpu",
    eval_batch_size: int = 1000,
    check_every: int = 10,
) -> TrainResult:
    """Train a :class:`~bnlab.nets.BNMLP` on cross-entropy and return its test accuracy (Yang et al. 2019 §4).

    :func:`train` with the BN-MLP's checks: ``batch_size ≥ 2`` and a multiple of the model's
    ``sub_batch_size``, inputs flattened to ``in_features``, labels in ``[0, num_classes)``, and a
    test set required.  The paper trains with SGD (Figs. 3a,b,d, 5) and RMSProp (Fig. 3c) at
    η = 1e-5·B; pass the optimizer as a factory, e.g. ``functools.partial(torch.optim.SGD, lr=...)``.
    """
    dev = resolve_device(device)
    _is_bnmlp(model)
    x_tr, y_tr = _flat_features("train", train_data, model, dev)
    batch_size = _check_bnmlp(model, batch_size, x_tr.shape[0])
    x_te, y_te = _flat_features("test", test_data, model, dev)
    return train(model, (x_tr, y_tr), optimizer=optimizer, batch_size=batch_size, steps=steps, epochs=epochs,
                 test_data=(x_te, y_te), seed=seed, device=dev, check_every=check_every,
                 eval_batch_size=eval_batch_size)


def _is_bnmlp(model) -> bool:
    from bnlab.nets.models import BNMLP

    if not isinstance(model, BNMLP):
        raise ValueError(f"model={type(model).__name__} is not allowed: expected a BNMLP")
    return True


def layer_norm_trajectory(
    model,
    train_data: Any,
    *,
    optimizer: torch.optim.Optimizer | Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
    batch_size: int,
    steps: int = 10,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> dict[str, np.ndarray]:
    """Per-layer norms of a :class:`~bnlab.nets.BNMLP` during its first ``steps`` optimization steps
    (Yang et al. 2019, Fig. 4).

    At every step t = 0, …, ``steps`` the current weights W^l are measured, a training batch is
    forwarded, the cross-entropy is backpropagated and the gradients at the pre-activations h^l (before
    BN, Eq. 7) and at W^l are measured; then (for t < ``steps``) the optimizer takes a step.  Row t
    therefore describes the network after t updates.

    Returns
    -------
    dict
        ``weight_norm``, ``preact_grad_norm``, ``weight_grad_norm``: float64 arrays of shape
        (steps + 1, depth) of Frobenius norms (layer 1 = the input layer first); ``loss``: (steps + 1,).
        ``preact_grad_norm`` is the norm over the whole batch and all neurons of ∂loss/∂h^l, whose square
        grows by λ_G (Yang et al. 2019, Thm 3.9) per layer towards the input at initialization.
    """
    dev = resolve_device(device)
    _is_bnmlp(model)
    x_tr, y_tr = _flat_features("train", train_data, model, dev)
    batch_size = _check_bnmlp(model, batch_size, x_tr.shape[0])
    steps = check_int("steps", steps, minimum=0)
    seed = check_seed("seed", seed)
    model.to(dev).train()
    opt = _build_optimizer(optimizer, model)
    gen = torch.Generator().manual_seed(seed)
    w_norm, g_norm, wg_norm, losses = [], [], [], []
    for t, idx in enumerate(_batches(x_tr.shape[0], batch_size, steps + 1, gen, dev)):
        with torch.no_grad():
            w_norm.append(torch.stack([w.detach().norm() for w in model.weights]))
        loss = nn.functional.cross_entropy(model(x_tr[idx], record=True), y_tr[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        g_norm.append(torch.stack([h.grad.norm() for h in model.recorded_preactivations]))
        wg_norm.append(torch.stack([w.grad.norm() for w in model.weights]))
        losses.append(loss.detach())
        if t < steps:
            opt.step()
    model.recorded_preactivations = []

    def _np(rows):
        return torch.stack(rows).to(torch.float64).cpu().numpy()

    return {
        "weight_norm": _np(w_norm),
        "preact_grad_norm": _np(g_norm),
        "weight_grad_norm": _np(wg_norm),
        "loss": _np(losses),
    }
