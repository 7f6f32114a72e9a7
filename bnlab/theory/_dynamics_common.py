"""Private helpers shared by the dynamics modules (forward, backward, cross_batch).

The Gegenbauer coefficients themselves come from the core module
:mod:`bnlab.theory.gegenbauer` (public, separately tested); what lives here is
only what the dynamics need on top of it:

* :func:`_gegenbauer_energy` — the coefficients in both normalizations, log N_l
  and P_l(−1/(B−1)) in one call (B ≥ 4 through the core; B = 3, where the core's
  normalization c_{B−1,l} = (B−3)/(B−3+2l) vanishes, by the Chebyshev special case);
* :func:`_gegenbauer_series` — Aitken/Richardson extrapolation of truncated
  series for φ with a kink (algebraic coefficient decay);
* :func:`_relu_arccos_kernel` — J_1 and J_1' of relu through
  :func:`bnlab.theory.vphi.alpha_relu_kernel`.

Measured agreement of the core's coefficients with the former dynamics-private
Gauss–Jacobi quadrature (relu, tanh, sin, gelu, alpha_relu(0.5); B = 4, 8, 32,
128, 1024; 50 to 1603 terms): max |Δb_l| / ‖b‖ ≤ 1e-11 wherever the old one was
finite; the core's Parseval residual is ≤ 1e-15 for tanh at B = 32, 128 where
the old quadrature overshot by 2e-11, and the old Gauss–Jacobi rule returned
NaN at B = 1024 with ≥ 403 terms (scipy's roots_jacobi fails for large
exponents), which the core does not.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import special

from bnlab.theory.gegenbauer import gegenbauer_orthonormal_coefficients, normalized_gegenbauer
from bnlab.theory.vphi import alpha_relu_kernel

__all__: list[str] = []


def _log_harmonic_dimension(l: np.ndarray, batch_size: int) -> np.ndarray:
    """log N_l with N_l = c_{B−1,l}⁻¹ C_l^{((B−3)/2)}(1) = (B−3+2l)/(B−3) · (B−3)_l / l!
    (the dimension of degree-l spherical harmonics on S^{B−2}); B = 3: N_0 = 1, N_l = 2.

    Kept in log form (N_l overflows float64 for large B·l); the core module has the
    same quantity only privately (:func:`bnlab.theory.gegenbauer._log_c_at_one_over_c`)
    and without the B = 3 case.
    """
    l = np.asarray(l, dtype=np.float64)
    if batch_size == 3:
        return np.where(l == 0, 0.0, math.log(2.0))
    lam2 = batch_size - 3.0
    logc1 = special.gammaln(l + lam2) - special.gammaln(lam2) - special.gammaln(l + 1.0)
    return np.log((lam2 + 2.0 * l) / lam2) + logc1


def _chebyshev_coefficients(act, n_terms: int, n_nodes: int | None = None) -> np.ndarray:
    """B = 3 only: b_l = E[φ(√2 cos θ) P_l(cos θ)] with θ uniform on [0, π] and the
    orthonormal P_0 = 1, P_l = √2 cos(lθ) (the core refuses B = 3).

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
    f = act(math.sqrt(2.0) * np.cos(theta)) * wt
    l = np.arange(n_terms, dtype=np.float64)
    out = np.cos(np.outer(l, theta)) @ f
    out[1:] *= math.sqrt(2.0)
    return out


def _gegenbauer_energy(act, batch_size: int, n_terms: int):
    """(a_l, log N_l, b_l = a_l √N_l, P_l(−1/(B−1))) for l < n_terms.

    a_l: the paper's coefficients, φ(√(B−1)x) = Σ a_l c_{B−1,l}⁻¹ C_l^{((B−3)/2)}(x)
    (Yang et al. 2019, Thm 3.4); b_l: the orthonormal ones
    (:func:`bnlab.theory.gegenbauer.gegenbauer_orthonormal_coefficients`); P_l = C_l/C_l(1)
    (:func:`bnlab.theory.gegenbauer.normalized_gegenbauer`).  Accuracy: that of the core,
    ≈1e-14 ‖φ‖ per coefficient.
    """
    b = batch_size
    l = np.arange(n_terms)
    logn = _log_harmonic_dimension(l, b)
    xi = -1.0 / (b - 1)
    if b == 3:
        bcoef = _chebyshev_coefficients(act, n_terms)
        pxi = np.cos(l * math.acos(xi))  # P_l = T_l (λ = 0)
    else:
        bcoef = gegenbauer_orthonormal_coefficients(act, b, n_terms)
        pxi = normalized_gegenbauer(b, n_terms, np.array(xi))
    a = bcoef * np.exp(-0.5 * logn)
    return a, logn, bcoef, pxi


def _default_terms(act, batch_size: int) -> int:
    # smooth φ: coefficients decay geometrically; kinks (homogeneous φ) decay algebraically and
    # the truncated sums are extrapolated (see _gegenbauer_series)
    return 400 if act.homogeneity is not None else 160


def _gegenbauer_series(fn, act, n_terms: int, richardson_orders: tuple[int, ...] | None = None):
    """fn(n_terms) for smooth φ; for φ with a kink at 0 (positive-homogeneous) the truncation
    error of the series is algebraic, e ≈ C n^{−p} (measured p ≈ 1 for relu), so the values at
    n, 2n, 4n terms are combined by Aitken's Δ² (exact for e = C n^{−p}): relative error
    ≈ 1e-9 for relu at B ≤ 32 with n = 400 (vs 1e-3 for the raw sum)."""
    if act.homogeneity is None:
        return fn(n_terms)
    s0, s1, s2 = (np.asarray(fn(k * n_terms), dtype=np.float64) for k in (1, 2, 4))
    if richardson_orders == (1, 2):
        # known expansion e = C₁/n + C₂/n² (e.g. λ_G↓ for φ' with a jump): eliminate both terms
        out = (8.0 * s2 - 6.0 * s1 + s0) / 3.0
        return tuple(out.tolist()) if out.ndim else float(out)
    d1, d2 = s1 - s0, s2 - s1
    den = d2 - d1
    safe = np.abs(den) > 1e-300
    out = np.where(safe, s2 - d2 * d2 / np.where(safe, den, 1.0), s2)
    return tuple(out.tolist()) if out.ndim else float(out)


def _relu_arccos_kernel(c: float) -> tuple[float, float]:
    """J_1(c) = (√(1−c²) + (π − arccos c) c)/π and J_1'(c) = (π − arccos c)/π (Cho & Saul 2009),
    as 2 k_1(c) and 2 k_0(c) with k_α = :func:`bnlab.theory.vphi.alpha_relu_kernel`
    (c_1 = 1/2; Price: k_1' = k_0).  Agrees with the elementary form to 2e-16 at c = −1/(B−1)."""
    return 2.0 * float(alpha_relu_kernel(1.0, c)), 2.0 * float(alpha_relu_kernel(0.0, c))
