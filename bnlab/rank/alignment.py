"""Directional gradient alignment of the last layer (Daneshmand et al. 2020, Prop. 19, Fig. 10).

For a classifier whose last layer is linear, logits_i = W h_i + b with h_i the last hidden
representation of sample i, the per-sample gradient is ∇_W L_i = g_i h_iᵀ with
g_i = ∂ℓ(y_i, ·)/∂logits_i (Eq. 97).  If H_L has rank one (h_i = c_i h), every neuron's
gradient rows (g_i)_k h_iᵀ are collinear across samples: |cos| = 1 (Prop. 19).

BN in train mode: a sample's loss depends on the whole batch through the batch statistics,
so "per-sample gradients" of the earlier layers are not per-sample at all and ``vmap`` over
single samples would silently normalize each sample by itself.  The last layer, though, acts
on each sample separately: with the batch's forward pass fixed (BN using the batch's
statistics, as in training), ∇_W L_i = g_i h_iᵀ exactly.  :func:`gradient_alignment` therefore
runs the whole batch once (capturing h_i through a forward pre-hook) and takes the per-sample
gradients of the last layer alone with ``torch.func.vmap(torch.func.grad(...))``.  It raises
if the model's output is not that layer's output (a BN or anything else after it would mix
the samples again).  BN running statistics are restored afterwards (no side effect).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad, vmap

from bnlab.rank.hooks import last_linear_name

__all__ = ["GradientAlignment", "gradient_alignment"]


@dataclass(frozen=True)
class GradientAlignment:
    """Per-sample gradients of the last layer's weight and their cosine similarities.

    grads : (N, d_out, d) — ∇_W L_i (the bias excluded: its gradient g_i carries no h_i).
    cosine : (N, N) — cosines of the flattened ∇_W L_i.
    neuron_cosine : (d_out, N, N) — per output neuron k, cosines of the rows (∇_W L_i)_{k,:}
        (Prop. 19's statement; a zero row gives cosine 0).
    mean_abs_cosine, mean_abs_neuron_cosine : mean |cos| over pairs i ≠ j whose two gradients
        (rows) are non-zero — Prop. 19 is about samples with non-zero error and representation; a
        zero h_i (e.g. a ReLU representation that is exactly 0) has no direction.  NaN if no pair.
    zero_fraction : fraction of samples whose whole gradient is zero.
    """

    grads: torch.Tensor
    cosine: torch.Tensor
    neuron_cosine: torch.Tensor
    mean_abs_cosine: float
    mean_abs_neuron_cosine: float
    zero_fraction: float
    layer: str


def _cosines(v: torch.Tensor) -> torch.Tensor:
    # v: (..., N, p) → (..., N, N); zero vectors have cosine 0 with everything.
    norm = v.norm(dim=-1, keepdim=True)
    u = v / torch.where(norm > 0, norm, torch.ones_like(norm))
    return u @ u.transpose(-1, -2)


def _mean_abs_offdiag(c: torch.Tensor, nonzero: torch.Tensor) -> float:
    # c: (..., N, N); nonzero: (..., N) — pairs i ≠ j with both vectors non-zero
    n = c.shape[-1]
    pair = nonzero.unsqueeze(-1) & nonzero.unsqueeze(-2) & ~torch.eye(n, dtype=torch.bool, device=c.device)
    count = int(pair.sum())
    if count == 0:
        return float("nan")
    return float((c.abs() * pair).sum() / count)


def gradient_alignment(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy,
    layer: str | None = None,
) -> GradientAlignment:
    """Cosine similarity of the per-sample gradients of the last linear layer (Prop. 19, Fig. 10).

    Parameters
    ----------
    model : an ``nn.Module`` whose output is the output of ``layer`` (an ``nn.Linear``).
    x, y : a batch of N ≥ 2 inputs and targets.
    loss_fn : ℓ(logits, targets) with mean reduction, applied to one sample at a time.
    layer : name of the last ``nn.Linear``; default the last one registered.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model is not allowed: expected an nn.Module, got {type(model).__name__}")
    name = last_linear_name(model) if layer is None else layer
    modules = dict(model.named_modules())
    if name not in modules:
        raise ValueError(f"layer {name!r} is not allowed: the model has no submodule of that name")
    lin = modules[name]
    if not isinstance(lin, nn.Linear):
        raise ValueError(f"layer {name!r} is not allowed: expected an nn.Linear, got {type(lin).__name__}")
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor) or x.ndim < 1 or y.ndim < 1:
        raise ValueError("x, y are not allowed: expected tensors with a leading batch dimension")
    if x.shape[0] < 2 or y.shape[0] != x.shape[0]:
        raise ValueError(f"x, y are not allowed: expected N >= 2 samples each, got {x.shape[0]} and {y.shape[0]}")
    if x.is_floating_point() and not bool(torch.isfinite(x).all()):
        raise ValueError("x is not allowed: it contains NaN or infinite entries")
    if y.is_floating_point():
        if not bool(torch.isfinite(y).all()):
            raise ValueError("y is not allowed: it contains NaN or infinite entries")
        if loss_fn is F.cross_entropy and y.ndim == 1:
            # cross-entropy takes integer class indices; float class targets (2.55) are refused, not truncated
            raise ValueError(f"y is not allowed: class targets for cross-entropy must be integers, got {y.dtype}")
    elif loss_fn is F.cross_entropy and y.numel() and (int(y.min()) < 0 or int(y.max()) >= lin.out_features):
        raise ValueError(f"y is not allowed: class indices must lie in [0, {lin.out_features}) for layer {name!r}")

    captured = {}

    def pre_hook(_m, inputs):
        captured["h"] = inputs[0].detach()

    def hook(_m, _inputs, output):
        captured["out"] = output

    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
    handles = [lin.register_forward_pre_hook(pre_hook), lin.register_forward_hook(hook)]
    try:
        with torch.no_grad():
            out = model(x)
    finally:
        for hd in handles:
            hd.remove()
        with torch.no_grad():
            for k, v in model.named_buffers():
                v.copy_(buffers[k])
    if "h" not in captured:
        raise ValueError(f"layer {name!r} did not run in the forward pass")
    if captured["out"] is not out:
        raise ValueError(
            f"model is not allowed: its output is not the output of layer {name!r}; the per-sample gradient of "
            "the last layer is exact only when nothing (e.g. a BN) follows it")
    h = captured["h"].reshape(x.shape[0], -1)
    weight = lin.weight.detach()
    bias = None if lin.bias is None else lin.bias.detach()

    def one_loss(w, h_i, y_i):
        logits = F.linear(h_i.unsqueeze(0), w, bias)
        return loss_fn(logits, y_i.unsqueeze(0))

    grads = vmap(grad(one_loss), in_dims=(None, 0, 0))(weight, h, y)  # (N, d_out, d)
    flat = grads.reshape(grads.shape[0], -1)
    rows = grads.transpose(0, 1)  # (d_out, N, d)
    cos = _cosines(flat)
    ncos = _cosines(rows)
    nonzero = flat.abs().amax(dim=-1) > 0
    return GradientAlignment(
        grads=grads,
        cosine=cos,
        neuron_cosine=ncos,
        mean_abs_cosine=_mean_abs_offdiag(cos, nonzero),
        mean_abs_neuron_cosine=_mean_abs_offdiag(ncos, rows.abs().amax(dim=-1) > 0),
        zero_fraction=float((~nonzero).to(torch.float64).mean()),
        layer=name,
    )
