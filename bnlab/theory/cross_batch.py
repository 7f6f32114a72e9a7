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
Each method is a route object (:func:`bnlab.theory._routes.plan_route`; the code of each route, for all
three dynamics, lives in its own module: ``_closed_route``, ``_sphere_route``, ``_gegenbauer_route``,
``_montecarlo_route``); this module is the quantity's face and result type.

``"closed"``: c_CB* for every positive-homogeneous φ (Thm H.6); the rate for
relu (Beta functions and the arccosine kernel) and the identity
(λ = 2Γ(B/2)²/((B−1)Γ((B−1)/2)²) = (B−1)/2 · P(B/2, 1/2)⁻², Thm 3.11).
``"laplace"``: Thms H.6 and H.14 for every positive-homogeneous φ (≈1e-13).
``"sphere"``: the one-dimensional spherical integrals above by the quadrature
of :mod:`bnlab.theory._sphere_route` (≈1e-11 relative).  ``"gegenbauer"``: Thms H.3
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

from dataclasses import dataclass

from bnlab.activations import get_activation
from bnlab.theory._checks import check_batch_size
from bnlab.theory._closed_route import _c_star_closed
from bnlab.theory._routes import DYNAMICS_METHODS, Dynamics, check_finite_result, plan_route

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
    route = plan_route(act, b, method, _CROSS_BATCH, n_terms=n_terms, n_samples=n_samples, seed=seed)
    c, lam, stderr, trunc = route.cross_batch()
    check_finite_result(act, b, route.method, c, lam)
    return CrossBatchResult(b, float(c), float(lam), route.method, stderr, trunc)


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
