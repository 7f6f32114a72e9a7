"""Per-layer measurements on batched pre-activations (the simulated twins of the theory's quantities).

All functions take tensors batched over networks: pre-activations ``H`` of
shape ``(networks, B, N)`` (B samples of a batch, N neurons).

* :func:`batch_covariance` — Σ = H Hᵀ / N, the batch covariance averaged over
  neurons (the finite-width estimate of Σ^l, Yang et al. 2019, Eq. 8).
* :func:`bsb1_projection` — the orthogonal (Frobenius) projection of Σ on
  the space of BSB1 matrices q[(1−c)I + c11ᵀ] (Yang et al. 2019, §3.1): its
  (q, c) and the squared residual ‖Σ − BSB1(q, c)‖²_F.
* :func:`bsb1_distance` — relative Frobenius distance ‖Σ − Σ*‖/‖Σ*‖ to the
  BSB1 fixed point Σ* = BSB1(q*, c*) of the theory (Thm 3.4/3.5).
* :func:`cross_batch_correlation` — the correlation of the mean-centered
  pre-activations of two batches pushed through the same network,
  tr(GΞG)/sqrt(tr(GΣ₁G) tr(GΣ₂G)) with Ξ = H₁H₂ᵀ/N; the centered cross-batch
  block is exactly the eigenspace M̃ of the cross-batch dynamics (Yang et al.
  2019, §3.2, Def. H.10, Thm H.13), so it decays at the rate λ_M̃.
* :func:`weight_gradient_norm_sq` — ‖∂L/∂W‖²_F = ‖Aᵀδ‖²_F = ⟨AAᵀ, δδᵀ⟩_F
  computed from two B×B Gram matrices (O(B²N) instead of forming the N×N
  weight gradient; exact up to rounding).
"""
from __future__ import annotations

import torch

from bnlab.sim._linalg import gram

__all__ = [
    "batch_covariance",
    "bsb1_projection",
    "bsb1_distance",
    "cross_batch_correlation",
    "weight_gradient_norm_sq",
]


def batch_covariance(h: torch.Tensor) -> torch.Tensor:
    """Σ = H Hᵀ / N for ``h`` of shape (..., B, N); returns (..., B, B)."""
    return gram(h).div_(h.shape[-1])


def bsb1_projection(cov: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Project Σ (..., B, B) on the BSB1 matrices.

    Returns ``(q, c, residual_sq)``: q = mean of the diagonal, c = (mean of the
    off-diagonal)/q, and ‖Σ − q[(1−c)I + c11ᵀ]‖²_F.  The BSB1 matrices form a
    linear space spanned by I and 11ᵀ − I, which are Frobenius-orthogonal,
    so the projection takes the mean diagonal and the mean off-diagonal entry.
    """
    q, off, off_ss, diag_ss = _bsb1_moments(cov)
    return q, off / q, off_ss + diag_ss


def _bsb1_moments(cov: torch.Tensor):
    """``(q, off, off_ss, diag_ss)`` of Σ (..., B, B), in float64: the mean diagonal entry q, the
    mean off-diagonal entry, and the sums of squared deviations of the off-diagonal entries from
    ``off`` and of the diagonal entries from q (so ‖Σ − BSB1‖²_F = off_ss + diag_ss).  One pass
    over the B×B entries, centered before squaring (no cancellation when c → 1); the entries stay
    in Σ's dtype (a float32 Σ is no more accurate than that) and the sums accumulate in float64."""
    acc = torch.float64
    b = cov.shape[-1]
    diag = torch.diagonal(cov, dim1=-2, dim2=-1)
    diag_sum = diag.sum(-1, dtype=acc)
    q = diag_sum / b
    off = (cov.sum((-2, -1), dtype=acc) - diag_sum) / (b * (b - 1))
    sq = (cov - off[..., None, None].to(cov.dtype)).square_()
    torch.diagonal(sq, dim1=-2, dim2=-1).zero_()  # off-diagonal only: no large diagonal terms to cancel
    off_ss = sq.sum((-2, -1), dtype=acc)
    diag_ss = (diag.to(acc) - q[..., None]).square().sum(-1)
    return q, off, off_ss, diag_ss


def bsb1_distance(cov: torch.Tensor, q_star: float, c_star: float) -> torch.Tensor:
    """Relative Frobenius distance ‖Σ − Σ*‖_F / ‖Σ*‖_F with Σ* = q*[(1−c*)I + c*11ᵀ]."""
    b = cov.shape[-1]
    eye = torch.eye(b, dtype=cov.dtype, device=cov.device)
    target = q_star * ((1.0 - c_star) * eye + c_star * torch.ones_like(eye))
    return (cov - target).pow(2).sum((-2, -1)).sqrt() / target.pow(2).sum().sqrt()


def cross_batch_correlation(h1: torch.Tensor, h2: torch.Tensor) -> torch.Tensor:
    """Centered correlation of two batches (..., B, N) → (...,); see the module docstring."""
    c1 = h1 - h1.mean(-2, keepdim=True)
    c2 = h2 - h2.mean(-2, keepdim=True)
    num = (c1 * c2).sum((-2, -1))
    return num / torch.sqrt(c1.pow(2).sum((-2, -1)) * c2.pow(2).sum((-2, -1)))


def weight_gradient_norm_sq(a: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """‖Aᵀδ‖²_F for a layer h = A W: ``a`` (..., B, d_in) its input, ``delta`` (..., B, N) = ∂L/∂h."""
    return (gram(a) * gram(delta)).sum((-2, -1))
