"""The Gegenbauer route of the dynamics: series in the Gegenbauer coefficients of φ(√(B−1)x)
(Yang et al. 2019, Thms 3.8, 3.9, 3.11, F.22, F.24, G.5; errata in :mod:`bnlab.theory.forward`) (private).

The series and their exactly summed single-point parts come from
``bnlab.theory.gegenbauer._dynamics_series``; each quantity returns a bound on its truncation error.
λ_L↓, λ_M↓ have no Gegenbauer form in the paper (None).  See :mod:`bnlab.theory._routes` for the route
objects' common face.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from scipy import special

from bnlab.theory.gegenbauer import _CONVERGED_PARSEVAL_RTOL, RULE_RTOL, _dynamics_series

__all__ = ["GegenbauerRoute"]


@dataclass(frozen=True)
class GegenbauerRoute:
    """Any φ with ``n_terms`` Gegenbauer coefficients; spectral for smooth φ, kinks through exact moments."""

    act: object
    batch_size: int
    n_terms: int
    method: ClassVar[str] = "gegenbauer"

    def forward(self):
        """(λ_L↑, λ_M↑, stderr, truncation error): Thm 3.8 / F.22 / F.24 (as corrected)."""
        lam_l, lam_m, trunc = _forward_gegenbauer(self.act, self.batch_size, self.n_terms)
        return lam_l, lam_m, None, trunc

    def backward(self):
        """(λ_G↓, None, None, stderr, truncation error): Thm 3.9 / G.5."""
        lam_g, trunc = _gradient_rate_gegenbauer(self.act, self.batch_size, self.n_terms)
        return lam_g, None, None, None, trunc

    def cross_batch(self):
        """(c_CB* = a_0², λ_M̃, stderr, truncation error): Thms H.3, 3.11."""
        c, lam, trunc = _cross_batch_gegenbauer(self.act, self.batch_size, self.n_terms)
        return c, lam, None, trunc


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
    # summed single-point parts leave the two-point tails (max|R_l(ξ)| × the tail); a converged plain head leaves the
    # whole tail: Σ_{l≥n} b_l² (1 − R_l(ξ)) ≤ 2 × Parseval tail for μ*, and weights |w_l (1 − k R_l)|, |u_l (1 − k R)| ≤
    # wmax (1 + k) for λ_L↑'s numerator (this was reported as 0, and relu^2's λ_L↑ at B = 8 is 1.7e-12 off while
    # 1.1e-12 was reported)
    d_den = s.two_point_bound(ptail) if s.summed else 2.0 * ptail
    d_num = kk * wmax * s.two_point_bound(ptail) if s.summed else (1.0 + kk) * wmax * ptail
    err_l = (d_num + abs(lam_l) * d_den) / abs(den)
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
    tail_m = max(q - float(np.sum(bc[: max(L - 2, 1)] ** 2)), 0.0)
    d_m = s.two_point_bound(tail_m) if s.summed else tail_m  # plain head: the tails themselves (|R_l(ξ)| ≤ 1)
    err_m = (c_m * d_m + abs(lam_m) * d_den) / abs(mu)
    return lam_m, err_m


def _gradient_rate_gegenbauer(act, b: int, n_terms: int) -> tuple[float, float]:
    """Thm 3.9 / G.5: λ_G↓ = Σ_l ε_l/(B−3) b_l² (1 − R_l(ξ)) / Σ_l b_l² (1 − R_l(ξ)),
    ε_l = l(l+B−3), ξ = −1/(B−1) (a_l² N_l = b_l², N_l(1 − P_l(ξ)) in the paper's normalization).

    Returns (λ_G↓, bound on its truncation error).  The single-point parts are summed exactly
    (:class:`bnlab.theory.gegenbauer._GegenbauerSeries`): Σ_l b_l² = E f² (Parseval) and
    Σ_l ε_l b_l² = E(1−x²)f'² (ε_l are the eigenvalues of −Δ on S^{B−2} and f(u_1) is zonal, so
    this is the Dirichlet energy E|∇_S f|²), which leaves only the two-point sums with R_l(ξ).
    Without this, φ' with a jump (relu) gives ε_l b_l² ~ l^{−2} and a truncation error ~ 1/n.
    """
    s = _dynamics_series(act, b, n_terms, dirichlet=True)
    l = np.arange(n_terms, dtype=np.float64)
    e2 = s.coef * s.coef
    eps2 = l * (l + b - 3.0) * e2
    den = s.single_point(np.sum(e2), s.moments.second) - float(np.sum(e2 * s.pxi))
    # The numerator's head converges on its own schedule: ε_l b_l² decays like l² b_l², so a Parseval tail below
    # _CONVERGED_PARSEVAL_RTOL (what s.summed tests) does not make the Dirichlet head converged.  relu^α with
    # α ≥ 1.5 (b_l² ~ l^{−2α−2}) passed the Parseval test with a Dirichlet tail ~ n^{−(2α−2)}: λ_G↓ at B = 4 was
    # 3.9e-7 off for α = 1.5 while 3e-12 was reported.  So the moment is used whenever the Dirichlet head is
    # unconverged, whatever the Parseval head does.
    d_tail = max(s.moments.dirichlet - float(np.sum(eps2)), 0.0)
    num_summed = s.summed or d_tail > _CONVERGED_PARSEVAL_RTOL * abs(s.moments.dirichlet)
    num = (s.moments.dirichlet if num_summed else float(np.sum(eps2))) - float(np.sum(eps2 * s.pxi))
    lam = num / ((b - 3.0) * den)
    # neglected: with a summed single-point part only the two-point tails Σ_{l≥n} b_l² R_l(ξ), Σ_{l≥n} ε_l b_l² R_l(ξ),
    # bounded by max|R_l(ξ)| × the tails; with a plain head the whole tail Σ_{l≥n} (·)(1 − R_l(ξ)), |1 − R_l| ≤ 2
    d_den = s.two_point_bound(s.parseval_tail) if s.summed else 2.0 * s.parseval_tail
    d_num = s.two_point_bound(d_tail) if num_summed else 2.0 * d_tail
    err = d_num / ((b - 3.0) * abs(den)) + abs(lam) * d_den / abs(den)
    return float(lam), float(err + RULE_RTOL * abs(lam))


def _cross_batch_gegenbauer(act, b: int, n_terms: int):
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
    # summed: the two-point tail of μ*; plain converged head: its whole tail Σ_{l≥n} b_l²(1 − R_l(ξ)) ≤ 2 × Parseval tail
    d_mu = s.two_point_bound(s.parseval_tail) if s.summed else 2.0 * s.parseval_tail
    err = abs(lam) * d_mu / abs(mu)
    return float(a[0] ** 2), float(lam), float(err + RULE_RTOL * abs(lam))
