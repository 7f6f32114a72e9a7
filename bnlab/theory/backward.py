"""Gradient backpropagation in batchnorm networks at the BSB1 fixed point (Yang et al. 2019, §3.1.2, App. G, L).

Definition
----------
Under gradient independence the covariance Π^l of the backpropagated
gradients obeys Π^l = V_{B_φ'}(Σ*)†{Π^{l+1}} = G^{⊗2} ∘ F(Σ*){Π^{l+1}}
(Eqs. 17, 18), with F(Σ*) ultrasymmetric; G^{⊗2}∘F has eigenspaces RG, L, M
(Thm 3.6, E.62) with eigenvalues λ_G↓ (the *gradient explosion rate*: the
gradient norm squared grows as λ_G↓^L with depth L), λ_L↓, λ_M↓.

Writing |Gh| = √μ* r, n(Gh) = √B u (r ~ χ_{B−1} independent of u uniform on
the unit sphere of the sum-zero hyperplane), d(φ∘n)/dz = √B/(√μ* r)·D P_u with
D = diag φ'(√B u), P_u = G − uuᵀ, and E[r⁻²] = 1/(B−3):

    G^{⊗2}∘F{Π} = B/((B−3)μ*) · E_u[P_u D Π D P_u]          (App. G.1.1)

Methods
-------
Each method is a route object (:func:`bnlab.theory._routes.plan_route`; the code of each route, for all
three dynamics, lives in its own module: ``_closed_route``, ``_sphere_route``, ``_gegenbauer_route``,
``_montecarlo_route``); this module is the quantity's face and result type.

``"sphere"`` (App. G.1.1): the ten brackets of F reduced to 2-d integrals
and Thm E.62 (≈1e-10 relative; needs φ' square integrable, e.g. relu^α with α > 1/2).
``"gegenbauer"``: λ_G↓ by Thm 3.9 / G.5 (λ_L↓, λ_M↓ have no Gegenbauer form in
the paper: they are returned as None).  ``"closed"``: relu (Thm 3.10 for λ_G↓,
Thm G.12 with α = 1 for λ_L↓, λ_M↓) and identity (λ_G↓ = (B−2)/(B−3),
λ_L↓ = λ_M↓ = (B² − 2B − 1)/(B² − 2B − 3), from the sphere's fourth moments).
``"laplace"``: Thm G.12 for every positive-homogeneous φ of degree α > 1/2
(≈1e-13).  ``"montecarlo"``: traces of u ↦ P_u D · D P_u over each eigenspace, from
uniform samples of the sphere, with standard errors.  ``"auto"``: closed (relu,
identity), else laplace (other positive-homogeneous φ, (B−1)/2 > α), else sphere.  For ε > 0 :func:`gradient_explosion_rate` delegates to
:func:`bnlab.theory.epsilon.epsilon_analysis`.

B = 3: E[r⁻²] = ∞ for r ~ χ_2, so the mean field backward map diverges (the
paper conjectures, from simulations, explosion similar to B = 4; App. J): a
``ValueError`` explains it.

Errata found while checking the printed formulas numerically
------------------------------------------------------------
(see ``tests/theory/test_backward.py`` for the checks)
* Thm 3.10 / Eq. 19 and Thm G.12 (α = 1) agree with the spherical integral
  to 1e-12 for 4 ≤ B ≤ 128.
* App. L states the weight-gradient norm as ⟨Π^l, μ*G⟩ = μ* tr Π^l; this holds
  for Π^l ∈ H_B^G, i.e. from the second backward step on (Π^L itself need not
  be G-projected).

References
----------
Yang et al. 2019, §3.1.2, Thms 3.9, 3.10, G.5, G.12, App. G.1.1, App. L.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bnlab._validation import check_int, check_real
from bnlab.activations import get_activation
from bnlab.theory._checks import check_batch_size
from bnlab.theory._routes import DYNAMICS_METHODS, Dynamics, check_finite_result, plan_route
from bnlab.theory.epsilon import _epsilon_analysis

__all__ = [
    "BackwardEigenvalues",
    "backward_eigenvalues",
    "gradient_explosion_rate",
    "weight_gradient_norms",
    "BACKWARD_METHODS",
]

BACKWARD_METHODS = DYNAMICS_METHODS


@dataclass(frozen=True)
class BackwardEigenvalues:
    """Eigenvalues of G^{⊗2}∘F(Σ*) on RG (``lambda_G`` = gradient explosion rate λ_G↓), L and M.

    ``lambda_L``/``lambda_M`` are None when the method does not give them
    (gegenbauer) or M is empty; ``stderr`` holds Monte Carlo standard errors
    of (λ_G, λ_L, λ_M); ``truncation_error`` (gegenbauer only, else None) bounds
    the absolute error of λ_G from truncating the series (the two-point tail; see
    :func:`bnlab.theory.gegenbauer.oscillating_tail_bound`).
    """

    lambda_G: float
    lambda_L: float | None
    lambda_M: float | None
    method: str
    stderr: tuple[float, float, float] | None = None
    truncation_error: float | None = None


def _require_b4(b: int):
    if b < 4:
        raise ValueError(
            f"batch_size={b} is not allowed for the backward dynamics: with B = 3, E[|Gh|⁻²] diverges "
            "(r ~ χ_2), so the mean field gradient covariance is infinite (Yang et al. 2019, App. J); "
            "use batch_size >= 4"
        )


def _check_derivative_integrable(act):
    hom = act.homogeneity
    if hom is not None and hom <= 0.5:
        raise ValueError(
            f"phi={act.spec!r} has a derivative of degree {hom - 1:g} that is not square integrable "
            "(Thm 3.9 needs φ'(√(B−1)x) ∈ L²): the gradient explosion rate is infinite; use a degree > 1/2"
        )


def _check_backward_preconditions(act, b: int):
    _require_b4(b)
    _check_derivative_integrable(act)


_BACKWARD = Dynamics("the backward eigenvalues", "Thms 3.10, G.12", check=_check_backward_preconditions,
                      montecarlo_batch_power=2)  # a B×B matrix per sample


def backward_eigenvalues(
    phi, batch_size: int, *, method: str = "auto", n_terms: int | None = None, n_samples: int = 200_000, seed=0
) -> BackwardEigenvalues:
    """Eigenvalues λ_G↓ (gradient explosion rate), λ_L↓, λ_M↓ of the backward dynamics at the BSB1 fixed point.

    Parameters
    ----------
    phi, method, n_terms, n_samples, seed :
        As in :func:`bnlab.theory.forward_eigenvalues` (the three dynamics share one prologue).
    batch_size : int
        B ≥ 4 (B = 3: the mean field backward map diverges, ``ValueError``).

    Returns
    -------
    BackwardEigenvalues

    Accuracy
    --------
    closed: rounding; sphere: ≈1e-10 relative (but only algebraic in the radial
    rule for non-homogeneous φ with a kink, e.g. selu: 1e-4 at B = 32);
    gegenbauer: ≈1e-12 (smooth φ); relu-like φ (relu, leaky relu, abs, relu^α with
    α > ½) with the default terms (1000 for B ≤ 5, else 400), measured vs Thms
    3.10/G.12: ≤ 2e-8 (B = 4), ≤ 2e-10 (B = 5), ≤ 3e-11 (B = 8), ≤ 1e-15
    (32 ≤ B ≤ 1024), because Σ b_l² and
    Σ l(l+B−3) b_l² are summed exactly (Parseval, Dirichlet energy; see
    :func:`bnlab.theory._gegenbauer_route._gradient_rate_gegenbauer`) and only the R_l(ξ)-weighted tail is
    truncated; ``truncation_error`` bounds it.  montecarlo: the returned standard errors.

    References
    ----------
    Yang et al. 2019, Thms 3.9, 3.10, G.5, G.12, App. G.1.1.
    """
    act, b = get_activation(phi), check_batch_size(batch_size)
    return _backward_eigenvalues(act, b, method, n_terms=n_terms, n_samples=n_samples, seed=seed)


def _backward_eigenvalues(
    act, b: int, method: str = "auto", *, n_terms: int | None = None, n_samples: int = 200_000, seed=0
) -> BackwardEigenvalues:
    """The kernel of :func:`backward_eigenvalues`: φ resolved and B checked; the route chosen and run."""
    route = plan_route(act, b, method, _BACKWARD, n_terms=n_terms, n_samples=n_samples, seed=seed)
    lam_g, lam_l, lam_m, stderr, trunc = route.backward()
    check_finite_result(act, b, route.method, lam_g, lam_l, lam_m)
    f = lambda v: None if v is None else float(v)  # noqa: E731
    return BackwardEigenvalues(float(lam_g), f(lam_l), f(lam_m), route.method, stderr, trunc)


def gradient_explosion_rate(
    phi, batch_size: int, *, eps: float = 0.0, sigma_w2: float = 1.0, method: str = "auto"
) -> float:
    """The gradient explosion rate λ_G↓: E|∇_{h^l} L|² grows as λ_G↓^{L−l} (Yang et al. 2019, Thm 3.9).

    Parameters
    ----------
    phi, batch_size, method :
        As in :func:`backward_eigenvalues`.
    eps : float
        Batchnorm ε ≥ 0.  For ε > 0 the fixed point and rate depend on σ_w²
        and the computation is delegated to
        :func:`bnlab.theory.epsilon.epsilon_analysis` (§3.1.2 "Effect of ε").
    sigma_w2 : float
        Weight variance σ_w² > 0 (irrelevant when ε = 0: batchnorm is scale invariant).

    Returns
    -------
    float
        λ_G↓ > 1 for every non-constant φ with a BSB1 fixed point (Thm 3.9);
        relu: decreases to π/(π−1) ≈ 1.467 (Thm 3.10); identity: (B−2)/(B−3).
    """
    eps = check_real("eps", eps, minimum=0.0)
    sigma_w2 = check_real("sigma_w2", sigma_w2, minimum=0.0, strict_minimum=True)
    act, b = get_activation(phi), check_batch_size(batch_size)
    if eps > 0.0:
        return float(_epsilon_analysis(act, b, eps, sigma_w2).grad_explosion_rate)
    return _backward_eigenvalues(act, b, method).lambda_G


def weight_gradient_norms(phi, batch_size: int, depth: int, *, method: str = "auto") -> np.ndarray:
    """Predicted per-layer weight-gradient second moments relative to the last layer (Yang et al. 2019, App. L).

    Definition: for a depth-``depth`` network at the BSB1 fixed point,
    E[(∂L/∂W^l_{αβ})²] = ⟨Π^l, Σ*⟩ = μ* tr Π^l (App. L), and since the trace
    of Π only sees its RG component, which G^{⊗2}∘F multiplies by λ_G↓,
    tr Π^l = λ_G↓^{depth−l} tr Π^{depth} once Π is G-projected (from the
    second-to-last layer on).  Returns the array
    ``r[l−1] = E(∂L/∂W^l)² / E(∂L/∂W^depth)² = λ_G↓^{depth−l}`` for
    l = 1, …, depth (so r[-1] = 1 and r[0] = λ_G↓^{depth−1}), assuming
    Π^{depth} ∈ H_B^G.

    Returns
    -------
    numpy.ndarray of shape (depth,), float64 (overflows to inf only beyond ~1e308).
    """
    d = check_int("depth", depth, minimum=1)
    rate = gradient_explosion_rate(phi, batch_size, method=method)
    return np.power(rate, np.arange(d - 1, -1, -1, dtype=np.float64))
