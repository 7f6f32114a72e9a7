"""Train the ResNets of Lange et al.'s Figs. 6-7 with BN, GN, BNP or BNP+GN (§5 "Residual Networks", Appendix B).

:func:`train_resnet` builds a CIFAR ResNet (:func:`bnlab.nets.resnet`: ResNet-110 of He et al. 2016a,
its pre-activation version of He et al. 2016b, or ResNet-18) with the normalization of the method,
attaches a :class:`~bnlab.optim.BNPreconditioner` for ``"bnp"`` (the network without normalization)
and ``"bnp_gn"`` (the GroupNorm network), and trains it with momentum SGD, weight decay, a learning
rate warm-up and step decay (:func:`resnet_learning_rate`) on He et al.'s augmented CIFAR data
(:func:`bnlab.data.random_crop_flip`), recording the training loss and test accuracy of every epoch.

Interpretations (the paper leaves these open; see also :mod:`bnlab.reproductions.lange_resnet`):

* Weight decay is SGD's (``torch.optim.SGD(weight_decay=...)``): it is added to the gradient *after*
  BNP has preconditioned it, so the decay itself is not preconditioned.  The paper does not say.
* "He-Normal weight initialization scaled by 0.1" (Appendix B) is W ~ N(0, 2·0.1²/fan_in):
  ``init_scale`` multiplies the weights, so σ_w² = 2·init_scale².
* "group size 4" / "groupsize 32" is read as the number of groups G of GroupNorm (Wu & He 2018 call G
  the group number and use G = 32 by default), i.e. ``num_groups``.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

import torch

from bnlab._task_checkpoint import DEFAULT_EVERY
from bnlab._validation import check_choice, check_int, check_real

__all__ = ["RESNET_METHODS", "WARMUPS", "resnet_learning_rate", "train_resnet"]

#: ``method`` values of :func:`train_resnet`: the normalization layer, or BNP on the plain / GN network.
RESNET_METHODS = ("bn", "gn", "bnp", "bnp_gn")
#: Learning-rate warm-ups of :func:`resnet_learning_rate`.
WARMUPS = ("none", "constant", "linear")


def resnet_learning_rate(step: int, *, base_lr: float, steps_per_epoch: int, milestones: Sequence[int] = (),
                         gamma: float = 0.1, warmup: str = "none", warmup_steps: int = 0,
                         warmup_lr: float = 0.01) -> float:
    """The learning rate of optimizer step ``step`` (0-based) of the ResNet schedules (Lange et al., App. B).

    * Step decay: ``base_lr · gamma^k`` with k the number of ``milestones`` (in epochs) already
      completed, i.e. the rate drops once ``step ≥ milestone · steps_per_epoch`` ("learning rate decay
      at epoch 80/120", §5).
    * ``warmup="constant"``: ``warmup_lr`` for the first ``warmup_steps`` steps, then the schedule —
      He et al. 2016a's ResNet-110 warm-up ("0.01 ... until the training error is below 80% (about
      400 iterations), and then go back to 0.1"), which the paper follows for BN ("initial learning
      rate 0.01 increasing to 0.1 after 400 iterations").
    * ``warmup="linear"``: from ``warmup_lr`` at step 0 linearly to the scheduled rate at step
      ``warmup_steps`` (the paper's GN and BNP+GN: "a linear warmup schedule, with initial learning
      rate 0.01 increasing to 0.1 over 1 or 2 epochs").
    """
    step = check_int("step", step, minimum=0)
    base_lr = check_real("base_lr", base_lr, minimum=0.0, strict_minimum=True)
    steps_per_epoch = check_int("steps_per_epoch", steps_per_epoch, minimum=1)
    milestones = _milestones(milestones)
    gamma = check_real("gamma", gamma, minimum=0.0, maximum=1.0)
    warmup = check_choice("warmup", warmup, WARMUPS)
    warmup_steps = check_int("warmup_steps", warmup_steps, minimum=0)
    warmup_lr = check_real("warmup_lr", warmup_lr, minimum=0.0, strict_minimum=True)
    decays = sum(step >= m * steps_per_epoch for m in milestones)
    lr = base_lr * gamma ** decays
    if warmup == "none" or step >= warmup_steps:
        return lr
    if warmup == "constant":
        return warmup_lr
    return warmup_lr + (lr - warmup_lr) * step / warmup_steps


def _milestones(milestones) -> tuple[int, ...]:
    try:
        out = tuple(check_int("milestones", m, minimum=1) for m in milestones)
    except TypeError:
        raise ValueError(f"milestones={milestones!r} is not allowed: expected a sequence of epochs") from None
    if list(out) != sorted(set(out)):
        raise ValueError(f"milestones={milestones!r} is not allowed: expected strictly increasing epochs")
    return out


def _load(dataset: Any, data_dir: str | None):
    """(train, test) Datasets: loaded by name, or a given pair (tests use synthetic 32×32 images)."""
    from bnlab.data import Dataset, load_dataset

    if isinstance(dataset, str):
        return load_dataset(dataset, "train", data_dir=data_dir), load_dataset(dataset, "test", data_dir=data_dir)
    if (isinstance(dataset, (tuple, list)) and len(dataset) == 2
            and all(isinstance(d, Dataset) for d in dataset)):
        return tuple(dataset)
    raise ValueError(f"dataset={dataset!r} is not allowed: expected a data set name or a (train, test) pair of "
                     "bnlab.data.Dataset")


def train_resnet(
    *,
    method: str = "bnp_gn",
    dataset: Any = "cifar10",
    depth: int = 110,
    preact: bool = False,
    batch_size: int = 128,
    epochs: float = 164,
    lr: float = 0.1,
    momentum: float = 0.9,
    weight_decay: float = 1e-4,
    milestones: Sequence[int] = (80, 120),
    warmup: str = "linear",
    warmup_steps: int | None = None,
    warmup_epochs: float | None = None,
    warmup_lr: float = 0.01,
    init_scale: float = 1.0,
    num_groups: int = 4,
    augment: bool = True,
    train_size: int | None = None,
    test_size: int | None = None,
    rho: float = 0.99,
    eps1: float = 1e-2,
    eps2: float = 1e-4,
    seed: int = 0,
    device: str = "cpu",
    data_dir: str | None = None,
    callbacks: Sequence[Any] = (),
    checkpoint: str | os.PathLike | None = None,
    checkpoint_every: float = DEFAULT_EVERY,
):
    """Train one ResNet of Lange et al. Figs. 6-7 and return per-epoch training loss and test accuracy.

    Parameters
    ----------
    method:
        ``"bn"``, ``"gn"`` (GroupNorm in place of every BN, Wu & He 2018), ``"bnp"`` (the ResNet
        without normalization, convolutions with biases, BNP on every Conv2d and the Linear head) or
        ``"bnp_gn"`` (BNP on the GroupNorm ResNet; its convolutions have no bias, so BNP only rescales
        their gradients, see :mod:`bnlab.optim.bnp`).
    dataset:
        A :mod:`bnlab.data` name (``"cifar10"``, ``"cifar100"``) or a ``(train, test)`` pair of
        :class:`~bnlab.data.Dataset`.  Images are standardized per channel with the training
        statistics (He et al. subtract the per-pixel mean).
    depth, preact:
        :func:`bnlab.nets.resnet`'s ``depth`` (110, 18, or a smaller CIFAR depth) and ``preact``.
    batch_size, epochs, lr, momentum, weight_decay:
        Mini-batch size, epochs (may be fractional), base learning rate, SGD momentum and weight decay.
    milestones, warmup, warmup_steps, warmup_epochs, warmup_lr:
        The schedule of :func:`resnet_learning_rate`; the warm-up length in steps or in epochs (at
        most one of them; neither = no warm-up).
    init_scale:
        He-normal weights times ``init_scale`` (σ_w² = 2·init_scale²); the paper's BNP+GN uses 0.1
        (CIFAR-10) and 0.4 (CIFAR-100).
    num_groups:
        GroupNorm's number of groups for ``"gn"`` / ``"bnp_gn"``; must divide every width.
    augment:
        He et al. 2016a's pad-4 random crop and horizontal flip (:class:`bnlab.data.RandomCropFlip`).
    train_size, test_size:
        Draw that many examples (seeded) for shorter runs; None = all.
    rho, eps1, eps2:
        BNP's hyperparameters (Algorithm 2; the paper's defaults).
    seed, device, data_dir:
        Seed of the data draw, order, augmentation and initialization; torch device; data directory.
    callbacks:
        :func:`bnlab.nets.train` callbacks, called after every step (once the learning rate of the
        next step is set).
    checkpoint, checkpoint_every:
        A file that a run cut short (hours at the paper's length) goes on from when called again with
        the same arguments, saved every that many seconds (:func:`bnlab.nets.train`'s: the network,
        SGD's momentum, BNP's statistics, the augmentation's generator); ``callbacks`` must then keep
        their state the ``torch`` way.  Inside a sweep's task the engine names the file.

    Returns
    -------
    NetworkTrainingResult
        With ``model`` = ``"resnet<depth>"`` or ``"preact_resnet<depth>"`` and ``norm`` = ``method``.
    """
    from bnlab.data import RandomCropFlip, standardize
    from bnlab.nets import resnet
    from bnlab.optim.bnp import BNPreconditioner
    from bnlab.optim.training import _train_and_record

    method = check_choice("method", method, RESNET_METHODS)
    if not isinstance(preact, bool):
        raise ValueError(f"preact={preact!r} is not allowed: expected True or False")
    if not isinstance(augment, bool):
        raise ValueError(f"augment={augment!r} is not allowed: expected True or False")
    batch_size = check_int("batch_size", batch_size, minimum=2 if method in ("bn",) else 1)
    epochs = check_real("epochs", epochs, minimum=0.0, strict_minimum=True)
    lr = check_real("lr", lr, minimum=0.0, strict_minimum=True)
    momentum = check_real("momentum", momentum, minimum=0.0)
    if momentum >= 1.0:
        raise ValueError(f"momentum={momentum!r} is not allowed: expected a number in [0, 1)")
    weight_decay = check_real("weight_decay", weight_decay, minimum=0.0)
    milestones = _milestones(milestones)
    warmup = check_choice("warmup", warmup, WARMUPS)
    if warmup_steps is not None and warmup_epochs is not None:
        raise ValueError(f"warmup_steps={warmup_steps!r}, warmup_epochs={warmup_epochs!r} is not allowed: give at "
                         "most one warm-up length")
    if warmup_steps is not None:
        warmup_steps = check_int("warmup_steps", warmup_steps, minimum=0)
    if warmup_epochs is not None:
        warmup_epochs = check_real("warmup_epochs", warmup_epochs, minimum=0.0)
    warmup_lr = check_real("warmup_lr", warmup_lr, minimum=0.0, strict_minimum=True)
    init_scale = check_real("init_scale", init_scale, minimum=0.0, strict_minimum=True)
    num_groups = check_int("num_groups", num_groups, minimum=1)
    seed = check_int("seed", seed, minimum=0)
    BNPreconditioner._check_hyper(rho, eps1, eps2)

    train_data, test_data = _load(dataset, data_dir)
    name = dataset if isinstance(dataset, str) else train_data.name
    if len(train_data.image_shape) != 3:
        raise ValueError(f"dataset={name!r} is not allowed: expected images (N, C, H, W)")
    if train_size is not None:
        train_size = check_int("train_size", train_size, minimum=batch_size, maximum=len(train_data))
        train_data = train_data.subset(train_size, seed=seed)
    if test_size is not None:
        test_size = check_int("test_size", test_size, minimum=1, maximum=len(test_data))
        test_data = test_data.subset(test_size, seed=seed)
    train_data, test_data = standardize(train_data, test_data)
    steps_per_epoch = len(train_data) // batch_size
    if steps_per_epoch < 1:
        raise ValueError(f"batch_size={batch_size} is not allowed: the training set has only {len(train_data)} images")
    if warmup_epochs is not None:
        warmup_steps = int(round(warmup_epochs * steps_per_epoch))
    warmup_steps = warmup_steps or 0

    base = {"bnp": "none", "bnp_gn": "gn"}.get(method, method)
    nkw = {"num_groups": num_groups} if base == "gn" else None
    net = resnet(depth, train_data.num_classes, norm=base, in_channels=train_data.image_shape[0], preact=preact,
                 init="gaussian", sigma_w2=2.0 * init_scale ** 2, norm_kwargs=nkw, seed=seed).to(device)
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)

    def rate(step: int) -> float:
        return resnet_learning_rate(step, base_lr=lr, steps_per_epoch=steps_per_epoch, milestones=milestones,
                                    warmup=warmup, warmup_steps=warmup_steps, warmup_lr=warmup_lr)

    def set_rate(step: int) -> None:
        for group in opt.param_groups:
            group["lr"] = rate(step)

    set_rate(0)

    next_rate = _NextRate(set_rate)

    transform = RandomCropFlip(padding=4, seed=seed) if augment else None
    model = f"{'preact_' if preact else ''}resnet{depth}"
    return _train_and_record(net, train_data, test_data, model=model, norm=method, dataset=name, optimizer=opt,
                             batch_size=batch_size, epochs=epochs, lr=lr, seed=seed, device=device,
                             callbacks=[next_rate, *callbacks], bnp=dict(rho=rho, eps1=eps1, eps2=eps2),
                             transform=transform, checkpoint=checkpoint, checkpoint_every=checkpoint_every)


class _NextRate:
    """The callback that, after step t, sets the learning rate of step t + 1 (a function of the step only: it
    keeps no state; the rate itself lives in the optimizer's ``param_groups``, which a checkpoint keeps)."""

    def __init__(self, set_rate):
        self._set_rate = set_rate

    def __call__(self, info) -> None:
        self._set_rate(info.step + 1)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict) -> None:
        if state_dict != {}:
            raise ValueError(f"state_dict={state_dict!r} is not allowed: the learning-rate schedule keeps no state")
