"""Train Lange et al.'s networks with BNP or a normalization layer, one call (Figs. 3-5, ``bnlab train``).

:func:`train_network` builds the fully connected network (three hidden layers of 100, ReLU,
post-activation normalization, Glorot-uniform weights and zero biases: Lange et al. §5 and
Appendix B) or the 5-layer CNN (:class:`bnlab.nets.BNPCNN`), trains it with SGD through
:func:`bnlab.nets.train` and returns the per-epoch training loss and test accuracy.  ``norm="bnp"``
is the vanilla network with a :class:`~bnlab.optim.BNPreconditioner` between ``backward()`` and
``step()``; ``"bnp_gn"`` is BNP on the GroupNorm network (§5, "BNP+GN").
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch

from bnlab._task_checkpoint import DEFAULT_EVERY
from bnlab._validation import (DEFAULT_MAX_MEMORY_BYTES, check_choice, check_device, check_int, check_real,
                               check_seed)
from bnlab._vocabulary import NORM_ALIASES, canonical_value

__all__ = ["TRAIN_NORMS", "TRAIN_MODELS", "default_learning_rate", "build_network", "train_network",
           "NetworkTrainingResult"]

#: ``norm`` values of :func:`train_network`: BNP, BNP on GroupNorm, and bnlab.nets' normalizations.
TRAIN_NORMS = ("bnp", "bnp_gn", "none", "bn", "brn", "ln", "gn")
TRAIN_MODELS = ("fc", "cnn")

# Lange et al. Table 2 (fully connected, SGD): mini-batch 60 is MNIST's row; 6 and 1 are CIFAR-10's
# (the paper reports no MNIST learning rates there).  Entries the paper marks N/A borrow the nearest
# method's value (BRN ← BN, GN ← LN).
_FC_LR = {
    60: {"none": 0.1, "bn": 0.5, "bnp": 0.5, "brn": 0.5, "ln": 0.1, "gn": 0.1, "bnp_gn": 0.5},
    6: {"none": 5e-3, "bn": 5e-2, "bnp": 5e-2, "brn": 5e-2, "ln": 5e-2, "gn": 5e-2, "bnp_gn": 5e-2},
    1: {"none": 5e-4, "bnp": 0.1, "ln": 1e-2, "gn": 1e-2, "bnp_gn": 0.1, "bn": 1e-2, "brn": 1e-2},
}
# Table 3 (5-layer CNN, CIFAR-10, SGD; the paper's vanilla at 128 used Adam, not reproduced here).
_CNN_LR = {
    128: {"none": 0.1, "bn": 0.1, "bnp": 0.1, "brn": 0.1, "ln": 0.1, "gn": 0.1, "bnp_gn": 0.1},
    2: {"none": 1e-3, "bn": 1e-3, "bnp": 1e-2, "brn": 1e-2, "ln": 1e-3, "gn": 1e-3, "bnp_gn": 1e-2},
    1: {"none": 1e-3, "bnp": 0.1, "ln": 1e-3, "gn": 1e-3, "bnp_gn": 0.1, "bn": 1e-3, "brn": 1e-3},
}


def default_learning_rate(model: str, norm: str, batch_size: int) -> float:
    """The paper's tuned SGD learning rate for (model, norm) at the nearest reported batch size.

    Lange et al. Table 2 (FC: batch 60 / 6 / 1) and Table 3 (CNN: 128 / 2 / 1); the row is the
    reported batch size nearest to ``batch_size`` on a log scale.
    """
    check_choice("model", model, TRAIN_MODELS)
    norm = check_choice("norm", canonical_value("norm", norm, NORM_ALIASES), TRAIN_NORMS)
    batch_size = check_int("batch_size", batch_size, minimum=1)
    table = _FC_LR if model == "fc" else _CNN_LR
    row = min(table, key=lambda b: abs(math.log(b) - math.log(batch_size)))
    return table[row][norm]


@dataclass
class NetworkTrainingResult:
    """Outcome of :func:`train_network`.

    ``epochs``: one ``{"epoch", "train_loss", "test_accuracy"}`` per completed epoch, plus a final
    row at the fractional epoch count when training stops mid-epoch.  ``test_accuracy`` is the
    final one; ``diverged`` whether the loss became non-finite.
    """

    model: str
    norm: str
    dataset: str
    batch_size: int
    learning_rate: float
    epochs_requested: float
    steps: int
    epochs: list[dict[str, Any]]
    test_accuracy: float | None
    final_train_loss: float
    diverged: bool
    seconds: float
    train_size: int
    test_size: int
    seed: int
    callbacks_data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _num_groups(widths: Sequence[int]) -> int:
    # GroupNorm needs the group count to divide every width; 4 groups as the paper's ResNets when possible.
    for g in (4, 2, 1):
        if all(w % g == 0 for w in widths):
            return g
    return 1


def build_network(model: str, norm: str, in_shape, num_classes: int, *, widths=(100, 100, 100), seed: int = 0,
                  max_memory_bytes: int = DEFAULT_MAX_MEMORY_BYTES):
    """The network of :func:`train_network` (no preconditioner attached; ``bnp`` → the vanilla
    network, ``bnp_gn`` → the GroupNorm network, 4 groups where the widths allow)."""
    from bnlab.nets import MLP, BNPCNN

    base = {"bnp": "none", "bnp_gn": "gn"}.get(norm, norm)
    if model == "fc":
        kwargs = {"norm_kwargs": {"num_groups": _num_groups(widths)}} if base == "gn" else {}
        return MLP(math.prod(in_shape), list(widths), num_classes, phi="relu", norm=base, placement="post",
                   init="glorot_uniform", seed=seed, max_memory_bytes=max_memory_bytes, **kwargs)
    kwargs = {"norm_kwargs": {"num_groups": _num_groups((32, 64, 32, 64))}} if base == "gn" else {}
    return BNPCNN(tuple(in_shape), num_classes, norm=base, seed=seed, max_memory_bytes=max_memory_bytes, **kwargs)


def train_network(
    *,
    model: str = "fc",
    norm: str = "bnp",
    dataset: str = "mnist",
    batch_size: int = 60,
    epochs: float = 1.0,
    lr: float | None = None,
    momentum: float = 0.0,
    widths: Sequence[int] = (100, 100, 100),
    train_size: int | None = None,
    test_size: int | None = None,
    rho: float = 0.99,
    eps1: float = 1e-2,
    eps2: float = 1e-4,
    native: bool = False,
    seed: int = 0,
    device: str = "cpu",
    callbacks: Sequence[Callable] = (),
    data_dir: str | None = None,
    max_memory_bytes: int = DEFAULT_MAX_MEMORY_BYTES,
    checkpoint: str | os.PathLike | None = None,
    checkpoint_every: float = DEFAULT_EVERY,
) -> NetworkTrainingResult:
    """Train Lange et al.'s FC network or 5-layer CNN with ``norm`` and report per-epoch loss and accuracy.

    ``epochs`` may be fractional (steps = round(epochs · ⌊n/batch⌋), as :func:`bnlab.nets.train`).
    ``lr=None`` takes :func:`default_learning_rate`.  ``train_size`` / ``test_size`` draw that many
    examples (seeded) for quick runs.  BN and Batch Renorm cannot train at ``batch_size=1`` (the
    mini-batch variance of one sample is zero): that is a ``ValueError``, as the paper reports
    (§5, "BN and BN Renorm do not train").  BNP's hyperparameters are ``rho``, ``eps1``, ``eps2``;
    ``native=True`` gives BNP its compiled CPU kernels (:class:`~bnlab.optim.BNPreconditioner`'s
    ``native``: the same preconditioned gradients to rounding, a faster step at small batches).
    ``widths`` are the FC network's hidden widths (the CNN has fixed ones: ``widths`` with
    ``model="cnn"`` is refused unless it is the default).  The network's parameters are checked against
    ``max_memory_bytes`` (default 1 GiB; ``bnlab train --max-memory-gb``) before it is built.
    ``checkpoint``, ``checkpoint_every``: a file that a run cut short goes on from when called again with
    the same arguments, saved every that many seconds (:func:`bnlab.nets.train`'s; BNP's running
    statistics included); ``callbacks`` must then keep their state the ``torch`` way.
    """
    from bnlab.data import DATASET_NAMES, load_dataset
    from bnlab.optim.bnp import BNPreconditioner

    model = check_choice("model", model, TRAIN_MODELS)
    dataset = check_choice("dataset", dataset, DATASET_NAMES)  # named as the caller knows it, before any work
    norm = check_choice("norm", canonical_value("norm", norm, NORM_ALIASES), TRAIN_NORMS)
    batch_size = check_int("batch_size", batch_size, minimum=1)
    epochs = check_real("epochs", epochs, minimum=0.0, strict_minimum=True)
    if lr is None:
        lr = default_learning_rate(model, norm, batch_size)
    lr = check_real("lr", lr, minimum=0.0, strict_minimum=True)
    momentum = check_real("momentum", momentum, minimum=0.0)
    if momentum >= 1.0:
        raise ValueError(f"momentum={momentum!r} is not allowed: expected a number in [0, 1)")
    seed = check_seed("seed", seed)
    device = check_device("device", device)
    if isinstance(widths, (str, bytes)):
        raise ValueError(f"widths={widths!r} is not allowed: expected a sequence of positive integers")
    try:
        widths = tuple(check_int("widths", w, minimum=1) for w in widths)
    except TypeError:
        raise ValueError(f"widths={widths!r} is not allowed: expected a sequence of positive integers") from None
    if not widths:
        raise ValueError("widths=() is not allowed: expected at least one hidden layer")
    if model == "cnn" and widths != (100, 100, 100):
        raise ValueError(f"widths={list(widths)} is not allowed with model='cnn': the CNN's layers are fixed "
                         "(widths sets the FC network's hidden layers)")
    max_memory_bytes = check_int("max_memory_bytes", max_memory_bytes, minimum=1)
    if norm in ("bn", "brn") and batch_size == 1:
        raise ValueError(
            f"norm={norm!r} with batch_size=1 is not allowed: batch normalization of one sample has zero "
            "variance and cannot train (Lange et al. §5); use norm='bnp', 'ln' or 'none'"
        )
    BNPreconditioner._check_hyper(rho, eps1, eps2)
    if not isinstance(native, bool):
        raise ValueError(f"native={native!r} is not allowed: expected True or False")
    if native and norm not in ("bnp", "bnp_gn"):
        raise ValueError(
            f"native=True is not allowed with norm={norm!r}: it selects BNP's compiled CPU kernels, and "
            f"norm={norm!r} trains without BNP; use norm='bnp' or 'bnp_gn', or leave native out"
        )

    train_data = load_dataset(dataset, "train", data_dir=data_dir)
    test_data = load_dataset(dataset, "test", data_dir=data_dir)
    if batch_size > (len(train_data.y) if train_size is None else check_int("train_size", train_size, minimum=1)):
        raise ValueError(f"batch_size={batch_size} is not allowed: larger than the {train_size or len(train_data.y)} "
                         "training examples")
    if train_size is not None:
        train_size = check_int("train_size", train_size, minimum=batch_size, maximum=len(train_data.y))
        train_data = train_data.subset(train_size, seed=seed)
    if test_size is not None:
        test_size = check_int("test_size", test_size, minimum=1, maximum=len(test_data.y))
        test_data = test_data.subset(test_size, seed=seed)

    net = build_network(model, norm, tuple(train_data.x.shape[1:]), train_data.num_classes, widths=widths,
                        seed=seed, max_memory_bytes=max_memory_bytes)

    def make_optimizer(params):
        return torch.optim.SGD(params, lr=lr, momentum=momentum)

    return _train_and_record(net, train_data, test_data, model=model, norm=norm, dataset=dataset,
                             optimizer=make_optimizer, batch_size=batch_size, epochs=epochs, lr=lr, seed=seed,
                             device=device, callbacks=callbacks, bnp=dict(rho=rho, eps1=eps1, eps2=eps2, native=native),
                             checkpoint=checkpoint, checkpoint_every=checkpoint_every)


class _PreconditionerStep:
    """The hook of a BNP run: ``pre.step()`` between ``backward()`` and ``optimizer.step()``, keeping the
    preconditioner's state the ``torch`` way, so a checkpoint of :func:`bnlab.nets.train` holds its running
    statistics."""

    def __init__(self, pre):
        self.pre = pre

    def __call__(self, _model) -> None:
        self.pre.step()

    def state_dict(self) -> dict:
        return self.pre.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.pre.load_state_dict(state_dict)


def _train_and_record(net, train_data, test_data, *, model: str, norm: str, dataset: str, optimizer, batch_size: int,
                      epochs: float, lr: float, seed: int, device, callbacks: Sequence[Callable], bnp: dict,
                      transform=None, checkpoint=None, checkpoint_every: float = DEFAULT_EVERY
                      ) -> NetworkTrainingResult:
    """The one training driver under :func:`train_network` and :func:`~bnlab.optim.train_resnet`.

    Moves ``net`` to ``device``; for ``norm`` ``"bnp"``/``"bnp_gn"`` attaches a
    :class:`~bnlab.optim.BNPreconditioner` (``bnp``: its keyword arguments) stepped between
    ``backward()`` and ``step()``; trains with :func:`bnlab.nets.train` (``optimizer``: an optimizer or
    a factory, evaluation every epoch; ``checkpoint``, ``checkpoint_every`` as there); and returns the
    per-epoch rows, closed by a row at the fractional epoch count when training stopped mid-epoch.
    Arguments are checked by the callers.
    """
    from bnlab.nets import train
    from bnlab.optim.bnp import BNPreconditioner

    net = net.to(device)
    hooks = []
    if norm in ("bnp", "bnp_gn"):
        hooks.append(_PreconditionerStep(BNPreconditioner(net, **bnp)))
    t0 = time.perf_counter()
    res = train(net, train_data, optimizer=optimizer, batch_size=batch_size, epochs=epochs, test_data=test_data,
                hooks=hooks, callbacks=callbacks, eval_every_epoch=True, seed=seed, device=device,
                transform=transform, checkpoint=checkpoint, checkpoint_every=checkpoint_every)
    seconds = time.perf_counter() - t0
    rows = [dict(r) for r in (res.epochs or [])]
    steps_per_epoch = len(train_data.y) // batch_size
    done_epochs = res.steps / steps_per_epoch if steps_per_epoch else 0.0
    if not rows or abs(rows[-1]["epoch"] - done_epochs) > 1e-9:
        rows.append({"epoch": round(done_epochs, 6), "train_loss": res.final_train_loss,
                     "test_accuracy": res.test_accuracy})
    return NetworkTrainingResult(
        model=model, norm=norm, dataset=dataset, batch_size=batch_size, learning_rate=lr,
        epochs_requested=epochs, steps=res.steps, epochs=rows, test_accuracy=res.test_accuracy,
        final_train_loss=res.final_train_loss, diverged=res.diverged, seconds=seconds,
        train_size=len(train_data.y), test_size=len(test_data.y), seed=seed,
    )
