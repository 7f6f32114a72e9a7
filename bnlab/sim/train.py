"""Trainable batch-normalized MLPs and the training loops of Yang et al. 2019 §4.

The network is the batch-normalized fully-connected net of Yang et al. 2019,
Eq. (7), with BN *before* the nonlinearity::

    h^1 = W^1 x,      h̃^l = BN(h^l),      h^{l+1} = W^{l+1} φ(γ h̃^l + β),
    logits = W^{out} φ(γ h̃^L + β) + b^{out},

with ``depth = L`` batch-normalized layers of ``width`` neurons, weights
``W^l_{αβ} ~ N(0, σ_w²/fan_in)`` and no hidden biases (a bias before BN is
removed by the mean subtraction, so σ_b² = 0 loses nothing; §3.1).  BN
normalizes every neuron with the batch mean and the biased batch variance,
``BN(h)_α = (h_α − μ_α)/sqrt(σ_α² + ε)``.  As in the paper (§3.1, "these may
be incorporated into the nonlinearity") γ and β are constants folded into
φ — ``affine="frozen"``; ``affine="trainable"`` instead makes them per-neuron
parameters initialized at γ, β, as in standard BN layers.

*Ghost batches* (Fig. 3b): with ``sub_batch_size=B`` the batch statistics are
computed over consecutive sub-batches of B samples inside a larger batch
(e.g. 1000), i.e. BN is applied to each sub-batch independently — vectorized
as one reshape, not a loop.  In evaluation mode the running statistics are
used, updated in training exactly as ``torch.nn.BatchNorm1d`` does (momentum,
unbiased variance), averaged over the sub-batches.

:func:`train_classifier` trains with SGD or RMSProp on cross-entropy and
reports the test accuracy; a non-finite loss or non-finite test logits stop
the run and record it as *diverged* with chance accuracy (1/num_classes).
:func:`layer_norm_trajectory` records the per-layer norms of the weights, of
the gradients with respect to the pre-activations h^l and of the weight
gradients during the first optimization steps (Fig. 4).

Everything is deterministic given ``seed``: the weights are drawn from a
``torch.Generator`` seeded with it and the data order from another one; no
global random state is read.  ``device="cuda"`` runs on a GPU.

Errata (Yang et al. 2019)
-------------------------
* Eq. (7) prints ``σ_α² = sqrt((1/N)Σ_i (h_αi − μ_α)² + ε)``; the square on
  σ_α is a typo — the normalization divides by ``σ_α = sqrt(var + ε)``
  (checked against ``torch.nn.BatchNorm1d`` in ``tests/sim/test_train.py``).
* In the same line μ_α and σ_α are averages over "N_i"; these are averages
  over the batch index i (B samples), not over neurons.

References
----------
Yang, Pennington, Rao, Sohl-Dickstein, Schoenholz, "A Mean Field Theory of
Batch Normalization", ICLR 2019: Eq. (7) (the network), §4 and Figs. 3–5
(trainability experiments).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from bnlab._validation import check_choice, check_int, check_real
from bnlab.activations import Activation, get_activation

__all__ = [
    "BNMLP",
    "TrainResult",
    "train_classifier",
    "layer_norm_trajectory",
    "OPTIMIZERS",
]

#: Optimizers accepted by :func:`train_classifier`.
OPTIMIZERS = ("sgd", "rmsprop")


def _resolve_device(device: Any) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device={device!r} is not allowed: {exc}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} is not allowed: CUDA is not available on this machine")
    return dev


def _ghost_batchnorm(h: torch.Tensor, sub_batch_size: int | None, eps: float):
    """Normalize ``h`` (n, C) over sub-batches of ``sub_batch_size`` rows.

    Returns the normalized tensor and the per-sub-batch mean and biased
    variance, shapes (n/B, C) (one row when ``sub_batch_size`` is None).
    """
    n, c = h.shape
    b = n if sub_batch_size is None else sub_batch_size
    hg = h.reshape(n // b, b, c)
    mean = hg.mean(dim=1, keepdim=True)
    var = hg.var(dim=1, unbiased=False, keepdim=True)
    out = (hg - mean) * torch.rsqrt(var + eps)
    return out.reshape(n, c), mean.squeeze(1), var.squeeze(1)


class BNMLP(nn.Module):
    """Batch-normalized MLP of Yang et al. 2019, Eq. (7) (BN before φ).

    Parameters
    ----------
    in_features, num_classes:
        Input dimension and number of output classes.
    depth:
        Number L ≥ 1 of batch-normalized hidden layers.
    width:
        Neurons N per hidden layer.
    phi:
        Nonlinearity: a registry name or expression (see
        :func:`bnlab.activations.get_activation`, extra keyword arguments
        ``**phi_params`` go there) or an :class:`~bnlab.activations.Activation`.
    gamma, beta:
        BN scale and shift; the network computes φ(γ h̃ + β).  With an
        ``Activation`` that already carries γ, β leave these at 1 and 0.
    eps:
        ε ≥ 0 added to the batch variance (the paper uses 1e-3 in Fig. 3).
        ε = 0 divides by the raw batch standard deviation.
    sigma_w2:
        Weight variance σ_w²: W_{αβ} ~ N(0, σ_w²/fan_in).  Hidden layers are
        invariant to it through BN (§3.1), the readout is not.
    sub_batch_size:
        B of "ghost" batch statistics (Fig. 3b): None (the whole batch) or an
        integer ≥ 2 that divides every training batch.
    affine:
        ``"frozen"`` (γ, β are constants, as in the paper) or ``"trainable"``
        (per-neuron parameters initialized at γ, β).
    momentum:
        Momentum of the running statistics used in evaluation mode (as in
        ``torch.nn.BatchNorm1d``).
    seed:
        Seed of the weight initialization (a private ``torch.Generator``).
    dtype:
        Parameter dtype (float32 for training, float64 for exact checks).
    """

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        *,
        depth: int,
        width: int,
        phi: str | Activation = "relu",
        gamma: float = 1.0,
        beta: float = 0.0,
        eps: float = 1e-3,
        sigma_w2: float = 1.0,
        sub_batch_size: int | None = None,
        affine: str = "frozen",
        momentum: float = 0.1,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        **phi_params: Any,
    ):
        super().__init__()
        self.in_features = check_int("in_features", in_features, minimum=1)
        self.num_classes = check_int("num_classes", num_classes, minimum=2)
        self.depth = check_int("depth", depth, minimum=1)
        self.width = check_int("width", width, minimum=1)
        self.gamma = check_real("gamma", gamma)
        self.beta = check_real("beta", beta)
        self.eps = check_real("eps", eps, minimum=0.0)
        self.sigma_w2 = check_real("sigma_w2", sigma_w2, minimum=0.0, strict_minimum=True)
        self.affine = check_choice("affine", affine, ("frozen", "trainable"))
        self.momentum = check_real("momentum", momentum, minimum=0.0, maximum=1.0)
        seed = check_int("seed", seed, minimum=0)
        if sub_batch_size is not None:
            sub_batch_size = check_int("sub_batch_size", sub_batch_size, minimum=2)
        self.sub_batch_size = sub_batch_size
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"dtype={dtype!r} is not allowed: expected torch.float32 or torch.float64")

        if isinstance(phi, Activation):
            if phi_params:
                raise ValueError(f"phi_params={phi_params!r} is not allowed with an Activation object for phi")
            if (gamma != 1.0 or beta != 0.0) and (phi.gamma != 1.0 or phi.beta != 0.0):
                raise ValueError(
                    f"gamma={gamma!r}, beta={beta!r} are not allowed together with an Activation that already "
                    f"has gamma={phi.gamma}, beta={phi.beta}: give them in one place"
                )
            if gamma == 1.0 and beta == 0.0:
                self.gamma, self.beta = phi.gamma, phi.beta
            base = dataclasses.replace(phi, gamma=1.0, beta=0.0)
        else:
            base = get_activation(phi, **phi_params)
        if base._base_torch is None:
            raise ValueError(f"phi={phi!r} is not allowed: it has no torch implementation")
        self.base_activation = base
        #: φ(γ·+β) with the constants folded in (the paper's convention).
        self.activation = base.with_affine(self.gamma, self.beta)

        gen = torch.Generator().manual_seed(seed)
        fan_in = [self.in_features] + [self.width] * (self.depth - 1)
        self.weights = nn.ParameterList(
            nn.Parameter(torch.randn(self.width, f, generator=gen, dtype=torch.float64).mul_(math.sqrt(self.sigma_w2 / f)).to(dtype))
            for f in fan_in
        )
        self.readout = nn.Linear(self.width, self.num_classes, dtype=dtype)
        with torch.no_grad():
            self.readout.weight.copy_(
                torch.randn(self.num_classes, self.width, generator=gen, dtype=torch.float64) * math.sqrt(self.sigma_w2 / self.width)
            )
            self.readout.bias.zero_()
        if self.affine == "trainable":
            self.bn_scale = nn.Parameter(torch.full((self.depth, self.width), self.gamma, dtype=dtype))
            self.bn_shift = nn.Parameter(torch.full((self.depth, self.width), self.beta, dtype=dtype))
        self.register_buffer("running_mean", torch.zeros(self.depth, self.width, dtype=dtype))
        self.register_buffer("running_var", torch.ones(self.depth, self.width, dtype=dtype))
        #: pre-activations h^l of the last forward with ``record=True`` (grads retained).
        self.recorded_preactivations: list[torch.Tensor] = []

    def extra_repr(self) -> str:
        return (
            f"depth={self.depth}, width={self.width}, phi={self.activation.spec}, eps={self.eps}, "
            f"sigma_w2={self.sigma_w2}, sub_batch_size={self.sub_batch_size}, affine={self.affine!r}"
        )

    def _normalize(self, h: torch.Tensor, layer: int) -> torch.Tensor:
        if not self.training:
            return (h - self.running_mean[layer]) * torch.rsqrt(self.running_var[layer] + self.eps)
        n = h.shape[0]
        b = self.sub_batch_size
        if b is not None and n % b != 0:
            raise ValueError(
                f"batch of {n} samples is not allowed with sub_batch_size={b}: it must be a multiple of it"
            )
        if (b or n) < 2:
            raise ValueError(f"batch of {n} samples is not allowed in training mode: BN needs at least 2")
        out, mean, var = _ghost_batchnorm(h, b, self.eps)
        with torch.no_grad():
            bb = b or n
            # as torch.nn.BatchNorm1d: running var is updated with the unbiased batch variance
            self.running_mean[layer].lerp_(mean.mean(0), self.momentum)
            self.running_var[layer].lerp_((var * (bb / (bb - 1))).mean(0), self.momentum)
        return out

    def forward(self, x: torch.Tensor, *, record: bool = False) -> torch.Tensor:
        """Logits for a batch ``x`` of shape (n, in_features) (or (n, C, H, W), flattened).

        ``record=True`` keeps the pre-activations h^l (before BN) with
        ``retain_grad`` in :attr:`recorded_preactivations`, for Fig. 4.
        """
        x = x.reshape(x.shape[0], -1)
        if x.shape[1] != self.in_features:
            raise ValueError(f"x with {x.shape[1]} features is not allowed: the model expects {self.in_features}")
        self.recorded_preactivations = []
        act = self.activation.torch if self.affine == "frozen" else self.base_activation.torch
        a = x
        for layer, w in enumerate(self.weights):
            h = a @ w.T
            if record:
                h.retain_grad()
                self.recorded_preactivations.append(h)
            n = self._normalize(h, layer)
            if self.affine == "trainable":
                n = n * self.bn_scale[layer] + self.bn_shift[layer]
            a = act(n)
        return self.readout(a)


@dataclass
class TrainResult:
    """Outcome of :func:`train_classifier`.

    Attributes
    ----------
    test_accuracy:
        Fraction of correctly classified test samples (chance when diverged).
    diverged:
        Whether the loss (or the test logits) became NaN/inf.
    diverged_at_step:
        The step at which a non-finite loss was first seen (None if never).
    steps:
        Optimization steps taken.
    final_train_loss:
        Mean training loss over the last ≤ 50 steps (NaN when diverged).
    chance:
        1/num_classes.
    """

    test_accuracy: float
    diverged: bool
    diverged_at_step: int | None
    steps: int
    final_train_loss: float
    chance: float
    history: list[float] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("history")
        if not math.isfinite(d["final_train_loss"]):
            d["final_train_loss"] = None
        return d


def _as_tensors(name: str, data: Any, device: torch.device, dtype: torch.dtype):
    """(x, y) tensors from a bnlab.data Dataset (``.x``, ``.y``) or an (x, y) pair."""
    if hasattr(data, "x") and hasattr(data, "y"):
        x, y = data.x, data.y
    elif isinstance(data, (tuple, list)) and len(data) == 2:
        x, y = data
    else:
        raise ValueError(f"{name}={type(data).__name__} is not allowed: expected a Dataset with .x/.y or an (x, y) pair")
    x = torch.as_tensor(np.asarray(x) if not isinstance(x, torch.Tensor) else x)
    y = torch.as_tensor(np.asarray(y) if not isinstance(y, torch.Tensor) else y)
    if x.ndim < 2 or y.ndim != 1 or x.shape[0] != y.shape[0] or x.shape[0] == 0:
        raise ValueError(
            f"{name} is not allowed: expected x of shape (n, ...) and y of shape (n,) with n ≥ 1, "
            f"got {tuple(x.shape)} and {tuple(y.shape)}"
        )
    x = x.reshape(x.shape[0], -1).to(device=device, dtype=dtype)
    if not torch.isfinite(x).all():
        raise ValueError(f"{name} is not allowed: its inputs contain NaN or infinite values")
    return x, y.to(device=device, dtype=torch.long)


def _make_optimizer(name: str, params, lr: float, momentum: float):
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum)
    # TensorFlow's RMSProp defaults (decay 0.9, small epsilon), which the paper's
    # experiments used; torch's default alpha=0.99 averages over a longer window.
    return torch.optim.RMSprop(params, lr=lr, alpha=0.9, eps=1e-10, momentum=momentum)


def _batches(n: int, batch_size: int, steps: int, gen: torch.Generator, device: torch.device):
    """Yield ``steps`` index batches: reshuffled epochs, last partial batch dropped."""
    per_epoch = n // batch_size
    done = 0
    while done < steps:
        perm = torch.randperm(n, generator=gen).to(device)
        for i in range(min(per_epoch, steps - done)):
            yield perm[i * batch_size : (i + 1) * batch_size]
        done += min(per_epoch, steps - done)


def _check_common(model, optimizer, lr, batch_size, n_train, momentum):
    if not isinstance(model, BNMLP):
        raise ValueError(f"model={type(model).__name__} is not allowed: expected a BNMLP")
    optimizer = check_choice("optimizer", optimizer, OPTIMIZERS)
    lr = check_real("lr", lr, minimum=0.0, strict_minimum=True)
    momentum = check_real("momentum", momentum, minimum=0.0, maximum=1.0)
    batch_size = check_int("batch_size", batch_size, minimum=2)
    if batch_size > n_train:
        raise ValueError(f"batch_size={batch_size} is not allowed: the training set has only {n_train} samples")
    if model.sub_batch_size is not None and batch_size % model.sub_batch_size:
        raise ValueError(
            f"batch_size={batch_size} is not allowed: it must be a multiple of the model's "
            f"sub_batch_size={model.sub_batch_size}"
        )
    return optimizer, lr, batch_size, momentum


@torch.no_grad()
def _accuracy(model: BNMLP, x: torch.Tensor, y: torch.Tensor, eval_batch_size: int) -> tuple[float, bool]:
    model.eval()
    correct = torch.zeros((), dtype=torch.long, device=x.device)
    finite = torch.ones((), dtype=torch.bool, device=x.device)
    for i in range(0, x.shape[0], eval_batch_size):
        logits = model(x[i : i + eval_batch_size])
        finite &= torch.isfinite(logits).all()
        correct += (logits.argmax(dim=1) == y[i : i + eval_batch_size]).sum()
    model.train()
    return correct.item() / x.shape[0], bool(finite.item())


def train_classifier(
    model: BNMLP,
    train: Any,
    test: Any,
    *,
    optimizer: str = "sgd",
    lr: float,
    batch_size: int,
    epochs: float | None = None,
    steps: int | None = None,
    seed: int = 0,
    device: str | torch.device = "cpu",
    momentum: float = 0.0,
    eval_batch_size: int = 1000,
    check_every: int = 10,
) -> TrainResult:
    """Train ``model`` on cross-entropy and return its test accuracy.

    Parameters
    ----------
    model:
        A :class:`BNMLP` (moved to ``device`` in place).
    train, test:
        A ``bnlab.data`` Dataset (``.x``, ``.y``) or an ``(x, y)`` pair of
        arrays/tensors; ``x`` is flattened per sample.
    optimizer:
        ``"sgd"`` (Fig. 3a,b,d, Fig. 5) or ``"rmsprop"`` (Fig. 3c; decay 0.9
        as TensorFlow's default).
    lr:
        Learning rate η (the paper uses η = 1e-5·B).
    batch_size:
        Training batch size (a multiple of ``model.sub_batch_size``).
    epochs, steps:
        Training length: exactly one of them.  ``epochs`` may be fractional;
        each epoch reshuffles and drops the last partial batch.
    seed:
        Seed of the data order (a private ``torch.Generator``).
    device:
        ``"cpu"``, ``"cuda"``, … .
    momentum:
        Momentum of SGD/RMSProp (0, as in the paper).
    eval_batch_size:
        Batch of the test pass (running statistics are used, so it does not
        change the result beyond float rounding).
    check_every:
        Non-finite losses are checked every this many steps (a host sync).

    Returns
    -------
    TrainResult
        ``diverged=True`` with ``test_accuracy = chance`` when a training loss
        or a test logit became NaN/inf.

    Notes
    -----
    Same ``model`` initialization, ``seed`` and device → same result (CPU
    kernels are deterministic; on CUDA cuBLAS may reorder sums).
    """
    dev = _resolve_device(device)
    x_tr, y_tr = _as_tensors("train", train, dev, model.readout.weight.dtype)
    x_te, y_te = _as_tensors("test", test, dev, model.readout.weight.dtype)
    optimizer, lr, batch_size, momentum = _check_common(model, optimizer, lr, batch_size, x_tr.shape[0], momentum)
    seed = check_int("seed", seed, minimum=0)
    eval_batch_size = check_int("eval_batch_size", eval_batch_size, minimum=1)
    check_every = check_int("check_every", check_every, minimum=1)
    if (epochs is None) == (steps is None):
        raise ValueError(f"epochs={epochs!r}, steps={steps!r} is not allowed: give exactly one of them")
    if epochs is not None:
        epochs = check_real("epochs", epochs, minimum=0.0, strict_minimum=True)
        steps = max(1, int(round(epochs * (x_tr.shape[0] // batch_size))))
    steps = check_int("steps", steps, minimum=1)
    if x_tr.shape[1] != model.in_features or x_te.shape[1] != model.in_features:
        raise ValueError(
            f"train/test with {x_tr.shape[1]}/{x_te.shape[1]} features are not allowed: the model expects {model.in_features}"
        )
    n_classes = model.num_classes
    if int(y_tr.max()) >= n_classes or int(y_te.max()) >= n_classes or int(min(y_tr.min(), y_te.min())) < 0:
        raise ValueError(f"labels are not allowed: they must lie in [0, {n_classes})")

    model.to(dev).train()
    opt = _make_optimizer(optimizer, model.parameters(), lr, momentum)
    gen = torch.Generator().manual_seed(seed)
    chance = 1.0 / n_classes
    losses = torch.empty(steps, device=dev)
    diverged_at = None
    done = 0
    for step, idx in enumerate(_batches(x_tr.shape[0], batch_size, steps, gen, dev)):
        loss = nn.functional.cross_entropy(model(x_tr[idx]), y_tr[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses[step] = loss.detach()
        done = step + 1
        if done % check_every == 0 or done == steps:
            window = losses[done - min(check_every, done) : done]
            if not torch.isfinite(window).all():
                bad = (~torch.isfinite(window)).nonzero()[0].item()
                diverged_at = done - window.numel() + bad
                break
    history = losses[:done].cpu().tolist()
    if diverged_at is not None:
        return TrainResult(chance, True, diverged_at, done, float("nan"), chance, history)
    acc, finite = _accuracy(model, x_te, y_te, eval_batch_size)
    final = float(np.mean(history[-50:]))
    if not finite:
        return TrainResult(chance, True, None, done, final, chance, history)
    return TrainResult(acc, False, None, done, final, chance, history)


def layer_norm_trajectory(
    model: BNMLP,
    train: Any,
    *,
    lr: float,
    batch_size: int,
    steps: int = 10,
    optimizer: str = "sgd",
    seed: int = 0,
    device: str | torch.device = "cpu",
    momentum: float = 0.0,
) -> dict[str, np.ndarray]:
    """Per-layer norms during the first ``steps`` optimization steps (Fig. 4).

    At every step t = 0, …, ``steps`` the model's current weights W^l are
    measured, a training batch is forwarded, the cross-entropy is
    backpropagated and the gradients at the pre-activations h^l (before BN,
    Eq. 7) and at W^l are measured; then (for t < ``steps``) the optimizer
    takes a step.  Row t therefore describes the network after t updates.

    Returns
    -------
    dict
        ``weight_norm``, ``preact_grad_norm``, ``weight_grad_norm``: float64
        arrays of shape (steps + 1, depth) of Frobenius norms (layer 1 = the
        input layer first); ``loss``: (steps + 1,).  ``preact_grad_norm`` is
        the norm over the whole batch and all neurons of ∂loss/∂h^l, whose
        square grows by λ_G (Yang et al. 2019, Thm 3.9) per layer towards the
        input at initialization.
    """
    dev = _resolve_device(device)
    x_tr, y_tr = _as_tensors("train", train, dev, model.readout.weight.dtype)
    optimizer, lr, batch_size, momentum = _check_common(model, optimizer, lr, batch_size, x_tr.shape[0], momentum)
    steps = check_int("steps", steps, minimum=0)
    seed = check_int("seed", seed, minimum=0)
    model.to(dev).train()
    opt = _make_optimizer(optimizer, model.parameters(), lr, momentum)
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
