"""Fourier method for the batchnorm transform (Yang et al. 2019, App. E.2, Thm E.25, Eq. 32).

Thm E.25 writes the normalization 1/‖Gh‖ through the Fourier representation
of δ(s − ‖Gh‖²/B):

    V_Bφ(Σ) = (1/2π) lim ∫_a^b ds ∫ dλ e^{iλs} det(I + 2iλΣ^G/B)^{−1/2} V_φ(Σ^G (I + 2iλΣ^G/B)^{−1} / s).

Scope of this implementation: Σ with GΣG = μG (every BSB1 Σ, hence every
fixed-point computation), any φ, ε ≥ 0.  Then, for a pair (i, j), split
‖z‖² (z = Gh/√μ in the (B−1)-dim image of G) into the part in the plane of
the two rows of √B𝔢 and its orthogonal complement, which is χ² with
m = B−3 degrees of freedom independent of the plane.  Its contribution to
the λ-integrand is (1 + 2iλμ/B)^{−m/2}, whose inverse Fourier transform is a
Gamma density; doing the λ- and s-integrals in closed form leaves
integrals over the unit disk (pair) and the unit interval (diagonal)
(cf. Lemmas E.38, E.39):

    diagonal  = E_{t}[φ(√(B−1) t)²],           t ∈ [−1, 1], density ∝ (1−t²)^{(B−4)/2}
    off-diag. = E_{y}[φ(√(B−1) y₁) φ(√(B−1) y·ê)], y in the unit disk, density ∝ (1−‖y‖²)^{(B−5)/2},
                ê = (cos γ, sin γ), cos γ = −1/(B−1).

These are evaluated in Cartesian/polar coordinates — a route independent of
the angular (θ, ψ) parametrization of :mod:`.spherical`: with x = t² (resp.
x = ‖y‖²) and folding t ↦ −t (resp. y ↦ −y) the integrand is analytic in x,
so Gauss–Jacobi quadrature for (1 − x)^{power} x^{β} is spectrally accurate
(β absorbs the x^α of a degree-α homogeneous φ); the polar angle of y is
split where either argument vanishes (kinks of relu-like φ) and integrated
with the tanh-sinh rule.  With ε > 0 the arguments are multiplied by
s(u) = √(2uμ/(2uμ + Bε)), u ~ Gamma((B−1)/2), as in :mod:`.spherical`.

Accuracy ≈1e-13 relative for B ≲ 10⁴ (error estimate: difference between
(64, level 5) and (128, level 6) rules; (48, 4) and (96, 5) when ε > 0); for larger B the Jacobi nodes near
x = 0 lose relative precision (use the spherical or Gegenbauer routes).
For non-isotropic GΣG the λ-integral has no closed form and this function
raises ValueError (use "laplace", "sphere" or "montecarlo").

Errata
------
None found in the parts of App. E.2 used here (the isotropic reduction is
derived above and checked against the spherical and Monte Carlo routes).
"""
from __future__ import annotations

import math

import numpy as np
from scipy import linalg, special

from bnlab.activations import Activation
from bnlab.theory._linalg import bsb1, isotropic_g_scale, tanh_sinh_panel
from bnlab.theory.spherical import _radial_rule

__all__ = ["fourier_transform", "fourier_isotropic_entries", "jacobi_rule_unit"]


def jacobi_rule_unit(n: int, a: float, b: float) -> tuple[np.ndarray, np.ndarray]:
    """Gauss–Jacobi rule on [0, 1] for the *normalized* weight ∝ (1−x)^a x^b (Golub–Welsch)."""
    k = np.arange(n, dtype=np.float64)
    s = 2.0 * k + a + b
    with np.errstate(invalid="ignore", divide="ignore"):
        alpha = np.where(s * (s + 2.0) != 0, (b * b - a * a) / (s * (s + 2.0)), (b - a) / (a + b + 2.0))
    alpha[0] = (b - a) / (a + b + 2.0)
    kk = np.arange(1, n, dtype=np.float64)
    ss = 2.0 * kk + a + b
    with np.errstate(invalid="ignore", divide="ignore"):
        beta = 4.0 * kk * (kk + a) * (kk + b) * (kk + a + b) / (ss * ss * (ss + 1.0) * (ss - 1.0))
    beta[0] = 4.0 * (1.0 + a) * (1.0 + b) / ((2.0 + a + b) ** 2 * (3.0 + a + b))
    # map y ∈ [−1, 1] to x = (1 + y)/2: diagonal (1 + α)/2, off-diagonal √β/2
    nodes, vecs = linalg.eigh_tridiagonal((1.0 + alpha) / 2.0, np.sqrt(beta) / 2.0)
    w = vecs[0] ** 2
    return np.clip(nodes, 0.0, 1.0), w / w.sum()


def _log_poch(x: float, a: float) -> float:
    return float(np.log(special.poch(x, a)))


def _diag(phi: Activation, b: int, n: int, scales, sweights) -> float:
    amp = math.sqrt(b - 1.0)
    pw = 0.5 * (b - 4)
    alpha = phi.homogeneity if (phi.homogeneity is not None and phi.homogeneity > 0) else 0.0
    beta = -0.5 + alpha
    x, w = jacobi_rule_unit(n, pw, beta)
    t = np.sqrt(x)
    vals = 0.5 * (phi(amp * t[:, None] * scales) ** 2 + phi(-amp * t[:, None] * scales) ** 2) @ sweights
    if alpha:
        # E_{Beta(1/2, pw+1)}[f] = E_{Beta(β+1, pw+1)}[f x^{−α}] · B(β+1, pw+1)/B(1/2, pw+1)
        ratio = math.exp(special.gammaln(alpha + 0.5) - special.gammaln(0.5) - _log_poch(pw + 1.5, alpha))
        return float(np.sum(w * vals * x**-alpha) * ratio)
    return float(np.sum(w * vals))


def _offdiag(phi: Activation, b: int, n: int, level: int, scales, sweights) -> float:
    amp = math.sqrt(b - 1.0)
    gamma = math.acos(-1.0 / (b - 1.0))
    cuts = np.array([0.0, gamma - 0.5 * math.pi, 0.5 * math.pi, math.pi])
    om, wo = tanh_sinh_panel(cuts[:-1], cuts[1:], level)
    om, wo = om.ravel(), wo.ravel() / math.pi
    c1, c2 = np.cos(om), np.cos(om - gamma)
    if b == 3:
        # S¹: the "disk" degenerates to its boundary circle (ρ = 1)
        f = phi(amp * c1[:, None] * scales) * phi(amp * c2[:, None] * scales)
        g = phi(-amp * c1[:, None] * scales) * phi(-amp * c2[:, None] * scales)
        return float(wo @ (0.5 * (f + g) @ sweights))
    pw = 0.5 * (b - 5)
    alpha = phi.homogeneity if (phi.homogeneity is not None and phi.homogeneity > 0) else 0.0
    x, w = jacobi_rule_unit(n, pw, alpha)
    rho = np.sqrt(x)
    arg1 = amp * rho[:, None, None] * c1[None, :, None] * scales
    arg2 = amp * rho[:, None, None] * c2[None, :, None] * scales
    vals = 0.5 * (phi(arg1) * phi(arg2) + phi(-arg1) * phi(-arg2)) @ sweights  # (nx, nω)
    inner = vals @ wo
    if alpha:
        # density ∝ (1−x)^{pw} on [0,1]; rule is for (1−x)^{pw} x^α: ratio B(α+1, pw+1)/B(1, pw+1)
        ratio = math.exp(special.gammaln(alpha + 1.0) - _log_poch(pw + 2.0, alpha))
        return float(np.sum(w * inner * x**-alpha) * ratio)
    return float(np.sum(w * inner))


def fourier_isotropic_entries(
    phi: Activation, batch_size: int, *, mu: float = 1.0, eps: float = 0.0
) -> tuple[float, float, float]:
    """(diagonal, off-diagonal, abs_error) of V_Bφ(Σ) for GΣG = μG by the Fourier reduction."""
    b = int(batch_size)
    alpha = phi.homogeneity
    if eps > 0 and alpha is not None and alpha > 0 and phi.homogeneous_coeffs is not None:
        # φ(s x) = s^α φ(x), s > 0: the radial average factors out exactly
        scales, sweights = _radial_rule(b, mu, eps)
        factor = float(np.sum(sweights * scales ** (2.0 * alpha)))
        d, o, err = fourier_isotropic_entries(phi, b, mu=mu, eps=0.0)
        return factor * d, factor * o, factor * err
    scales, sweights = _radial_rule(b, mu, eps)
    # with ε > 0 every node carries the radial rule too: one level lower keeps the cost
    # bounded and is still converged (the reported error compares the two rules)
    lv = 5 if eps == 0 else 4
    n = 64 if eps == 0 else 48
    d1 = _diag(phi, b, n, scales, sweights)
    o1 = _offdiag(phi, b, n, lv, scales, sweights)
    d2 = _diag(phi, b, 2 * n, scales, sweights)
    o2 = _offdiag(phi, b, 2 * n, lv + 1, scales, sweights)
    return d2, o2, max(abs(d2 - d1), abs(o2 - o1))


def fourier_transform(phi: Activation, sigma: np.ndarray, *, eps: float = 0.0) -> tuple[np.ndarray, float]:
    """V_Bφ(Σ) by the Fourier method (Σ with GΣG = μG only) and its error estimate."""
    b = sigma.shape[0]
    mu = isotropic_g_scale(sigma)
    if mu is None:
        raise ValueError(
            "method='fourier' is not allowed for this Sigma: the Fourier route is implemented for Sigma with "
            "G Sigma G proportional to G (e.g. BSB1 matrices), where the lambda-integral of Yang et al. 2019, "
            "Eq. 32 has a closed form; use method='laplace', 'sphere' or 'montecarlo' for a general Sigma"
        )
    if mu <= 0 and eps == 0:  # pragma: no cover - rejected at the boundary
        raise ValueError("Sigma is not allowed: G Sigma G = 0")
    d, o, err = fourier_isotropic_entries(phi, b, mu=max(mu, 0.0), eps=eps)
    return bsb1(b, d, o), err
