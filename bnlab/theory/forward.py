"""Linearized forward dynamics of batchnorm networks at the BSB1 fixed point (Yang et al. 2019, §3.1.1).

Definition
----------
Near the BSB1 fixed point Σ* = q*((1−c*)I + c*11ᵀ) of Σ ↦ V_Bφ(Σ), the
deviation evolves by the Jacobian; its nonzero eigenvalues are those of
``G^{⊗2} ∘ Ĵ ∘ G^{⊗2}`` (Lemma F.17), an ultrasymmetric operator (Thm 3.6,
E.62) with three eigenspaces on H_B^G:

* ``RG``: λ_G↑ = 0 (batchnorm removes the overall scale in one step);
* ``L = {D^G : D diagonal, tr D = 0}``: λ_L↑ (fluctuation of the norms);
* ``M = {Σ : Σ^G = Σ, Diag Σ = 0}``: λ_M↑ (the correlations).

With μ* = q*(1 − c*) (so GΣ*G = μ*G) and u uniform on the unit sphere of the
sum-zero hyperplane W, the Gaussian integration-by-parts identity
``∂_Σ E f(h) = ½E[f(h)(Σ⁺hhᵀΣ⁺ − Σ⁺)]`` on W gives, for Δ ∈ H_B^G,

    Ĵ{Δ} = (2μ*)⁻¹ E_u[φ(√B u)φ(√B u)ᵀ ((B−1) uᵀΔu − tr Δ)]          (App. F.3.1, Eq. 46)

Methods
-------
Each method is a route object (:func:`bnlab.theory._routes.plan_route`; the code of each route, for all
three dynamics, lives in its own module: ``_closed_route``, ``_sphere_route``, ``_gegenbauer_route``,
``_montecarlo_route``); this module is the quantity's face and result type.

``"sphere"`` (App. F.3.1): the ten ultrasymmetric brackets of Ĵ reduced to
2-d integrals over (u_1, u_2) (the other coordinates enter polynomially and
are integrated in closed form) and evaluated by the quadrature of
:func:`sphere_grid`; eigenvalues from Thm E.62.  Accuracy ≈ 1e-10 relative
(see :func:`sphere_grid`).  Any φ; B ≤ 2048.

``"gegenbauer"`` (Thm 3.8 with the coefficients of Thms F.22, F.24, as
corrected below): ratios of quadratic forms in the Gegenbauer coefficients
a_l of φ(√(B−1)x), taken from the core module :mod:`bnlab.theory.gegenbauer`
(:func:`~bnlab.theory.gegenbauer.gegenbauer_orthonormal_coefficients`,
:func:`~bnlab.theory.gegenbauer.normalized_gegenbauer`) through
``bnlab.theory.gegenbauer._dynamics_series``.  Accuracy: spectral for smooth φ
(1e-10 with the default number of terms).  For φ with a kink the coefficients
decay algebraically, so the single-point parts of the series (no factor R_l(ξ))
are summed exactly through the moments E f², E x² f² (``_forward_gegenbauer``)
and only the R_l(ξ)-weighted tail is truncated (bounded by ``truncation_error``):
relu, leaky relu, abs, relu^α agree with Thms 3.7/F.33 to ≤ 5e-12 at B = 4 (relu^½: 4e-10),
≤ 3e-13 for 8 ≤ B ≤ 128, ≤ 2e-12 at B = 1024 with 400 terms.  4 ≤ B ≤ 2048
(λ_M↑ is evaluated in the orthonormal form, so N_l ~ binom(l+B−4, l) is never
formed: tanh at B = 1024 agrees with the sphere to 4e-12 with 160 to 1200 terms).

``"closed"``: Thm 3.7 for relu; for the identity λ_L↑ = λ_M↑ = (B−1)/(B+1)
(fourth moments of the uniform sphere measure).  Exact to rounding, any B ≥ 4.

``"montecarlo"``: the same expectations estimated from uniform samples of
the sphere, with standard errors; an independent check, not a production route.

``"laplace"`` (Thm F.33): closed forms for every positive-homogeneous φ
(relu^α, leaky relu, abs, ...) in terms of the kernel J_φ of Defn E.9
(hypergeometric, :mod:`bnlab.theory.vphi`) and its derivative; needs
(B−1)/2 > α.  Accuracy ≈1e-13.

``"auto"`` = closed (relu, identity), else laplace (other positive-homogeneous φ with
(B−1)/2 > α), else sphere.  ``fourier`` (App. E.2) is
developed for the fixed point only: it raises ``ValueError`` here.

Errata found while checking the printed formulas numerically
------------------------------------------------------------
* Thm F.22 (printed): the cross term is written ``a_1 a_{l+2} u_{B−1,l}``; it is
  ``a_l a_{l+2} u_{B−1,l}`` as in Thm 3.8 (with that reading λ_L↑ agrees with
  the sphere to 1e-12 for tanh and sin, 4 ≤ B ≤ 128).
* Thm F.24 (printed w̃_{B−1,l}, ũ_{B−1,l}) does not reproduce λ_M↑ once
  a_l ≠ 0 for some l ≥ 2 (tanh, B = 4: 0.7327 vs 0.7159 by the sphere, by
  bnlab's Monte Carlo and by finite differences of V_Bφ).  The reduction in
  its proof, λ_M↑ = (B−1)/((B−3)μ*)(−Σ*_12/(B−2) + 2(B−1)/(B−2) Ã_12(11)
  + (B−1) Ã_12(12)), with Lemma F.23 and Eq. 49, is correct and is what the
  ``"gegenbauer"`` method evaluates (agreement 1e-12 for smooth φ).
* Thm F.33 proof, Item 2: the result is labelled λ_L↑; it is λ_M↑.
* Thms E.61/E.62: see :mod:`bnlab.theory.ultrasymmetric` ([12|13] vs [12|31]).
* Thm 3.7 (Eqs. 13, 14) for relu is correct (sphere agreement 1e-12).

References
----------
Yang, Pennington, Rao, Sohl-Dickstein, Schoenholz (2019), "A Mean Field Theory
of Batch Normalization", ICLR: §3.1.1, Thms 3.6–3.8, E.61, E.62, F.22, F.24,
F.33, App. F.3.1.
"""
from __future__ import annotations

from dataclasses import dataclass

from bnlab.activations import get_activation
from bnlab.theory._checks import check_batch_size
from bnlab.theory._routes import DYNAMICS_METHODS, Dynamics, check_finite_result, plan_route

__all__ = ["ForwardEigenvalues", "forward_eigenvalues", "FORWARD_METHODS"]

#: Methods accepted by :func:`forward_eigenvalues`.
FORWARD_METHODS = DYNAMICS_METHODS

_FORWARD = Dynamics("the forward eigenvalues", "Thm 3.7", closed_min_batch=4, gegenbauer_min_batch=4)


@dataclass(frozen=True)
class ForwardEigenvalues:
    """Eigenvalues of the linearized forward dynamics G^{⊗2}∘Ĵ∘G^{⊗2} at the BSB1 fixed point.

    ``lambda_G`` (= 0, on RG), ``lambda_L`` (on L), ``lambda_M`` (on M; None
    for B = 3 where M is empty), ``method`` (the route used), ``stderr``
    (Monte Carlo standard errors of (λ_L, λ_M), else None), ``truncation_error``
    (gegenbauer only, else None: a bound on the absolute error of λ_L and λ_M from
    truncating the series, see :func:`bnlab.theory.gegenbauer.oscillating_tail_bound`).
    """

    lambda_G: float
    lambda_L: float
    lambda_M: float | None
    method: str
    stderr: tuple[float, float] | None = None
    truncation_error: float | None = None


def forward_eigenvalues(
    phi, batch_size: int, *, method: str = "auto", n_terms: int | None = None, n_samples: int = 200_000, seed=0
) -> ForwardEigenvalues:
    """Eigenvalues λ_G↑ (= 0), λ_L↑, λ_M↑ of the linearized forward dynamics at the BSB1 fixed point.

    Parameters
    ----------
    phi : str, callable or Activation
        The nonlinearity (anything :func:`bnlab.activations.get_activation` accepts).
    batch_size : int
        B ≥ 3 (B = 2 raises: the dynamics are constant; B = 3 warns and λ_M is None).
    method : {"auto", "closed", "laplace", "sphere", "gegenbauer", "montecarlo"}
        See the module docstring; "fourier" raises ``ValueError``.
    n_terms : int, optional
        Number of Gegenbauer coefficients (method="gegenbauer").
    n_samples, seed :
        Monte Carlo sample size and seed (int or ``numpy.random.Generator``).

    Returns
    -------
    ForwardEigenvalues

    Accuracy
    --------
    closed: rounding.  sphere: ≈1e-10 relative (kinks at 0 included).
    gegenbauer: ≈1e-12 for smooth φ; relu-like φ (relu, leaky relu, abs, relu^α)
    ≤ 4e-10 at B = 4 (relu^½), ≤ 3e-13 for 8 ≤ B ≤ 128, ≤ 2e-12 at B = 1024, with
    the bound ``truncation_error`` (was 1e-8 … 1e-5 with extrapolated truncated sums).
    montecarlo: the returned standard errors.

    References
    ----------
    Yang et al. 2019, Thms 3.6–3.8, E.62, F.22, F.24, F.33; App. F.3.1.
    """
    act, b = get_activation(phi), check_batch_size(batch_size)
    return _forward_eigenvalues(act, b, method, n_terms=n_terms, n_samples=n_samples, seed=seed)


def _forward_eigenvalues(
    act, b: int, method: str = "auto", *, n_terms: int | None = None, n_samples: int = 200_000, seed=0
) -> ForwardEigenvalues:
    """The kernel of :func:`forward_eigenvalues`: φ resolved and B checked; the route chosen and run."""
    route = plan_route(act, b, method, _FORWARD, n_terms=n_terms, n_samples=n_samples, seed=seed)
    lam_l, lam_m, stderr, trunc = route.forward()
    if b == 3:
        lam_m = None
    check_finite_result(act, b, route.method, lam_l, lam_m)
    return ForwardEigenvalues(0.0, float(lam_l), None if lam_m is None else float(lam_m), route.method, stderr, trunc)
