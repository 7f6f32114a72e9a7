"""Backward eigenvalues and the gradient explosion rate (Yang et al. 2019, Thms 3.9, 3.10, G.5, G.12, App. G.1.1, L).

Routes: closed forms (Thm 3.10 / Eq. 19 and Thm G.12 for relu; identity from
the sphere's fourth moments), spherical integration + Thm E.62 (with the
[12|13]/[12|31] erratum fixed), the Gegenbauer series of Thm 3.9, bnlab's
Monte Carlo of the sphere, and a direct Monte Carlo of E[Jᵀ Δ J] with
J = dB_φ/dh from torch autograd on h ~ N(0, Σ*) (no spherical reduction).

Tolerances: closed vs sphere 1e-9 (quadrature ≈1e-11); Gegenbauer 1e-6 where
its extrapolated truncation error (measured ≤ 4e-8 for relu at B ≤ 8, 7e-7 at
B = 32; ≈1e-12 for smooth φ) allows; Monte Carlo: 3 standard errors.
"""
import math

import numpy as np
import pytest

from bnlab.activations import get_activation

try:  # the direct routes live in test_forward.py (works with and without tests/theory/__init__.py)
    from .test_forward import backward_eigen_autograd, eigen_directions
except ImportError:
    from test_forward import backward_eigen_autograd, eigen_directions
from bnlab.theory import backward_eigenvalues, gradient_explosion_rate, weight_gradient_norms
from bnlab.theory.ultrasymmetric import dense_ultrasymmetric_operator, bracket_pattern

BATCHES = [4, 5, 8, 32, 128]


@pytest.mark.parametrize("b", BATCHES)
@pytest.mark.parametrize("name", ["relu", "identity"])
def test_closed_forms_agree_with_sphere(name, b):
    closed = backward_eigenvalues(name, b, method="closed")
    sphere = backward_eigenvalues(name, b, method="sphere")
    for f in ("lambda_G", "lambda_L", "lambda_M"):
        assert getattr(closed, f) == pytest.approx(getattr(sphere, f), rel=1e-9), f


@pytest.mark.parametrize("b", BATCHES)
@pytest.mark.parametrize("name,kw", [("relu", {}), ("alpha_relu", {"alpha": 1.5}), ("leaky_relu", {"slope": 0.2})])
def test_laplace_thm_g12_vs_sphere(name, kw, b):
    act = get_activation(name, **kw)
    if not (b - 1) / 2 > act.homogeneity:  # outside Thm F.33/G.12's assumption: a clear refusal
        with pytest.raises(ValueError, match="needs"):
            backward_eigenvalues(act, b, method="laplace")
        return
    lap, sphere = backward_eigenvalues(act, b, method="laplace"), backward_eigenvalues(act, b, method="sphere")
    for f in ("lambda_G", "lambda_L", "lambda_M"):
        assert getattr(lap, f) == pytest.approx(getattr(sphere, f), rel=1e-9), f


@pytest.mark.parametrize("b", [4, 5, 8, 32])
def test_relu_rate_gegenbauer(b):
    closed = gradient_explosion_rate("relu", b, method="closed")
    assert gradient_explosion_rate("relu", b, method="gegenbauer") == pytest.approx(closed, rel=1e-6)


@pytest.mark.slow
def test_relu_rate_gegenbauer_b128():
    closed = gradient_explosion_rate("relu", 128, method="closed")
    assert gradient_explosion_rate("relu", 128, method="gegenbauer") == pytest.approx(closed, rel=2e-5)


@pytest.mark.slow
def test_relu_rate_gegenbauer_b128_reaches_1e6_with_more_terms():
    # The relu kink makes the Gegenbauer series converge algebraically (tail ~ n^-2 after extrapolation):
    # measured 2.1e-5 at the default 400 terms, 1.7e-6 at 1000 and 2.3e-7 at 2000 (≈65 s). So 2000 terms
    # give the second numerical route (beside the sphere, 1e-12) at the 1e-6 for B = 128, and a
    # wrong coefficient or extrapolation would miss it by orders of magnitude.
    closed = backward_eigenvalues("relu", 128, method="closed").lambda_G
    series = backward_eigenvalues("relu", 128, method="gegenbauer", n_terms=2000).lambda_G
    assert series == pytest.approx(closed, rel=1e-6)


def test_identity_rate_is_exactly_b_minus_2_over_b_minus_3():
    for b in (4, 5, 8, 32, 128, 1000):
        expected = (b - 2) / (b - 3)
        assert gradient_explosion_rate("identity", b) == pytest.approx(expected, rel=1e-15)
        if b in (4, 32):  # one Gegenbauer coefficient: two B suffice
            assert gradient_explosion_rate("identity", b, method="gegenbauer") == pytest.approx(expected, rel=1e-12)
    for b in (4, 8, 128):
        assert gradient_explosion_rate("identity", b, method="sphere") == pytest.approx((b - 2) / (b - 3), rel=1e-11)


def test_relu_rate_decreases_to_pi_over_pi_minus_1():
    rates = [gradient_explosion_rate("relu", b) for b in (4, 8, 32, 128, 1024, 10**4, 10**6)]
    assert all(x > y for x, y in zip(rates, rates[1:]))
    # Eq. 19 expands as π/(π−1) + O(1/B): at B = 10⁶ the gap is below 1e-5
    assert rates[-1] == pytest.approx(math.pi / (math.pi - 1), abs=1e-5)
    assert rates[-1] > math.pi / (math.pi - 1)


@pytest.mark.parametrize("name", ["tanh", "sin", "gelu", "sigmoid"])
@pytest.mark.parametrize("b", [4, 8, 32, 128])
def test_smooth_phi_sphere_vs_gegenbauer(name, b):
    sphere = gradient_explosion_rate(name, b, method="sphere")
    assert sphere == pytest.approx(gradient_explosion_rate(name, b, method="gegenbauer"), rel=1e-6)
    assert sphere > 1.0  # Thm 3.9: explosion for every non-constant φ


@pytest.mark.parametrize("name", ["tanh", "relu"])
def test_montecarlo_within_three_standard_errors(name):
    ref = backward_eigenvalues(name, 8, method="sphere")
    mc = backward_eigenvalues(name, 8, method="montecarlo", n_samples=60_000, seed=3)
    for i, f in enumerate(("lambda_G", "lambda_L", "lambda_M")):
        assert abs(getattr(mc, f) - getattr(ref, f)) < 3 * mc.stderr[i], f


@pytest.mark.parametrize("name,b", [("tanh", 6), ("relu", 5), ("gelu", 8)])
def test_every_method_agrees_with_autograd_backward_map(name, b):
    act = get_activation(name)
    direct = backward_eigen_autograd(act, b, n=20_000, n_batches=10, seed=4)
    methods = ["sphere", "gegenbauer", "montecarlo"] + (["closed"] if name == "relu" else [])
    for m in methods:
        ev = backward_eigenvalues(act, b, method=m, n_samples=40_000)
        for key, val in (("G", ev.lambda_G), ("L", ev.lambda_L), ("M", ev.lambda_M)):
            if val is None:
                continue
            mean, se = direct[key]
            assert abs(val - mean) < 3 * se + 1e-9, (m, key, val, mean, se)


def test_weight_gradient_norms_follow_the_trace_of_the_dense_backward_recursion():
    # Independent route: the dense B²×B² operator G⊗2∘F assembled from the sphere's brackets,
    # iterated from a random PSD Π^L; μ* tr Π^l (App. L) must scale by λ_G↓ per layer after one step.
    from bnlab.theory.backward import _backward_moments_sphere, _mu_star_sphere

    b, depth = 6, 7
    act = get_activation("tanh")
    br = b / ((b - 3) * _mu_star_sphere(act, b)) * _backward_moments_sphere(act, b)
    names = ["11|11", "11|22", "11|12", "11|23", "12|11", "12|33", "12|12", "12|21", "12|13", "12|34", "12|31"]
    by_pat = {bracket_pattern(*[int(c) - 1 for c in k.replace("|", "")]): v for k, v in zip(names, br)}
    # complete the classes that never matter after projection with arbitrary values
    rng = np.random.default_rng(0)
    vals = {}
    for t in np.ndindex(b, b, b, b):
        p = bracket_pattern(*t)
        if p not in vals:
            q = bracket_pattern(p[1], p[0], p[3], p[2])
            vals[p] = by_pat.get(p, by_pat.get(q, vals.get(q, rng.standard_normal())))
    t_op = dense_ultrasymmetric_operator(vals, b)
    g = np.eye(b) - 1.0 / b
    a = rng.standard_normal((b, b))
    pi = a @ a.T
    traces = []
    for _ in range(depth):
        traces.append(np.trace(pi))
        pi = g @ np.einsum("klij,ij->kl", t_op, pi) @ g
    ratios = weight_gradient_norms(act, b, depth - 1, method="sphere")
    measured = np.array(traces[1:][::-1]) / traces[1]
    np.testing.assert_allclose(measured, ratios, rtol=1e-9)


def test_eps_positive_delegates_to_epsilon_analysis():
    from bnlab.theory import epsilon_analysis

    r = gradient_explosion_rate("relu", 16, eps=0.5, sigma_w2=2.0)
    assert r == epsilon_analysis("relu", 16, 0.5, sigma_w2=2.0).grad_explosion_rate
    # ε → 0 recovers the ε = 0 rate (continuity, checked against the closed form)
    assert gradient_explosion_rate("relu", 16, eps=1e-9) == pytest.approx(gradient_explosion_rate("relu", 16), rel=1e-5)


def test_bad_input():
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="χ_2|diverges"):
        backward_eigenvalues("tanh", 3)
    with pytest.raises(ValueError, match="square integrable"):
        backward_eigenvalues(get_activation("alpha_relu", alpha=0.5), 8)
    with pytest.raises(ValueError, match="eps"):
        gradient_explosion_rate("relu", 8, eps=-1.0)
    with pytest.raises(ValueError, match="sigma_w2"):
        gradient_explosion_rate("relu", 8, sigma_w2=0.0)
    with pytest.raises(ValueError, match="closed"):
        backward_eigenvalues("tanh", 8, method="closed")
    with pytest.raises(ValueError, match="depth"):
        weight_gradient_norms("relu", 8, 0)


def test_relu_gradient_rate_gegenbauer_at_large_b():
    # Regression: at B = 1024 the Gegenbauer coefficients (400/800/1600 terms for the Richardson
    # step) had NaNs beyond l ≈ 1030 and this raised.  Accuracy is limited by truncation, not
    # rounding: relu's b_l² ~ l^{-3} only once l ≫ B, so the C₁/n + C₂/n² Richardson model is not
    # yet asymptotic at n ≤ 1600 for B = 1024.  Measured relative error vs Thm 3.10's closed form:
    # 7.1e-4 (default), 1.3e-4 (n_terms=1000), 2.6e-5 (n_terms=2000); 1.5e-3 bounds the default
    # with a factor-2 margin, and the sign check pins the one-sided convergence from below.
    b = 1024
    closed = gradient_explosion_rate("relu", b, method="closed")
    geg = gradient_explosion_rate("relu", b, method="gegenbauer")
    assert math.isfinite(geg)
    assert geg == pytest.approx(closed, rel=1.5e-3)
    assert geg < closed
