"""V_φ: closed forms (hypergeometric k_α, arccosine J_1/J_2, Williams' erf) vs 2-D quadrature vs Monte Carlo."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bnlab.activations import get_activation
from bnlab.theory.vphi import alpha_relu_kernel, gaussian_kernel, homogeneous_kernel


def _random_psd(rng, b, rank=None):
    a = rng.standard_normal((b, rank or b))
    return a @ a.T / b


def test_alpha_relu_kernel_matches_cho_saul_j1_j2():
    # Prop. E.10: k_α(c) = c_α J_α(c); c_1 = 1/2, c_2 = 3/2.  Independent closed forms, so 1e-14.
    c = np.linspace(-1, 1, 41)
    j1 = (np.sqrt(1 - c**2) + (np.pi - np.arccos(c)) * c) / np.pi
    j2 = (3 * c * np.sqrt(1 - c**2) + (np.pi - np.arccos(c)) * (1 + 2 * c**2)) / (3 * np.pi)
    assert np.allclose(alpha_relu_kernel(1.0, c), 0.5 * j1, rtol=0, atol=1e-15)
    assert np.allclose(alpha_relu_kernel(2.0, c), 1.5 * j2, rtol=0, atol=1e-14)


@given(alpha=st.floats(0.3, 3.0), c=st.floats(-1.0, 1.0))
@settings(max_examples=40, deadline=None)
def test_alpha_relu_kernel_properties(alpha, c):
    # Prop. E.11: k_α(1) = c_α, k_α(−1) = 0, k_α(0) = Γ((α+1)/2)² 2^{α−2}/π, increasing in c.
    c_alpha = 2 ** (alpha - 1) * math.gamma(alpha + 0.5) / math.sqrt(math.pi)
    assert alpha_relu_kernel(alpha, 1.0) == pytest.approx(c_alpha, rel=1e-13)
    assert abs(alpha_relu_kernel(alpha, -1.0)) < 1e-13
    assert alpha_relu_kernel(alpha, 0.0) == pytest.approx(math.gamma((alpha + 1) / 2) ** 2 * 2 ** (alpha - 2) / math.pi)
    assert alpha_relu_kernel(alpha, min(c + 1e-3, 1.0)) >= alpha_relu_kernel(alpha, c) - 1e-15


@pytest.mark.parametrize(
    "phi",
    ["relu", "identity", "abs", "erf", ("alpha_relu", 0.5), ("alpha_relu", 2.0), ("leaky_relu", 0.1)],
)
def test_closed_vs_quadrature(phi, rng):
    # quadrature: tanh-sinh panels cut at the kinks, ≲1e-12 relative (module docstring);
    # closed forms ≲1e-14.  Tolerance 1e-10 of the largest entry.
    act = get_activation(phi[0], **({"alpha": phi[1]} if phi[0] == "alpha_relu" else {"slope": phi[1]})) if isinstance(phi, tuple) else get_activation(phi)
    s = _random_psd(rng, 5)
    a = gaussian_kernel(act, s, method="closed")
    b = gaussian_kernel(act, s, method="quadrature")
    assert np.max(np.abs(a - b)) <= 1e-10 * np.max(np.abs(a))


def test_identity_and_scale_gamma(rng):
    s = _random_psd(rng, 4)
    assert np.allclose(gaussian_kernel("identity", s), s, rtol=0, atol=1e-15)
    act = get_activation("relu", gamma=2.0)
    # relu(2x): homogeneous degree 1 with (a, b) = (2, 0) → 4 × V_relu
    assert np.allclose(gaussian_kernel(act, s), 4 * gaussian_kernel("relu", s), rtol=1e-13)


@pytest.mark.parametrize("phi", ["tanh", "sin", "gelu", "sigmoid"])
def test_quadrature_vs_montecarlo(phi, rng):
    # MC with 2e5 samples: compare within 4 standard errors per entry (the chance of a
    # false failure over 10 entries is < 1e-3).
    s = _random_psd(rng, 4)
    v = gaussian_kernel(phi, s)
    act = get_activation(phi)
    h = rng.standard_normal((200_000, 4)) @ np.linalg.cholesky(s + 1e-12 * np.eye(4)).T
    y = act(h)
    prods = y[:, :, None] * y[:, None, :]
    mean = prods.mean(axis=0)
    se = prods.std(axis=0) / math.sqrt(len(h))
    assert np.all(np.abs(mean - v) <= 4 * se + 1e-12)


def test_quadrature_levels_agree(rng):
    # the level-4 rule against level 5: the difference bounds the level-4 error
    from bnlab.theory.vphi import _quadrature

    s = _random_psd(rng, 4)
    act = get_activation("tanh")
    assert np.max(np.abs(_quadrature(act, s, 4) - _quadrature(act, s, 5))) < 1e-13


def test_singular_and_zero_variance():
    s = np.array([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    for method in ("closed", "quadrature"):
        v = gaussian_kernel("relu", s, method=method)
        assert np.all(np.isfinite(v))
        assert v[0, 1] == pytest.approx(0.5, abs=1e-12)  # perfectly correlated: E relu(x)² = 1/2
        assert np.allclose(v[2], 0.0, atol=1e-14)
    vt = gaussian_kernel("tanh", s)
    assert np.allclose(vt[2], 0.0, atol=1e-14)


def test_homogeneous_kernel_abs_is_even():
    c = np.linspace(-1, 1, 11)
    k = homogeneous_kernel(get_activation("abs"), c)
    assert np.allclose(k, k[::-1], atol=1e-15)


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        (("relu", np.array([[1.0, 2.0], [2.0, 1.0]])), {}, "positive semi-definite"),
        (("relu", np.array([[1.0, np.nan], [np.nan, 1.0]])), {}, "NaN"),
        (("relu", np.ones((2, 3))), {}, "square"),
        (("tanh", np.eye(2)), {"method": "closed"}, "closed"),
        (("relu", np.eye(2)), {"method": "bogus"}, "method"),
    ],
)
def test_bad_input(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        gaussian_kernel(*args, **kwargs)


def test_prop_e23_derivative_erratum():
    # Prop. E.23 as corrected: J'_φ(c) = (2α+1)(1−c²)^{-1}[(a²+b²)J_{α+1}(c) + 2abJ_{α+1}(−c) − cJ_φ(c)],
    # J = k/c_α.  Central difference with h = 1e-5 has error ~h² ≈ 1e-10: tolerance 1e-7.
    from bnlab.theory.vphi import alpha_relu_second_moment as c_

    alpha, a, b, c, h = 1.5, 1.0, 0.3, 0.4, 1e-5

    def j(al, x):
        return alpha_relu_kernel(al, x) / c_(al)

    def j_phi(x):
        return (a * a + b * b) * j(alpha, x) - 2 * a * b * j(alpha, -x)

    numeric = (j_phi(c + h) - j_phi(c - h)) / (2 * h)
    bracket = (a * a + b * b) * j(alpha + 1, c) + 2 * a * b * j(alpha + 1, -c)
    corrected = (2 * alpha + 1) / (1 - c * c) * (bracket - c * j_phi(c))
    printed = (2 * alpha + 1) / (1 - c * c) * bracket - c * j_phi(c)
    assert numeric == pytest.approx(corrected, rel=1e-7)
    assert abs(numeric - printed) > 1e-2
