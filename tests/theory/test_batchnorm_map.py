"""V_Bφ by the Laplace, spherical, Fourier and Monte Carlo routes (Yang et al. 2019, Eq. 8, Thms 3.2, 3.3, E.25)."""
import math

import numpy as np
import pytest

from bnlab.activations import get_activation
from bnlab.theory._linalg import bsb1, centering_matrix, im_g_basis
from bnlab.theory.batchnorm_map import TRANSFORM_METHODS, batchnorm_transform, batchnorm_transform_montecarlo
from bnlab.theory.laplace import laplace_transform

HOMOGENEOUS = ["relu", "identity", "alpha_relu(0.5)"]


def _act(spec):
    if spec == "alpha_relu(0.5)":
        return get_activation("alpha_relu", alpha=0.5)
    return get_activation(spec)


def _generic(b, seed=0):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((b, b))
    return a @ a.T / b + 0.2 * np.eye(b)


def test_methods_tuple():
    assert TRANSFORM_METHODS == ("laplace", "sphere", "fourier", "montecarlo")


# ---------------------------------------------------------------------------
# generic PSD Σ
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("phi", HOMOGENEOUS)
@pytest.mark.parametrize("b", [4, 5, 8])
def test_generic_sigma_laplace_vs_qmc_sphere_and_montecarlo(phi, b):
    act = _act(phi)
    s = _generic(b, seed=b)
    lap, err = laplace_transform(act, s)
    assert err < 1e-12
    # sphere (randomized QMC): its standard error is estimated from 8 scramblings, so allow 5 SE
    # (Student-t with 7 dof: P(|t| > 5) ≈ 2e-3 per entry; entries are strongly correlated).
    from bnlab.theory.spherical import qmc_transform

    q, se_q = qmc_transform(act, s, seed=1)
    assert np.all(np.abs(q - lap) <= 5 * se_q + 1e-12)
    assert np.max(se_q) < 2e-4
    # Monte Carlo with 2e5 samples: 4 standard errors per entry.
    mc, se = batchnorm_transform_montecarlo(act, s, n_samples=200_000, seed=2)
    assert np.all(np.abs(mc - lap) <= 4 * se + 1e-12)


def test_generic_sigma_laplace_closed_vs_quadrature_kernel():
    # Laplace with the closed V_φ vs with the 2-D quadrature V_φ (independent of the
    # hypergeometric / arccosine formulas); both ≲1e-12, so 1e-10.
    act = _act("relu")
    s = _generic(4, seed=11)
    a, _ = laplace_transform(act, s)
    b, _ = laplace_transform(act, s, kernel="quadrature")
    assert np.max(np.abs(a - b)) < 1e-10


@pytest.mark.slow
@pytest.mark.parametrize("phi", HOMOGENEOUS)
@pytest.mark.parametrize("b", [5, 8])
def test_generic_sigma_laplace_closed_vs_quadrature_kernel_slow(phi, b):
    act = _act(phi)
    s = _generic(b, seed=b + 1)
    a, _ = laplace_transform(act, s)
    q, _ = laplace_transform(act, s, kernel="quadrature")
    assert np.max(np.abs(a - q)) < 1e-10 * np.max(np.abs(a))


def test_depends_only_on_g_sigma_g():
    s = _generic(5, seed=3)
    u = np.arange(5.0)
    shifted = s + np.outer(u, np.ones(5)) + np.outer(np.ones(5), u) + 4.0
    assert np.allclose(batchnorm_transform("relu", s), batchnorm_transform("relu", shifted), atol=1e-12)


# ---------------------------------------------------------------------------
# BSB1 Σ: exact reductions
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("phi", HOMOGENEOUS)
@pytest.mark.parametrize("b", [4, 5, 8, 32, 128])
def test_bsb1_sigma_all_deterministic_methods_agree(phi, b):
    # laplace (numerical s-integral + closed V_φ), sphere (angles, tanh-sinh) and fourier
    # (Cartesian, Gauss–Jacobi) are ≲1e-12 each: 1e-10 relative.
    act = _act(phi)
    s = bsb1(b, 1.3, 0.4)
    ref = batchnorm_transform(act, s, method="sphere")
    for method in ("fourier",) + (("laplace",) if b <= 32 else ()):
        v = batchnorm_transform(act, s, method=method)
        assert np.max(np.abs(v - ref)) <= 1e-10 * np.max(np.abs(ref)), method


@pytest.mark.parametrize("phi", ["tanh", "sin", "gelu", "sigmoid"])
@pytest.mark.parametrize("b", [4, 8, 32])
def test_bsb1_sigma_general_phi_sphere_fourier_montecarlo(phi, b):
    s = bsb1(b, 2.0, -1.5 / (b - 1))  # PSD: smallest eigenvalue 0.5
    sp = batchnorm_transform(phi, s, method="sphere")
    fo = batchnorm_transform(phi, s, method="fourier")
    assert np.max(np.abs(sp - fo)) <= 1e-10 * np.max(np.abs(sp))
    if b <= 8:
        mc, se = batchnorm_transform_montecarlo(phi, s, n_samples=100_000, seed=5)
        assert np.all(np.abs(mc - sp) <= 4 * se + 1e-12)


def test_isotropic_non_bsb1_uses_exact_route():
    b = 6
    u = 0.05 * np.linspace(-1, 1, b)  # small enough for Σ to stay PSD
    s = 0.7 * np.eye(b) + np.outer(u, np.ones(b)) + np.outer(np.ones(b), u) + 2.0
    v = batchnorm_transform("tanh", s)
    ref = batchnorm_transform("tanh", bsb1(b, 1.0, 0.0))
    assert np.allclose(v, ref, atol=1e-13)


# ---------------------------------------------------------------------------
# eps > 0 (Eq. 7)
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("phi, b", [("relu", 4), ("relu", 8), ("tanh", 5)])
def test_eps_positive_bsb1(phi, b):
    s = bsb1(b, 0.5, 0.1)
    eps = 0.2
    sp = batchnorm_transform(phi, s, method="sphere", eps=eps)
    fo = batchnorm_transform(phi, s, method="fourier", eps=eps)
    assert np.max(np.abs(sp - fo)) <= 1e-10 * np.max(np.abs(sp))
    if phi == "relu":
        la = batchnorm_transform(phi, s, method="laplace", eps=eps)
        assert np.max(np.abs(sp - la)) <= 1e-10 * np.max(np.abs(sp))
    mc, se = batchnorm_transform_montecarlo(phi, s, n_samples=100_000, seed=9, eps=eps)
    assert np.all(np.abs(mc - sp) <= 4 * se + 1e-12)
    # ε matters: the map with ε > 0 differs from ε = 0 by far more than the errors
    assert np.max(np.abs(sp - batchnorm_transform(phi, s, method="sphere"))) > 1e-3


@pytest.mark.parametrize("method", ["laplace", "fourier"])
def test_eps_positive_generic_vs_montecarlo(method):
    s = _generic(5, seed=4)
    value = batchnorm_transform("relu", s, method=method, eps=0.3)
    mc, se = batchnorm_transform_montecarlo("relu", s, n_samples=200_000, seed=3, eps=0.3)
    assert np.all(np.abs(mc - value) <= 4 * se + 1e-12)


def test_eps_zero_sigma_g_is_zero():
    # constant batches: with eps=0 undefined (ValueError); with eps>0, B_φ(h) = φ(0)
    s = np.ones((4, 4))
    with pytest.raises(ValueError, match="eps"):
        batchnorm_transform("relu", s)
    v = batchnorm_transform("sigmoid", s, method="montecarlo", eps=0.1, n_samples=100, seed=0)
    assert np.allclose(v, 0.25)


# ---------------------------------------------------------------------------
# structure, errata, reproducibility, bad input
# ---------------------------------------------------------------------------
def test_basis_of_eq33_and_corrected_eq34():
    # Eq. (33): orthonormal columns spanning im G; Eq. (34) with the normalizations restored.
    b = 7
    e = im_g_basis(b)
    assert np.allclose(e.T @ e, np.eye(b - 1), atol=1e-15)
    assert np.allclose(e @ e.T, centering_matrix(b), atol=1e-15)
    th = np.array([0.3, 1.1, 2.0, 0.7, 0.2, 1.9])
    v = np.array([math.cos(th[0]), math.sin(th[0]) * math.cos(th[1]), math.sin(th[0]) * math.sin(th[1]) * math.cos(th[2])])
    v = np.concatenate([v, np.full(b - 4, 0.0)])
    v[3:] = 0.0
    rest = math.sqrt(max(0.0, 1 - np.sum(v[:3] ** 2)))
    v[3] = rest
    ev = e @ v
    assert ev[0] == pytest.approx(-math.sqrt((b - 1) / b) * math.cos(th[0]))
    assert ev[1] == pytest.approx(
        math.cos(th[0]) / math.sqrt(b * (b - 1)) - math.sqrt((b - 2) / (b - 1)) * math.sin(th[0]) * math.cos(th[1])
    )
    printed = math.cos(th[0]) - math.sqrt((b - 2) / (b - 1)) * math.sin(th[0]) * math.cos(th[1])
    assert abs(ev[1] - printed) > 1e-2  # the printed Eq. (34) is wrong


def test_laplace_printed_eq26_is_an_erratum():
    # Eq. (27) as printed uses V_φ((I + 2sΣ^G)^{-1}Σ^G)^{-1}; with the inverse the result is not
    # scale invariant, while V_Bφ(cΣ) = V_Bφ(Σ) (batchnorm) — the corrected form is.
    s = _generic(4, seed=6)
    a = batchnorm_transform("relu", s, method="laplace")
    b = batchnorm_transform("relu", 7.0 * s, method="laplace")
    assert np.allclose(a, b, atol=1e-12)


def test_montecarlo_reproducible():
    s = _generic(4)
    a = batchnorm_transform_montecarlo("tanh", s, n_samples=1000, seed=42)
    b = batchnorm_transform_montecarlo("tanh", s, n_samples=1000, seed=42)
    # same draws; BLAS sums are equal to rounding, not promised bit-identical
    np.testing.assert_allclose(a[0], b[0], rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(a[1], b[1], rtol=1e-12, atol=1e-15)
    c = batchnorm_transform("tanh", s, method="sphere", seed=3, n_samples=256)
    d = batchnorm_transform("tanh", s, method="sphere", seed=3, n_samples=256)
    np.testing.assert_allclose(c, d, rtol=1e-12, atol=1e-15)


def test_b3_supported_by_numerical_routes():
    from bnlab.theory._checks import SmallBatchWarning

    s = bsb1(3, 1.0, 0.2)
    with pytest.warns(SmallBatchWarning):
        sp = batchnorm_transform("tanh", s, method="sphere")
    with pytest.warns(SmallBatchWarning):
        fo = batchnorm_transform("tanh", s, method="fourier")
    assert np.allclose(sp, fo, atol=1e-12)


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        (("relu", np.eye(1)), {}, "at least 2"),
        (("relu", np.eye(2)), {}, "=2"),
        (("relu", np.eye(4)), {"eps": -0.1}, "eps"),
        (("relu", -np.eye(4)), {}, "positive semi-definite"),
        (("relu", np.full((4, 4), np.nan)), {}, "NaN"),
        (("relu", np.ones((4, 3))), {}, "square"),
        (("tanh", np.eye(4)), {"method": "laplace"}, "positive-homogeneous"),
        (("relu", np.eye(4)), {"method": "simpson"}, "method"),
        (("tanh", _generic(4)), {"method": "fourier", "eps": 0.1}, "fourier"),
        (("relu", np.eye(4)), {"method": "montecarlo", "n_samples": 0}, "n_samples"),
    ],
)
def test_bad_input(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        batchnorm_transform(*args, **kwargs)
