"""Batched ensembles: train many networks of one architecture together, network for network as :func:`train`.

A grid of trainability cells (Yang et al. 2019, Figs. 3–5; the learning-rate × γ phase diagram of the
Fisher part) trains hundreds of small networks that differ only in seed, learning rate and a few
per-network constants.  On a CPU each of their matrix products is tiny (a batch of 8–128 samples
times a 128 × 128 weight), so one-at-a-time training is dominated by per-operation overhead.
:func:`train_ensemble` stacks the M networks along a leading axis and runs one batched product per
layer (``torch.bmm``), so the overhead is paid once per ensemble instead of once per network.

Two stackings, chosen by the kind of the models:

* :class:`~bnlab.nets.BNMLP` (Yang et al. 2019, Eq. 7): the networks may differ in depth, γ, β and ε
  (and seed).  They are sorted by depth, deepest first, and layer l is computed for the k_l networks
  deeper than l only — a prefix of the stack — so the work is Σ_m depth_m, not M·max depth (no
  padding); γ, β, ε enter as (M, 1, 1) tensors.
* any other ``nn.Module``: the networks must be identical up to their parameter and buffer values
  (checked: same ``repr``, same names and shapes).  Their state is stacked with
  ``torch.func.stack_module_state`` and the forward pass is ``vmap(functional_call(...))``; a
  per-network constant of such a model must be a buffer (it is then stacked like the weights).

The training loop is that of :func:`bnlab.nets.train` with cross-entropy or ½‖f − onehot(y)‖² and
SGD or RMSProp (torch.optim's updates, with momentum and weight decay): per-network learning rates
(a tensor of M values), per-network data order (each network has its own ``torch.Generator`` seeded
with its seed, drawing the same batches :func:`train` would; networks with equal seeds share one
draw), and per-network divergence detection — a network whose loss is not finite (or exceeds
``diverge_above``: a parameter explosion in a learning-rate phase diagram) stops updating (its update
is masked) while the others go on; its result reports the step as :func:`train` does.  After
training, the final parameters and buffers are written back into the given models.  The test pass
reports accuracy and the mean test loss, with BN on running statistics or on each test batch's.

Same models, seeds and learning rates → the same numbers as one-at-a-time :func:`train` to rounding
(``tests/nets/test_ensemble.py`` derives the tolerance): the batched product sums in the same
order per output element on the CPU, but BLAS may block a ``bmm`` differently from an ``mm``.
"""
from __future__ import annotations

import copy
import math
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from bnlab import _threads
from bnlab._validation import check_choice, check_int, check_real, check_seed
from bnlab.nets.train import (
    TEST_BN_MODES,
    TrainResult,
    _as_tensors,
    _batches,
    _test_chunks,
    half_squared_error,
    resolve_device,
)

__all__ = ["ENSEMBLE_OPTIMIZERS", "ENSEMBLE_LOSSES", "train_ensemble"]

#: optimizers :func:`train_ensemble` implements (with torch.optim's update formulas)
ENSEMBLE_OPTIMIZERS = ("sgd", "rmsprop")
#: losses :func:`train_ensemble` trains on: softmax cross-entropy, or ½‖f − onehot(y)‖²
#: (:func:`~bnlab.nets.half_squared_error`, the Fisher paper's Gaussian model)
ENSEMBLE_LOSSES = ("cross_entropy", "mse")


# --------------------------------------------------------------------------- stacks
class _SampleVariance(torch.autograd.Function):
    """``h.var(dim=2, unbiased=False, keepdim=True)`` of a float32 CPU tensor (k, groups, b, width), faster.

    torch computes a float32 variance along a non-innermost axis on the CPU by a scalar Welford
    recurrence in float64 (``WelfordOps<float, double>``), ~1 ms for a (8, 1, 128, 128) batch — as long as
    the matrix product before it.  The two-pass formula in float64 (mean, then the mean of squared
    deviations) is four vectorized passes, 1.6–7× faster (``benchmarks/bench_ensemble.py``).  Both are
    exact to ~b·2⁻⁵³ relative before the one rounding to float32, so they give the same float32 value
    except where the float64 value lies that close to a rounding boundary, and then differ by one ulp:
    none of 13 million random variances differed, but over the ~10⁸ variances of the small-scale
    trainability sweeps a few do, and a chaotic deep net amplifies one ulp (measured: 2 of 188 networks
    of Yang et al. Figs. 3a–c, 5a–d ended with another test accuracy, 0.9195 → 0.927 and 0.0985 → 0.1005;
    every comparison row and verdict unchanged).  ``tests/nets/test_ensemble.py`` asserts one ulp.
    The backward is torch's own ``var_backward`` formula, (2/b)·grad·(h − mean), term for term.
    """

    @staticmethod
    def forward(ctx, h: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(h)
        hd = h.double()
        return (hd - hd.mean(2, keepdim=True)).square_().mean(2, keepdim=True).to(h.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (h,) = ctx.saved_tensors
        return (2.0 / h.shape[2]) * grad * (h - h.mean(2, keepdim=True))


def _sample_variance(h: torch.Tensor) -> torch.Tensor:
    return _SampleVariance.apply(h)


class _BNMLPStack:
    """M :class:`~bnlab.nets.BNMLP` as stacked tensors, deepest first (Yang et al. 2019, Eq. 7)."""

    def __init__(self, models: Sequence[nn.Module], dev: torch.device):
        first = models[0]
        for i, m in enumerate(models):
            for attr in ("in_features", "num_classes", "width", "sub_batch_size", "momentum", "sigma_w2"):
                if getattr(m, attr) != getattr(first, attr):
                    raise ValueError(
                        f"models[{i}] is not allowed: its {attr}={getattr(m, attr)!r} differs from models[0]'s "
                        f"{getattr(first, attr)!r} (an ensemble shares the architecture; depth, γ, β, ε may differ)"
                    )
            if m.base_activation.spec != first.base_activation.spec:
                raise ValueError(f"models[{i}] is not allowed: its φ={m.base_activation.spec!r} differs from "
                                 f"models[0]'s {first.base_activation.spec!r}")
            if m.affine != "frozen":
                raise ValueError(f"models[{i}] with affine={m.affine!r} is not allowed: the BN-MLP ensemble "
                                 "supports frozen γ, β (the paper's setting)")
            if m.readout.weight.dtype != first.readout.weight.dtype:
                raise ValueError(f"models[{i}] is not allowed: its dtype differs from models[0]'s")
        self.models = list(models)
        self.dtype = first.readout.weight.dtype
        self.act = first.base_activation.torch
        self.sub_batch_size = first.sub_batch_size
        self.momentum = first.momentum
        depths = [m.depth for m in models]
        # stable sort, deepest first: layer l is computed for the prefix of networks deeper than l
        self.order = sorted(range(len(models)), key=lambda i: -depths[i])
        self.inverse = np.argsort(self.order)
        self.depths = [depths[i] for i in self.order]
        self.max_depth = self.depths[0]
        self.k = [sum(d > l for d in self.depths) for l in range(self.max_depth)]

        def col(vals):
            return torch.tensor([vals[i] for i in self.order], dtype=self.dtype, device=dev).view(-1, 1, 1)

        self.gamma = col([m.gamma for m in models])
        self.beta = col([m.beta for m in models])
        self.eps = col([m.eps for m in models])
        self.affine = bool(any(m.gamma != 1.0 or m.beta != 0.0 for m in models))
        ms = [models[i] for i in self.order]
        with torch.no_grad():
            self.weights = [torch.stack([m.weights[l].detach() for m in ms[: self.k[l]]]).to(dev).requires_grad_()
                            for l in range(self.max_depth)]
            self.readout_w = torch.stack([m.readout.weight.detach() for m in ms]).to(dev).requires_grad_()
            self.readout_b = torch.stack([m.readout.bias.detach() for m in ms]).to(dev).requires_grad_()
            self.running_mean = [torch.stack([m.running_mean[l] for m in ms[: self.k[l]]]).to(dev)
                                 for l in range(self.max_depth)]
            self.running_var = [torch.stack([m.running_var[l] for m in ms[: self.k[l]]]).to(dev)
                                for l in range(self.max_depth)]

    def params(self) -> list[torch.Tensor]:
        return [*self.weights, self.readout_w, self.readout_b]

    def param_network_axis_sizes(self) -> list[int]:
        return [w.shape[0] for w in self.params()]

    def forward(self, x: torch.Tensor, training: bool, update_stats: bool = True) -> torch.Tensor:
        """Logits (M, n, classes) in the caller's network order, for inputs x (M, n, in_features) or a
        shared x (n, in_features); ``update_stats=False``: batch statistics without touching the running ones."""
        # x (n, in) is one input shared by every network (broadcast in the first product, never copied)
        a = x if x.ndim == 2 else x[torch.as_tensor(self.order, device=x.device)]
        finished = []
        for layer in range(self.max_depth):
            k = self.k[layer]
            if a.ndim == 3 and k < a.shape[0]:
                # networks of depth ≤ layer are done: their last activations wait for the readout
                finished.append(a[k:])
                a = a[:k]
            h = torch.matmul(a, self.weights[layer].transpose(1, 2))
            eps = self.eps[:k]
            if training:
                out = self._batch_norm(h, layer, eps, update_stats)
            else:
                out = (h - self.running_mean[layer].unsqueeze(1)) * torch.rsqrt(self.running_var[layer].unsqueeze(1) + eps)
            if self.affine:
                out = self.gamma[:k] * out + self.beta[:k]
            a = self.act(out)
        finished.append(a)
        a = torch.cat(finished[::-1], dim=0)
        logits = torch.baddbmm(self.readout_b.unsqueeze(1), a, self.readout_w.transpose(1, 2))
        return logits[torch.as_tensor(self.inverse, device=x.device)]

    def _batch_norm(self, h: torch.Tensor, layer: int, eps: torch.Tensor, update_stats: bool = True) -> torch.Tensor:
        # ghost_batch_norm (bnlab.nets.norms) with a leading network axis and a per-network ε
        k, n, width = h.shape
        b = self.sub_batch_size or n
        if n % b:
            raise ValueError(f"batch of {n} samples is not allowed with sub_batch_size={b}: it must be a multiple of it")
        hg = h.reshape(k, n // b, b, width)
        mean = hg.mean(dim=2, keepdim=True)
        var = _sample_variance(hg) if hg.dtype == torch.float32 and hg.device.type == "cpu" else \
            hg.var(dim=2, unbiased=False, keepdim=True)
        out = (hg - mean) * torch.rsqrt(var + eps.view(k, 1, 1, 1))
        if not update_stats:
            return out.reshape(k, n, width)
        with torch.no_grad():
            batch_mean, batch_var = mean.squeeze(2), var.squeeze(2) * (b / (b - 1))
            if n != b:  # average over the ghost batches (with one batch the mean is the value itself)
                batch_mean, batch_var = batch_mean.mean(1), batch_var.mean(1)
            else:
                batch_mean, batch_var = batch_mean.squeeze(1), batch_var.squeeze(1)
            self.running_mean[layer].lerp_(batch_mean, self.momentum)
            self.running_var[layer].lerp_(batch_var, self.momentum)
        return out.reshape(k, n, width)

    def write_back(self) -> None:
        ms = [self.models[i] for i in self.order]
        with torch.no_grad():
            for pos, m in enumerate(ms):
                dev = m.readout.weight.device
                for layer in range(m.depth):
                    m.weights[layer].copy_(self.weights[layer][pos].to(dev))
                    m.running_mean[layer].copy_(self.running_mean[layer][pos].to(dev))
                    m.running_var[layer].copy_(self.running_var[layer][pos].to(dev))
                m.readout.weight.copy_(self.readout_w[pos].to(dev))
                m.readout.bias.copy_(self.readout_b[pos].to(dev))


class _VmapStack:
    """M identical ``nn.Module`` (up to their tensors): ``stack_module_state`` + ``vmap(functional_call)``."""

    def __init__(self, models: Sequence[nn.Module], dev: torch.device):
        from torch.func import functional_call, stack_module_state

        first = models[0]
        shapes0 = {k: tuple(v.shape) for k, v in [*first.named_parameters(), *first.named_buffers()]}
        for i, m in enumerate(models):
            if type(m) is not type(first) or repr(m) != repr(first):
                raise ValueError(f"models[{i}] is not allowed: its structure ({type(m).__name__}) differs from "
                                 "models[0]'s; an ensemble shares one architecture")
            shapes = {k: tuple(v.shape) for k, v in [*m.named_parameters(), *m.named_buffers()]}
            if shapes != shapes0:
                raise ValueError(f"models[{i}] is not allowed: its parameter/buffer shapes differ from models[0]'s")
        self.models = list(models)
        self._data_ndim = 0  # ndim of the training inputs (n, ...), set by train_ensemble
        self.rows = list(range(len(models)))  # the caller's index of each stacked network
        self._dropped: dict[int, tuple] = {}  # caller index -> final (parameters, buffers) of a dropped network
        for m in models:
            m.to(dev)
        params, buffers = stack_module_state(list(models))
        self.names = list(params)
        self.param_list = [params[k] for k in self.names]
        self.buffers = buffers
        # the base runs on the "meta" device (no memory): functional_call substitutes every tensor
        self.base = copy.deepcopy(first).to("meta")

        def one(p, b, x):
            return functional_call(self.base, (p, b), (x,))

        self._one = one

    def params(self) -> list[torch.Tensor]:
        return self.param_list

    def forward(self, x: torch.Tensor, training: bool, update_stats: bool = True) -> torch.Tensor:
        from torch.func import vmap

        self.base.train(training)
        p = dict(zip(self.names, self.param_list))
        shared = x.ndim == self._data_ndim  # one batch (n, ...) for every network
        # BN in train mode updates its running statistics in place: a test pass on batch statistics
        # works on copies of the buffers
        keep = update_stats or not training
        buffers = self.buffers if keep else {k: v.clone() for k, v in self.buffers.items()}
        return vmap(self._one, in_dims=(0, 0, None if shared else 0), randomness="different")(p, buffers, x)

    def compact(self, keep: torch.Tensor) -> None:
        """Keep only the stacked networks at positions ``keep``; the others' final state is set aside."""
        kept = set(keep.tolist())
        with torch.no_grad():
            for pos, i in enumerate(self.rows):
                if pos not in kept:
                    self._dropped[i] = ([v[pos].clone() for v in self.param_list],
                                        {k: v[pos].clone() for k, v in self.buffers.items()})
            self.param_list = [v.detach()[keep].requires_grad_() for v in self.param_list]
            self.buffers = {k: v[keep] for k, v in self.buffers.items()}
        self.rows = [self.rows[pos] for pos in keep.tolist()]

    def write_back(self) -> None:
        with torch.no_grad():
            states = {i: ([v[pos] for v in self.param_list], {k: v[pos] for k, v in self.buffers.items()})
                      for pos, i in enumerate(self.rows)}
            states.update(self._dropped)
            for i, m in enumerate(self.models):
                params, buffers = states[i]
                for k, v in zip(self.names, params):
                    m.get_parameter(k).copy_(v)
                for k, v in buffers.items():
                    m.get_buffer(k).copy_(v)


# --------------------------------------------------------------------------- arguments
def _per_network(name: str, value: Any, m: int, *, minimum: float | None = None, strict: bool = False,
                 integer: bool = False) -> list:
    """A scalar broadcast to M values, or a sequence/tensor of M values, each checked."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().tolist()
    elif isinstance(value, np.ndarray):
        value = value.tolist()
    vals = list(value) if isinstance(value, (list, tuple)) else [value] * m
    if len(vals) != m:
        raise ValueError(f"{name} with {len(vals)} values is not allowed: expected one per model ({m})")
    check = check_int if integer else check_real
    kw = {"minimum": minimum} if minimum is not None else {}
    if strict and not integer:
        kw["strict_minimum"] = True
    return [check(f"{name}[{i}]", v, **kw) for i, v in enumerate(vals)]


def _check_models(models: Any) -> list[nn.Module]:
    try:
        models = list(models)
    except TypeError:
        raise ValueError(f"models={models!r} is not allowed: expected a sequence of nn.Module") from None
    if not models:
        raise ValueError("models=[] is not allowed: give at least one model")
    for i, m in enumerate(models):
        if not isinstance(m, nn.Module):
            raise ValueError(f"models[{i}]={type(m).__name__} is not allowed: expected a torch.nn.Module")
    if len({id(m) for m in models}) != len(models):
        raise ValueError("models is not allowed: the same model object appears twice")
    return models


def _reported_steps(bad_step: int, check_every: int, steps: int) -> int:
    """Steps :func:`train` reports for a run whose first non-finite loss is at ``bad_step``: it runs on
    to the next check (every ``check_every`` steps, and the last step)."""
    return min(steps, check_every * math.ceil((bad_step + 1) / check_every))


# --------------------------------------------------------------------------- training
@_threads.sized_for_training("models")  # small ensembles run on one thread (bnlab._threads)
def train_ensemble(
    models: Sequence[nn.Module],
    train_data: Any,
    *,
    lr: float | Sequence[float] | torch.Tensor,
    batch_size: int,
    steps: int | None = None,
    epochs: float | None = None,
    optimizer: str = "sgd",
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    rmsprop_alpha: float = 0.99,
    rmsprop_eps: float = 1e-8,
    loss: str = "cross_entropy",
    test_data: Any = None,
    seeds: int | Sequence[int] = 0,
    device: str | torch.device = "cpu",
    check_every: int = 10,
    eval_batch_size: int = 1000,
    diverge_above: float | None = None,
    test_bn_mode: str = "eval",
) -> list[TrainResult]:
    """Train M networks of one architecture together on one loss; one :class:`TrainResult` each.

    Network m follows :func:`bnlab.nets.train` with ``optimizer=torch.optim.SGD(lr=lr[m],
    momentum=momentum, weight_decay=weight_decay)`` (or ``RMSprop(lr=lr[m], alpha=rmsprop_alpha,
    eps=rmsprop_eps, momentum=momentum, weight_decay=weight_decay)``), ``loss_fn`` cross-entropy or
    :func:`~bnlab.nets.half_squared_error`, ``seed=seeds[m]``, the same ``batch_size``,
    ``steps``/``epochs``, ``check_every``, ``eval_batch_size``, ``diverge_above`` and
    ``test_bn_mode``, and gives the same numbers to rounding (see the module docstring).

    Parameters
    ----------
    models:
        M ``nn.Module`` of one architecture: :class:`~bnlab.nets.BNMLP` that may differ in depth, γ,
        β, ε and initialization, or any other module identical up to its tensors (per-network constants
        as buffers).  Trained in place (the final state is written back).
    train_data, test_data:
        A ``bnlab.data`` Dataset or an ``(x, y)`` pair with integer class labels (as :func:`train`).
    lr:
        Learning rate: one value for all, or M values (a list, array or tensor), each > 0.
    batch_size, steps, epochs:
        As :func:`train` (shared by all networks).
    optimizer:
        ``"sgd"`` or ``"rmsprop"`` (torch.optim.SGD's / RMSprop's update).
    momentum, weight_decay:
        As torch.optim's (heavy ball v ← μ v + d, θ ← θ − η v, with d the gradient (SGD) or the
        RMSProp-scaled gradient; the gradient includes weight_decay·θ).  The Fisher paper's phase
        diagrams use SGD with μ = 0.9 (its Eq. 1).
    rmsprop_alpha, rmsprop_eps:
        RMSProp's decay and ε (torch's defaults; TensorFlow's are 0.9 and 1e-10).
    loss:
        ``"cross_entropy"`` or ``"mse"`` (½‖f − onehot(y)‖², :func:`~bnlab.nets.half_squared_error`).
    seeds:
        Seeds of the data order: one for all (a shared order, drawn once) or M values.
    device, check_every, eval_batch_size:
        As :func:`train`; ``check_every`` is how often the host looks at the losses (to stop early
        when every network has diverged and to report divergence as :func:`train` does).
    diverge_above:
        As :func:`train`: a training loss above it counts as divergence (a parameter explosion).
    test_bn_mode:
        As :func:`train`: the test pass (accuracy and ``test_loss``) with running statistics
        (``"eval"``) or with the statistics of each test batch (``"train"``; running statistics untouched).

    Returns
    -------
    list[TrainResult]
        In the order of ``models``.  A network whose loss becomes non-finite (or exceeds
        ``diverge_above``) stops updating at that step (the others go on); it reports
        ``diverged=True``, ``diverged_at_step`` and the ``steps`` and ``history`` :func:`train` would
        report (it trains on to the next check).  With test data, ``test_loss`` is the mean test loss.
    """
    models = _check_models(models)
    m_count = len(models)
    dev = resolve_device(device)
    optimizer = check_choice("optimizer", optimizer, ENSEMBLE_OPTIMIZERS)
    lrs = _per_network("lr", lr, m_count, minimum=0.0, strict=True)
    seed_list = [check_seed(f"seeds[{i}]", s) for i, s in enumerate(_per_network("seeds", seeds, m_count, minimum=0,
                                                                                   integer=True))]
    rmsprop_alpha = check_real("rmsprop_alpha", rmsprop_alpha, minimum=0.0, maximum=1.0)
    rmsprop_eps = check_real("rmsprop_eps", rmsprop_eps, minimum=0.0)
    momentum = check_real("momentum", momentum, minimum=0.0)
    if momentum >= 1.0:
        raise ValueError(f"momentum={momentum!r} is not allowed: expected 0 <= momentum < 1")
    weight_decay = check_real("weight_decay", weight_decay, minimum=0.0)
    loss_kind = check_choice("loss", loss, ENSEMBLE_LOSSES)
    if diverge_above is not None:
        diverge_above = check_real("diverge_above", diverge_above)
    test_bn_mode = check_choice("test_bn_mode", test_bn_mode, TEST_BN_MODES)
    check_every = check_int("check_every", check_every, minimum=1)
    eval_batch_size = check_int("eval_batch_size", eval_batch_size, minimum=1)

    from bnlab.nets.models import BNMLP

    is_bnmlp = all(isinstance(m, BNMLP) for m in models)
    dtype = models[0].readout.weight.dtype if is_bnmlp else next(models[0].parameters()).dtype
    x_tr, y_tr = _as_tensors("train_data", train_data, dev, dtype)
    test = None if test_data is None else _as_tensors("test_data", test_data, dev, dtype)
    if test is not None:
        _test_chunks(test[0].shape[0], eval_batch_size, test_bn_mode)  # refuses a 1-sample test set in train mode
    if y_tr.is_floating_point():
        raise ValueError("train_data is not allowed: train_ensemble trains classifiers (integer labels)")
    n = x_tr.shape[0]
    batch_size = check_int("batch_size", batch_size, minimum=2 if is_bnmlp else 1)
    if batch_size > n:
        raise ValueError(f"batch_size={batch_size} is not allowed: the training set has only {n} samples")
    if (epochs is None) == (steps is None):
        raise ValueError(f"epochs={epochs!r}, steps={steps!r} is not allowed: give exactly one of them")
    if epochs is not None:
        epochs = check_real("epochs", epochs, minimum=0.0, strict_minimum=True)
        steps = max(1, int(round(epochs * (n // batch_size))))
    steps = check_int("steps", steps, minimum=1)
    if is_bnmlp:
        x_tr = x_tr.reshape(n, -1)
        test = None if test is None else (test[0].reshape(test[0].shape[0], -1), test[1])
        if x_tr.shape[1] != models[0].in_features:
            raise ValueError(f"train_data with {x_tr.shape[1]} features is not allowed: the models expect "
                             f"{models[0].in_features}")
        sb = models[0].sub_batch_size
        if sb is not None and batch_size % sb:
            raise ValueError(f"batch_size={batch_size} is not allowed: it must be a multiple of the models' "
                             f"sub_batch_size={sb}")
        if sb is not None and test_bn_mode == "train":
            raise ValueError("test_bn_mode='train' is not allowed for BN-MLPs with a sub_batch_size (test "
                             "batches are not multiples of it)")
        stack: Any = _BNMLPStack(models, dev)
    else:
        stack = _VmapStack(models, dev)
        stack._data_ndim = x_tr.ndim
    for m in models:
        m.to(dev).train()

    params = stack.params()
    lr_t = torch.tensor(lrs, dtype=dtype, device=dev)
    sq_avg = [torch.zeros_like(p) for p in params] if optimizer == "rmsprop" else None
    velocity = [torch.zeros_like(p) for p in params] if momentum > 0 else None
    # per-network views: a (M, 1, ..., 1) tensor for each parameter's leading axis
    def per_net(v: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return v[: p.shape[0]].view(-1, *([1] * (p.ndim - 1)))

    # data order: one generator per distinct seed, drawing exactly the batches train() draws
    distinct = sorted(set(seed_list))
    gens = {s: _batches(n, batch_size, steps, torch.Generator().manual_seed(s), dev) for s in distinct}
    which = torch.tensor([distinct.index(s) for s in seed_list], device=dev)
    shared = len(distinct) == 1

    # which network each row is (caller's index): of the forward's outputs (``out_rows``) and of the
    # parameter stacks (``par_rows``; a BN-MLP stack sorts by depth).  The vmap stack drops networks
    # that have stopped at the next check (``compact``): rows that only burned compute on a diverged
    # network — in a learning-rate phase diagram, the whole exploding half of the grid.
    out_rows = torch.arange(m_count, device=dev)
    par_rows = torch.as_tensor(stack.order, device=dev) if is_bnmlp else out_rows
    lr_stack = lr_t[par_rows]
    active = torch.ones(m_count, dtype=torch.bool, device=dev)  # caller's order
    # float32 like train()'s history, whose finiteness check is on the stored value (a float64 loss
    # beyond 3.4e38 counts as divergence there, and so here)
    losses = torch.full((steps, m_count), float("nan"), dtype=torch.float32, device=dev)
    first_bad = torch.full((m_count,), steps, dtype=torch.long, device=dev)
    chance = None
    done = 0
    for step in range(steps):
        idx = torch.stack([next(gens[s]) for s in distinct])  # (distinct seeds, batch)
        if shared:
            xb = x_tr[idx[0]]  # one batch, broadcast to every network by the stack
            yb = y_tr[idx[0]].unsqueeze(0).expand(out_rows.shape[0], batch_size)
        else:
            sel = idx[which[out_rows]]
            xb, yb = x_tr[sel], y_tr[sel]
        out = stack.forward(xb, True)
        if step == 0:
            k = out.shape[-1]
            for y in [y_tr] + ([] if test is None else [test[1]]):
                if int(y.min()) < 0 or int(y.max()) >= k:
                    raise ValueError(f"labels are not allowed: they must lie in [0, {k}) for models with {k} outputs")
            chance = 1.0 / k
        loss = _per_network_loss(loss_kind, out, yb)
        grads = torch.autograd.grad(loss.sum(), params, allow_unused=True)
        with torch.no_grad():
            lf = loss.detach().float()
            ok = torch.isfinite(lf)
            if diverge_above is not None:
                ok &= lf <= diverge_above
            bad = torch.zeros(m_count, dtype=torch.bool, device=dev)
            bad[out_rows] = ~ok
            first_bad = torch.where(active & bad, torch.full_like(first_bad, step), first_bad)
            active &= ~bad
            losses[step, out_rows] = lf
            act_stack = active[par_rows]
            # a stopped network gets a zero gradient and a zero rate: its parameters stay where they
            # are (its optimizer state decays harmlessly).  Everything is in place on the fresh
            # gradients and the state: no per-step allocation of parameter-sized tensors, which for
            # wide networks (26 × 1M parameters) cost more than the products themselves
            neg_rate = torch.where(act_stack, -lr_stack, torch.zeros_like(lr_stack))
            # on a CPU asking whether every network is active is free, and saves a pass over every
            # gradient; on a GPU it would be a sync per step, so the mask is always applied there
            masked = dev.type != "cpu" or not bool(act_stack.all())
            for i, (p, g) in enumerate(zip(params, grads)):
                if g is None:
                    continue
                if masked:
                    g.masked_fill_(~per_net(act_stack, p), 0.0)  # NaN-safe, unlike a multiplication by 0
                if weight_decay:
                    g.add_(p, alpha=weight_decay)
                d = g
                if sq_avg is not None:
                    s = sq_avg[i]
                    s.mul_(rmsprop_alpha).addcmul_(g, g, value=1 - rmsprop_alpha)
                    d = g / (s.sqrt() + rmsprop_eps)
                if velocity is not None:
                    # torch.optim: the first step's buffer is d itself (= μ·0 + d)
                    d = torch.add(d, velocity[i], alpha=momentum, out=velocity[i])  # one pass: v ← d + μ v
                p.addcmul_(per_net(neg_rate, p), d)
        done = step + 1
        if done % check_every == 0 and done < steps:
            if not bool(active.any()):
                break  # every network has diverged: nothing left to train
            if not is_bnmlp and not bool(active[out_rows].all()):
                keep = active[out_rows].nonzero().flatten()
                stack.compact(keep)
                out_rows = par_rows = out_rows[keep]
                params = stack.params()
                lr_stack = lr_t[par_rows]
                sq_avg = None if sq_avg is None else [v[keep] for v in sq_avg]
                velocity = None if velocity is None else [v[keep] for v in velocity]

    stack.write_back()
    first_bad_l = first_bad.cpu().tolist()
    hist = losses[:done].to(torch.float64).cpu().numpy()
    accs = test_losses = None
    if test is not None:
        # the networks still stacked (every one that has not diverged, in the order of out_rows)
        acc_rows, loss_rows = _ensemble_evaluate(stack, test, out_rows.shape[0], eval_batch_size, loss_kind,
                                                 test_bn_mode)
        accs, test_losses = [None] * m_count, [None] * m_count
        for pos, i in enumerate(out_rows.tolist()):
            accs[i], test_losses[i] = acc_rows[pos], loss_rows[pos]
    results = []
    for i in range(m_count):
        if first_bad_l[i] < steps:
            taken = _reported_steps(first_bad_l[i], check_every, steps)
            # train() goes on with non-finite weights after the bad step: its later losses are NaN
            h = [float(v) if t <= first_bad_l[i] else float("nan") for t, v in enumerate(hist[:taken, i])]
            results.append(TrainResult(None if test is None else chance, True, first_bad_l[i], taken, float("nan"),
                                       chance, h, [], False))
            continue
        h = hist[:done, i].tolist()
        final = float(np.mean(h[-50:]))
        if accs is None:
            results.append(TrainResult(None, False, None, done, final, chance, h, [], False))
        elif accs[i] is None:
            results.append(TrainResult(chance, True, None, done, final, chance, h, [], False))
        else:
            results.append(TrainResult(accs[i], False, None, done, final, chance, h, [], False, test_losses[i]))
    return results


def _per_network_loss(kind: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Batch-mean loss per network: logits (M, n, classes), labels (M, n) → (M,)."""
    if kind == "mse":
        return half_squared_error(out, y)
    per = nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="none")
    return per.view(out.shape[0], out.shape[1]).mean(dim=1)


@torch.no_grad()
def _ensemble_evaluate(stack, test, m_count: int, eval_batch_size: int, loss_kind: str,
                       bn_mode: str) -> tuple[list[float | None], list[float]]:
    """Per-network test accuracy (None where a logit is not finite) and mean test loss, BN in
    ``bn_mode`` (running statistics, or each test batch's statistics without updating the running ones)."""
    x, y = test
    correct = torch.zeros(m_count, dtype=torch.long, device=x.device)
    finite = torch.ones(m_count, dtype=torch.bool, device=x.device)
    total = torch.zeros(m_count, dtype=torch.float64, device=x.device)
    for sl in _test_chunks(x.shape[0], eval_batch_size, bn_mode):
        logits = stack.forward(x[sl], bn_mode == "train", update_stats=False)
        finite &= torch.isfinite(logits).flatten(1).all(dim=1)
        yb = y[sl].unsqueeze(0).expand(m_count, -1)
        correct += (logits.argmax(dim=-1) == yb).sum(dim=1)
        total += _per_network_loss(loss_kind, logits, yb).double() * logits.shape[1]
    acc = (correct.double() / x.shape[0]).cpu().tolist()
    return [a if f else None for a, f in zip(acc, finite.cpu().tolist())], (total / x.shape[0]).cpu().tolist()
