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
are summed exactly through the moments E f², E x² f² (:func:`_forward_gegenbauer`)
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

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from scipy import special

from bnlab.activations import get_activation
from bnlab.theory._checks import check_batch_size
from bnlab.theory._quadrature.sphere import SphereGrid, conditional_coefficients, ratio_stats, sample_sphere, sphere_grid_for
from bnlab.theory._routes import DYNAMICS_METHODS, Dynamics, check_finite_result, plan_route
from bnlab.theory.gegenbauer import RULE_RTOL, _dynamics_series
from bnlab.theory.ultrasymmetric import projected_eigenvalues
from bnlab.theory.vphi import _homogeneous_kernel_values, _relu_arccos_kernel

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


# ---------------------------------------------------------------------------
# brackets of Ĵ by spherical integration / Monte Carlo
# ---------------------------------------------------------------------------
@lru_cache(maxsize=32)
def _forward_moments_sphere(act, batch_size: int):
    """Moments E[f_k f_l · (u-monomial)] of f = φ(√B u) needed by the brackets of Ĵ.

    Memoized per (φ, B): the forward, backward (μ*) and cross-batch (μ*) routes share them.
    The returned array is read-only.
    """
    b = batch_size
    hom = act.homogeneity
    grid = sphere_grid_for(act, b, float(hom) if hom is not None else 0.0)  # split at kinks
    sb = math.sqrt(b)
    with np.errstate(invalid="ignore", divide="ignore"):
        f1 = act(sb * grid.x_distinct)  # once per distinct u_1 (a run of the kink rule)
        f2 = act(sb * grid.y)
    out = _sphere_brackets(grid, f1, f2)
    out.setflags(write=False)
    return out


def _sphere_brackets(grid: SphereGrid, f1: np.ndarray, f2: np.ndarray) -> np.ndarray:
    """[E f_1², E f_1 f_2, E f_1² x², E f_1² y², E f_1² xy, E f_1² y e3, E f_1 f_2 x², E f_1 f_2 e33,
    E f_1 f_2 xy, E f_1 f_2 x e3, E f_1 f_2 e34] (App. F.3.1) from f_1 = f(√B u_1) per run and
    f_2 = f(√B u_2) per node (see :class:`bnlab.theory._quadrature.sphere.SphereGrid`)."""
    x = grid.x_distinct
    c1, c2 = conditional_coefficients(grid.batch_size)
    a0, a1, a2 = grid.power_sums(None, 2)
    s0, s1, s2 = grid.power_sums(f2, 2)
    ff = f1 * f1
    return np.array([
        ff @ a0,
        f1 @ s0,
        (ff * x * x) @ a0,
        ff @ a2,
        (ff * x) @ a1,
        -c1 * (ff @ (x * a1 + a2)),
        (f1 * x * x) @ s0,
        c1 * (f1 @ ((1.0 - x * x) * s0 - s2)),
        (f1 * x) @ s1,
        -c1 * ((f1 * x) @ (x * s0 + s1)),
        c2 * (f1 @ ((2.0 * x * x - 1.0) * s0 + 2.0 * x * s1 + 2.0 * s2)),
    ])


def _forward_brackets(moments: np.ndarray, batch_size: int):
    """The ten brackets of Ĵ (Thm E.62 order) and (q*, q*c*, μ*) from the moments."""
    b = batch_size
    q, qc, m1111, m1122, m1112, m1123, m1211, m1233, m1212, m1213, m1234 = moments
    mu = q - qc
    k = 1.0 / (2.0 * mu)
    d = 1.0 - 1.0 / b
    brackets = np.array(
        [
            k * ((b - 1) * m1111 - d * q),
            k * ((b - 1) * m1122 - d * q),
            k * ((b - 1) * m1112 + q / b),
            k * ((b - 1) * m1123 + q / b),
            k * ((b - 1) * m1211 - d * qc),
            k * ((b - 1) * m1233 - d * qc),
            k * ((b - 1) * m1212 + qc / b),
            k * ((b - 1) * m1212 + qc / b),
            k * ((b - 1) * m1213 + qc / b),
            k * ((b - 1) * m1234 + qc / b),
        ]
    )
    return brackets, (q, qc, mu)


def _forward_sphere(act, batch_size: int):
    moments = _forward_moments_sphere(act, batch_size)
    brackets, _ = _forward_brackets(moments, batch_size)
    return projected_eigenvalues(brackets, batch_size)


def _forward_montecarlo(act, batch_size: int, n_samples: int, rng, chunk: int = 20000):
    """λ_L, λ_M as ratios of means over u ~ Unif(S^{B−2} ⊂ W), with delta-method errors.

    tr(P_S ∘ G^{⊗2}Ĵ ∘ P_S) over S = L, M uses the orthogonal projector onto L:
    ⟨P_L(A), uuᵀ⟩ = Σ_i c_i u_i², c = (diag A − mean)/(1 − 2/B) for A ∈ H_B^G.
    """
    b = batch_size
    num_l, num_m, den = [], [], []
    done = 0
    while done < n_samples:
        n = min(chunk, n_samples - done)
        u = sample_sphere(b, n, rng)
        f = act(math.sqrt(b) * u)
        gf = f - f.mean(axis=1, keepdims=True)
        dg = gf * gf
        c = (dg - dg.mean(axis=1, keepdims=True)) / (1.0 - 2.0 / b)
        pl = (c * u * u).sum(axis=1)
        tot = dg.sum(axis=1)
        fu = (gf * u).sum(axis=1)
        num_l.append((b - 1) * pl)
        num_m.append((b - 1) * (fu * fu - tot / (b - 1) - pl))
        den.append(2.0 * tot / (b - 1))  # 2μ* = 2 E|Gf|²/(B−1)
        done += n
    num_l, num_m, den = map(np.concatenate, (num_l, num_m, den))
    lam_l, se_l = ratio_stats(num_l / (b - 1), den)
    if b > 3:
        dim_m = b * (b - 3) / 2.0
        lam_m, se_m = ratio_stats(num_m / dim_m, den)
    else:
        lam_m, se_m = None, math.nan
    return lam_l, lam_m, (se_l, se_m)


# ---------------------------------------------------------------------------
# closed forms
# ---------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------
# Laplace method: positive-homogeneous φ (Thms F.33, G.12, H.6, H.14)
# ---------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------
# Gegenbauer form (Thm 3.8, F.22, F.24)
# ---------------------------------------------------------------------------
def _forward_gegenbauer(act, b: int, n_terms: int):
    """(λ_L↑, λ_M↑, bound on their truncation errors) by Thm 3.8 / F.22 / F.24 (as corrected in the errata).

    Single-point parts are summed exactly through the moments of
    :class:`bnlab.theory.gegenbauer._GegenbauerSeries`:
    the denominator Σ_l b_l²(1 − R_l(ξ)) = μ* has its Parseval part Σ b_l² = E f²; the numerator
    of λ_L↑ has the single-point part Σ_l b_l² w_l + Σ_l b_l b_{l+2} u_l⁰ = −E f²/2 + (B−1)/2 · E x² f²
    (u_l⁰: u_l with R(ξ) := 0), which is the Jacobi-matrix identity E x² f² = ‖Jb‖² (see
    :class:`bnlab.theory.gegenbauer.SeriesMoments`) rewritten with w_l, u_l⁰ (verified to 1e-15 on
    tanh, sin, gelu, sigmoid, softplus, erf at B = 5, 8, 33); the numerator of λ_M↑ is two-point only.
    """
    s = _dynamics_series(act, b, n_terms + 3)
    logn, bc, pxi = s.logn, s.coef, s.pxi
    l = np.arange(n_terms, dtype=np.float64)
    L = n_terms
    c = lambda k: (b - 3.0) / (b - 3.0 + 2.0 * k)  # noqa: E731  c_{B−1,k}
    kk = 2.0 * (b - 1.0) / (b - 2.0)
    xi_p = pxi[:L]
    bl, bl2 = bc[:L], bc[2 : L + 2]
    q = s.moments.second
    # denominator Σ a_l² v_l, v_l = N_l (1 − P_l(ξ)) = μ*
    head_q = float(np.sum(bl * bl))
    den = s.single_point(head_q, q) - float(np.sum(bl * bl * xi_p))
    # F.22: w_l = l(B−3+l)(B−3)/((B−5+2l)(B−1+2l)) c_l⁻¹ (C_l(1) − k C_l(ξ)),  a_l² w_l = b_l² (...)(1 − k P_l(ξ))
    with np.errstate(divide="ignore", invalid="ignore"):
        wl = np.where(l == 0, 0.0, l * (b - 3 + l) * (b - 3) / ((b - 5 + 2 * l) * (b - 1 + 2 * l)))
    # cross term a_l a_{l+2} u_l with C_j(1)/√(N_l N_{l+2}) = c_j N_j/√(N_l N_{l+2}):
    # u_l = ul_lo (1 − k P_l(ξ)) + ul_hi (1 − k P_{l+2}(ξ))
    r = np.exp(0.5 * (logn[2 : L + 2] - logn[:L]))  # √(N_{l+2}/N_l)
    ul_lo = 0.5 * (b - 1) * (b - 3 + l) * (b - 2 + l) / ((b - 3) * (b - 1 + 2 * l)) * c(l) / r
    ul_hi = 0.5 * (b - 1) * (l + 1) * (l + 2) / ((b - 3) * (b - 1 + 2 * l)) * c(l + 2) * r
    cross = bl * bl2
    head_l = float(np.sum(bl * bl * wl) + np.sum(cross * (ul_lo + ul_hi)))
    single_l = s.single_point(head_l, -0.5 * q + 0.5 * (b - 1.0) * s.moments.x_second)
    two_point_l = -kk * float(np.sum(bl * bl * wl * xi_p) + np.sum(cross * (ul_lo * xi_p + ul_hi * pxi[2 : L + 2])))
    lam_l = (single_l + two_point_l) / den
    # truncation: the neglected two-point tails, with weights bounded by the largest |w_l|, |u_l| of
    # the head's last quarter (w_l ↗ (B−3)/4, ul_lo + ul_hi ↗ (B−1)/4) and Σ_{l≥n}|b_l b_{l+2}| ≤ Σ_{l≥n} b_l²
    ptail = max(q - float(np.sum(bl * bl)), 0.0)
    k4 = max(1, L // 4)
    wmax = max(float(np.max(np.abs(wl[-k4:]))), 0.25 * (b - 3.0)) + max(
        float(np.max(np.abs(ul_lo[-k4:]) + np.abs(ul_hi[-k4:]))), 0.25 * (b - 1.0)
    )
    d_den = s.two_point_bound(ptail)
    err_l = (kk * wmax * d_den / abs(den) + abs(lam_l) * d_den / abs(den)) if s.summed else 0.0
    if b == 3:
        return lam_l, None, err_l + RULE_RTOL * abs(lam_l)
    lam_m, err_m = _lambda_m_gegenbauer(s, b, n_terms, den, d_den)
    return lam_l, lam_m, max(err_l + RULE_RTOL * abs(lam_l), err_m + RULE_RTOL * abs(lam_m))


def _lambda_m_gegenbauer(s, b: int, n_terms: int, mu: float, d_den: float) -> tuple[float, float]:
    """(λ_M↑, bound on its truncation error) from the series ``s`` of :func:`_forward_gegenbauer`, whose μ* and
    the bound ``d_den`` on μ*'s two-point tail it shares.

    Thm F.24 as printed does not reproduce the spherical values for l ≥ 2 (see the module errata); this is
    the paper's own reduction (proof of Thm F.24)
      λ_M = (B−1)/((B−3)μ*) (−Σ*_12/(B−2) + 2(B−1)/(B−2) Ã_12(11) + (B−1) Ã_12(12))
    with Ã_12(12) = E φ_1 φ_2 u_1 u_2 (Lemma F.23) and Ã_12(11) = E φ_1 φ_2 u_1² (Eq. 49), both expanded by
    the addition theorem E_v F(ê_1·v) H(ê_2·v) = Σ_l F_l H_l N_l P_l(ξ), the coefficients of tφ and t²φ
    obtained from a_l by the three-term recurrence (Prop. E.43).
    """
    logn, bc, pxi, q, L = s.logn, s.coef, s.pxi, s.moments.second, n_terms
    # Evaluated in the orthonormal form (b_l = a_l √N_l, Σ a_l² N_l P_l(ξ) = Σ b_l² P_l(ξ)) so that
    # neither N_l (overflows for large B·l) nor a_l (underflows) is ever formed: the coefficients
    # of tφ and t²φ in the paper's normalization, d_l = a_{l−1} l/(B+2l−3) + a_{l+1}(B+l−3)/(B+2l−3),
    # become d̃_l = d_l √N_l = b_{l−1} √(N_l/N_{l−1}) l/(B+2l−3) + b_{l+1} √(N_l/N_{l+1}) (B+l−3)/(B+2l−3),
    # with the ratios from log N_l differences.
    n_all = bc.size
    lf = np.arange(n_all, dtype=np.float64)
    up = np.exp(0.5 * (logn[1:] - logn[:-1]))  # up[l] = √(N_{l+1}/N_l)
    from_below = np.concatenate([[0.0], up]) * lf / (b + 2 * lf - 3)  # √(N_l/N_{l−1}) l/(B+2l−3)
    from_above = np.concatenate([1.0 / up, [0.0]]) * (b + lf - 3) / (b + 2 * lf - 3)

    def times_t(c):  # orthonormal coefficients of t·F from those of F
        return np.concatenate([[0.0], c[:-1]]) * from_below + np.concatenate([c[1:], [0.0]]) * from_above

    d = times_t(bc)  # t φ
    e = times_t(d)  # t² φ
    sl = slice(0, L)  # the last coefficients are contaminated by the truncation of the recurrence
    px = pxi[sl]
    qc = np.sum(bc[sl] ** 2 * px)
    a12 = (b - 1.0) / b * np.sum(d[sl] ** 2 * px)
    a11 = (b - 1.0) / b * np.sum(bc[sl] * e[sl] * px)
    num_m = (b - 1.0) / (b - 3.0) * (-qc / (b - 2.0) + 2.0 * (b - 1.0) / (b - 2.0) * a11 + (b - 1.0) * a12)
    lam_m = num_m / mu
    # truncation: the two-point tails of qc, a12, a11 (tφ, t²φ = Jb, J²b with ‖J‖ ≤ 1, so their ℓ² tails
    # beyond L are ≲ Σ_{l≥L−2} b_l²) and of μ*
    c_m = (b - 1.0) / (b - 3.0) * (1.0 / (b - 2.0) + 2.0 * (b - 1.0) ** 2 / (b * (b - 2.0)) + (b - 1.0) ** 2 / b)
    d_m = s.two_point_bound(max(q - float(np.sum(bc[: max(L - 2, 1)] ** 2)), 0.0))
    err_m = (c_m * d_m + abs(lam_m) * d_den) / abs(mu) if s.summed else 0.0
    return lam_m, err_m


# ---------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------
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
    r = plan_route(act, b, method, _FORWARD, n_terms=n_terms, n_samples=n_samples, seed=seed)
    method = r.method
    stderr = trunc = None
    if method == "closed":
        lam_l, lam_m = _forward_closed(r.relu_or_identity, b)
    elif method == "laplace":
        lam_l, lam_m = _forward_laplace(act, b)
    elif method == "sphere":
        ev = _forward_sphere(act, b)
        lam_l, lam_m = ev.lambda_L, ev.lambda_M
    elif method == "gegenbauer":
        lam_l, lam_m, trunc = _forward_gegenbauer(act, b, r.n_terms)
    else:  # montecarlo
        lam_l, lam_m, stderr = _forward_montecarlo(act, b, r.n_samples, r.rng)
    if b == 3:
        lam_m = None
    check_finite_result(act, b, method, lam_l, lam_m)
    return ForwardEigenvalues(0.0, float(lam_l), None if lam_m is None else float(lam_m), method, stderr, trunc)
