"""The closed-form routes of the dynamics: relu and identity (Thms 3.7, 3.10, 3.11, G.12, H.6) and the
Laplace closed forms of every positive-homogeneous φ (Thms F.33, G.12, H.6, H.14) (private).

A route is one object per class of φ, chosen once by :func:`bnlab.theory._routes.plan_route` and asked
for each dynamics in turn (``forward()``, ``backward()``, ``cross_batch()``, see
:mod:`bnlab.theory._routes`).  These two need no integration of φ: the relu arccosine kernel, or the
hypergeometric kernel J_φ of Defn E.9 (:mod:`bnlab.theory.vphi`), and Pochhammer ratios.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from scipy import special

from bnlab.theory._quadrature.rules import chi_inverse_moment
from bnlab.theory.vphi import _homogeneous_kernel_values, _relu_arccos_kernel

__all__ = ["ClosedRoute", "LaplaceRoute"]


@dataclass(frozen=True)
class ClosedRoute:
    """relu or identity (``kind``), up to a positive scale: the dynamics in closed form, exact to rounding."""

    act: object
    batch_size: int
    kind: str
    method: ClassVar[str] = "closed"

    def forward(self):
        """(λ_L↑, λ_M↑, stderr, truncation error): Thm 3.7; identity from the sphere's fourth moments."""
        lam_l, lam_m = _forward_closed(self.kind, self.batch_size)
        return lam_l, lam_m, None, None

    def backward(self):
        """(λ_G↓, λ_L↓, λ_M↓, stderr, truncation error): Thms 3.10, G.12 (α = 1); identity in closed form."""
        return (*_backward_closed(self.kind, self.batch_size), None, None)

    def cross_batch(self):
        """(c_CB*, λ_M̃, stderr, truncation error): Thms H.6, 3.11."""
        return _c_star_closed(self.act, self.batch_size), _rate_closed(self.kind, self.batch_size), None, None


@dataclass(frozen=True)
class LaplaceRoute:
    """Positive-homogeneous φ of degree α with (B−1)/2 > α: the Laplace closed forms (≈1e-13)."""

    act: object
    batch_size: int
    method: ClassVar[str] = "laplace"

    def forward(self):
        """(λ_L↑, λ_M↑, stderr, truncation error): Thm F.33."""
        lam_l, lam_m = _forward_laplace(self.act, self.batch_size)
        return lam_l, lam_m, None, None

    def backward(self):
        """(λ_G↓, λ_L↓, λ_M↓, stderr, truncation error): Thm G.12."""
        return (*_backward_laplace(self.act, self.batch_size), None, None)

    def cross_batch(self):
        """(c_CB*, λ_M̃, stderr, truncation error): Thms H.6, H.14."""
        return _c_star_closed(self.act, self.batch_size), _rate_laplace(self.act, self.batch_size), None, None


def _forward_closed(kind: str, b: int):
    if kind == "identity":
        lam = (b - 1.0) / (b + 1.0)
        return lam, lam
    j1, dj1 = _relu_arccos_kernel(-1.0 / (b - 1))
    mu = 0.5 * (1.0 - j1)
    # Thm 3.7, Eq. 13, λ_L = ((B−2)(1−J_1) + B/(B−1) J_1')/(2(B+1)μ*) with 2μ* = 1 − J_1, written as
    # 1 − gap, gap = (3(B−1)(1−J_1) − B J_1')/((B−1)(B+1)(1−J_1)) ≈ 2.27/B: no cancellation in the gap
    # (3(1−1/π) vs 1/2), so λ_L is correctly rounded up to B ~ 1e16 and stays < 1 (BSB1)
    gap_l = (3.0 * (b - 1.0) * (1.0 - j1) - b * dj1) / ((b - 1.0) * (b + 1.0) * (1.0 - j1))
    lam_l = 1.0 - gap_l
    lam_m = b * dj1 / (2.0 * (b + 1) * mu)  # Thm 3.7, Eq. 14
    return lam_l, lam_m


def _forward_laplace(act, b: int):
    """Thm F.33: λ_M↑ = c_α B (B−1)^{α−1} μ*⁻¹ 2^{−α} P((B+1)/2, α)⁻¹ J'_φ(ξ),
    λ_L↑ = c_α (B−1)^{α−1} μ*⁻¹ 2^{−α} P((B+1)/2, α)⁻¹ ((B−2) α [J_φ(1) − J_φ(ξ)] + B/(B−1) J'_φ(ξ)),
    P(a, k) = Γ(a+k)/Γ(a).  Verified against the sphere to 1e-13 (relu^0.5, relu^1.5, leaky relu, relu)."""
    v = _homogeneous_kernel_values(act, b)
    al = v["alpha"]
    pref = v["c_alpha"] * (b - 1.0) ** (al - 1.0) / v["mu"] * 2.0 ** (-al) / special.poch((b + 1) / 2.0, al)
    lam_m = pref * b * v["dJxi"]
    lam_l = pref * ((b - 2) * al * (v["J1"] - v["Jxi"]) + b / (b - 1.0) * v["dJxi"])
    return lam_l, lam_m


def _backward_closed(kind: str, b: int):
    if kind == "identity":
        lam_g = (b - 2.0) / (b - 3.0)
        lam = (b * b - 2.0 * b - 1.0) / (b * b - 2.0 * b - 3.0)
        return lam_g, lam, lam
    j1, dj1 = _relu_arccos_kernel(-1.0 / (b - 1))
    lam_g = ((b - 1.0 + dj1) / (1.0 - j1) - 1.0) / (b - 3.0)  # Thm 3.10, Eq. 19
    # Thm G.12 with α = 1, J_φ = J_1 (J_1(1) = 1)
    alpha = 1.0
    den = 1.0 - j1
    lam_l = (
        -2 * alpha**2 * (b - 2) * (b - 1 + alpha) / ((b - 3) * (b - 1) * (b - 1 + 2 * alpha))
        + 2
        * (alpha**2 * (3 * b - 4) + alpha * (3 * b * b - 11 * b + 8) + (b - 3) * (b - 1) ** 2)
        / ((b - 3) * (b - 1) ** 2 * (b - 1 + 2 * alpha))
        * dj1
        / den
        + alpha**2 * (b - 2) * (b - 3 + 2 * alpha) / ((2 * alpha - 1) * (b - 3) * (b - 1)) / den
    )
    lam_m = (
        b * (b * b + 2 * (alpha - 2) * b + 2 * (alpha - 3) * alpha + 3) / ((b - 3) * (b - 1) * (b - 1 + 2 * alpha)) * dj1 / den
    )
    return lam_g, lam_l, lam_m


def _backward_laplace(act, b: int):
    """Thm G.12 for φ positive-homogeneous of degree α > 1/2 (verified against the sphere to 1e-13)."""
    v = _homogeneous_kernel_values(act, b)
    al, j1, d = v["alpha"], v["J1"], v["J1"] - v["Jxi"]
    dj = v["dJxi"]
    lam_g = ((b - 3 + 2 * al) * ((2 * al - 1) * dj + al**2 * (b - 1) * j1)) / (
        (2 * al - 1) * (b - 3) * (b - 1) * d
    ) - al**2 / (b - 3)
    lam_l = (
        -2 * al**2 * (b - 2) * (b - 1 + al) / ((b - 3) * (b - 1) * (b - 1 + 2 * al))
        + 2 * (al**2 * (3 * b - 4) + al * (3 * b * b - 11 * b + 8) + (b - 3) * (b - 1) ** 2)
        / ((b - 3) * (b - 1) ** 2 * (b - 1 + 2 * al)) * dj / d
        + al**2 * (b - 2) * (b - 3 + 2 * al) / ((2 * al - 1) * (b - 3) * (b - 1)) * j1 / d
    )
    lam_m = b * (b * b + 2 * (al - 2) * b + 2 * (al - 3) * al + 3) / ((b - 3) * (b - 1) * (b - 1 + 2 * al)) * dj / d
    return lam_g, lam_l, lam_m


def _c_star_closed(act, b: int) -> float:
    """Thm H.6: c* = (a − b)² (B−1)^α/(4π) (Γ((B−1)/2) Γ((α+1)/2) / Γ((α+B−1)/2))²."""
    alpha = act.homogeneity
    a, bb = act.homogeneous_coeffs
    # Γ((B−1)/2)/Γ((α+B−1)/2) = 1/P((B−1)/2, α/2) (Pochhammer: accurate for large B)
    ratio = special.gamma((alpha + 1) / 2.0) / special.poch((b - 1) / 2.0, alpha / 2.0)
    return (a - bb) ** 2 * (b - 1.0) ** alpha / (4 * math.pi) * ratio * ratio


def _rate_closed(kind: str, b: int) -> float:
    if kind == "identity":
        return (b - 1.0) / 2.0 / special.poch(b / 2.0, 0.5) ** 2  # Thm 3.11: (B−1)/2 · P(B/2, 1/2)⁻²
    j1, _ = _relu_arccos_kernel(-1.0 / (b - 1))
    mu = 0.5 * (1.0 - j1)
    kappa = (b - 1.0) / b
    # E[1{t>0} κ(1−t²)] with t ~ (1−t²)^{(B−4)/2}: κ/2 · B(1/2, B/2)/B(1/2, (B−2)/2)
    e = 0.5 * kappa * special.poch((b - 2) / 2.0, 0.5) / special.poch(b / 2.0, 0.5)
    p = math.sqrt(b) * chi_inverse_moment(b, 1) * b * e / (math.sqrt(mu) * (b - 1.0))
    return p * p


def _rate_laplace(act, b: int) -> float:
    """Thm H.14: λ = B/2 ((B−1)/2)^{α−1} P(B/2, α/2)⁻² μ*⁻¹ c_α J'_φ(0) (positive-homogeneous φ, ≈1e-13)."""
    v = _homogeneous_kernel_values(act, b)
    al = v["alpha"]
    return b / 2.0 * ((b - 1) / 2.0) ** (al - 1.0) / special.poch(b / 2.0, al / 2.0) ** 2 / v["mu"] * v["c_alpha"] * v["dJ0"]
