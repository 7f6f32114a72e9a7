"""Rank measures of a hidden representation H (d × N: d features, N samples).

Every function takes a tensor of shape ``(..., d, N)`` — one representation or a stack of
them (layers, chains, both) — and returns one value per matrix, shape ``(...)``.  A stack
costs one ``torch.linalg`` call (``svdvals`` over the whole stack), never a Python loop
over its matrices.  float32 and float64, CPU and CUDA: results stay on the input's device.

The scale-invariant measures (r(H), numerical, stable and effective rank) are computed on H / max|H|,
so 1e200·H gives the same values as H and 1e-200·I₄ has rank 4 (no overflow or underflow of σ²);
the soft rank depends on the scale by definition.

Conventions follow Daneshmand et al. 2020 (NeurIPS), "Batch normalization provably avoids
rank collapse for randomly initialised deep networks" (the paper below): the columns of H
are the samples, M(H) = H Hᵀ / N is the second-moment matrix (Eq. 2), and the eigenvalues
of M are λ_i = σ_i² / N for the singular values σ_i of H.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from bnlab._validation import check_real

__all__ = [
    "RankMeasures",
    "as_representation",
    "soft_rank",
    "rank_lower_bound",
    "numerical_rank",
    "stable_rank",
    "effective_rank",
    "rank_measures",
]


def as_representation(h: Any, name: str = "h") -> torch.Tensor:
    """``h`` as a floating tensor of shape (..., d, N), or ``ValueError`` naming ``name``.

    NumPy arrays and nested lists become float64 tensors; integer tensors become float64.
    Rejected: fewer than 2 dimensions, width d = 0, batch N = 0, NaN or infinite entries.
    """
    if not isinstance(h, torch.Tensor):
        try:
            h = torch.as_tensor(h, dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(f"{name} is not allowed: cannot convert to a float64 tensor ({exc})") from None
    if h.is_complex():
        raise ValueError(f"{name} is not allowed: expected a real tensor, got dtype {h.dtype}")
    if not h.is_floating_point():
        h = h.to(torch.float64)
    if h.ndim < 2:
        raise ValueError(
            f"{name} is not allowed: expected a representation of shape (..., d, N), got shape {tuple(h.shape)}"
        )
    d, n = h.shape[-2], h.shape[-1]
    if d == 0:
        raise ValueError(f"{name} is not allowed: width d = 0 (shape {tuple(h.shape)}); expected d >= 1")
    if n == 0:
        raise ValueError(f"{name} is not allowed: batch size N = 0 (shape {tuple(h.shape)}); expected N >= 1")
    if h.numel() and not bool(torch.isfinite(h).all()):
        raise ValueError(f"{name} is not allowed: it contains NaN or infinite entries")
    return h


def _check_tau(tau: Any) -> float:
    return check_real("tau", tau, minimum=0.0, strict_minimum=True)


def _singular_values(h: torch.Tensor) -> torch.Tensor:
    # One batched LAPACK/cuSOLVER call for the whole stack; descending order.
    return torch.linalg.svdvals(h)


def _unit_scaled(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(H / max|H|, max|H|) per matrix of the stack (a zero matrix is left as is, with scale 0).

    The scale-invariant measures are computed on the rescaled matrix: σ_i² of 1e200·H overflows
    float64 (and of 1e25·H float32) and σ_i⁴ of 1e-200·I underflows to 0, which made r(H) and the
    stable rank NaN or 0; after rescaling the largest entry is 1 and neither can happen.
    """
    m = h.abs().amax(dim=(-2, -1), keepdim=True)
    return h / torch.where(m > 0, m, torch.ones_like(m)), m[..., 0, 0]


def _soft_rank_from_sv(sv: torch.Tensor, n: int, tau: float) -> torch.Tensor:
    return (sv * sv / n >= tau).sum(dim=-1)


def _lower_bound_from_sv(sv: torch.Tensor) -> torch.Tensor:
    lam = sv * sv
    num = lam.sum(dim=-1) ** 2
    den = (lam * lam).sum(dim=-1)
    return torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(den))


def _numerical_rank_from_sv(sv: torch.Tensor, d: int, n: int, rtol: float | None) -> torch.Tensor:
    if rtol is None:
        rtol = max(d, n) * torch.finfo(sv.dtype).eps
    smax = sv[..., :1]
    return (sv > rtol * smax).sum(dim=-1)


def _stable_rank_from_sv(sv: torch.Tensor) -> torch.Tensor:
    lam = sv * sv
    top = lam[..., 0]
    safe = torch.where(top > 0, top, torch.ones_like(top))
    return torch.where(top > 0, lam.sum(dim=-1) / safe, torch.zeros_like(top))


def _effective_rank_from_sv(sv: torch.Tensor) -> torch.Tensor:
    total = sv.sum(dim=-1, keepdim=True)
    p = sv / torch.where(total > 0, total, torch.ones_like(total))
    # 0·log 0 = 0: the zero singular values carry no entropy.
    ent = -(torch.where(p > 0, p * torch.log(torch.where(p > 0, p, torch.ones_like(p))), torch.zeros_like(p))).sum(-1)
    return torch.where(total[..., 0] > 0, torch.exp(ent), torch.zeros_like(ent))


def soft_rank(h: Any, tau: float = 0.5) -> torch.Tensor:
    """Soft rank rank_τ(H) = #{i : σ_i² / N ≥ τ} (Daneshmand et al. 2020, Eq. 3).

    The number of eigenvalues of M = H Hᵀ/N at least τ.  It depends on the scale of H: it is
    meant for representations with tr M = d (every row of mean square one, as after the
    paper's BN, Eq. 2), where Lemma 1 gives rank_τ(H) ≥ (1 − τ)² r(H) for τ ∈ [0, 1].

    Parameters
    ----------
    h : tensor (..., d, N)
    tau : float > 0

    Returns
    -------
    int64 tensor of shape (...)
    """
    tau = _check_tau(tau)
    h = as_representation(h)
    return _soft_rank_from_sv(_singular_values(h), h.shape[-1], tau)


def rank_lower_bound(h: Any) -> torch.Tensor:
    """The differentiable rank bound r(H) = tr(M)² / ‖M‖_F², M = H Hᵀ/N (Daneshmand et al. 2020, Eq. 4).

    Lemma 1: rank(H) ≥ r(H) for every H, and rank_τ(H) ≥ (1 − τ)² r(H) when tr M = d
    (as for every BN representation, property p.1 of App. A).  Scale-invariant.  Computed
    without a decomposition, as ‖H‖_F⁴ / ‖Hᵀ H‖_F²
    (tr M = ‖H‖_F²/N and ‖H Hᵀ‖_F = ‖Hᵀ H‖_F;
    the smaller Gram matrix is formed), so it is cheap and differentiable with respect to H —
    the objective of the rank-raising pre-training (Algorithm 1).  H = 0 gives 0 (its rank).

    Returns
    -------
    tensor of shape (...), the dtype of ``h``
    """
    h = as_representation(h)
    return _lower_bound_gram(_unit_scaled(h)[0])


def _lower_bound_gram(h: torch.Tensor) -> torch.Tensor:
    d, n = h.shape[-2], h.shape[-1]
    ht = h.transpose(-1, -2)
    gram = ht @ h if n <= d else h @ ht
    fro2 = gram.diagonal(dim1=-2, dim2=-1).sum(-1)  # = ‖H‖_F²
    den = (gram * gram).sum(dim=(-2, -1))
    safe = torch.where(den > 0, den, torch.ones_like(den))
    return torch.where(den > 0, fro2 * fro2 / safe, torch.zeros_like(den))


def numerical_rank(h: Any, rtol: float | None = None) -> torch.Tensor:
    """Numerical rank: #{i : σ_i > rtol · σ_max}, as ``torch.linalg.matrix_rank``.

    The default ``rtol = max(d, N) · eps(dtype)`` is NumPy's and ``torch.linalg.matrix_rank``'s
    default.  (The paper's footnote 2 quotes σ_max · d · 1e-7 for the removed ``torch.matrix_rank``,
    i.e. roughly the float32 eps; with float64 inputs the default here is ~1e9 times smaller.)
    """
    h = as_representation(h)
    if rtol is not None:
        rtol = check_real("rtol", rtol, minimum=0.0)
    return _numerical_rank_from_sv(_singular_values(_unit_scaled(h)[0]), h.shape[-2], h.shape[-1], rtol)


def stable_rank(h: Any) -> torch.Tensor:
    """Stable rank ‖H‖_F² / ‖H‖_2² = Σ σ_i² / σ_1² (Tropp 2015, §2.1; cited as [28] by the paper).

    Note: the authors' scripts call ‖Hᵀ H‖_F² / σ_1⁴ = Σ σ_i⁴ / σ_1⁴ a "stable rank"; that is a
    different quantity (the stable rank of H Hᵀ, not of H).  H = 0 gives 0.
    """
    h = as_representation(h)
    return _stable_rank_from_sv(_singular_values(_unit_scaled(h)[0]))


def effective_rank(h: Any) -> torch.Tensor:
    """Effective rank exp(−Σ p_i log p_i), p_i = σ_i / Σ_j σ_j (Roy & Vetterli 2007, Def. 1).

    The entropy of the singular values normalized to sum one (an ℓ1 normalization — not a
    softmax of the singular values, a common mistake).  Between 1 and rank(H); H = 0 gives 0.
    """
    h = as_representation(h)
    return _effective_rank_from_sv(_singular_values(_unit_scaled(h)[0]))


@dataclass(frozen=True)
class RankMeasures:
    """All rank measures of a stack of representations, from one ``svdvals`` call.

    Every field has the stack's leading shape (...); ``singular_values`` has (..., min(d, N)).
    """

    soft_rank: torch.Tensor
    rank_lower_bound: torch.Tensor
    numerical_rank: torch.Tensor
    stable_rank: torch.Tensor
    effective_rank: torch.Tensor
    singular_values: torch.Tensor
    tau: float

    def to_dict(self) -> dict:
        """Plain Python lists/floats (JSON-serializable)."""
        out = {k: getattr(self, k).detach().cpu().tolist() for k in (
            "soft_rank", "rank_lower_bound", "numerical_rank", "stable_rank", "effective_rank", "singular_values")}
        out["tau"] = self.tau
        return out


def rank_measures(h: Any, tau: float = 0.5, rtol: float | None = None) -> RankMeasures:
    """Every rank measure of ``h`` (..., d, N) from a single batched SVD.

    ``rank_lower_bound`` here is computed from the singular values, (Σ σ_i²)² / Σ σ_i⁴, which
    equals :func:`rank_lower_bound`'s Gram-matrix route (an independent route used by the tests).
    """
    tau = _check_tau(tau)
    h = as_representation(h)
    if rtol is not None:
        rtol = check_real("rtol", rtol, minimum=0.0)
    d, n = h.shape[-2], h.shape[-1]
    unit, scale = _unit_scaled(h)
    sv = _singular_values(unit)  # of H / max|H|: the scale-invariant measures never overflow or underflow
    # rank_τ compares σ_i(H)²/N = (σ_i(unit)·scale)²/N with τ without forming the square of the scale
    threshold = tau * n / (scale.to(sv.dtype) ** 2)
    return RankMeasures(
        soft_rank=(sv * sv >= threshold[..., None]).sum(dim=-1),
        rank_lower_bound=_lower_bound_from_sv(sv),
        numerical_rank=_numerical_rank_from_sv(sv, d, n, rtol),
        stable_rank=_stable_rank_from_sv(sv),
        effective_rank=_effective_rank_from_sv(sv),
        singular_values=sv * scale[..., None].to(sv.dtype),
        tau=tau,
    )
