"""Independent reference values of the mean field theory, for the simulator's tests.

Closed forms from Yang et al. 2019 (each verified against a second route in
tests/sim/test_reference.py) and a Gegenbauer-quadrature route (Thm 3.4, 3.9)
for non-homogeneous φ.  They are deliberately computed here, apart from
bnlab.theory, so that the simulator is checked against formulas it shares no
code with.
"""
from __future__ import annotations

import math

import numpy as np
from scipy import special


def arccos_kernel(c):
    """J_1(c) = (sqrt(1−c²) + (π − arccos c)c)/π (Cho & Saul 2009; Yang et al. 2019 Thm 3.5)."""
    c = np.asarray(c, dtype=np.float64)
    return (np.sqrt(1 - c * c) + (np.pi - np.arccos(c)) * c) / np.pi


def arccos_kernel_derivative(c):
    return (np.pi - np.arccos(np.asarray(c, dtype=np.float64))) / np.pi


def relu_bsb1(b: int) -> tuple[float, float]:
    """(q*, c*) for relu (Thm 3.5)."""
    return 0.5, float(arccos_kernel(-1.0 / (b - 1)))


def relu_grad_rate(b: int) -> float:
    """λ_G for relu (Thm 3.10, Eq. 19)."""
    c = -1.0 / (b - 1)
    return float(((b - 1 + arccos_kernel_derivative(c)) / (1 - arccos_kernel(c)) - 1) / (b - 3))


def identity_grad_rate(b: int) -> float:
    """λ_G for φ = id: (B−2)/(B−3) (Thm 3.9/3.10)."""
    return (b - 2) / (b - 3)


def _pochhammer_sq(b: int) -> float:
    # P(B/2, 1/2)² with P(a, x) = Γ(a + x)/Γ(a)
    return math.exp(2 * (special.gammaln(b / 2 + 0.5) - special.gammaln(b / 2)))


def identity_cross_batch_rate(b: int) -> float:
    """λ_M̃ for φ = id: (B−1)/2 · P(B/2, 1/2)^−2 (Thm 3.11 / Cor. I.6)."""
    return (b - 1) / 2 / _pochhammer_sq(b)


def relu_cross_batch_rate(b: int) -> float:
    """λ_M̃ for relu from Thm H.14 with α = 1, J_φ = J_1:
    (B/(B−1)) P((B−1)/2, 1) J'(0) / (P(B/2, 1/2)² (J(1) − J(−1/(B−1)))), P((B−1)/2, 1) = (B−1)/2."""
    return (b / 4) / (_pochhammer_sq(b) * (1 - float(arccos_kernel(-1.0 / (b - 1)))))


def gegenbauer_theory(phi, b: int, *, lmax: int = 120, nodes: int = 1500) -> dict:
    """q*, c* (Thm 3.4), λ_G (Thm 3.9) and λ_M̃ (Thm 3.11) by Gauss–Gegenbauer quadrature.

    φ(√(B−1)x) = Σ_l A_l C_l^{(λ)}(x), λ = (B−3)/2, A_l = a_l / c_{B−1,l},
    c_{B−1,l} = λ/(λ+l).  Exponentially accurate for analytic φ (tanh); for relu
    the kink at 0 limits it to ~1e-3 at these sizes (checked in test_reference.py).
    """
    lam = (b - 3) / 2
    x, w = special.roots_gegenbauer(nodes, lam)
    f = phi(math.sqrt(b - 1) * x)
    ls = np.arange(lmax + 1)
    logh = (
        math.log(math.pi)
        + (1 - 2 * lam) * math.log(2)
        + special.gammaln(ls + 2 * lam)
        - special.gammaln(ls + 1)
        - np.log(ls + lam)
        - 2 * special.gammaln(lam)
    )
    cl = np.array([special.eval_gegenbauer(int(l), lam, x) for l in ls])  # (lmax+1, nodes)
    A = (cl * (w * f)).sum(1) / np.exp(logh)
    c_norm = lam / (lam + ls)
    a = A * c_norm
    rho = -1.0 / (b - 1)
    c1 = special.eval_gegenbauer(ls, lam, 1.0)
    crho = special.eval_gegenbauer(ls, lam, rho)
    q = float(np.sum(a**2 / c_norm * c1))
    qc = float(np.sum(a**2 / c_norm * crho))
    r = (c1 - crho) / c_norm
    grad = float(np.sum((ls + b - 3) / (b - 3) * ls * a**2 * r) / np.sum(a**2 * r))
    pb = math.exp(special.gammaln(b / 2 + 0.5) - special.gammaln(b / 2))
    cross = float(0.5 * a[1] ** 2 * pb**-2 * b * (b - 1) / np.sum(a**2 * r))
    return {"q_star": q, "c_star": qc / q, "grad_rate": grad, "cross_rate": cross}
