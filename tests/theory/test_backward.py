"""Backward eigenvalues and the gradient explosion rate (Yang et al. 2019, Thms 3.9, 3.10, G.5, G.12, App. G.1.1, L).

Routes: closed forms (Thm 3.10 / Eq. 19 and Thm G.12 for relu; identity from
the sphere's fourth moments), spherical integration + Thm E.62 (with the
[12|13]/[12|31] erratum fixed), the Gegenbauer series of Thm 3.9, bnlab's
Monte Carlo of the sphere, and a direct Monte Carlo of E[Jᵀ Δ J] with
J = dB_φ/dh from torch autograd on h ~ N(0, Σ*) (no spherical reduction).

Tolerances: closed vs sphere 1e-9 (quadrature ≈1e-11); Gegenbauer 1e-9 for
kinked φ at B ≥ 8 (single-point tails summed through moments: measured ≤ 9e-12,
1e-6 at B ≤ 5 where R_l(ξ) decays slowly) and 1e-10 vs the sphere for analytic φ
(measured ≤ 1.3e-12); Monte Carlo: 3 standard errors.
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


@pytest.mark.parametrize("b", [4, 5])
def test_relu_rate_gegenbauer_small_b(b):
    # B ≤ 5: R_l(ξ) decays only like l^{-(B−3)/2}, so the two-point tail left after summing the single-point
    # tails is the largest here: measured 1e-8 (B=4), 1e-10 (B=5) at the default 1000 terms (8e-8, 6e-9 with
    # 400; the error oscillates in n within an n^{-3/2} envelope), within the bound.
    closed = gradient_explosion_rate("relu", b, method="closed")
    ev = backward_eigenvalues("relu", b, method="gegenbauer")
    assert ev.lambda_G == pytest.approx(closed, rel=1e-7)
    assert abs(ev.lambda_G - closed) <= ev.truncation_error


KINKED = [
    ("relu", {}),
    ("leaky_relu", {"slope": 0.2}),
    ("abs", {}),
    ("alpha_relu", {"alpha": 1.5}),
    ("alpha_relu", {"alpha": 0.6}),
]


@pytest.mark.parametrize("b", [8, 32, 128])
@pytest.mark.parametrize("name,kw", KINKED)
def test_kinked_rate_gegenbauer_vs_closed_forms(name, kw, b):
    # Thm 3.9 by the Gegenbauer series with its single-point tails summed through the moments
    # (Σ b_l² = E f², Σ l(l+B−3) b_l² = E(1−x²)f'²) vs Thm 3.10 (relu) / Thm G.12 (Laplace, the others).
    # Measured relative error ≤ 3e-11 (B = 8), ≤ 1e-15 (B ≥ 32) at the default 400 terms; before the
    # tail summation the extrapolated series was 7e-9 / 7e-7 / 2e-5 off for relu at B = 8 / 32 / 128 and
    # 3e-3 / 2e-2 for relu^0.6 (φ' ~ x^{-0.4} singular at the kink) at B = 8 / 32.
    act = get_activation(name, **kw)
    ref = backward_eigenvalues(act, b, method="closed" if name == "relu" else "laplace").lambda_G
    ev = backward_eigenvalues(act, b, method="gegenbauer")
    assert ev.lambda_G == pytest.approx(ref, rel=1e-9)
    # the reported bound covers the error and is not vacuous: at B = 8 it is max_{l≥300}|R_l(ξ)| ≈ 4e-6 times
    # the Dirichlet tail, 2e-3 (relu) to 0.25 (relu^0.6: Σ_{l≥n} l² b_l² ~ n^{-0.2}) of E(1−x²)f'²;
    # at B ≥ 32, R_l(ξ) is negligible and only the rounding floor RULE_RTOL remains
    assert abs(ev.lambda_G - ref) <= ev.truncation_error + 1e-13 * ref
    assert ev.truncation_error < (2e-6 if b == 8 else 2e-12) * ref


def test_relu_rate_tail_summation_matters_with_few_terms():
    # Fails if the tail summation is wrong: with only 100 terms the plain truncated series
    # Σ ε_l b_l²(1−R_l(ξ)) / ((B−3) Σ b_l²(1−R_l(ξ))) is off by ~1e-2 (its Dirichlet tail ~ 1/n), the summed
    # one is exact to rounding (measured 1.2e-2 vs 2e-16 at B = 32).
    from bnlab.theory.gegenbauer import gegenbauer_orthonormal_coefficients, normalized_gegenbauer

    b, n = 32, 100
    closed = gradient_explosion_rate("relu", b, method="closed")
    bl = gegenbauer_orthonormal_coefficients("relu", b, n_terms=n)
    v = bl**2 * (1.0 - normalized_gegenbauer(b, n, np.array(-1.0 / (b - 1))))
    l = np.arange(n)
    raw = np.sum(l * (l + b - 3) * v) / ((b - 3) * np.sum(v))
    summed = backward_eigenvalues("relu", b, method="gegenbauer", n_terms=n).lambda_G
    assert abs(raw / closed - 1) > 3e-3
    assert abs(summed / closed - 1) < 1e-12


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
    from bnlab.theory._sphere_route import _backward_moments_sphere, _mu_star_sphere

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


@pytest.mark.parametrize("name,kw", KINKED[:2])
def test_kinked_gradient_rate_gegenbauer_at_large_b(name, kw):
    # B = 1024: the coefficients reach the l^{-4} regime only for l ≫ B, so no truncation of the plain
    # series is accurate at affordable n (relu: 7.1e-4 off at the default terms, 2.6e-5 with 2000 terms,
    # 65 s, before the tail summation).  With the single-point tails summed by the moments and
    # R_l(ξ) < 1e-40 beyond l = 50, measured error 8e-16 (relu), 7e-16 (leaky relu) in ≈0.2 s.
    b = 1024
    act = get_activation(name, **kw)
    ref = backward_eigenvalues(act, b, method="closed" if name == "relu" else "laplace").lambda_G
    ev = backward_eigenvalues(act, b, method="gegenbauer")
    assert ev.lambda_G == pytest.approx(ref, rel=1e-12)
    assert ev.truncation_error <= 2e-12 * ref
