"""Batched ensembles: train many networks together, network for network as :func:`train`.

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
* any other ``nn.Module``: networks identical up to their parameter and buffer values (same class,
  ``repr``, names and shapes) form one stack: their state is stacked with
  ``torch.func.stack_module_state`` and the forward pass is ``vmap(functional_call(...))``; a
  per-network constant of such a model must be a buffer (it is then stacked like the weights).
  Networks of several structures (MLPs of different depths or widths) form one stack per structure,
  trained in the same step, so none pays for another's layers.

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
import os
import time
from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from bnlab import _threads
from bnlab._run_length import STEADY_FROM, note_steady_steps, timing_steps
from bnlab._task_checkpoint import DEFAULT_EVERY
from bnlab._validation import check_choice, check_int, check_real, check_seed
from bnlab.nets import _native_bn
from bnlab.nets._checkpoint import CheckpointError, EnsembleCheckpointer
from bnlab.nets._ensemble_step import (
    STEP_MODES,
    StepConfig,
    StepRunner,
    auto_route_as_for,
    build_step,
    per_network_loss,
    resolve_step_mode,
)
from bnlab.nets.train import (
    TEST_BN_MODES,
    TrainResult,
    _as_tensors,
    _batches,
    _test_chunks,
    resolve_device,
)

__all__ = ["ENSEMBLE_OPTIMIZERS", "ENSEMBLE_LOSSES", "ENSEMBLE_STEP_MODES", "train_ensemble", "auto_route_as_for"]

#: optimizers :func:`train_ensemble` implements (with torch.optim's update formulas)
ENSEMBLE_OPTIMIZERS = ("sgd", "rmsprop")
#: losses :func:`train_ensemble` trains on: softmax cross-entropy, or ½‖f − onehot(y)‖²
#: (:func:`~bnlab.nets.half_squared_error`, the Fisher paper's Gaussian model)
ENSEMBLE_LOSSES = ("cross_entropy", "mse")
#: how :func:`train_ensemble` runs its step (``step_mode``): ``"auto"``, ``"eager"``, ``"compile"``, ``"cuda_graph"``
ENSEMBLE_STEP_MODES = STEP_MODES
# batch indices drawn ahead per device copy: check_every steps, at most this many (bounded memory
# for a run that never checks; the copy is asynchronous, so a window boundary is not a sync)
_MAX_WINDOW = 1024


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
    def forward(h: torch.Tensor) -> torch.Tensor:
        return _two_pass_variance(h)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        # forward and setup_context apart: the form torch.func.grad (the compiled step) accepts
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (h,) = ctx.saved_tensors
        return (2.0 / h.shape[2]) * grad * (h - h.mean(2, keepdim=True))


def _two_pass_variance(h: torch.Tensor) -> torch.Tensor:
    hd = h.double()
    return (hd - hd.mean(2, keepdim=True)).square_().mean(2, keepdim=True).to(h.dtype)


def _sample_variance(h: torch.Tensor) -> torch.Tensor:
    return _SampleVariance.apply(h)


class _BatchNormEager(torch.autograd.Function):
    """Batch normalization of a float32 CPU stack (k, groups, b, width) as one autograd node, for the eager
    step: ``out = (h − mean)·rsqrt(var + ε)`` with ``mean`` over the b samples in float32 and ``var`` the
    float64 two-pass variance (:class:`_SampleVariance`), the same forward operations as the composite
    route (so the same floats), and the batch statistics ``mean``, ``var`` as outputs without gradient.

    The backward is the closed form of that composite's gradient (Ioffe & Szegedy 2015, §3),
    ``r·(g − mean(g) − x̂·mean(g·x̂))`` with ``r = rsqrt(var + ε)``, ``x̂ = out``: 6 operations where
    autograd's graph of the composite runs ~25 (the mean's, the variance's, the rsqrt's and the
    broadcasts' backward nodes), at B = 8 each costing more in overhead than in arithmetic.  Equal to the
    composite's gradient in exact arithmetic, so to float32 rounding (``tests/nets/test_ensemble.py``
    bounds the difference).  In the classic form (``forward(ctx, ...)``, no ``setup_context``):
    ``Function.apply`` of a function that defines ``setup_context`` binds the arguments to ``forward``'s
    signature (``inspect.signature``) on every call, ~110 µs, 5 ms of a 60–90 ms step of a depths-4…48
    stack; torch.func transforms accept only that form, so under them (the compiled step) the composite
    with :class:`_SampleVariance` runs instead."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, eps: torch.Tensor):
        mean = h.mean(dim=2, keepdim=True)
        var = _two_pass_variance(h)
        r = torch.rsqrt(var + eps)
        out = (h - mean).mul_(r)
        ctx.save_for_backward(out, r)
        ctx.mark_non_differentiable(mean, var)
        return out, mean, var

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _grad_mean, _grad_var):
        out, r = ctx.saved_tensors
        centred = grad - grad.mean(dim=2, keepdim=True)
        projection = (grad * out).mean(dim=2, keepdim=True)
        return centred.addcmul_(out, projection, value=-1.0).mul_(r), None


def _column_major(w: torch.Tensor) -> torch.Tensor:
    """A stacked weight (R, out, in) laid out as its transpose (R, in, out) is, i.e. ``w.transpose(1, 2)``
    contiguous: the layout the forward's product ``a @ w.transpose(1, 2)`` reads and the one autograd
    returns the weight's gradient in.  The optimizer state (``zeros_like``) then shares it, so every
    elementwise update runs over memory in order; with the row-major stack the gradient came back
    transposed and each update op read it with a stride of ``in`` (measured: RMSProp's update 35 ms of
    a 90 ms step at B = 8, width 128, depths 4–48; contiguous operands 5–10× faster)."""
    return _in_dim_order(w, (0, 2, 1))


def _dim_order(t: torch.Tensor) -> tuple[int, ...]:
    """The axes of ``t`` from the outermost in memory to the innermost (by stride; ties in axis order)."""
    return tuple(sorted(range(t.ndim), key=lambda d: (-t.stride(d), d)))


def _in_dim_order(t: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """``t``'s values laid out in memory in ``order`` (:func:`_dim_order`); ``t`` itself when it already is."""
    if _dim_order(t) == order:
        return t
    back = [0] * len(order)
    for i, d in enumerate(order):
        back[d] = i
    return t.permute(order).contiguous().permute(back)


class _BNMLPStack:
    """M :class:`~bnlab.nets.BNMLP` as stacked tensors, deepest first (Yang et al. 2019, Eq. 7)."""

    compactable = False  # the prefix structure stays; a stopped network's rows are masked
    used = None  # every parameter reaches the loss

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
        # φ that the native BN kernel applies itself (None: it runs after the kernel, as self.act)
        spec = first.base_activation.spec
        self._native_phi = spec if spec in _native_bn.ACTIVATIONS else None
        self.sub_batch_size = first.sub_batch_size
        self.momentum = first.momentum
        depths = [m.depth for m in models]
        # stable sort, deepest first: layer l is computed for the prefix of networks deeper than l
        self.order = sorted(range(len(models)), key=lambda i: -depths[i])
        self.rows = list(self.order)  # the caller's index of each stacked network
        self.depths = [depths[i] for i in self.order]
        self.max_depth = self.depths[0]
        self.k = [sum(d > l for d in self.depths) for l in range(self.max_depth)]

        def col(vals):
            return torch.tensor([vals[i] for i in self.order], dtype=self.dtype, device=dev).view(-1, 1, 1)

        self.gamma = col([m.gamma for m in models])
        self.beta = col([m.beta for m in models])
        self.eps = col([m.eps for m in models])
        self._layer_eps = [self.eps[:k] for k in self.k]  # layer l's prefix, sliced once
        self.affine = bool(any(m.gamma != 1.0 or m.beta != 0.0 for m in models))
        ms = [models[i] for i in self.order]
        with torch.no_grad():
            self.weights = [_column_major(torch.stack([m.weights[l].detach() for m in ms[: self.k[l]]]).to(dev))
                            for l in range(self.max_depth)]
            self.readout_w = _column_major(torch.stack([m.readout.weight.detach() for m in ms]).to(dev))
            self.readout_b = torch.stack([m.readout.bias.detach() for m in ms]).to(dev)
            self.running_mean = [torch.stack([m.running_mean[l] for m in ms[: self.k[l]]]).to(dev)
                                 for l in range(self.max_depth)]
            self.running_var = [torch.stack([m.running_var[l] for m in ms[: self.k[l]]]).to(dev)
                                for l in range(self.max_depth)]

    def adopt_gradient_layout(self, x: torch.Tensor) -> None:
        """Nothing to do: the weights are stacked column major (:func:`_column_major`), the layout of the
        gradients this stack's own backward forms."""

    def params(self) -> list[torch.Tensor]:
        return [*self.weights, self.readout_w, self.readout_b]

    def param_rows(self) -> list[tuple[int, int]]:
        """The rows (start, stop) each parameter stacks: layer l the prefix of networks deeper than l."""
        return [(0, w.shape[0]) for w in self.params()]

    def stats(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return self.running_mean, self.running_var

    def num_outputs(self, x: torch.Tensor) -> int:
        return self.readout_w.shape[1]

    def train_logits(self, params: list[torch.Tensor], stats, x: torch.Tensor):
        """Logits (R, n, classes) in row order and each layer's batch statistics (the step's forward)."""
        return self._run(params, x, training=True)

    def func_value_and_grads(self, params: list[torch.Tensor], stats, x: torch.Tensor, y: torch.Tensor, kind: str):
        """(losses (R,), gradients, batch statistics) by ``torch.func.grad`` of the summed loss (each
        network's parameters reach only its own loss): the compiled step's differentiation."""

        def objective(ps):
            logits, batch_stats = self._run(ps, x, training=True)
            loss = per_network_loss(kind, logits, y)
            return loss.sum(), (loss, batch_stats)

        grads, (loss, batch_stats) = torch.func.grad(objective, has_aux=True)(params)
        return loss, grads, batch_stats

    def save_stats(self, stats) -> None:
        """Nothing to save: the running statistics change only in :meth:`update_stats`."""

    def update_stats(self, stats, batch_stats, saved=None, active: torch.Tensor | None = None) -> None:
        """Running statistics ← lerp towards the step's batch statistics (as the module's BN layer);
        those of networks not ``active`` stay (lerp(r, r, w) = r exactly)."""
        means, variances = batch_stats
        if active is not None:
            keep = [active[: m.shape[0]].unsqueeze(1) for m in means]
            means = [torch.where(a, m, r) for a, m, r in zip(keep, means, stats[0])]
            variances = [torch.where(a, v, r) for a, v, r in zip(keep, variances, stats[1])]
        torch._foreach_lerp_(stats[0], means, self.momentum)
        torch._foreach_lerp_(stats[1], variances, self.momentum)

    def forward(self, x: torch.Tensor, training: bool, update_stats: bool = True) -> torch.Tensor:
        """Logits (R, n, classes) in row order for inputs x (R, n, in_features) in row order or a
        shared x (n, in_features); ``update_stats=False``: batch statistics without touching the running ones."""
        logits, batch_stats = self._run(self.params(), x, training=training)
        if training and update_stats:
            self.update_stats(self.stats(), batch_stats)
        return logits

    def _run(self, params: list[torch.Tensor], x: torch.Tensor, training: bool):
        weights, readout_w, readout_b = params[: self.max_depth], params[-2], params[-1]
        # x (n, in) is one input shared by every network (broadcast in the first product, never copied)
        a = x
        finished = []
        means, variances = [], []
        for layer in range(self.max_depth):
            k = self.k[layer]
            if a.ndim == 3 and k < a.shape[0]:
                # networks of depth ≤ layer are done: their last activations wait for the readout
                finished.append(a[k:])
                a = a[:k]
            # bmm where both are stacks: what matmul runs then, without its broadcast bookkeeping (two
            # expands per layer); the shared x of the first layer broadcasts in matmul
            h = (torch.bmm if a.ndim == 3 else torch.matmul)(a, weights[layer].transpose(1, 2))
            eps = self._layer_eps[layer]
            if training:
                a, mean, var = self._batch_norm_layer(h, eps)
                means.append(mean)
                variances.append(var)
                continue
            out = (h - self.running_mean[layer].unsqueeze(1)) * torch.rsqrt(self.running_var[layer].unsqueeze(1) + eps)
            if self.affine:
                out = self.gamma[:k] * out + self.beta[:k]
            a = self.act(out)
        finished.append(a)
        a = torch.cat(finished[::-1], dim=0)
        logits = torch.baddbmm(readout_b.unsqueeze(1), a, readout_w.transpose(1, 2))
        return logits, (means, variances)

    def _batch_norm_layer(self, h: torch.Tensor, eps: torch.Tensor):
        """φ(γ·BN(h) + β) of a training forward — ghost_batch_norm (bnlab.nets.norms) with a leading network
        axis and a per-network ε — and the batch statistics for the running ones (mean, unbiased variance;
        averaged over ghost batches)."""
        k, n, width = h.shape
        b = self.sub_batch_size or n
        if n % b:
            raise ValueError(f"batch of {n} samples is not allowed with sub_batch_size={b}: it must be a multiple of it")
        hg = h.reshape(k, n // b, b, width)
        if _native_bn.can_use(hg):
            # the float32 CPU eager step: BN, the frozen affine map and ReLU in one compiled call each way
            # (bnlab.nets._native_bn: the same forward floats as the operators below); another φ runs after it
            affine = (self.gamma[:k], self.beta[:k]) if self.affine else (None, None)
            out, mean, var = _native_bn.batch_norm_stack(hg, eps, *affine, phi=self._native_phi)
            out = out.reshape(k, n, width)
            a = out if self._native_phi is not None else self.act(out)
        else:
            # the eager float32 CPU step without the kernel: one autograd node with a closed-form backward;
            # under torch.func (the compiled step, which fuses the composite anyway) and in float64 (the
            # reference routes) the composite
            if hg.dtype == torch.float32 and hg.device.type == "cpu" and not torch._C._are_functorch_transforms_active():
                out, mean, var = _BatchNormEager.apply(hg, eps.view(k, 1, 1, 1))
            else:
                mean = hg.mean(dim=2, keepdim=True)
                var = _sample_variance(hg) if hg.dtype == torch.float32 and hg.device.type == "cpu" else \
                    hg.var(dim=2, unbiased=False, keepdim=True)
                out = (hg - mean) * torch.rsqrt(var + eps.view(k, 1, 1, 1))
            out = out.reshape(k, n, width)
            if self.affine:
                out = self.gamma[:k] * out + self.beta[:k]
            a = self.act(out)
        with torch.no_grad():
            if n != b:  # average over the ghost batches (with one batch the mean is the value itself)
                batch_mean, batch_var = mean.squeeze(2).mean(1), (var.squeeze(2) * (b / (b - 1))).mean(1)
            else:
                batch_mean, batch_var = mean.view(k, width), var.view(k, width) * (b / (b - 1))
        return a, batch_mean, batch_var

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

    compactable = True  # networks that stopped can be dropped at a check (``compact``)

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
        self.used: list[bool] | None = None  # which parameters reach the loss (``used_params``)
        self._data_ndim = 0  # ndim of the training inputs (n, ...), set by train_ensemble
        self.rows = list(range(len(models)))  # the caller's index of each stacked network
        self._dropped: dict[int, tuple] = {}  # caller index -> final (parameters, buffers) of a dropped network
        for m in models:
            m.to(dev)
        params, buffers = stack_module_state(list(models))
        self.names = list(params)
        # plain tensors: the step makes its own leaves (or differentiates functionally)
        self.param_list = [params[k].detach() for k in self.names]
        self.buffers = buffers
        # the base runs on the "meta" device (no memory): functional_call substitutes every tensor
        self.base = copy.deepcopy(first).to("meta")

        def one(p, b, x):
            return functional_call(self.base, (p, b), (x,))

        self._one = one

    def adopt_gradient_layout(self, x: torch.Tensor) -> None:
        """Lay every stacked parameter out in memory as its gradient comes back (one probe forward and
        backward on ``x``, buffers untouched); the optimizer state, made ``zeros_like`` the parameters,
        follows.  Under vmap a linear layer's weight gradient (M, out, in) comes back transposed
        (strides (out·in, 1, out)), while ``stack_module_state`` stacks row-major: every elementwise
        update that mixes the two (momentum's ``buf += g``, weight decay) then read one operand with a
        stride of ``out`` — measured on fisher-fig2's cell (11 networks 784-512-512-512-10, B = 64, momentum
        SGD, one core): ``add_`` 9 ms per (11, 512, 784) weight against ~2 ms in order, 23 % of the cell.
        The probe differentiates as the eager step does (autograd through the vmapped forward); the compiled
        routes' ``vmap(grad(·))`` returns each gradient in its parameter's layout, so it agrees with either.
        The probe draws no random number the training would (a module's dropout): the generators are forked."""
        with torch.random.fork_rng(devices=_cuda_devices(x)), torch.enable_grad():
            leaves = [p.detach().requires_grad_() for p in self.param_list]
            out = self._vmapped(leaves, {k: v.clone() for k, v in self.buffers.items()}, x, True)
            grads = torch.autograd.grad(out.sum(), leaves, allow_unused=True)
        self.param_list = [p if g is None else _in_dim_order(p, _dim_order(g)) for p, g in zip(self.param_list, grads)]

    def params(self) -> list[torch.Tensor]:
        return self.param_list

    def param_rows(self) -> list[tuple[int, int]]:
        return [(0, len(self.rows))] * len(self.param_list)

    def stats(self) -> dict[str, torch.Tensor]:
        return self.buffers

    def num_outputs(self, x: torch.Tensor) -> int:
        """Outputs per network: the last axis of a forward on ``x`` (buffers untouched; the generators forked,
        as for every probe: it draws no random number the training would)."""
        with torch.random.fork_rng(devices=_cuda_devices(x)), torch.no_grad():
            return self.forward(x, True, update_stats=False).shape[-1]

    def used_params(self, x: torch.Tensor) -> list[bool]:
        """Which parameters the output on ``x`` depends on (an unused one gets no optimizer step, as in
        torch.optim); structural, so one probe with autograd (buffers untouched) answers for every step.
        The generators are forked: only the compiled routes probe, and a module's dropout must draw the
        numbers the eager route draws."""
        with torch.random.fork_rng(devices=_cuda_devices(x)), torch.enable_grad():
            leaves = [p.detach().requires_grad_() for p in self.param_list]
            out = self._vmapped(leaves, {k: v.clone() for k, v in self.buffers.items()}, x, True)
            grads = torch.autograd.grad(out.sum(), leaves, allow_unused=True)
        self.used = [g is not None for g in grads]
        return self.used

    def train_logits(self, params: list[torch.Tensor], buffers: dict, x: torch.Tensor):
        """Logits (R, n, classes) of the step's forward; BN layers update ``buffers`` in place."""
        return self._vmapped(params, buffers, x, True), None

    def func_value_and_grads(self, params: list[torch.Tensor], buffers: dict, x: torch.Tensor, y: torch.Tensor,
                             kind: str):
        """(losses (R,), gradients, None) by ``vmap(grad(one network's loss))``: the compiled step's
        differentiation.  The vmap is outside the grad because a module's in-place buffer update (BN's
        ``num_batches_tracked += 1``) under grad(vmap(…)) is beyond Dynamo (it traces vmap(grad(…)))."""
        from torch.func import grad, vmap

        self.base.train(True)

        def one_loss(p, b, xi, yi):
            logits = self._one(p, b, xi)
            loss = per_network_loss(kind, logits.unsqueeze(0), yi.unsqueeze(0)).squeeze(0)
            return loss, loss

        shared = x.ndim == self._data_ndim
        grads, loss = vmap(grad(one_loss, has_aux=True), in_dims=(0, 0, None if shared else 0, 0),
                           randomness="different")(dict(zip(self.names, params)), buffers, x, y)
        return loss, [grads[k] for k in self.names], None

    def save_stats(self, buffers: dict) -> dict:
        """Copies of the buffers before a step (the modules' BN layers update them in the forward)."""
        return {k: v.clone() for k, v in buffers.items()}

    def update_stats(self, buffers: dict, batch_stats, saved: dict, active: torch.Tensor | None) -> None:
        """The modules' BN layers updated the buffers in the forward: those of networks not ``active``
        get their saved values back (``active=None``: every network is active)."""
        if active is None:
            return
        for k, v in buffers.items():
            v.copy_(torch.where(active.view(-1, *([1] * (v.ndim - 1))), v, saved[k]))

    def _vmapped(self, params: list[torch.Tensor], buffers: dict, x: torch.Tensor, training: bool) -> torch.Tensor:
        from torch.func import vmap

        self.base.train(training)
        shared = x.ndim == self._data_ndim  # one batch (n, ...) for every network
        return vmap(self._one, in_dims=(0, 0, None if shared else 0), randomness="different")(
            dict(zip(self.names, params)), buffers, x)

    def forward(self, x: torch.Tensor, training: bool, update_stats: bool = True) -> torch.Tensor:
        # BN in train mode updates its running statistics in place: a test pass on batch statistics
        # works on copies of the buffers
        keep = update_stats or not training
        buffers = self.buffers if keep else {k: v.clone() for k, v in self.buffers.items()}
        return self._vmapped(self.param_list, buffers, x, training)

    def compact(self, keep: torch.Tensor) -> None:
        """Keep only the stacked networks at positions ``keep``; the others' final state is set aside."""
        kept = set(keep.tolist())
        with torch.no_grad():
            for pos, i in enumerate(self.rows):
                if pos not in kept:
                    self._dropped[i] = ([v[pos].clone() for v in self.param_list],
                                        {k: v[pos].clone() for k, v in self.buffers.items()})
            self.param_list = [v[keep] for v in self.param_list]  # indexing keeps the layout
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


def _structure(m: nn.Module) -> tuple:
    """What a vmap stack requires its networks to share: class, ``repr``, parameter and buffer shapes."""
    return (type(m), repr(m), tuple((k, tuple(v.shape), v.dtype) for k, v in [*m.named_parameters(), *m.named_buffers()]))


class _GroupedStack:
    """Networks of several structures (e.g. MLPs of different depths): one vmap stack per structure,
    trained in the same step, so no network pays for a deeper one's layers (no padding).

    Rows are the groups' rows one after the other; every per-network vector of the step (rate, mask,
    loss) is indexed by row, and a parameter stacks the rows of its group (``param_rows``)."""

    compactable = True

    def __init__(self, groups: list[tuple[_VmapStack, list[int]]]):
        self.groups = groups  # (stack, the caller's index of each of its models)
        self._gone: list[tuple[_VmapStack, list[int]]] = []  # groups whose every network was dropped

    @property
    def rows(self) -> list[int]:
        return [callers[i] for g, callers in self.groups for i in g.rows]

    @property
    def _data_ndim(self) -> int:
        return self.groups[0][0]._data_ndim

    @_data_ndim.setter
    def _data_ndim(self, value: int) -> None:
        for g, _ in self.groups:
            g._data_ndim = value

    def _sizes(self) -> list[int]:
        return [len(g.rows) for g, _ in self.groups]

    def _split_params(self, params: list) -> list[list]:
        out, at = [], 0
        for g, _ in self.groups:
            out.append(params[at : at + len(g.param_list)])
            at += len(g.param_list)
        return out

    def _split_rows(self, v: torch.Tensor, shared: bool = False) -> list:
        return [v] * len(self.groups) if shared else list(torch.split(v, self._sizes()))

    def params(self) -> list[torch.Tensor]:
        return [p for g, _ in self.groups for p in g.params()]

    def param_rows(self) -> list[tuple[int, int]]:
        out, start = [], 0
        for g, _ in self.groups:
            out += [(start, start + len(g.rows))] * len(g.param_list)
            start += len(g.rows)
        return out

    def stats(self) -> list[dict]:
        return [g.stats() for g, _ in self.groups]

    def num_outputs(self, x: torch.Tensor) -> int:
        counts = {g.num_outputs(x) for g, _ in self.groups}
        if len(counts) > 1:
            raise ValueError(f"models is not allowed: their numbers of outputs differ ({sorted(counts)}); an "
                             "ensemble trains on one set of labels")
        return counts.pop()

    def used_params(self, x: torch.Tensor) -> list[bool]:
        return [u for g, _ in self.groups for u in g.used_params(x)]

    def adopt_gradient_layout(self, x: torch.Tensor) -> None:
        for g, _ in self.groups:
            g.adopt_gradient_layout(x)

    @property
    def used(self) -> list[bool] | None:
        if any(g.used is None for g, _ in self.groups):
            return None
        return [u for g, _ in self.groups for u in g.used]

    def train_logits(self, params: list, stats: list, x: torch.Tensor):
        xs = self._split_rows(x, shared=x.ndim == self._data_ndim)
        return torch.cat([g.train_logits(p, b, xi)[0] for (g, _), p, b, xi in
                          zip(self.groups, self._split_params(params), stats, xs)]), None

    def func_value_and_grads(self, params: list, stats: list, x: torch.Tensor, y: torch.Tensor, kind: str):
        xs = self._split_rows(x, shared=x.ndim == self._data_ndim)
        losses, grads = [], []
        for (g, _), p, b, xi, yi in zip(self.groups, self._split_params(params), stats, xs, self._split_rows(y)):
            loss, gr, _ = g.func_value_and_grads(p, b, xi, yi, kind)
            losses.append(loss)
            grads += gr
        return torch.cat(losses), grads, None

    def save_stats(self, stats: list) -> list:
        return [g.save_stats(b) for (g, _), b in zip(self.groups, stats)]

    def update_stats(self, stats: list, batch_stats, saved: list, active: torch.Tensor | None) -> None:
        parts = self._split_rows(active) if active is not None else [None] * len(self.groups)
        for (g, _), b, sv, a in zip(self.groups, stats, saved, parts):
            g.update_stats(b, None, sv, a)

    def forward(self, x: torch.Tensor, training: bool, update_stats: bool = True) -> torch.Tensor:
        return torch.cat([g.forward(x, training, update_stats) for g, _ in self.groups])

    def compact(self, keep: torch.Tensor) -> None:
        """Keep the rows ``keep``; a group left without rows is set aside (its final state kept)."""
        start, at = [], 0
        for size in self._sizes():
            start.append(at)
            at += size
        keep_l = keep.tolist()
        groups = []
        for (g, callers), a, size in zip(self.groups, start, self._sizes()):
            local = torch.tensor([r - a for r in keep_l if a <= r < a + size], dtype=torch.long, device=keep.device)
            g.compact(local)
            (groups if local.numel() else self._gone).append((g, callers))
        self.groups = groups

    def write_back(self) -> None:
        for g, _ in self.groups + self._gone:
            g.write_back()


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

class _EnsembleRun:
    """One ensemble training: its state tensors, its data order and its step route.

    ``step()`` runs one step (drawing the next window of batch indices when one is used up);
    ``check()`` is the host's look every ``check_every`` steps.  :func:`train_ensemble` drives it;
    ``benchmarks/bench_ensemble.py`` times and counts its steps."""

    def __init__(self, stack: Any, cfg: StepConfig, route: str, x: torch.Tensor, y: torch.Tensor, *,
                 lrs: list[float], seeds: list[int], batch_size: int, steps: int, check_every: int):
        dev = x.device
        if cfg.host_reads and len(set(lrs)) == 1:
            cfg = replace(cfg, shared_lr=lrs[0])  # the update by a scalar rate (``_update``)
        self.stack, self.cfg, self.steps, self.done = stack, cfg, steps, 0
        # data order: one generator per distinct seed, drawing exactly the batches train() draws, a
        # window of steps ahead (on the host; one asynchronous copy to the device per window)
        self._distinct = sorted(set(seeds))
        self._order = (x.shape[0], batch_size, steps)
        self._gens = self._data_orders(0)
        self._drawn = 0  # steps whose batch indices have been drawn (the data orders' position)
        # no shape of the step's state depends on the run's length (``steps``): a compiled step is then the
        # same graph for a run of 12 steps and of 75 000, so Inductor's graph cache serves a plan's pilots
        # (a task cut to k₁ and k₂ steps) and a grid's tasks of the same shapes alike, and the pilots time
        # the same compilation; the loss history is written to a window-sized ring that the host copies
        # into the whole run's history at each window boundary (``_flush``: an asynchronous device copy)
        self._window = min(check_every, _MAX_WINDOW)
        # before the optimizer state copies the layout; on every route, so that the eager step (the
        # reference the compiled ones are checked against) and the compiled ones multiply the same
        # layouts: vmap(grad(·)) returns each gradient in its parameter's layout, whichever it is
        stack.adopt_gradient_layout(x[:batch_size])
        params = stack.params()
        rows = torch.as_tensor(stack.rows, device=dev)  # the caller's index of each stacked network
        r = len(stack.rows)
        self.state = {
            "x": x, "y": y,
            "idx": torch.zeros(self._window, len(self._distinct), batch_size, dtype=torch.long, device=dev),
            "slot": torch.zeros((), dtype=torch.long, device=dev),
            "which": torch.tensor([self._distinct.index(seeds[i]) for i in stack.rows], device=dev),
            "params": params, "stats": stack.stats(),
            "sq_avg": [torch.zeros_like(p) for p in params] if cfg.optimizer == "rmsprop" else None,
            # RMSProp's denominators, rewritten each step by the eager step (``_update``)
            "denom": [torch.empty_like(p) for p in params] if cfg.optimizer == "rmsprop" and route == "eager" else None,
            "velocity": [torch.zeros_like(p) for p in params] if cfg.momentum > 0 else None,
            "lr": torch.tensor(lrs, dtype=params[0].dtype, device=dev)[rows],
            "active": torch.ones(r, dtype=torch.bool, device=dev),
            "first_bad": torch.full((r,), steps, dtype=torch.long, device=dev),
            "t": torch.zeros((), dtype=torch.long, device=dev),
            # the window's losses (W, M) in the caller's order, flat: entry slot·M + caller index
            "losses": torch.full((self._window * cfg.num_networks,), float("nan"), dtype=torch.float32, device=dev),
            "row_ids": rows,
        }
        if route != "eager" and stack.compactable:
            stack.used_params(x[:batch_size])  # the functional gradient needs to know (``build_step``)
        self.runner = StepRunner(route, lambda grad_route: build_step(stack, cfg, grad_route),
                                 param_rows=stack.param_rows)
        # the whole run's loss history (steps, M), filled from the ring window by window
        self._history = torch.full((steps, cfg.num_networks), float("nan"), dtype=torch.float32, device=dev)
        self._flushed = 0  # steps whose losses are in _history
        # the vmap stack drops networks that have stopped, at a check (``compact``): rows that only
        # burned compute on a diverged network — in a learning-rate phase diagram, the whole exploding
        # half of the grid.  The eager step does so at every check with a stopped network; a compiled one
        # recompiles (or recaptures) for each new number of rows, so it compacts when at most half are left
        self._compact_at = 1.0 if route == "eager" else 0.5
        self._dropped_first_bad: dict[int, int] = {}  # caller index -> first bad step of a dropped network

    def _data_orders(self, start: int) -> dict:
        """One batch generator per distinct seed, from batch ``start`` on (``train()``'s order)."""
        n, batch_size, steps = self._order
        return {s: _batches(n, batch_size, steps, torch.Generator().manual_seed(s), torch.device("cpu"), start=start)
                for s in self._distinct}

    def _flush(self) -> None:
        """Copy the losses of the steps done since the last flush from the ring into the history.  Windows
        start at multiples of the window (the slot restarts at 0 there), so step s is in slot s mod W; a
        flush at every window boundary keeps the unflushed steps within one window (a mid-window flush,
        from :meth:`history`, leaves the rest of that window to the next)."""
        n = self.done - self._flushed
        if n > 0:
            ring = self.state["losses"].view(self._window, self.cfg.num_networks)
            start = self._flushed % self._window
            self._history[self._flushed:self.done].copy_(ring[start:start + n])
            self._flushed = self.done

    def step(self) -> None:
        if self.done % self._window == 0:
            self._flush()  # before the slot restarts
            count = min(self._window, self.steps - self.done)
            draws = torch.stack([torch.stack([next(self._gens[s]) for s in self._distinct]) for _ in range(count)])
            if draws.device != self.state["idx"].device and self.state["idx"].is_cuda:
                draws = draws.pin_memory()
            self.state["idx"][:count].copy_(draws, non_blocking=True)
            self.state["slot"].zero_()
            self._drawn += count
        self.runner(self.state)
        self.done += 1

    def check(self) -> bool:
        """The host's look at the mask (a sync): False when every network has stopped; the vmap stack
        drops stopped networks (see ``_compact_at``)."""
        st = self.state
        active = st["active"]
        n_active = int(active.sum())
        if n_active == 0:
            return False
        if self.stack.compactable and n_active < active.shape[0] and \
                n_active <= self._compact_at * active.shape[0]:
            keep = active.nonzero().flatten()
            gone = (~active).nonzero().flatten()
            for i, fb in zip(st["row_ids"][gone].tolist(), st["first_bad"][gone].tolist()):
                self._dropped_first_bad[i] = fb
            # each parameter's optimizer state keeps the kept rows among those it stacks
            keep_l = keep.tolist()
            local = [torch.tensor([r - a for r in keep_l if a <= r < b], dtype=torch.long, device=keep.device)
                     for a, b in self.stack.param_rows()]
            self.stack.compact(keep)
            st["params"], st["stats"] = self.stack.params(), self.stack.stats()
            for key in ("lr", "active", "first_bad", "row_ids", "which"):
                st[key] = st[key][keep]
            for key in ("sq_avg", "velocity", "denom"):
                if st[key] is not None:
                    # indexing keeps each tensor's layout, the gradient's (``adopt_gradient_layout``)
                    st[key] = [v[k] for v, k in zip(st[key], local) if k.numel()]
            self.runner.reset()
        return True

    def first_bad(self) -> list[int]:
        """Per network (the caller's order): the first step whose loss was bad, or ``steps``."""
        out = [self.steps] * self.cfg.num_networks
        for i, fb in zip(self.state["row_ids"].tolist(), self.state["first_bad"].tolist()):
            out[i] = fb
        for i, fb in self._dropped_first_bad.items():
            out[i] = fb
        return out

    def history(self) -> np.ndarray:
        """The training losses (steps done, M) as float64."""
        self._flush()
        return self._history[: self.done].to(torch.float64).cpu().numpy()

    #: the step's per-network and bookkeeping tensors a checkpoint keeps (besides the optimizer state)
    _SAVED = ("idx", "slot", "which", "lr", "active", "first_bad", "t", "row_ids")
    _SAVED_LISTS = ("sq_avg", "velocity")

    def checkpoint_state(self) -> dict:
        """What :meth:`restore` needs to go on from here, for a checkpoint (``_checkpoint``); the
        parameters and buffers are the models' (written back by the caller)."""
        self._flush()
        st = self.state
        return {"done": self.done, "drawn": self._drawn, "history": self._history[: self.done].cpu(),
                "dropped_first_bad": {int(k): int(v) for k, v in self._dropped_first_bad.items()},
                **{k: st[k] for k in self._SAVED}, **{k: st[k] for k in self._SAVED_LISTS}}

    def restore(self, path, saved: dict) -> None:
        """Go on from :meth:`checkpoint_state` ``saved`` (read from ``path``), each entry checked first: the
        stack has been built from the checkpoint's models and compacted to its rows (``row_ids``)."""
        from bnlab.nets import _checkpoint as ck

        st = self.state
        for k in self._SAVED + self._SAVED_LISTS:
            ck.check_like(path, k, saved.get(k), st[k])
        done, drawn, steps = saved.get("done"), saved.get("drawn"), self.steps
        if not (isinstance(done, int) and isinstance(drawn, int) and 0 <= done <= steps):
            raise ck.refused(path, f"its step count {done!r} is not one of this run's 0 … {steps}")
        # the data orders are drawn a window at a time: at a window boundary up to the step done, else the window
        whole = done if done % self._window == 0 else min(steps, (done // self._window + 1) * self._window)
        slot = int(saved["slot"])
        if drawn != whole or int(saved["t"]) != done or not 0 <= slot <= self._window or \
                (done % self._window and slot != done % self._window):
            raise ck.refused(path, f"its position in the data order (step {done}, {drawn} batches drawn, slot {slot})"
                                    " is not one this run reaches")
        if saved["row_ids"].tolist() != list(self.stack.rows):
            raise ck.refused(path, "its stacked rows are not those of its models")
        which, first_bad = saved["which"], saved["first_bad"]
        if which.numel() and not (0 <= int(which.min()) and int(which.max()) < len(self._distinct)):
            raise ck.refused(path, "its data-order index of a network is out of range")
        if first_bad.numel() and not (0 <= int(first_bad.min()) and int(first_bad.max()) <= steps):
            raise ck.refused(path, "its first bad step of a network is out of range")
        history, dropped = saved.get("history"), saved.get("dropped_first_bad")
        if not ck.same_kind(history, self._history[:done]):
            raise ck.refused(path, f"its loss history is not a ({done}, {self.cfg.num_networks}) float32 tensor")
        gone = set(range(self.cfg.num_networks)) - set(self.stack.rows)
        if not isinstance(dropped, dict) or set(dropped) != gone or \
                not all(isinstance(v, int) and 0 <= v <= steps for v in dropped.values()):
            raise ck.refused(path, "its dropped networks are not those missing from its stacked rows")
        with torch.no_grad():
            for k in self._SAVED:
                st[k].copy_(saved[k])
            for k in self._SAVED_LISTS:
                for own, value in zip(st[k] or [], saved[k] or []):
                    own.copy_(value)  # into the tensor made like its parameter: the layout stays the gradient's
            self._history[:done].copy_(history)
        self.done, self._flushed, self._drawn = done, done, drawn
        self._dropped_first_bad = dict(dropped)
        self._gens = self._data_orders(drawn)


def _cuda_devices(x: torch.Tensor) -> list[int]:
    """The CUDA devices whose generators a probe on ``x`` forks (``torch.random.fork_rng``'s ``devices``)."""
    return [x.device.index or 0] if x.device.type == "cuda" else []


def _synced_clock(dev: torch.device) -> float:
    """``time.perf_counter()`` once the device has finished the work queued so far."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter()


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
    step_mode: str = "auto",
    checkpoint: str | os.PathLike | None = None,
    checkpoint_every: float = DEFAULT_EVERY,
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
        M ``nn.Module``: :class:`~bnlab.nets.BNMLP` of one width and φ that may differ in depth, γ, β, ε
        and initialization, or any other modules with the same number of outputs and one dtype,
        stacked by structure (those identical up to their tensors together; per-network constants as
        buffers).  Trained in place (the final state is written back).
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
    step_mode:
        How each step runs (:data:`ENSEMBLE_STEP_MODES`): ``"eager"`` (op by op, the reference),
        ``"compile"`` (the whole step — forward, backward, update, divergence bookkeeping — compiled by
        ``torch.compile`` as one graph; falls back to eager with a warning if it does not compile),
        ``"cuda_graph"`` (that step captured once in a CUDA graph and replayed; CUDA only) or ``"auto"``:
        ``"cuda_graph"`` on CUDA for runs of at least 2 000 steps (compiling and capturing took 104 s
        against 5.4 s for the eager set-up at a Fig. 3a column on an H200, paid back from ~1 650 steps); on
        the CPU ``"compile"`` for runs of at least 25 000 steps (where the compilation, minutes, is paid
        back); else ``"eager"``.  :func:`auto_route_as_for` makes ``"auto"`` choose for another length
        (a plan's pilot runs the route of the whole task).  Every route computes the same numbers to
        rounding (``tests/nets/test_ensemble_step.py``); docs/nets.md says what each costs.
    checkpoint:
        A file in which the run keeps its state, to go on after an interruption (a batch job's time
        limit, a killed worker): when the file exists, the run resumes from it — the models, given as
        for a fresh run, are set to its state and training goes on from its step, computing the numbers
        the uninterrupted run computes, to rounding; while training, the state is saved there at a
        check (every ``check_every`` steps) once ``checkpoint_every`` seconds have passed since the
        last save; once the run completes, the file is removed.  A file written by another run (other
        models, data or options, or another bnlab version), and anything but a regular file that
        ``torch.load(weights_only=True)`` reads as such a checkpoint, is a ``ValueError``
        (``bnlab.nets._checkpoint`` says what a checkpoint holds and how it is checked).
        Inside a task of a sweep the engine gives one (``bnlab.experiments``; docs/paper-scale.md).
    checkpoint_every:
        Seconds between two saves (≥ 0; 0 saves at every check).  A save writes every network's
        parameters and buffers and the optimizer state (0.47 GB for a Fig. 3a column at paper scale).

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
    opts = _EnsembleOptions.checked(m_count, optimizer=optimizer, lr=lr, seeds=seeds, rmsprop_alpha=rmsprop_alpha,
                                    rmsprop_eps=rmsprop_eps, momentum=momentum, weight_decay=weight_decay,
                                    loss=loss, diverge_above=diverge_above, test_bn_mode=test_bn_mode,
                                    check_every=check_every, eval_batch_size=eval_batch_size)
    data = _EnsembleData.checked(models, train_data, test_data, dev, opts, batch_size=batch_size, steps=steps,
                                 epochs=epochs)
    saver = EnsembleCheckpointer.for_run(checkpoint, checkpoint_every, models, data, opts)
    saved = saver.resume(models, dev) if saver is not None else None
    route = resolve_step_mode(step_mode, dev, data.steps)
    try:
        stack, run, k_out = _start_run(models, dev, data, opts, route, saver, saved)
    except CheckpointError as exc:  # refused after the models were set to it: they are given back their state
        saver.abandon(models, exc)  # (raises, unless the file is a sweep task's: then the run starts afresh)
        stack, run, k_out = _start_run(models, dev, data, opts, route, saver, None)
    # a plan's pilot (bnlab._run_length) learns the seconds of the steady steps, past warm-up and capture
    # (not a run resumed past STEADY_FROM: its clock would start nowhere)
    timed = timing_steps() and data.steps > STEADY_FROM and run.done <= STEADY_FROM
    t_steady = 0.0
    while run.done < data.steps:
        if timed and run.done == STEADY_FROM:
            t_steady = _synced_clock(dev)
        run.step()
        if run.done % opts.check_every == 0 and run.done < data.steps:
            if not run.check():
                break  # every network has diverged: nothing left to train
            if saver is not None and saver.due():
                saver.save(run, stack, models, dev)
    if timed and run.done > STEADY_FROM:
        note_steady_steps(run.done - STEADY_FROM, _synced_clock(dev) - t_steady)
    stack.write_back()
    if saver is not None:
        saver.finish(run, stack, models, dev)
    return _ensemble_results(run, stack, data, opts, chance=1.0 / k_out)


def _start_run(models: list[nn.Module], dev: torch.device, data: "_EnsembleData", opts: "_EnsembleOptions",
               route: str, saver: EnsembleCheckpointer | None, saved: dict | None) -> tuple[Any, "_EnsembleRun", int]:
    """The stack, the run and the number of outputs of :func:`train_ensemble`, from step 0 or — with
    ``saved``, the checkpoint ``saver`` read, whose models are loaded — from the checkpoint's step
    (:class:`~bnlab.nets._checkpoint.CheckpointError` where it does not fit the run)."""
    stack = _make_stack(models, dev, data, opts)
    if saved is not None:
        saver.compact_to(stack, saved)
    for m in models:
        m.to(dev).train()
    # labels against the number of outputs, before any step (a bad label would fail inside the step)
    k_out = stack.num_outputs(data.x[:data.batch_size])
    for y in [data.y] + ([] if data.test is None else [data.test[1]]):
        if int(y.min()) < 0 or int(y.max()) >= k_out:
            raise ValueError(f"labels are not allowed: they must lie in [0, {k_out}) for models with {k_out} outputs")
    cfg = StepConfig(loss=opts.loss, optimizer=opts.optimizer, momentum=opts.momentum,
                     weight_decay=opts.weight_decay, rmsprop_alpha=opts.rmsprop_alpha, rmsprop_eps=opts.rmsprop_eps,
                     diverge_above=opts.diverge_above, shared_order=len(set(opts.seeds)) == 1,
                     num_networks=len(models), host_reads=route == "eager" and data.x.device.type == "cpu")
    run = _EnsembleRun(stack, cfg, route, data.x, data.y, lrs=opts.lrs, seeds=opts.seeds,
                       batch_size=data.batch_size, steps=data.steps, check_every=opts.check_every)
    if saved is not None:
        run.restore(saver.path, saved)
        saver.restore_rng(saved, dev)
    return stack, run, k_out


@dataclass(frozen=True)
class _EnsembleOptions:
    """train_ensemble's optimizer, loss and bookkeeping options, checked (per-network values expanded)."""

    optimizer: str
    lrs: list[float]
    seeds: list[int]
    rmsprop_alpha: float
    rmsprop_eps: float
    momentum: float
    weight_decay: float
    loss: str
    diverge_above: float | None
    test_bn_mode: str
    check_every: int
    eval_batch_size: int

    @classmethod
    def checked(cls, m_count: int, *, optimizer, lr, seeds, rmsprop_alpha, rmsprop_eps, momentum, weight_decay, loss,
                diverge_above, test_bn_mode, check_every, eval_batch_size) -> "_EnsembleOptions":
        optimizer = check_choice("optimizer", optimizer, ENSEMBLE_OPTIMIZERS)
        lrs = _per_network("lr", lr, m_count, minimum=0.0, strict=True)
        seed_list = [check_seed(f"seeds[{i}]", s)
                     for i, s in enumerate(_per_network("seeds", seeds, m_count, minimum=0, integer=True))]
        rmsprop_alpha = check_real("rmsprop_alpha", rmsprop_alpha, minimum=0.0, maximum=1.0)
        rmsprop_eps = check_real("rmsprop_eps", rmsprop_eps, minimum=0.0)
        momentum = check_real("momentum", momentum, minimum=0.0)
        if momentum >= 1.0:
            raise ValueError(f"momentum={momentum!r} is not allowed: expected 0 <= momentum < 1")
        weight_decay = check_real("weight_decay", weight_decay, minimum=0.0)
        loss_kind = check_choice("loss", loss, ENSEMBLE_LOSSES)
        if diverge_above is not None:
            diverge_above = check_real("diverge_above", diverge_above)
        return cls(optimizer=optimizer, lrs=lrs, seeds=seed_list, rmsprop_alpha=rmsprop_alpha, rmsprop_eps=rmsprop_eps,
                   momentum=momentum, weight_decay=weight_decay, loss=loss_kind, diverge_above=diverge_above,
                   test_bn_mode=check_choice("test_bn_mode", test_bn_mode, TEST_BN_MODES),
                   check_every=check_int("check_every", check_every, minimum=1),
                   eval_batch_size=check_int("eval_batch_size", eval_batch_size, minimum=1))


@dataclass(frozen=True)
class _EnsembleData:
    """The training (and test) tensors on the device, the batch size and the number of steps, checked."""

    x: torch.Tensor
    y: torch.Tensor
    test: tuple[torch.Tensor, torch.Tensor] | None
    batch_size: int
    steps: int
    is_bnmlp: bool

    @classmethod
    def checked(cls, models, train_data, test_data, dev: torch.device, opts: _EnsembleOptions, *, batch_size, steps,
                epochs) -> "_EnsembleData":
        from bnlab.nets.models import BNMLP

        is_bnmlp = all(isinstance(m, BNMLP) for m in models)
        dtypes = {p.dtype for m in models for p in m.parameters() if p.is_floating_point()}
        if len(dtypes) > 1:
            raise ValueError(f"models is not allowed: their parameters have different dtypes "
                             f"({sorted(map(str, dtypes))}); an ensemble trains in one dtype")
        dtype = models[0].readout.weight.dtype if is_bnmlp else next(models[0].parameters()).dtype
        x_tr, y_tr = _as_tensors("train_data", train_data, dev, dtype)
        test = None if test_data is None else _as_tensors("test_data", test_data, dev, dtype)
        if test is not None:
            _test_chunks(test[0].shape[0], opts.eval_batch_size, opts.test_bn_mode)  # a 1-sample test set in train mode
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
        return cls(x=x_tr, y=y_tr, test=test, batch_size=batch_size, steps=steps, is_bnmlp=is_bnmlp)


def _make_stack(models, dev: torch.device, data: _EnsembleData, opts: _EnsembleOptions) -> Any:
    """The stacked networks: one BN-MLP stack (depths share a prefix), or one vmap stack per structure."""
    if data.is_bnmlp:
        if data.x.shape[1] != models[0].in_features:
            raise ValueError(f"train_data with {data.x.shape[1]} features is not allowed: the models expect "
                             f"{models[0].in_features}")
        sb = models[0].sub_batch_size
        if sb is not None and data.batch_size % sb:
            raise ValueError(f"batch_size={data.batch_size} is not allowed: it must be a multiple of the models' "
                             f"sub_batch_size={sb}")
        if sb is not None and opts.test_bn_mode == "train":
            raise ValueError("test_bn_mode='train' is not allowed for BN-MLPs with a sub_batch_size (test "
                             "batches are not multiples of it)")
        return _BNMLPStack(models, dev)
    # one vmap stack per structure (class, repr, parameter/buffer shapes): networks of different
    # depths or widths train in the same step without padding to the largest
    by_structure: dict[tuple, list[int]] = {}
    for i, m in enumerate(models):
        by_structure.setdefault(_structure(m), []).append(i)
    if len(by_structure) == 1:
        stack: Any = _VmapStack(models, dev)
    else:
        stack = _GroupedStack([(_VmapStack([models[i] for i in idx], dev), idx) for idx in by_structure.values()])
    stack._data_ndim = data.x.ndim
    return stack


def _ensemble_results(run: "_EnsembleRun", stack, data: _EnsembleData, opts: _EnsembleOptions, *,
                      chance: float) -> list[TrainResult]:
    """One TrainResult per network in the caller's order: what train() would report for it."""
    m_count, steps, done = len(opts.lrs), data.steps, run.done
    first_bad_l = run.first_bad()
    hist = run.history()
    accs = test_losses = None
    if data.test is not None:
        # the networks still stacked (every one that has not diverged, in row order)
        acc_rows, loss_rows = _ensemble_evaluate(stack, data.test, len(stack.rows), opts.eval_batch_size, opts.loss,
                                                 opts.test_bn_mode)
        accs, test_losses = [None] * m_count, [None] * m_count
        for pos, i in enumerate(stack.rows):
            accs[i], test_losses[i] = acc_rows[pos], loss_rows[pos]
    results = []
    for i in range(m_count):
        if first_bad_l[i] < steps:
            taken = _reported_steps(first_bad_l[i], opts.check_every, steps)
            # train() goes on with non-finite weights after the bad step: its later losses are NaN
            h = [float(v) if t <= first_bad_l[i] else float("nan") for t, v in enumerate(hist[:taken, i])]
            results.append(TrainResult(None if data.test is None else chance, True, first_bad_l[i], taken,
                                       float("nan"), chance, h, [], False))
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
        total += per_network_loss(loss_kind, logits, yb).double() * logits.shape[1]
    acc = (correct.double() / x.shape[0]).cpu().tolist()
    return [a if f else None for a, f in zip(acc, finite.cpu().tolist())], (total / x.shape[0]).cpu().tolist()
