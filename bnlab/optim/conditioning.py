"""Theorem 4 measured: the conditioning of one neuron's Hessian block with and without BNP.

Lange et al. (Prop. 2) write the Hessian of the mean mini-batch loss with respect to one neuron's
extended weight ŵ = [b_i, w_iᵀ]ᵀ of a dense layer as ``Ĥᵀ S Ĥ`` (Eq. 10), with Ĥ = [e, H] the
layer's extended input matrix and S = (1/N) diag(L''(a_j)) the second derivatives of each sample's
loss with respect to the neuron's pre-activation a_j.  BNP's change of variables ŵ = P z turns it
into ``Pᵀ Ĥᵀ S Ĥ P = Ĝᵀ S Ĝ`` (Theorem 3), and Theorem 4 bounds how much better conditioned Ĝ is
than Ĥ in terms of κ(D).  Fig. 8 of the paper plots both condition numbers and κ(D) during training
of a 2×100 network at batch 60; :class:`ConditioningLogger` records the same numbers as a training
callback.

Condition numbers follow the paper's definition for singular matrices (§1): the largest over the
smallest *nonzero* singular value, "nonzero" meaning above ``rtol · σ_max`` with ``rtol`` =
dimension × machine epsilon of the matrix's dtype (the rank convention of ``torch.linalg.matrix_rank``).
With N = 60 < n_in + 1 = 101 the Hessian block has rank ≤ N, so this definition matters.

Errata: the appendix's restatement of Prop. 2 gives ĥ_j ∈ ℝ^{(n_ℓ+1)×1}; it is ℝ^{(n_{ℓ-1}+1)×1} as
in the main text (ĥ_j stacks 1 and the layer *input* h_j^{(ℓ-1)}).  With ε₁ = 1e-2, the σ̃ part of
BNP's own D has κ ≤ √(1.01/0.01) ≈ 10, so the κ(D) of 10²-10⁵ that Fig. 8 shows is the mini-batch D
of Eq. 12 — the one ``kappa_D`` reports.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, asdict
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from bnlab._validation import check_choice, check_int

__all__ = ["condition_number", "neuron_hessian", "layer_hessian_conditioning", "HessianConditioning",
           "ConditioningLogger"]


def condition_number(matrix: torch.Tensor, *, rtol: float | None = None) -> float:
    """κ(A) = σ_max / σ*_min, the smallest singular value counted being the smallest above ``rtol·σ_max``.

    Lange et al. §1 (the definition for singular or rectangular matrices).  ``rtol`` defaults to
    max(m, n) × eps of ``matrix``'s dtype.  Returns ``inf`` for a zero matrix.
    """
    if not isinstance(matrix, torch.Tensor) or matrix.dim() != 2:
        raise ValueError(f"matrix is not allowed: expected a 2-D torch.Tensor, got {type(matrix).__name__}")
    if not bool(torch.isfinite(matrix).all()):
        raise ValueError("matrix is not allowed: it contains NaN or infinite entries")
    if rtol is None:
        rtol = max(matrix.shape) * torch.finfo(matrix.dtype).eps
    s = torch.linalg.svdvals(matrix.to(torch.float64))
    smax = float(s.max()) if s.numel() else 0.0
    if smax == 0.0:
        return float("inf")
    kept = s[s > rtol * smax]
    return smax / float(kept.min())


def _check_dense_layer(model: nn.Module, layer: nn.Module) -> None:
    if not isinstance(layer, nn.Linear):
        raise ValueError(f"layer={type(layer).__name__} is not allowed: expected an nn.Linear (Lange et al. Prop. 2)")
    if not any(m is layer for m in model.modules()):
        raise ValueError("layer is not allowed: it is not a submodule of model")


def neuron_hessian(
    model: nn.Module,
    layer: nn.Linear,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    neuron: int = 0,
    loss_fn: Callable = F.cross_entropy,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Hessian of the mean loss w.r.t. ŵ = [b_i, w_iᵀ] of ``layer`` by Prop. 2: ``Ĥᵀ S Ĥ`` (Eq. 10).

    Returns ``(hessian, H_hat, s)``: the (n_in+1)×(n_in+1) Hessian in float64, Ĥ = [e, H] (N×(n_in+1))
    and the diagonal of S (N entries, (1/N) L''(a_j), obtained by double backward).  The model runs in
    eval mode (restored afterwards): Prop. 2 needs each sample's loss to depend on the neuron only
    through its own pre-activation, which holds for networks without batch coupling (vanilla, LN, GN,
    or BN with running statistics).  ``loss_fn(output, targets)`` must average over the batch.
    """
    _check_dense_layer(model, layer)
    neuron = check_int("neuron", neuron, minimum=0, maximum=layer.out_features - 1)
    captured: dict[str, torch.Tensor] = {}

    def grab(module, args, output):
        captured["h"] = args[0]
        captured["a"] = output

    flags = [(m, m.training) for m in model.modules()]
    handle = layer.register_forward_hook(grab)
    try:
        model.eval()
        with torch.enable_grad():
            out = model(inputs)
            if "a" not in captured:
                raise ValueError("layer is not allowed: the model's forward pass did not call it")
            h, a = captured["h"], captured["a"]
            if h.dim() != 2:
                raise ValueError(f"layer input of shape {tuple(h.shape)} is not allowed: expected (N, n_in)")
            loss = loss_fn(out, targets)
            (g,) = torch.autograd.grad(loss, a, create_graph=True)
            gi = g[:, neuron]
            if gi.requires_grad:
                (second,) = torch.autograd.grad(gi.sum(), a)
                s = second[:, neuron]
            else:  # the loss is linear in a (no curvature)
                s = torch.zeros_like(gi)
    finally:
        handle.remove()
        for m, flag in flags:
            m.train(flag)
    h = h.detach().to(torch.float64)
    s = s.detach().to(torch.float64)
    h_hat = torch.cat([torch.ones(h.shape[0], 1, dtype=torch.float64, device=h.device), h], dim=1)
    hessian = h_hat.T @ (s[:, None] * h_hat)
    return hessian, h_hat, s


@dataclass(frozen=True)
class HessianConditioning:
    """Condition numbers of one neuron's Hessian block (Lange et al. Theorem 4, Fig. 8).

    ``kappa_hessian`` = κ(Ĥᵀ S Ĥ); ``kappa_preconditioned`` = κ(Pᵀ Ĥᵀ S Ĥ P) with the P named by
    ``statistics`` ("batch": Eq. 12's U D from the mini-batch μ_H, σ_H; "running": Eq. 15's P from
    a BNPreconditioner's μ and σ̃); ``kappa_D`` = κ(D) of Eq. 12 (mini-batch σ_H, the entry 1
    included); ``kappa_H_hat``, ``kappa_HU``, ``kappa_G_hat`` = κ(Ĥ), κ(ĤU), κ(ĤUD) of Theorem 4.
    Input features that are constant over the batch (σ_H = 0, e.g. dead ReLUs) make zero columns
    of ĤU; they are left out of D (``constant_features`` counts them).
    """

    kappa_hessian: float
    kappa_preconditioned: float
    kappa_D: float
    kappa_H_hat: float
    kappa_HU: float
    kappa_G_hat: float
    statistics: str
    batch_size: int
    n_in: int
    constant_features: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def layer_hessian_conditioning(
    model: nn.Module,
    layer: nn.Linear,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    neuron: int = 0,
    loss_fn: Callable = F.cross_entropy,
    preconditioner: Any = None,
    statistics: str | None = None,
) -> HessianConditioning:
    """κ of one neuron's Hessian block before and after BNP preconditioning, and κ(D) (Theorem 4).

    ``statistics`` defaults to "running" when a :class:`~bnlab.optim.BNPreconditioner` is given (the
    P it actually applies, Eq. 15, including σ̃'s ε₁, ε₂) and to "batch" otherwise (Theorem 3's P
    from the mini-batch).  The forward pass runs without recording statistics in the preconditioner.
    """
    if statistics is None:
        statistics = "running" if preconditioner is not None else "batch"
    check_choice("statistics", statistics, ("batch", "running"))
    if statistics == "running" and preconditioner is None:
        raise ValueError("statistics='running' is not allowed without a preconditioner")
    ctx = preconditioner.paused() if preconditioner is not None else contextlib.nullcontext()
    with ctx:
        hessian, h_hat, _ = neuron_hessian(model, layer, inputs, targets, neuron=neuron, loss_fn=loss_fn)
    h = h_hat[:, 1:]
    n, n_in = h.shape
    mu_h = h.mean(0)
    sigma_h = torch.sqrt(((h - mu_h) ** 2).mean(0))
    live = sigma_h > 0
    if statistics == "batch":
        mu, sigma = mu_h, torch.where(live, sigma_h, torch.ones_like(sigma_h))
    else:
        name = next((k for k, m in preconditioner.layers.items() if m is layer), None)
        if name is None:
            raise ValueError("layer is not allowed: the preconditioner does not precondition it")
        mean, var_tilde, _ = preconditioner.preconditioner_vectors(name)
        mu, sigma = mean.to(torch.float64).to(h.device), torch.sqrt(var_tilde.to(torch.float64)).to(h.device)
    # P = U D with U = [[1, -μᵀ], [0, I]], D = diag(1, 1/σ) (Eqs. 12, 15).
    p = _mean_shift(mu) * _lead_one(1.0 / sigma)[None, :]
    pre_hessian = p.T @ hessian @ p
    hu = h_hat @ _mean_shift(mu_h)
    d_batch = _lead_one(1.0 / sigma_h[live])
    g_hat = hu[:, _lead_one(live)] * d_batch[None, :]
    return HessianConditioning(
        kappa_hessian=condition_number(hessian),
        kappa_preconditioned=condition_number(pre_hessian),
        kappa_D=float(d_batch.max() / d_batch.min()),
        kappa_H_hat=condition_number(h_hat),
        kappa_HU=condition_number(hu),
        kappa_G_hat=condition_number(g_hat),
        statistics=statistics,
        batch_size=n,
        n_in=n_in,
        constant_features=int((~live).sum()),
    )


def _mean_shift(mu: torch.Tensor) -> torch.Tensor:
    """U = [[1, -μᵀ], [0, I]] of Lange et al. Eq. 12 in float64 (the bias column absorbs the mean)."""
    u = torch.eye(mu.shape[0] + 1, dtype=torch.float64, device=mu.device)
    u[0, 1:] = -mu
    return u


def _lead_one(v: torch.Tensor) -> torch.Tensor:
    """``v`` with a leading 1 (True for a mask): the entry of the bias coordinate ŵ₀ = b."""
    return torch.cat([torch.ones(1, dtype=v.dtype, device=v.device), v])


class ConditioningLogger:
    """A training callback recording :func:`layer_hessian_conditioning` on a fixed probe batch (Fig. 8).

    Call it as ``logger(info)`` after a step (``info.step`` is used if present; bnlab.nets.train's
    StepInfo has it); every ``every`` calls it appends a dict to :attr:`records` with the step and
    the fields of :class:`HessianConditioning`.  It never stops training (returns ``None``).
    """

    def __init__(
        self,
        model: nn.Module,
        layer: nn.Linear,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        *,
        neuron: int = 0,
        loss_fn: Callable = F.cross_entropy,
        preconditioner: Any = None,
        statistics: str | None = None,
        every: int = 1,
    ):
        _check_dense_layer(model, layer)
        self.model, self.layer, self.inputs, self.targets = model, layer, inputs, targets
        self.neuron = check_int("neuron", neuron, minimum=0, maximum=layer.out_features - 1)
        self.loss_fn = loss_fn
        self.preconditioner = preconditioner
        self.statistics = statistics
        self.every = check_int("every", every, minimum=1)
        self.records: list[dict[str, Any]] = []
        self._calls = 0

    def __call__(self, info: Any = None) -> None:
        step = getattr(info, "step", self._calls)
        self._calls += 1
        if (self._calls - 1) % self.every:
            return None
        res = layer_hessian_conditioning(
            self.model, self.layer, self.inputs, self.targets, neuron=self.neuron, loss_fn=self.loss_fn,
            preconditioner=self.preconditioner, statistics=self.statistics,
        )
        self.records.append({"step": int(step), **res.to_dict()})
        return None
