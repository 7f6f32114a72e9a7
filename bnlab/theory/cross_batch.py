"""Cross-batch dynamics: how fast two batches decorrelate, forward and backward (Yang et al. 2019, §3.2, App. H, I).

Definition
----------
Propagating k batches together (Eq. 20), the kB × kB covariance converges to
the CBSB1 fixed point (Eq. 21): diagonal blocks Σ*, off-diagonal blocks the
constant c_CB* (Thms H.3, H.6).  After centring, the off-diagonal blocks
vanish, so the embeddings of the two batches become independent: with u, u'
independent and uniform on the unit sphere of the sum-zero hyperplane,

    c_CB* = (E φ(√B u_1))² = a_0²                                   (Thm H.3)

The linearized dynamics of an off-diagonal block Ξ ∈ H^G is Ξ ↦ A Ξ Aᵀ with
A = E[d B_φ(h)/dh] (Price's theorem: ∂_C E[F(x)H(y)ᵀ] = E[∂F] ⋅ E[∂H]ᵀ at
zero cross-covariance), and by permutation symmetry and A1 = 0, A = p G with

    p = √B E[r⁻¹] μ*^{−1/2} · B E[φ'(√B u_1)((B−1)/B − u_1²)] / (B − 1),  r ~ χ_{B−1},

so λ_M̃↑ = p².  The backward cross-batch map Ξ ↦ E[J_xᵀ Ξ J_y] = Aᵀ Ξ A has
the same eigenvalue: λ_M̃↑ = λ_M̃↓ (Thm 3.11, I.5).

Methods
-------
``"closed"``: c_CB* for every positive-homogeneous φ (Thm H.6); the rate for
relu (Beta functions and the arccosine kernel) and the identity
(λ = 2Γ(B/2)²/((B−1)Γ((B−1)/2)²) = (B−1)/2 · P(B/2, 1/2)⁻², Thm 3.11).
``"laplace"``: Thms H.6 and H.14 for every positive-homogeneous φ (≈1e-13).
``"sphere"``: the one-dimensional spherical integrals above by the quadrature
of :mod:`bnlab.theory.forward` (≈1e-11 relative).  ``"gegenbauer"``: Thms H.3
(c* = a_0²) and 3.11.  ``"montecarlo"``: uniform samples of the sphere.
``"auto"``: closed (relu, identity), else laplace (other positive-homogeneous φ with
(B−1)/2 > α), else sphere.

Errata found while checking the printed formulas numerically
------------------------------------------------------------
* Thm 3.11 and H.14 call λ_M̃ "P(B/2, 1/2)" — P(a, b) is the Pochhammer
  ratio Γ(a+b)/Γ(a) (Defn E.7); with it the identity case is
  (B−1)/2 · P(B/2, 1/2)⁻² as stated (checked against the sphere to 1e-12).
* Thm H.3 writes √c* = Γ((B−1)/2)/Γ((B−2)/2) π^{−1/2} ∫_0^π φ(−√(B−1) cos θ) sin^{B−3}θ dθ;
  the measure of t = −cos θ is ∝ sin^{B−3}θ dθ = (1−t²)^{(B−4)/2} dt, consistent
  with a_0 = E_t φ(√(B−1)t) (verified for relu and tanh against the sphere).

References
----------
Yang et al. 2019, §3.2, Thms 3.11, H.3, H.6, H.13, H.14, I.3–I.6.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import special

from bnlab.activations import get_activation
from bnlab.theory._checks import check_batch_size
from bnlab.theory._quadrature.rules import chi_inverse_moment
from bnlab.theory._quadrature.sphere import SphereGrid, sample_sphere, sphere_grid_for
from bnlab.theory._routes import DYNAMICS_METHODS, Dynamics, check_finite_result, plan_route
from bnlab.theory.forward import _forward_moments_sphere
from bnlab.theory.gegenbauer import RULE_RTOL, _dynamics_series
from bnlab.theory.vphi import _homogeneous_kernel_values, _relu_arccos_kernel

__all__ = ["CrossBatchResult", "cross_batch_analysis", "cross_batch_fixed_point", "cross_batch_rate", "CROSS_BATCH_METHODS"]

CROSS_BATCH_METHODS = DYNAMICS_METHODS

_CROSS_BATCH = Dynamics("the cross-batch dynamics", "Thms 3.11, H.6")


@dataclass(frozen=True)
class CrossBatchResult:
    """The CBSB1 fixed point's cross-batch entry ``c_star`` and the decorrelation rate ``rate`` = λ_M̃↑ = λ_M̃↓.

    ``method`` is the route; ``stderr`` the Monte Carlo standard errors of (c_star, rate) or None;
    ``truncation_error`` (gegenbauer only, else None) bounds the absolute error of ``rate`` from
    truncating the series (c_star = a_0² is not a series).
    """

    batch_size: int
    c_star: float
    rate: float
    method: str
    stderr: tuple[float, float] | None = None
    truncation_error: float | None = None


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


def _sphere_marginals(grid: SphereGrid, values: np.ndarray) -> tuple[float, float]:
    """(E v(u_1), E v(u_1) u_1²) from v per run."""
    x = grid.x_distinct
    a0 = grid.power_sums(None, 0)[0]
    return float(values @ a0), float((values * x * x) @ a0)


def _sphere(act, b: int):
    hom = act.homogeneity
    sb = math.sqrt(b)
    # c*: E f(√B u_1), radial power α/2 for homogeneous φ
    g0 = sphere_grid_for(act, b, hom / 2.0 if hom is not None else 0.0)  # split at kinks
    m = _sphere_marginals(g0, act(sb * g0.x_distinct))[0]
    # rate: E φ'(√B u_1)((B−1)/B − u_1²), radial power (α−1)/2
    g1 = sphere_grid_for(act, b, (hom - 1.0) / 2.0 if hom is not None else 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        e0, e2 = _sphere_marginals(g1, act.derivative(sb * g1.x_distinct))
    e = (b - 1.0) / b * e0 - e2
    mom = _forward_moments_sphere(act, b)
    mu = float(mom[0] - mom[1])
    p = sb * chi_inverse_moment(b, 1) * b * e / (math.sqrt(mu) * (b - 1.0))
    return m * m, p * p


def _gegenbauer(act, b: int, n_terms: int):
    """(c_CB* = a_0², λ_M̃ by Thm 3.11, bound on the truncation error of λ_M̃).

    Only the denominator μ* = Σ_l b_l² (1 − R_l(ξ)) is a series; its Parseval part Σ b_l² = E f²
    is summed exactly (:class:`bnlab.theory.gegenbauer._GegenbauerSeries`), leaving the
    two-point tail Σ_{l≥n} b_l² R_l(ξ).
    """
    s = _dynamics_series(act, b, n_terms)
    a, bc, pxi = s.a, s.coef, s.pxi
    e2 = bc * bc
    mu = s.single_point(np.sum(e2), s.moments.second) - float(np.sum(e2 * pxi))
    # Thm 3.11: λ = (1/2π) B (B−1) a_1² Beta(B/2, 1/2)² / Σ a_l² c⁻¹(C_l(1) − C_l(ξ))
    lam = b * (b - 1.0) * a[1] ** 2 * math.exp(2 * special.betaln(b / 2.0, 0.5)) / (2 * math.pi * mu)
    err = abs(lam) * s.two_point_bound(s.parseval_tail) / abs(mu) if s.summed else 0.0
    return float(a[0] ** 2), float(lam), float(err + RULE_RTOL * abs(lam))


def _montecarlo(act, b: int, n: int, rng, chunk: int = 50000):
    xs, ys, ms = [], [], []
    done = 0
    kappa = (b - 1.0) / b
    sb = math.sqrt(b)
    while done < n:
        k = min(chunk, n - done)
        u = sample_sphere(b, k, rng)
        f = act(sb * u)
        g = act.derivative(sb * u)
        ms.append(f.mean(axis=1))
        gf = f - f.mean(axis=1, keepdims=True)
        ys.append((gf * gf).sum(axis=1) / (b - 1))
        xs.append((g * (kappa - u * u)).sum(axis=1) / (b - 1))
        done += k
    x, y, m = map(np.concatenate, (xs, ys, ms))
    c = sb * chi_inverse_moment(b, 1)
    xm, ym = x.mean(), y.mean()
    lam = c * c * xm * xm / ym
    cov = np.cov(np.stack([x, y])) / x.size
    grad = np.array([2 * c * c * xm / ym, -c * c * xm * xm / ym**2])
    se_lam = math.sqrt(max(grad @ cov @ grad, 0.0))
    mm = m.mean()
    se_c = 2 * abs(mm) * m.std(ddof=1) / math.sqrt(m.size)
    return mm * mm, lam, (se_c, se_lam)


def cross_batch_analysis(phi, batch_size: int, *, method: str = "auto", n_terms=None, n_samples: int = 200_000, seed=0):
    """Cross-batch fixed point c_CB* and decorrelation rate λ_M̃ as a :class:`CrossBatchResult`.

    Parameters
    ----------
    phi : str, callable or Activation
    batch_size : int
        B ≥ 4 (B = 3 warns and is computed by the numerical routes; its rate is
        infinite because E[r⁻¹] is finite but the backward map is not — we
        return the forward rate).
    method : {"auto", "closed", "sphere", "gegenbauer", "montecarlo"}

    Accuracy
    --------
    closed: rounding; sphere ≈1e-11; gegenbauer ≈1e-12 (smooth φ); relu-like φ
    ≤ 2e-12 (B = 4), ≤ 2e-13 (B ≥ 8) with μ*'s Parseval part summed exactly
    (``truncation_error`` bounds the rest); montecarlo: the returned standard errors.
    """
    act, b = get_activation(phi), check_batch_size(batch_size)
    return _cross_batch_analysis(act, b, method, n_terms=n_terms, n_samples=n_samples, seed=seed)


def _cross_batch_analysis(
    act, b: int, method: str = "auto", *, n_terms: int | None = None, n_samples: int = 200_000, seed=0
) -> CrossBatchResult:
    """The kernel of :func:`cross_batch_analysis`: φ resolved and B checked; the route chosen and run."""
    r = plan_route(act, b, method, _CROSS_BATCH, n_terms=n_terms, n_samples=n_samples, seed=seed)
    method = r.method
    stderr = trunc = None
    if method == "closed":
        c, lam = _c_star_closed(act, b), _rate_closed(r.relu_or_identity, b)
    elif method == "laplace":
        c, lam = _c_star_closed(act, b), _rate_laplace(act, b)
    elif method == "sphere":
        c, lam = _sphere(act, b)
    elif method == "gegenbauer":
        c, lam, trunc = _gegenbauer(act, b, r.n_terms)
    else:
        c, lam, stderr = _montecarlo(act, b, r.n_samples, r.rng)
    check_finite_result(act, b, method, c, lam)
    return CrossBatchResult(b, float(c), float(lam), method, stderr, trunc)


def cross_batch_fixed_point(phi, batch_size: int, *, method: str = "auto") -> float:
    """c_CB*, the constant off-diagonal block of the CBSB1 fixed point (Yang et al. 2019, Thms H.3, H.6).

    Returns c_CB* = (E φ(√B u_1))² = a_0² ≥ 0 (0 for odd φ).  ``method="closed"``
    applies to every positive-homogeneous φ (Thm H.6); see
    :func:`cross_batch_analysis` for the other methods and their accuracy.
    """
    act, b = get_activation(phi), check_batch_size(batch_size)
    if method == "closed" and act.homogeneity is not None:
        return _c_star_closed(act, b)
    return _cross_batch_analysis(act, b, method).c_star


def cross_batch_rate(phi, batch_size: int, *, method: str = "auto") -> float:
    """λ_M̃↑ = λ_M̃↓ < 1: per-layer factor of the cross-batch covariance (forward) and gradient
    covariance (backward) (Yang et al. 2019, Thms 3.11, H.13, H.14, I.3–I.6).

    Maximized over φ by the identity, for which it increases to 1 as B → ∞.
    See :func:`cross_batch_analysis` for methods and accuracy.
    """
    act, b = get_activation(phi), check_batch_size(batch_size)
    return _cross_batch_analysis(act, b, method).rate
