"""B = 3 with kinks away from 0: the spherical routes' circle rule is cut at every kink.

At B = 3 the batchnorm sphere is a circle, u(θ) = cos θ e_1 + sin θ e_2 with e_1, e_2 an orthonormal basis of the
sum-zero plane of R³, θ uniform (Yang et al. 2019, Thm 3.3), so every mean-field quantity is a 1-D integral in θ.
The reference here integrates those with scipy's adaptive ``quad`` between breakpoints at every θ where some
√3 u_i(θ) is a kink of φ: independent of bnlab's rules (only φ and φ' are bnlab's).  Before the fix the B = 3
rule was cut at u_1 = 0 and u_2 = 0 only, and a kink at k ≠ 0 fell inside an arc: λ_M̃ of relu(x + 1) was
0.799605 against 0.779017 (2.6 %), λ_L↑ and c_CB* ≈ 4e-4 off.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.integrate import quad

from bnlab.activations import get_activation
from bnlab.theory import analyze

_E1 = np.array([1.0, -1.0, 0.0]) / math.sqrt(2.0)
_E2 = np.array([1.0, 1.0, -2.0]) / math.sqrt(6.0)
_G = np.eye(3) - 1.0 / 3.0
_DL = _G @ np.diag([1.0, -1.0, 0.0]) @ _G  # a unit direction of the L eigenspace (App. F.3)


def _u(t):
    return math.cos(t) * _E1 + math.sin(t) * _E2


def _circle_reference(act) -> dict[str, float]:
    """q*, c*, λ_L↑, c_CB*/q*, λ_M̃ at B = 3 by adaptive quadrature on the circle, breakpoints at all kinks.

    λ_L↑ = ⟨D_L, dV[D_L]⟩/(μ*‖D_L‖²) with dV from the pathwise derivative dy = J D_L u/... (App. F.3.1);
    λ_M̃ = (√3 E‖Gh‖⁻¹ E tr(GJG)/(B−1))² with E‖g‖⁻¹ = √(π/2)/√μ* for χ_2 (§3.2, Thm 3.11)."""
    pts = {0.0, 2.0 * math.pi}
    for i in range(3):
        rad, ph = math.hypot(_E1[i], _E2[i]), math.atan2(_E2[i], _E1[i])
        for k in [*act.kinks, 0.0]:
            c = k / (math.sqrt(3.0) * rad)
            if abs(c) < 1.0:
                pts.update(((ph + math.acos(c)) % (2 * math.pi), (ph - math.acos(c)) % (2 * math.pi)))
    pts = sorted(pts)

    def mean(f):
        return sum(quad(f, a, b, limit=400, epsabs=1e-15, epsrel=1e-14)[0] for a, b in zip(pts[:-1], pts[1:])) / (
            2.0 * math.pi)

    def y(t):
        return np.asarray(act(math.sqrt(3.0) * _u(t)), dtype=np.float64)

    def dphi(t):
        return np.asarray(act.derivative(math.sqrt(3.0) * _u(t)), dtype=np.float64)

    q = mean(lambda t: y(t)[0] ** 2)
    qc = mean(lambda t: y(t)[0] * y(t)[1])
    mu = q - qc

    def l_num(t):
        u = _u(t)
        du = _DL @ u
        return y(t) @ _DL @ (math.sqrt(3.0) * dphi(t) * (du - (u @ du) * u))

    lam_l = mean(l_num) / (mu * (_DL * _DL).sum())
    m = mean(lambda t: y(t)[0])
    e = mean(lambda t: dphi(t)[0] * (2.0 / 3.0 - _u(t)[0] ** 2))
    p = math.sqrt(3.0) * math.sqrt(math.pi / 2.0) * 3.0 * e / (math.sqrt(mu) * 2.0)
    return dict(q=q, c=qc / q, lamL=lam_l, cCB=m * m / q, xrate=p * p)


@pytest.mark.parametrize(
    "name, params",
    [("relu", dict(beta=1.0)), ("relu", dict(beta=0.5)), ("relu", dict(beta=-0.5)), ("relu", dict(gamma=2.0, beta=0.5)),
     ("leaky_relu", dict(slope=0.1, beta=0.5)), ("selu", {}), ("relu(x - 0.3) + 0.1*x", {})],
)
def test_b3_kinked_matches_circle_quadrature(name, params):
    """Tolerance 1e-11 relative (c_CB* relative to q*): the circle rule's measured error is ≤ 3.4e-15 (step 1/12,
    `_CIRCLE_STEP`) and scipy's quad with breakpoints at the kinks reaches its epsrel 1e-14 on these piecewise
    analytic integrands (the two agree to ≤ 3.4e-15); 1e-11 leaves room for both and is 10⁷ below the defect
    (λ_M̃ 1.5–3.7 %, λ_L↑ and c_CB* ≥ 6e-6 relative at B = 3 before the fix)."""
    act = get_activation(name, **params)
    ref = _circle_reference(act)
    r = analyze(act, 3)
    got = dict(q=r.q_star, c=r.c_star, lamL=r.forward_lambda_L, cCB=r.cross_batch_c_star / r.q_star,
               xrate=r.cross_batch_rate)
    for key, val in ref.items():
        scale = 1.0 if key == "cCB" else abs(val)
        assert abs(got[key] - val) <= 1e-11 * scale, (key, got[key], val)


def test_b3_singular_derivative_rate_exact_distance():
    """relu^0.6 at B = 3: λ_M̃ integrates φ'(√3 u_1) ~ |u_1|^{−0.4} up to the kink at 0.  The circle rule computes
    u_i near a cut at a kink at 0 as ∓R_i sin d (exact to relative rounding); from cos of a rounded angle, |u_1| is
    never below ≈1e-16 there and ∫_0^{1e-16} |u|^{−0.4} du ≈ 2.5e-10 was lost (measured 1.6e-9 before).

    Reference: E φ'(√3 u_1)(2/3 − u_1²) in ψ with u_1 = √(2/3) cos ψ (ψ uniform): the singular factor
    (π/2 − ψ)^{−0.4} is taken by quad's algebraic weight, so the remaining integrand is analytic (quad to its epsrel 1e-13; it agrees with a 30-digit mpmath
    quadrature of the same mean to ~1e-16).
    Tolerance 1e-12 relative: both sides ≤ 1e-13, the defect 1.6e-9."""
    alpha = 0.6
    act = get_activation("alpha_relu", alpha=alpha)
    rad = math.sqrt(2.0 / 3.0)

    def smooth_part(v):  # ψ = π/2 − v, v ∈ (0, π/2]: φ'(√3 R cos ψ) = α (√3 R sin v)^{α−1}
        sv = math.sin(v)
        ratio = (sv / v) ** (alpha - 1.0) if v > 0 else 1.0
        return alpha * (math.sqrt(3.0) * rad) ** (alpha - 1.0) * ratio * (2.0 / 3.0 - (rad * sv) ** 2)

    # ψ ∈ (−π/2, π/2) where u_1 > 0, symmetric in ψ: E = 2/(2π) ∫_0^{π/2} v^{α−1} smooth(v) dv
    integral = quad(smooth_part, 0.0, math.pi / 2.0, weight="alg", wvar=(alpha - 1.0, 0.0), epsabs=0.0,
                    epsrel=1e-13, limit=200)[0]
    e = integral / math.pi
    r = analyze(act, 3)
    mu = r.q_star * (1.0 - r.c_star)  # closed fixed point (Thm F.8), ≤ 1e-15
    p = math.sqrt(3.0) * math.sqrt(math.pi / 2.0) * 3.0 * e / (math.sqrt(mu) * 2.0)
    assert r.cross_batch_rate == pytest.approx(p * p, rel=1e-12, abs=0.0)
