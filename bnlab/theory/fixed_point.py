"""The BSB1 fixed point of the batchnorm covariance dynamics (Yang et al. 2019, §3, Thms 3.4, 3.5, F.5, F.8, F.13).

The dynamics Σ^l = V_Bφ(Σ^{l−1}) (Eq. 43 with ε = 0) have a unique BSB1
fixed point Σ* = q*[(1−c*)I + c*11ᵀ] = μ*I + ν*11ᵀ.  Because V_Bφ(Σ)
depends on a BSB1 Σ only through GΣG ∝ G, one application of V_Bφ to *any*
BSB1 matrix already gives Σ* (proof of Thm F.5).

Parametrizations (:class:`BSB1FixedPoint`):

* q* = Σ*_ii, c* = Σ*_ij/Σ*_ii (§3, Thm 3.4);
* μ* = q*(1 − c*), ν* = q*c* (App. F: Thm F.5, Thm F.13).  μ* is also the
  eigenvalue of GΣ*G on im G, i.e. GΣ*G = μ*G (Cor. F.9: "GΣ*G = μ*I_{B−1}"
  in the basis 𝔢) — the two uses of μ* in App. F agree.

Methods:

``"closed"``     positive-homogeneous φ of degree α: Thm F.8,
                 q* = K_{α,B} J_φ(1), q*c* = K_{α,B} J_φ(−1/(B−1)),
                 K_{α,B} = c_α Γ((B−1)/2)/Γ((B−1)/2 + α) ((B−1)/2)^α (Defn F.6),
                 with the ratio of gammas evaluated as exp of a difference of
                 log-gammas by ``scipy.special.poch`` (B up to 10⁶ and beyond).
                 relu: q* = 1/2, c* = J_1(−1/(B−1)) (Thm 3.5).
``"gegenbauer"`` Thm 3.4 / F.13 with the orthonormal coefficients of
                 :mod:`.gegenbauer` (B ≥ 4); for kinked φ q* = E f² exactly
                 (Parseval, the moment on the coefficients' rule) and only
                 q*c*'s R_l(ξ)-weighted tail is truncated.
``"sphere"``     Thm F.5, 1-D/2-D angular integrals (:mod:`.spherical`).
``"fourier"``    App. E.2 isotropic reduction (:mod:`.fourier`).
``"laplace"``    Thm 3.2 integrated numerically at Σ = G (distinct from "closed",
                 which has the s-integral done analytically).
``"iterate"``    iterate V_Bφ from a generic (seeded) Σ⁰ (App. F.1) until
                 successive iterates agree; raises if the limit is not BSB1
                 (symmetry breaking, App. J/K) or if it does not converge.
                 Positive-homogeneous φ: Laplace steps to 1e-10; other φ:
                 30 layers of the spherical QMC cubature (accuracy ~1e-3).
``"montecarlo"`` V_Bφ of a BSB1 Σ by direct sampling (the reference; its
                 ``abs_error`` is 3 standard errors).
``"auto"``       closed where available, else gegenbauer (B ≥ 4) with the
                 spherical route as fallback for slowly converging series.

Errata
------
* Thm 3.5 / Thm F.8 are consistent with each other and with the numerics:
  for relu q* = K_{1,B}J_relu(1) = c_1·((B−1)/2)/((B−1)/2)·1 = 1/2.
* Cor. F.9 writes GΣ*G = μ*I_{B−1}: it is μ*G in R^{B×B} (μ*I_{B−1} is its
  expression 𝔢ᵀΣ*𝔢 in the basis 𝔢).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from bnlab._validation import check_choice, check_int, check_psd_matrix, check_real
from bnlab.activations import Activation, get_activation
from bnlab.theory._checks import check_batch_size
from bnlab.theory._linalg import bsb1, bsb1_parts, centering_matrix
from bnlab.theory.batchnorm_map import TRANSFORM_METHODS, _checked_sigma, _montecarlo as _transform_montecarlo, _transform
from bnlab.theory.fourier import fourier_isotropic_entries
from bnlab.theory.gegenbauer import (
    RULE_RTOL,
    _normalized_gegenbauer,
    _quadratic_form,
    _series_moments,
    oscillating_tail_bound,
)
from bnlab.theory.laplace import laplace_transform, require_homogeneous
from bnlab.theory.spherical import isotropic_transform_entries, qmc_transform
from bnlab.theory.vphi import _homogeneous_fixed_point

__all__ = ["BSB1FixedPoint", "bsb1_fixed_point", "iterate_batch_covariance", "FIXED_POINT_METHODS"]

FIXED_POINT_METHODS = ("auto", "closed", "gegenbauer", "sphere", "fourier", "laplace", "iterate", "montecarlo")


@dataclass(frozen=True)
class BSB1FixedPoint:
    """The BSB1 fixed point Σ* = q*[(1−c*)I + c*11ᵀ] = μ*I + ν*11ᵀ (Yang et al. 2019, §3, App. F).

    Attributes
    ----------
    batch_size : B
    q_star, c_star : diagonal entry and correlation of Σ*
    mu_star, nu_star : Σ* = μ*I + ν*11ᵀ; GΣ*G = μ*G
    method : the route that produced it
    abs_error : estimate of the absolute error of the entries of Σ*
    """

    batch_size: int
    q_star: float
    c_star: float
    mu_star: float
    nu_star: float
    method: str
    abs_error: float

    def matrix(self) -> np.ndarray:
        """Σ* as a (B, B) array."""
        return bsb1(self.batch_size, self.q_star, self.nu_star)

    @classmethod
    def from_entries(cls, batch_size: int, diagonal: float, off_diagonal: float, method: str, abs_error: float):
        q = float(diagonal)
        nu = float(off_diagonal)
        c = nu / q if q != 0 else float("nan")
        return cls(int(batch_size), q, c, q - nu, nu, method, float(abs_error))


def _closed(act: Activation, b: int) -> BSB1FixedPoint:
    diag, off = _homogeneous_fixed_point(act, b)
    return BSB1FixedPoint.from_entries(b, diag, off, "closed", 1e-15 * max(abs(diag), abs(off)))


def _gegenbauer(act: Activation, b: int, rtol: float = 1e-13, max_terms: int = 1024) -> BSB1FixedPoint:
    """Thm 3.4 / F.13: q* = Σ_l b_l², q*c* = Σ_l b_l² R_l(−1/(B−1)).

    Degrees n = 32, 64, … ≤ ``max_terms`` until either the series has converged (relative
    Parseval tail ≤ ``rtol``: truncated at the first such degree, as
    :func:`bnlab.theory.gegenbauer.gegenbauer_coefficients` does) or the summed form is accurate:
    q* is the Parseval sum, i.e. exactly the moment E f² on the coefficients' rule, and only q*c*'s
    two-point tail Σ_{l≥n} b_l² R_l(ξ) remains, bounded by
    :func:`bnlab.theory.gegenbauer.oscillating_tail_bound` (stop once the bound is ≤ ``rtol``·q*:
    32 terms at B ≥ 32, where R_l(ξ) < 1e-20 beyond l = 24; 1024 at B = 4, bound 1e-11).  The summed
    form serves every φ: for a kink (algebraic decay of b_l) it is what makes the route accurate at all,
    and for analytic φ it stops as soon as the two-point tail is negligible instead of waiting for the
    Parseval tail (tanh at B = 32: 32 terms instead of 64, the result moves by ≤ 1e-13 relative, by
    which the truncated Parseval sum fell short of E f²).

    B ≥ 4: at B = 3 the normalization c_{B−1,l} = (B−3)/(B−3+2l) of Thm 3.4 vanishes and the series' R_l(ξ)
    are 0/0 (the result was NaN c*, μ*, ν*): a ``ValueError`` naming batch_size, as the forward, backward and
    cross-batch Gegenbauer routes give.
    """
    if b < 4:
        raise ValueError(
            f"batch_size={b} is not allowed for method='gegenbauer': the Gegenbauer expansion needs batch_size >= 4 "
            "(its normalization c_{B-1,l} = (B-3)/(B-3+2l) vanishes at B = 3, Yang et al. 2019, Thm 3.4); "
            f"use method='sphere' for batch_size={b}"
        )
    xi = -1.0 / (b - 1)
    n = 32
    while True:
        n = min(n, max_terms)
        coeffs, mom = _series_moments(act, b, n)
        q = mom.second
        tails = q - np.cumsum(coeffs**2)
        ok = np.nonzero(tails <= rtol * abs(q))[0]
        if ok.size or q == 0.0:  # converged: the plain truncated sums
            k = int(ok[0]) + 1 if ok.size else 1
            diag, off = _quadratic_form(coeffs[:k], b, np.array([1.0, xi]))
            err = abs(float(tails[k - 1])) + 1e-14 * abs(q)
            break
        r_xi = _normalized_gegenbauer(b, n, np.array(xi))
        bound = oscillating_tail_bound(r_xi, float(tails[-1]))
        if bound <= rtol * abs(q) or n >= max_terms:  # the Parseval part from the moment
            diag, off = q, float(np.sum(coeffs**2 * r_xi))
            err = bound + RULE_RTOL * abs(q)
            break
        n *= 2
    if err > 1e-9 * abs(q):
        warnings.warn(
            f"Gegenbauer series of phi={act.spec!r} at B={b} converges slowly (relative error bound {err / q:.1e}); "
            "the fixed point's abs_error reflects it",
            stacklevel=3,
        )
    return BSB1FixedPoint.from_entries(b, float(diag), float(off), "gegenbauer", err)


def _sphere(act: Activation, b: int) -> BSB1FixedPoint:
    d, o, err = isotropic_transform_entries(act, b)
    return BSB1FixedPoint.from_entries(b, d, o, "sphere", err)


def _fourier(act: Activation, b: int) -> BSB1FixedPoint:
    d, o, err = fourier_isotropic_entries(act, b)
    return BSB1FixedPoint.from_entries(b, d, o, "fourier", err)


def _laplace(act: Activation, b: int) -> BSB1FixedPoint:
    v, err = laplace_transform(act, centering_matrix(b))
    parts = bsb1_parts(v, rtol=1e-9)
    d, o = parts if parts is not None else (float(np.mean(np.diag(v))), float(v[0, 1]))
    return BSB1FixedPoint.from_entries(b, d, o, "laplace", err)


def _montecarlo(act: Activation, b: int, n_samples: int, seed) -> BSB1FixedPoint:
    mean, se = _transform_montecarlo(act, np.eye(b), b, 0.0, n_samples, seed)
    off_mask = ~np.eye(b, dtype=bool)
    d = float(np.mean(np.diag(mean)))
    o = float(np.mean(mean[off_mask]))
    # entries are correlated, so use the mean per-entry standard error (conservative for the averages)
    err = 3.0 * float(max(np.mean(np.diag(se)), np.mean(se[off_mask])))
    return BSB1FixedPoint.from_entries(b, d, o, "montecarlo", err)


def _iterate(act: Activation, b: int, seed, max_depth: int = 3000, tol: float = 1e-10) -> BSB1FixedPoint:
    homogeneous = act.homogeneity is not None and act.homogeneous_coeffs is not None and act.homogeneity > 0
    if not homogeneous:
        return _iterate_qmc(act, b, seed)
    rng = np.random.default_rng(0 if seed is None else seed)
    a = rng.standard_normal((b, b))
    sigma = a @ a.T / b + 0.1 * np.eye(b)
    prev_delta = None
    err = float("inf")
    for _ in range(max_depth):
        new = _laplace_step(act, sigma)
        delta = float(np.max(np.abs(new - sigma)))
        sigma = new
        # geometric convergence at rate r: the remaining error is ≈ delta·r/(1−r)
        if prev_delta is not None and 0 < delta < prev_delta:
            r = delta / prev_delta
            err = delta * r / (1.0 - r)
            if err <= tol * max(1.0, float(np.max(np.abs(sigma)))):
                break
        prev_delta = delta
    else:
        raise ValueError(
            f"method='iterate' did not converge for phi={act.spec!r}, B={b} within {max_depth} layers "
            f"(last change {delta:.2e})"
        )
    return _bsb1_or_raise(act, sigma, 1e-7, err)


def _bsb1_or_raise(act, sigma, rtol, err):
    parts = bsb1_parts(sigma, rtol=rtol)
    if parts is None:
        raise ValueError(
            f"method='iterate': the dynamics for phi={act.spec!r}, B={sigma.shape[0]} converged to a matrix that "
            "is not BSB1 (symmetry breaking, Yang et al. 2019 App. J/K); there is no attracting BSB1 fixed point"
        )
    return BSB1FixedPoint.from_entries(sigma.shape[0], parts[0], parts[1], "iterate", err)


def _laplace_step(act, sigma):
    return laplace_transform(act, sigma)[0]


def _iterate_qmc(act: Activation, b: int, seed, max_depth: int = 30, n_points: int = 2**12) -> BSB1FixedPoint:
    """Iterate with the spherical QMC cubature (common random numbers, so the map is deterministic).

    For φ without an accurate general-Σ route the iteration is only as good as
    the cubature (~1e-4): the limit is accepted as BSB1 when it is within 1e-2
    relative of its BSB1 projection, and ``abs_error`` is the larger of the
    cubature's standard error and the distance to that projection.
    """
    rng = np.random.default_rng(0 if seed is None else seed)
    a = rng.standard_normal((b, b))
    sigma = a @ a.T / b + 0.1 * np.eye(b)
    qseed = int(rng.integers(2**31))
    se = np.zeros((b, b))
    for _ in range(max_depth):
        sigma, se = qmc_transform(act, sigma, n_points=n_points, n_replicates=4, seed=qseed)
        sigma = 0.5 * (sigma + sigma.T)
    d = float(np.mean(np.diag(sigma)))
    o = float((sigma.sum() - np.trace(sigma)) / (b * (b - 1)))
    dist = float(np.max(np.abs(sigma - bsb1(b, d, o))))
    fp = _bsb1_or_raise(act, sigma, 1e-2, 0.0)
    return BSB1FixedPoint.from_entries(b, fp.q_star, fp.nu_star, "iterate", max(dist, 3.0 * float(np.max(se))))


def bsb1_fixed_point(phi, batch_size, *, method: str = "auto", n_samples: int | None = None, seed=None) -> BSB1FixedPoint:
    """The BSB1 fixed point of Σ ↦ V_Bφ(Σ) (Yang et al. 2019, Thms 3.4, 3.5, F.5, F.8, F.13).

    Parameters
    ----------
    phi : activation spec
    batch_size : int ≥ 3 (B = 2 is an explanatory ValueError; "gegenbauer" needs B ≥ 4)
    method : {"auto", "closed", "gegenbauer", "sphere", "fourier", "laplace", "iterate", "montecarlo"}
    n_samples, seed : for "montecarlo" (default 400 000 samples) and the random start of "iterate"

    Returns
    -------
    BSB1FixedPoint

    Accuracy
    --------
    closed ≈1e-15 relative; sphere, fourier, laplace ≈1e-12; gegenbauer ≈1e-13 for
    analytic φ and ≲ 1e-12 for kinked φ (relu: measured ≤ 4e-15 for 4 ≤ B ≤ 1024; its
    abs_error bounds the truncated two-point tail, ≤ 1e-11 relative for relu, 7e-9 for
    relu^½ at B = 4); iterate:
    the last change between layers; montecarlo: 3 standard errors.
    """
    method = check_choice("method", method, FIXED_POINT_METHODS)
    act = get_activation(phi)
    b = check_batch_size(batch_size)
    if method == "iterate":
        # not a quadrature of V_Bφ at a BSB1 Σ but a run of the dynamics from a random Σ⁰ (App. F.1)
        return _iterate(act, b, seed)
    if method in ("closed", "laplace"):
        require_homogeneous(act, f"method={method!r}")  # "auto" takes "closed" only for such φ
    if method == "montecarlo":
        n_samples = 400_000 if n_samples is None else check_int("n_samples", n_samples, minimum=2)
    return _bsb1_fixed_point(act, b, method, n_samples, seed)


def _bsb1_fixed_point(act, b: int, method: str = "auto", n_samples: int = 400_000, seed=None) -> BSB1FixedPoint:
    """The kernel of :func:`bsb1_fixed_point`: φ resolved, B, the method and n_samples checked (and φ
    positive-homogeneous for "closed" and "laplace"); V_Bφ of a BSB1 Σ by ``method`` (any of
    :data:`FIXED_POINT_METHODS` but "iterate", which the public function runs itself)."""
    if method == "auto":
        method = _auto_method(act, b)
    if method == "montecarlo":
        return _montecarlo(act, b, n_samples, seed)
    # the one route that the method names, chosen here once; each computes V_Bφ of a BSB1 Σ on its own rules
    return _QUADRATURE_ROUTES[method](act, b)


def _auto_method(act, b: int) -> str:
    """What "auto" takes: the closed form for positive-homogeneous φ (Thm F.8), else the Gegenbauer series
    (B ≥ 4), else the sphere."""
    if act.homogeneity is not None and act.homogeneous_coeffs is not None and act.homogeneity > 0:
        return "closed"
    return "gegenbauer" if b >= 4 else "sphere"


#: The deterministic routes of the fixed point, one per method: V_Bφ of a BSB1 Σ by the closed form (Thm F.8),
#: the Gegenbauer series (Thm 3.4 / F.13), the sphere (Thm F.5), the Fourier reduction (App. E.2) and the
#: Laplace integral (Thm 3.2); "montecarlo" also takes its sample size and seed, "iterate" runs the dynamics.
_QUADRATURE_ROUTES = {
    "closed": _closed,
    "gegenbauer": _gegenbauer,
    "sphere": _sphere,
    "fourier": _fourier,
    "laplace": _laplace,
}


def iterate_batch_covariance(phi, Sigma0, depth, *, method: str = "auto", eps: float = 0.0, seed=None) -> np.ndarray:
    """Σ⁰, Σ¹ = V_Bφ(Σ⁰), …, Σ^depth as an array of shape (depth+1, B, B) (Yang et al. 2019, Eq. 43, App. F.1).

    ``method`` is passed to :func:`batchnorm_transform` at every layer; random
    routes draw their seeds from one ``numpy.random.Generator(seed)`` so the
    whole trajectory is reproducible.
    """
    act = get_activation(phi)
    sigma = check_psd_matrix("Sigma0", Sigma0)
    check_batch_size(sigma.shape[0], name="Sigma0.shape[0] (the batch size B)")
    depth = check_int("depth", depth, minimum=0)
    method = check_choice("method", method, ("auto",) + TRANSFORM_METHODS)
    eps = check_real("eps", eps, minimum=0.0)
    rng = np.random.default_rng(seed)
    out = np.empty((depth + 1,) + sigma.shape)
    out[0] = sigma
    for l in range(1, depth + 1):
        # each layer's Σ is checked as batchnorm_transform checks it (a collapse to GΣG = 0 is an error)
        nxt = _transform(act, *_checked_sigma(out[l - 1], eps), method, None, rng)
        out[l] = 0.5 * (nxt + nxt.T)
    return out
