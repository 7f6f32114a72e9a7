"""Rank-raising pre-training (Daneshmand et al. 2020, Algorithm 1, App. G) for any torch model.

For k = 1..M: draw a minibatch X_k of N inputs; take T gradient steps that raise the rank
bound r(H_L(X_k)) (Eq. 4) of the last hidden representation H_L with respect to all
parameters.  Unsupervised: labels are never used.

Layer-wise (``layer="layerwise"`` or a list of names): for each minibatch, T steps on r(H_1),
then T steps on r(H_2), ..., then on r(H_L).  This is what §4 describes ("we maximize the
lower-bound r(H_ℓ) ... in each layer ℓ") and Fig. 6's caption ("pre-trained layer-wise with
25 and 75 iterations"); Algorithm 1 as printed only names H_L.  Measured here on a depth-32
ReLU MLP (width 128, Xavier-normal, SGD lr 1e-2, N = 64, one minibatch): last-layer-only
T = 75 left r(H_L) at 1.0 while layer-wise T = 25 raised it from 1.01 to 6.1 (docs/rank.md).

The objective minimized is, by default, ‖M‖_F / tr(M) = r(H)^{−1/2} — what the authors'
script minimizes (see /work/shared/ANCHORS.md) — or −r(H) (``objective="neg_r"``), the
literal "gradient step on r(H_L)" of Algorithm 1.  Both are maximized by the same H (r is
monotone in either); they differ in the gradient's scale, so in the step size that works.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn

from bnlab._validation import check_choice, check_int, check_seed
from bnlab.rank.hooks import last_linear_name, record_representations
from bnlab.rank.measures import _lower_bound_gram

__all__ = ["PretrainResult", "rank_pretrain", "PRETRAIN_OBJECTIVES"]

PRETRAIN_OBJECTIVES = ("inverse_sqrt", "neg_r")


@dataclass
class PretrainResult:
    """The pre-trained model (the same object, trained in place) and the rank history.

    ``history`` has one entry per gradient step: {"minibatch": k, "layer": name, "step": t,
    "r": r(H) of that layer on X_k before the step}.  ``initial_r`` and ``final_r`` are r(H) of
    ``layer`` (the last of ``layers``: H_L) on the first minibatch before any step and on the
    last minibatch after the last step.
    """

    model: nn.Module
    layer: str
    capture: str
    layers: list = field(default_factory=list)
    history: list = field(default_factory=list)
    initial_r: float = float("nan")
    final_r: float = float("nan")

    @property
    def r_history(self) -> list[float]:
        return [h["r"] for h in self.history]

    def to_dict(self) -> dict:
        return {"layer": self.layer, "layers": list(self.layers), "capture": self.capture,
                "initial_r": self.initial_r,
                "final_r": self.final_r, "history": list(self.history)}


def _inputs_of(data: Any) -> torch.Tensor:
    if isinstance(data, torch.utils.data.TensorDataset):
        data = data.tensors
    if isinstance(data, (tuple, list)) and data and isinstance(data[0], torch.Tensor):
        data = data[0]
    if not isinstance(data, torch.Tensor):
        raise ValueError(
            f"data is not allowed: expected a tensor of inputs (n, ...), an (inputs, labels) tuple or a "
            f"TensorDataset, got {type(data).__name__}")
    if data.ndim < 1 or data.shape[0] == 0:
        raise ValueError(f"data is not allowed: expected at least one input, got shape {tuple(data.shape)}")
    if data.is_floating_point() and not bool(torch.isfinite(data).all()):
        raise ValueError("data is not allowed: its inputs contain NaN or infinite values")
    return data


#: Pre-training estimated to take longer than this (a day) is refused up front.
MAX_PRETRAIN_SECONDS = 86400.0


def _check_pretrain_time(model: nn.Module, passes: int, batch_size: int) -> None:
    """A lower estimate, as bnlab.nets.train's: 0.2 ms per step plus 6 flops per parameter and sample at
    1e11 flop/s; ``passes`` = minibatches × layers × steps forward-backward passes."""
    params = sum(p.numel() for p in model.parameters())
    secs = passes * (2e-4 + 6.0 * params * batch_size / 1e11)
    if secs > MAX_PRETRAIN_SECONDS:
        raise ValueError(
            f"steps is not allowed: {passes:.3g} gradient steps (minibatches × layers × steps) would take at "
            f"least {secs:.3g} s ({secs / 86400:.3g} days), more than a day"
        )


def _make_optimizer(optimizer: Any, model: nn.Module) -> torch.optim.Optimizer:
    if optimizer is None:
        return torch.optim.SGD(model.parameters(), lr=1e-3)
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if callable(optimizer):
        opt = optimizer(model.parameters())
        if not isinstance(opt, torch.optim.Optimizer):
            raise ValueError(f"optimizer is not allowed: the factory returned {type(opt).__name__}, "
                             "expected a torch.optim.Optimizer")
        return opt
    raise ValueError(f"optimizer={optimizer!r} is not allowed: expected a torch.optim.Optimizer, a factory "
                     "params -> Optimizer (e.g. functools.partial(torch.optim.SGD, lr=1e-3)) or None")


def rank_pretrain(
    model: nn.Module,
    data: Any,
    *,
    layer: str | Sequence[str] | None = None,
    capture: str | None = None,
    minibatches: int = 1,
    steps: int = 40,
    batch_size: int = 64,
    optimizer: Any = None,
    objective: str = "inverse_sqrt",
    seed: int = 0,
) -> PretrainResult:
    """Algorithm 1 of Daneshmand et al. 2020 (App. G): raise r(H) of one layer by gradient steps.

    Parameters
    ----------
    model : any ``nn.Module``; trained in place (its mode is left as it is: BN in train mode
        normalizes with the minibatch's statistics).
    data : inputs (n, ...), an (inputs, labels) tuple or a ``TensorDataset`` (labels unused);
        on the model's device.
    layer : a submodule name (``model.named_modules()``).  Default: the last ``nn.Linear``
        (the classifier) with ``capture="input"``, i.e. the last hidden representation H_L.
        A list of names: layer-wise pre-training, in the list's order.  "layerwise": the
        inputs of every ``nn.Linear`` but the first, in registration order (H_1, ..., H_L of
        an MLP), with ``capture="input"``.
    capture : "output" or "input" of the layer(s); default "output" for named layers.
    minibatches, steps, batch_size : M, T and N of Algorithm 1 (the authors' script: M = 1000,
        T = 40, N = 64).
    optimizer : a ``torch.optim.Optimizer`` on the model's parameters, a factory
        ``params -> Optimizer``, or None for SGD with lr 1e-3 (the authors' choice).
    objective : "inverse_sqrt" (minimize ‖M‖_F/tr M = r^{−1/2}) or "neg_r" (minimize −r).
    seed : seeds the minibatch draws (N distinct inputs per minibatch, i.i.d. across minibatches).
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model is not allowed: expected an nn.Module, got {type(model).__name__}")
    inputs = _inputs_of(data)
    minibatches = check_int("minibatches", minibatches, minimum=1)
    steps = check_int("steps", steps, minimum=1)
    batch_size = check_int("batch_size", batch_size, minimum=2, maximum=inputs.shape[0])
    objective = check_choice("objective", objective, PRETRAIN_OBJECTIVES)
    seed = check_seed("seed", seed)
    if layer is None:
        layers = [last_linear_name(model)]
        capture = "input" if capture is None else capture
    elif isinstance(layer, str) and layer == "layerwise":
        layers = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)][1:]
        if not layers:
            raise ValueError("layer='layerwise' is not allowed: the model has fewer than two nn.Linear layers")
        capture = "input" if capture is None else capture
    else:
        layers = [layer] if isinstance(layer, str) else list(layer)
        if not layers or not all(isinstance(n, str) for n in layers):
            raise ValueError(f"layer={layer!r} is not allowed: expected a layer name or a list of names")
    capture = check_choice("capture", "output" if capture is None else capture, ("output", "input"))
    with record_representations(model, layers, capture=capture):
        pass  # validates every name before any training (unknown names raise ValueError)
    _check_pretrain_time(model, minibatches * len(layers) * steps, batch_size)
    opt = _make_optimizer(optimizer, model)
    gen = torch.Generator().manual_seed(seed)
    result = PretrainResult(model=model, layer=layers[-1], capture=capture, layers=layers)

    def bound(x, name):
        with record_representations(model, name, capture=capture, detach=False) as store:
            model(x)
        if name not in store:
            raise ValueError(f"layer {name!r} did not run in the forward pass")
        return _lower_bound_gram(store[name])

    x = None
    updates = 0  # optimizer steps taken so far: a dead or overflowing H before the first one is the data's
    for k in range(minibatches):
        idx = torch.randperm(inputs.shape[0], generator=gen)[:batch_size].to(inputs.device)
        x = inputs[idx]
        if k == 0:
            with torch.no_grad():
                result.initial_r = float(bound(x, layers[-1]))
        for name in layers:
            for t in range(steps):
                opt.zero_grad(set_to_none=True)
                r = bound(x, name)
                r_value = float(r.detach())
                if not math.isfinite(r_value) or r_value == 0.0:
                    if updates == 0:
                        what = ("represents the minibatch by a zero matrix (zero inputs, or its units dead for "
                                "every sample)" if r_value == 0.0 else "overflows on the minibatch")
                        raise ValueError(
                            f"data is not allowed for this model: before any pre-training step, layer {name!r} "
                            f"{what}, so r(H) = {r_value} and Algorithm 1 has nothing to raise; check the inputs' scale")
                    raise FloatingPointError(
                        f"r(H) of layer {name!r} is {r_value} at minibatch {k}, step {t}, after {updates} "
                        "pre-training steps (the representation overflowed or died); lower the step size")
                loss = r.rsqrt() if objective == "inverse_sqrt" else -r
                loss.backward()
                opt.step()
                updates += 1
                result.history.append({"minibatch": k, "layer": name, "step": t, "r": r_value})
    with torch.no_grad():
        result.final_r = float(bound(x, layers[-1]))
    return result

