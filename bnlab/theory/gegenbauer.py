"""Gegenbauer expansion of φ on the batchnorm sphere (Yang et al. 2019, Thm 3.4, App. E.4, Thm F.13).

Definition (the paper's normalization).  With λ = (B−3)/2 and
c_{B−1,l} = (B−3)/(B−3+2l) = λ/(λ+l),

    φ(√(B−1) x) = Σ_l a_l (1/c_{B−1,l}) C_l^{(λ)}(x),   x ∈ [−1, 1],

in L²((1−x²)^{λ−1/2}).  Because ‖C_l^{(λ)}‖² = c_{B−1,l} C_l^{(λ)}(1) in the
*normalized* weight μ_B(dx) ∝ (1−x²)^{(B−4)/2}dx (the law of one coordinate of
a uniform point of S^{B−2}), the orthonormal coefficients are

    b_l = E_{μ_B}[φ(√(B−1)x) P_l(x)] = a_l √(C_l^{(λ)}(1)/c_{B−1,l}),

with P_l the orthonormal Gegenbauer polynomials, and every quadratic form of
the theory is a sum of b_l² times the *normalized* Gegenbauer polynomial
R_l(t) = C_l^{(λ)}(t)/C_l^{(λ)}(1) ∈ [−1, 1]:

    Σ_l a_l² (1/c_{B−1,l}) C_l^{(λ)}(t) = Σ_l b_l² R_l(t)      (Thm 3.4, Thm F.13),

which is how this module evaluates them (no factor C_l(1) ~ binom(l+B−4, l)
is ever formed, so B = 1024 and beyond work).  Parseval: Σ b_l² = E φ² = q*.

Numerics.  b_l are computed from P_l √w (P_l alone overflows near x = ±1
for large B·l) evaluated by the stable orthonormal three-term recurrence x P_l = √β_{l+1} P_{l+1} + √β_l P_{l−1},
β_l = l(l+2λ−1)/(4(l+λ)(l+λ−1)), on a tanh-sinh rule in θ (x = cos θ) split
at θ = π/2 (the kink of relu-like φ), whose step is tied to the highest
degree so that the rule resolves the oscillations of P_l; the weight
sin^{B−3}θ is normalized with the same rule (see :mod:`.spherical`).  The
coefficients a_l = b_l √(c_{B−1,l}/C_l(1)) use log-gamma for C_l(1).
When ``n_terms`` is None the series is truncated at the first n with relative
Parseval tail (q − Σ_{l<n} b_l²)/q ≤ rtol.  Accuracy: each b_l to ≈1e-14·‖φ‖;
for analytic φ the coefficients decay geometrically and rtol = 1e-12 is
reached with tens (B = 8) to a few hundred (B = 1024) terms.  φ with a kink
converge algebraically (relu: b_l² ~ l^{−4} once l ≫ B, b_l² l⁴ still growing at
l = 800 for B = 1024; relu^α: b_l² ~ l^{−2α−2}): the coefficients are cut at
``max_terms`` and a :class:`GegenbauerTruncationWarning` reports the Parseval
tail reached (relu at 1024 terms: 3e-10 at B = 4, 1e-8 at B = 32, 9e-7 at B = 1024).

Tails of kinked φ (:class:`SeriesMoments`, :func:`gegenbauer_series_moments`).
Truncating the theory's series there is not accurate (relu at B = 1024, 400
terms: λ_G↓ 7e-4 low, since Σ l(l+B−3) b_l² has a tail ~ 1/n), and no power-law
tail model b_l² ≈ C l^{−4}(1 + d/l + …) is asymptotic at affordable n for
large B.  Instead the consumers sum the tails exactly.  Every quadratic form
of the theory is a *single-point* part (no R_l(ξ)) plus a *two-point* part
(a factor R_l(ξ), ξ = −1/(B−1), from the addition theorem).  The single-point
parts are moments of one coordinate of the sphere,

    Σ_l b_l² = E f²,   ‖J b‖² = E x² f²,   Σ_l l(l+B−3) b_l² = E (1−x²) f'²

(orthonormality; J the Jacobi matrix of the recurrence; l(l+B−3) the
eigenvalues of −Δ on S^{B−2}, so the last one is the Dirichlet energy, by
integration by parts, valid when f is continuous with E(1−x²)f'² < ∞), which the
rule of the coefficients integrates to ≈1e-14 whatever the kink, because the
rule is split at every kink (x = 0 and, for φ kinked elsewhere such as relu(x + 1), at
x = k/√(B−1); kinks from :attr:`bnlab.activations.Activation.kinks`); the Dirichlet moment has a rule of its own
that reaches |x| ≈ 1e-300, since φ' may be singular there (relu^α, ½ < α < 1).  What is left, the two-point tail
Σ_{l≥n} c_l R_l(ξ), is bounded by max_{l≥n}|R_l(ξ)| Σ_{l≥n}|c_l|
(:func:`oscillating_tail_bound`), and |R_l(ξ)| ≲ l^{−(B−3)/2} (R_400(ξ) ≈ 1e-6 at
B = 8, < 1e-60 at B = 128).  Resulting accuracy of the Gegenbauer routes for
relu-like φ with the default terms (1000 for B ≤ 5, else 400; vs closed forms,
measured): λ_G↓ ≤ 2e-8 (B = 4), ≤ 2e-10 (B = 5), ≤ 3e-11 (B = 8), ≤ 1e-15
(B = 32 … 1024); λ_L↑, λ_M↑, q*,
c*, λ_M̃ ≤ 5e-12 at B = 4, ≤ 3e-13 for 8 ≤ B ≤ 128, ≤ 2e-12 at B = 1024 —
previously (extrapolated truncated sums) λ_G↓ was 2e-5 off at B = 128 and
7e-4 at B = 1024.  The reported bounds (``truncation_error``, ``abs_error``)
include a rounding floor :data:`RULE_RTOL`.  For analytic φ the head has
converged (relative Parseval tail < 1e-12) and its plain sums are used: their
results are unchanged (to rounding, ≤ 1e-15).

Errata found in the paper
-------------------------
* Defn E.44 / Thm 3.4 use c_{N,l} = (N−2)/(N+2l−2); for B = 3 (N = B−1 = 2)
  this is 0 for every l ≥ 1 (and 0/0 for l = 0), so the normalization of
  Thm 3.4 is undefined at B = 3; this module requires B ≥ 4.
* The relation Σ a_l² c_l⁻¹ C_l(1) = E φ² (Parseval) needs ‖C_l‖² = c_l C_l(1)
  in the *normalized* weight; with the unnormalized weight (1−x²)^{λ−1/2} of
  Defn E.40 the factor ω_{B−3}/ω_{B−2} of Lemma E.38 is missing.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
from scipy import special

from bnlab._validation import check_int, check_real, check_finite_array
from bnlab.activations import get_activation
from bnlab.theory._checks import check_batch_size
from bnlab.theory._quadrature.kinks import theta_cuts
from bnlab.theory._quadrature.rules import sin_power_panels, tanh_sinh_rule

__all__ = [
    "gegenbauer_coefficients",
    "gegenbauer_orthonormal_coefficients",
    "gegenbauer_basis_at",
    "normalized_gegenbauer",
    "gegenbauer_quadratic_form",
    "GegenbauerTruncationWarning",
    "SeriesMoments",
    "gegenbauer_series_moments",
    "oscillating_tail_bound",
    "RULE_RTOL",
]

DEFAULT_MAX_TERMS = 1024

#: Relative accuracy floor of the moments and of sums of coefficients on the quadrature rule, included in
#: the reported error bounds (measured: E f² for relu^1.5 at B = 1024 is 3.6e-13 from the closed form,
#: the same for the sphere route; ≤ 2e-14 for B ≤ 128).
RULE_RTOL = 1e-12


class GegenbauerTruncationWarning(UserWarning):
    """The Gegenbauer series of φ did not reach the requested Parseval tolerance."""


def _check_b(batch_size) -> int:
    b = check_int("batch_size", batch_size)
    if b != 3:
        b = check_batch_size(b)
    if b < 4:
        raise ValueError(
            f"batch_size={b} is not allowed for the Gegenbauer expansion: its normalization "
            "c_{B-1,l} = (B-3)/(B-3+2l) vanishes at B = 3 (Yang et al. 2019, Thm 3.4); use batch_size >= 4 "
            "or the spherical method"
        )
    return b


def _recurrence_beta(lam: float, n: int) -> np.ndarray:
    l = np.arange(1, n, dtype=np.float64)
    return l * (l + 2.0 * lam - 1.0) / (4.0 * (l + lam) * (l + lam - 1.0))


def normalized_gegenbauer(batch_size, n_terms, t) -> np.ndarray:
    """R_l(t) = C_l^{((B−3)/2)}(t)/C_l^{((B−3)/2)}(1), l = 0..n_terms−1; shape (n_terms,) + t.shape.

    Stable recurrence (l + 2λ) R_{l+1} = 2(l+λ) t R_l − l R_{l−1}, |R_l| ≤ 1 on [−1, 1].
    """
    b = _check_b(batch_size)
    n = check_int("n_terms", n_terms, minimum=1)
    return _normalized_gegenbauer(b, n, check_finite_array("t", t))


def _normalized_gegenbauer(b: int, n: int, t: np.ndarray) -> np.ndarray:
    """The kernel of :func:`normalized_gegenbauer` (B ≥ 4, n ≥ 1 and t already checked)."""
    lam = 0.5 * (b - 3)
    out = np.empty((n,) + t.shape)
    if t.size <= _SCALAR_RECURRENCE_POINTS:
        # a few points (the theory's ξ = −1/(B−1), or 1 and ξ): the same float64 operations in the same order on
        # Python floats, point by point, without the per-step cost of NumPy on tiny arrays
        flat = out.reshape(n, -1)
        for k, tk in enumerate(t.ravel().tolist()):
            flat[:, k] = _recurrence_at(tk, lam, n)
        return out
    out[0] = 1.0
    if n > 1:
        out[1] = t
    for l in range(1, n - 1):
        out[l + 1] = (2.0 * (l + lam) * t * out[l] - l * out[l - 1]) / (l + 2.0 * lam)
    return out


#: up to this many points :func:`_normalized_gegenbauer` runs its recurrence on Python floats
_SCALAR_RECURRENCE_POINTS = 4


def _recurrence_at(t: float, lam: float, n: int) -> list[float]:
    """R_0(t) … R_{n−1}(t) for one point by (l + 2λ) R_{l+1} = 2(l+λ) t R_l − l R_{l−1}."""
    out = [1.0, t][:n]
    for l in range(1, n - 1):
        out.append((2.0 * (l + lam) * t * out[l] - l * out[l - 1]) / (l + 2.0 * lam))
    return out


def _log_c_at_one_over_c(b: int, n: int) -> np.ndarray:
    """log(C_l(1)/c_{B−1,l}), l = 0..n−1, with C_l(1) = binom(l+2λ−1, l), c = λ/(λ+l)."""
    lam = 0.5 * (b - 3)
    l = np.arange(n, dtype=np.float64)
    log_c1 = special.gammaln(l + 2.0 * lam) - special.gammaln(l + 1.0) - special.gammaln(2.0 * lam)
    return log_c1 + np.log((lam + l) / lam)


def gegenbauer_basis_at(batch_size, n_terms, t) -> np.ndarray:
    """C_l^{((B−3)/2)}(t)/c_{B−1,l} for l = 0..n_terms−1 (the paper's basis functions of Thm 3.4).

    Computed as R_l(t) · C_l(1)/c_{B−1,l} with log-gamma normalizations.  These
    grow like binom(l+B−4, l) at t = ±1, so for large B·l they overflow; a
    ValueError says so (use :func:`normalized_gegenbauer` with the orthonormal
    coefficients instead, which never overflow).
    """
    b = _check_b(batch_size)
    r = _normalized_gegenbauer(b, check_int("n_terms", n_terms, minimum=1), check_finite_array("t", t))
    logs = _log_c_at_one_over_c(b, r.shape[0])
    if np.max(logs) > 700.0:
        raise ValueError(
            f"gegenbauer_basis_at(batch_size={b}, n_terms={r.shape[0]}) overflows float64 "
            f"(C_l(1)/c_l reaches e^{np.max(logs):.0f}); use normalized_gegenbauer with "
            "gegenbauer_orthonormal_coefficients"
        )
    return r * np.exp(logs).reshape((-1,) + (1,) * (r.ndim - 1))


def _level_for(n: int) -> int:
    # tanh-sinh middle spacing ≈ 1.23 h on a panel of length π/2; resolving P_l ~ cos(lθ)
    # needs h ≲ 1.3/l: take two more halvings for margin.
    return max(5, int(math.ceil(math.log2(max(n, 1) / 1.3))) + 2)


@dataclass(frozen=True)
class SeriesMoments:
    """Single-point moments of f(x) = φ(√(B−1)x) under μ_B, on the rule that gives the b_l.

    They are the exact values of the series that have no factor R_l(ξ) (orthonormality of P_l
    and the Sturm–Liouville form of the Gegenbauer operator):

    * ``second``    E f²            = Σ_l b_l²                                   (Parseval)
    * ``x_second``  E x² f²         = ‖J b‖² = Σ_l (β_l + β_{l+1}) b_l² + 2 Σ_l √(β_{l+1}β_{l+2}) b_l b_{l+2}
      (J the Jacobi matrix of the recurrence x P_l = √β_{l+1} P_{l+1} + √β_l P_{l−1})
    * ``dirichlet`` E (1−x²) f'(x)² = Σ_l l(l+B−3) b_l²   (l(l+B−3): eigenvalues of −Δ on S^{B−2};
      None unless requested, and inf when φ' is not square integrable, e.g. relu^α with α ≤ ½)

    Accuracy ≈1e-14 relative (tanh-sinh split at every kink of φ, see the module docstring).
    """

    second: float
    x_second: float
    dirichlet: float | None = None


def _dirichlet_moment(phi, b: int, level: int) -> float:
    """E_μ (1−x²) f'(x)², f(x) = φ(√(B−1)x), by tanh-sinh in the angular distance d = |θ − π/2| ∈ (0, π/2).

    A rule of its own because φ' may be singular at the kink: relu^α with ½ < α < 1 gives
    (1−x²)f'² ~ |x|^{2α−2}.  The coefficients' rule reaches only |x| ≳ 1e-17 (θ near π/2 rounds
    and its half-width stops there), which loses ∫_0^{1e-17} x^{2α−2} dx (5e-4 relative at α = 0.6).
    Here x = ±sin d and sin θ = cos d = sin(π/2 − d) are computed from the exact distances to
    both panel ends, and the half-width 6.1 lets the nodes reach d ≈ 1e-300 (nodes with weight
    < 1e-300 are dropped by the rule), so the lost mass is ≲ (1e-300)^{2α−1}; for regular
    integrands the rule is as accurate as the coefficients' one (both are double exponential).
    """
    t, one_minus_t, wt = tanh_sinh_rule(2.0 ** -level, 6.1)
    half = 0.5 * math.pi
    dist = half * t  # angular distance from the kink θ = π/2
    xabs = np.sin(dist)
    cos_d = np.sin(half * one_minus_t)  # = sin θ, accurate near θ = 0, π
    with np.errstate(divide="ignore"):
        lw = (b - 3.0) * np.log(cos_d)
    w = wt * np.exp(lw - np.max(lw))
    w = w / (2.0 * np.sum(w))  # the two panels x > 0, x < 0 carry the same weights
    scale = math.sqrt(b - 1.0)
    total = 0.0
    for sign in (1.0, -1.0):
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            fp = scale * phi.derivative(sign * scale * xabs)
            vals = w * (cos_d * cos_d) * fp * fp
        total += float(np.sum(np.where(w > 0.0, vals, 0.0)))
    return total


def _theta_panels(phi, b: int) -> np.ndarray:
    """Panel ends in θ: 0, π/2, π and θ_k = arccos(k/√(B−1)) for every kink k ≠ 0 of φ inside the range
    (:func:`bnlab.theory._quadrature.kinks.theta_cuts`), so that each panel's integrand is smooth."""
    return np.array(sorted({0.0, 0.5 * math.pi, math.pi, *theta_cuts(phi, math.sqrt(b - 1.0))}))


def _dirichlet_moment_panels(phi, b: int, ends: np.ndarray, level: int) -> float:
    """E_μ (1−x²) f'(x)² on tanh-sinh panels in θ ending at 0, π/2, π and the kinks of φ (φ' bounded
    or with a jump there: selu, relu(γx + β), ...; a φ' singular at a kink k ≠ 0 is resolved only to
    |x − k| ≈ 1e-16, see :mod:`bnlab.theory._quadrature.sphere`)."""
    theta, w = sin_power_panels(ends, b - 3.0, level)
    scale = math.sqrt(b - 1.0)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        fp = scale * phi.derivative(scale * np.cos(theta))
        vals = w * np.sin(theta) ** 2 * fp * fp
    return float(np.sum(np.where(w > 0.0, vals, 0.0)))


def _coefficients_on_rule(phi, b: int, n: int, level: int, *, dirichlet: bool = False) -> tuple[np.ndarray, SeriesMoments]:
    lam = 0.5 * (b - 3)
    ends = _theta_panels(phi, b)
    theta, w = sin_power_panels(ends, b - 3.0, level)
    x = np.cos(theta)
    scale = math.sqrt(b - 1.0)
    f = phi(scale * x)
    ff = w * f * f
    q = float(np.sum(ff))
    if not dirichlet:
        d = None
    elif ends.size > 3:  # kinks away from 0: φ' jumps there; panels ending at each kink
        d = _dirichlet_moment_panels(phi, b, ends, level + 1)
    else:
        d = _dirichlet_moment(phi, b, level)
    moments = SeriesMoments(q, float(np.sum(ff * x * x)), d)
    # P_l itself overflows near x = ±1 for large B·l (P_l(1)² = C_l(1)/c_l ~ binom(l+B−4, l),
    # e^{1400} at B = 1024, l = 1030), where the weight sin^{B−3}θ underflows: inf·0 = NaN.
    # The recurrence is linear, so run it on v_l = P_l √w instead: by the Christoffel bound
    # w_i Σ_{l<n} P_l(x_i)² ≲ 1, |v_l| ≲ 1 at every node and nothing overflows; nodes whose
    # weight underflows contribute ≲ √w·‖f‖ ≈ 0 exactly as they should.
    sw = np.sqrt(w)
    return _project(f * sw, sw, x, lam, n), moments


#: rows of v_l = P_l √w held at once by :func:`_project` (memory O(rows · nodes), not O(n · nodes))
_PROJECT_BLOCK = 64


def _project(fsw: np.ndarray, sw: np.ndarray, x: np.ndarray, lam: float, n: int) -> np.ndarray:
    """b_l = Σ_i (f √w)_i v_l(x_i), l < n, with v_l = P_l √w from the orthonormal three-term recurrence
    x P_l = √β_{l+1} P_{l+1} + √β_l P_{l−1}, run in place on blocks of rows, each block one matrix–vector
    product (the recurrence is sequential in l; the block keeps the per-row cost at three in-place operations)."""
    coeffs = np.empty(n)
    sb = np.sqrt(_recurrence_beta(lam, max(n, 2)))  # sb[l-1] = √β_l
    block = np.empty((min(n, _PROJECT_BLOCK), sw.size))
    prev, cur = None, sw
    for start in range(0, n, block.shape[0]):
        rows = block[: min(block.shape[0], n - start)]
        for j in range(rows.shape[0]):
            l = start + j
            if l == 0:
                rows[j] = sw
            elif l == 1:
                np.multiply(x, cur, out=rows[j])
                rows[j] /= sb[0]
            else:
                np.multiply(x, cur, out=rows[j])
                rows[j] -= sb[l - 2] * prev
                rows[j] /= sb[l - 1]
            prev, cur = cur, rows[j]
        coeffs[start : start + rows.shape[0]] = rows @ fsw
        # the next block overwrites these rows: keep the two the recurrence needs
        prev, cur = prev.copy(), cur.copy()
    return coeffs


def gegenbauer_series_moments(phi, batch_size, n_terms, *, dirichlet: bool = False) -> tuple[np.ndarray, SeriesMoments]:
    """(b_0 … b_{n−1}, :class:`SeriesMoments`) of φ(√(B−1)x), both from one quadrature rule.

    The moments sum the *tails* of the series without a factor R_l(ξ) exactly: e.g.
    Σ_{l≥n} b_l² = ``second`` − Σ_{l<n} b_l².  This is how the theory routes
    (:mod:`.fixed_point`, :mod:`.forward`, :mod:`.backward`, :mod:`.cross_batch`) handle
    φ with a kink, whose coefficients decay only algebraically (module docstring).
    ``dirichlet=True`` also evaluates E(1−x²)f'² (needs φ').
    """
    act = get_activation(phi)
    b = _check_b(batch_size)
    n = check_int("n_terms", n_terms, minimum=1)
    return _series_moments(act, b, n, dirichlet=dirichlet)


def _series_moments(act, b: int, n: int, *, dirichlet: bool = False) -> tuple[np.ndarray, SeriesMoments]:
    """The kernel of :func:`gegenbauer_series_moments` (φ resolved, B ≥ 4 and n checked)."""
    return _coefficients_on_rule(act, b, n, _level_for(n), dirichlet=dirichlet)


def oscillating_tail_bound(r_xi, tail) -> float:
    """Bound on |Σ_{l≥n} c_l R_l(ξ)| for Σ_{l≥n} |c_l| ≤ ``tail``, from R_0(ξ) … R_{n−1}(ξ).

    max_{l≥n} |R_l(ξ)| × tail, with the maximum over l ≥ n replaced by the maximum over the
    last quarter of the computed degrees.  Why that is safe: for l ≫ λ = (B−3)/2 the envelope
    of |R_l(cos θ)| decreases monotonically like l^{−λ} (sin θ)^{−λ} (Darboux's formula,
    Szegő, *Orthogonal Polynomials*, §8.21: C_l^{(λ)}(cos θ) = O(l^{λ−1}) while
    C_l^{(λ)}(1) ~ l^{2λ−1}/Γ(2λ)), and for l ≲ λ at ξ = −1/(B−1) it decreases faster still
    (measured |R_50(ξ)| ≈ 2e-23 at B = 128).  The oscillation of R_l(ξ) makes the true sum
    smaller (measured: the actual error of relu's λ_G↓ is 2e-3 of the resulting bound at B = 4,
    7e-4 at B = 8): a bound, not an estimate.
    """
    r = np.abs(np.asarray(r_xi, dtype=np.float64))
    k = max(1, r.size // 4)
    return float(np.max(r[-k:]) * abs(float(tail)))


def gegenbauer_orthonormal_coefficients(
    phi, batch_size, n_terms=None, *, rtol: float = 1e-12, max_terms: int = DEFAULT_MAX_TERMS
) -> np.ndarray:
    """b_l = E_{μ_B}[φ(√(B−1)x) P_l(x)] (orthonormal Gegenbauer coefficients), l = 0..n−1.

    Parameters and truncation as in :func:`gegenbauer_coefficients`; Σ_l b_l² = q* (Parseval).
    """
    coeffs, _q, _tail = _expansion(phi, batch_size, n_terms, rtol, max_terms)
    return coeffs


def _expansion(phi, batch_size, n_terms, rtol, max_terms):
    act = get_activation(phi)
    b = _check_b(batch_size)
    rtol = check_real("rtol", rtol, minimum=0.0, strict_minimum=True)
    max_terms = check_int("max_terms", max_terms, minimum=1)
    if n_terms is not None:
        n = check_int("n_terms", n_terms, minimum=1)
        coeffs, mom = _coefficients_on_rule(act, b, n, _level_for(n))
        q = mom.second
        tail = q - float(np.sum(coeffs**2))
        return coeffs, q, tail
    n = 32
    while True:
        n = min(n, max_terms)
        coeffs, mom = _coefficients_on_rule(act, b, n, _level_for(n))
        q = mom.second
        partial = np.cumsum(coeffs**2)
        tails = q - partial
        ok = np.nonzero(tails <= rtol * abs(q))[0]
        if ok.size or q == 0.0:
            k = int(ok[0]) + 1 if ok.size else 1
            return coeffs[:k], q, float(tails[k - 1])
        if n >= max_terms:
            rel = float(tails[-1] / q)
            warnings.warn(
                f"the Gegenbauer series of phi={act.spec!r} at batch_size={b} did not reach rtol={rtol:g}: "
                f"relative Parseval tail {rel:.2e} after max_terms={max_terms} terms (phi is not smooth "
                "enough for geometric convergence); quadratic forms built from these coefficients are "
                f"accurate to about {rel:.1e} relative",
                GegenbauerTruncationWarning,
                stacklevel=3,
            )
            return coeffs, q, float(tails[-1])
        n *= 2


def gegenbauer_coefficients(phi, batch_size, n_terms=None, *, rtol: float = 1e-12, max_terms: int = DEFAULT_MAX_TERMS):
    """Gegenbauer coefficients a_l of φ(√(B−1)x) in the normalization of Yang et al. 2019, Thm 3.4.

    φ(√(B−1)x) = Σ_l a_l (1/c_{B−1,l}) C_l^{((B−3)/2)}(x),  c_{B−1,l} = (B−3)/(B−3+2l).

    Parameters
    ----------
    phi : activation spec
    batch_size : int, ≥ 4
    n_terms : int or None
        Number of coefficients; None chooses the smallest n whose relative
        Parseval tail is ≤ ``rtol`` (up to ``max_terms``, else a
        :class:`GegenbauerTruncationWarning` states the tail reached).
    rtol : float
        Relative Parseval tolerance for the automatic truncation.
    max_terms : int
        Cap on the automatic truncation.

    Returns
    -------
    ndarray of shape (n,)
        a_0 … a_{n−1}.  For large B·l these are tiny (a_l = b_l √(c_l/C_l(1)));
        for the quadratic forms of the theory prefer
        :func:`gegenbauer_orthonormal_coefficients` + :func:`normalized_gegenbauer`
        (or :func:`gegenbauer_quadratic_form`).

    Accuracy
    --------
    Each coefficient to ≈1e-14 ‖φ‖ (quadrature); truncation as described in the module docstring.

    References
    ----------
    Yang et al. 2019, Thm 3.4, App. E.4 (Defn E.40–E.44), Thm F.13.
    """
    b = _check_b(batch_size)
    coeffs, _q, _tail = _expansion(phi, b, n_terms, rtol, max_terms)
    logs = _log_c_at_one_over_c(b, coeffs.size)
    return coeffs * np.exp(-0.5 * logs)


def gegenbauer_quadratic_form(coefficients, batch_size, t, *, orthonormal: bool = True) -> np.ndarray:
    """Σ_l a_l² (1/c_{B−1,l}) C_l(t) = Σ_l b_l² R_l(t), vectorized over t.

    ``coefficients`` are the orthonormal b_l (default) or the paper's a_l
    (``orthonormal=False``).  With t = 1 and t = −1/(B−1) this gives q* and q*c*
    (Thm 3.4).
    """
    b = _check_b(batch_size)
    c = check_finite_array("coefficients", coefficients, ndim=1)
    if not orthonormal:
        c = c * np.exp(0.5 * _log_c_at_one_over_c(b, c.size))
    if c.size == 0:
        raise ValueError("coefficients is not allowed: expected at least one coefficient")
    t = check_finite_array("t", t)
    return _quadratic_form(c, b, t)


def _quadratic_form(c: np.ndarray, b: int, t: np.ndarray) -> np.ndarray:
    """The kernel of :func:`gegenbauer_quadratic_form`: Σ_l c_l² R_l(t) for orthonormal c (all checked)."""
    return np.tensordot(c * c, _normalized_gegenbauer(b, c.size, t), axes=(0, 0))


# ---------------------------------------------------------------------------
# the series of the dynamics (forward, backward, cross-batch Gegenbauer routes)
# ---------------------------------------------------------------------------
def _log_harmonic_dimension(l: np.ndarray, batch_size: int) -> np.ndarray:
    """log N_l with N_l = c_{B−1,l}⁻¹ C_l^{((B−3)/2)}(1) = (B−3+2l)/(B−3) · (B−3)_l / l!
    (the dimension of degree-l spherical harmonics on S^{B−2}); B = 3: N_0 = 1, N_l = 2.

    Kept in log form (N_l overflows float64 for large B·l); the same quantity as
    :func:`_log_c_at_one_over_c` with the B = 3 case.
    """
    l = np.asarray(l, dtype=np.float64)
    if batch_size == 3:
        return np.where(l == 0, 0.0, math.log(2.0))
    lam2 = batch_size - 3.0
    logc1 = special.gammaln(l + lam2) - special.gammaln(lam2) - special.gammaln(l + 1.0)
    return np.log((lam2 + 2.0 * l) / lam2) + logc1


def _chebyshev_coefficients(act, n_terms: int, n_nodes: int | None = None) -> tuple[np.ndarray, SeriesMoments]:
    """B = 3 only: b_l = E[φ(√2 cos θ) P_l(cos θ)] with θ uniform on [0, π] and the
    orthonormal P_0 = 1, P_l = √2 cos(lθ) (the core refuses B = 3), and the moments
    E f², E x² f² on the same rule (see :class:`SeriesMoments`).

    Gauss–Legendre on θ ∈ [0, π/2] and [π/2, π] separately, so a kink of φ at 0
    (θ = π/2) sits on a panel edge and the rule converges geometrically on each
    panel; n_nodes ≥ 2 n_terms + 200 resolves cos(lθ) for l < n_terms.
    """
    if n_nodes is None:
        n_nodes = max(2 * n_terms + 200, 400)
    x, w = special.roots_legendre(n_nodes)
    half = 0.25 * math.pi
    theta = np.concatenate([half * (x + 1.0), half * (x + 1.0) + 2.0 * half])
    wt = np.concatenate([w, w]) * half / math.pi  # uniform probability on [0, π]
    fx = act(math.sqrt(2.0) * np.cos(theta))
    f = fx * wt
    l = np.arange(n_terms, dtype=np.float64)
    out = np.cos(np.outer(l, theta)) @ f
    out[1:] *= math.sqrt(2.0)
    ff = f * fx
    return out, SeriesMoments(float(np.sum(ff)), float(np.sum(ff * np.cos(theta) ** 2)))


#: The head of a series counts as converged when its relative Parseval tail is below this; then the
#: truncated sums are used as they are (bit-identical to the plain series for analytic φ, whose
#: coefficients decay geometrically), otherwise the tails are summed through the moments.
_CONVERGED_PARSEVAL_RTOL = 1e-12


@dataclass(frozen=True)
class _GegenbauerSeries:
    """Head (l < n) of the Gegenbauer series of φ on the batchnorm sphere and the moments that sum its tails.

    a: the paper's coefficients, φ(√(B−1)x) = Σ a_l c_{B−1,l}⁻¹ C_l^{((B−3)/2)}(x) (Thm 3.4);
    logn: log N_l; coef: the orthonormal b_l = a_l √N_l; pxi: R_l(ξ) = C_l(ξ)/C_l(1) at
    ξ = −1/(B−1); moments: E f², E x² f², E(1−x²)f'² (:class:`SeriesMoments`);
    summed: whether the head is unconverged, so that :meth:`single_point` returns the moment.

    Why this sums the tails (Yang et al. 2019, Thms 3.4, 3.8, 3.9, F.13, F.22, F.24, G.5).  Every
    series of the theory is a quadratic form in b whose weights split into a *single-point* part
    (no R_l(ξ)) and a *two-point* part (a factor R_l(ξ) or R_{l+2}(ξ), from the addition theorem
    E_v F(ê_1·v)H(ê_2·v) = Σ_l F_l H_l R_l(ξ)).  The single-point part is a moment of one
    coordinate, E_μ[f² p(x)] or E_μ[(1−x²)f'²], which the quadrature rule of the coefficients gives
    to 1e-14 whatever the smoothness of φ; the two-point part converges like |R_l(ξ)| b_l² l^k,
    with |R_l(ξ)| ≲ l^{−(B−3)/2} (far faster for l ≲ B).  For φ with a kink b_l² ~ l^{−4} only once
    l ≫ B (relu: b_l² l⁴ is still growing at l = 800 for B = 1024), so the plain sums converge like
    n^{−3} (Parseval) and n^{−1} (Σ l(l+B−3) b_l²) from a large constant and no power-law tail model
    is asymptotic at affordable n for large B; the moments need no model.
    """

    a: np.ndarray
    logn: np.ndarray
    coef: np.ndarray
    pxi: np.ndarray
    moments: SeriesMoments
    summed: bool

    def single_point(self, head_sum: float, moment: float) -> float:
        """The full single-point series: its moment when the head is unconverged, else the head's sum."""
        return float(moment) if self.summed else float(head_sum)

    def two_point_bound(self, tail: float) -> float:
        """Bound on the neglected two-point tail Σ_{l≥n} c_l R_l(ξ), given Σ_{l≥n} |c_l| ≤ ``tail``
        (:func:`oscillating_tail_bound`)."""
        return oscillating_tail_bound(self.pxi, tail)

    @property
    def parseval_tail(self) -> float:
        """Σ_{l≥n} b_l² = E f² − Σ_{l<n} b_l² (≥ 0 up to rounding)."""
        return max(self.moments.second - float(np.sum(self.coef**2)), 0.0)


def _dynamics_series(act, batch_size: int, n_terms: int, *, dirichlet: bool = False) -> _GegenbauerSeries:
    """The first ``n_terms`` Gegenbauer coefficients of φ(√(B−1)x) with their moments (:class:`_GegenbauerSeries`).

    b_l from :func:`gegenbauer_series_moments` (B ≥ 4) or the Chebyshev
    special case (B = 3, where the core's normalization c_{B−1,l} = (B−3)/(B−3+2l) vanishes);
    R_l(ξ) from :func:`normalized_gegenbauer`.  ``dirichlet`` also
    evaluates E(1−x²)f'² (B ≥ 4).  Accuracy: that of the core, ≈1e-14 ‖φ‖ per coefficient and
    ≈1e-14 relative for the moments.
    """
    b = batch_size
    l = np.arange(n_terms)
    logn = _log_harmonic_dimension(l, b)
    xi = -1.0 / (b - 1)
    if b == 3:
        bcoef, mom = _chebyshev_coefficients(act, n_terms)
        pxi = np.cos(l * math.acos(xi))  # P_l = T_l (λ = 0)
    else:
        bcoef, mom = _series_moments(act, b, n_terms, dirichlet=dirichlet)
        pxi = _normalized_gegenbauer(b, n_terms, np.array(xi))
    a = bcoef * np.exp(-0.5 * logn)
    head = float(np.sum(bcoef**2))
    summed = mom.second - head > _CONVERGED_PARSEVAL_RTOL * abs(mom.second)
    return _GegenbauerSeries(a, logn, bcoef, pxi, mom, bool(summed))
