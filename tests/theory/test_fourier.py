"""Fourier method for general PSD Σ (Yang et al. 2019, App. E.2, Thm E.25, Eq. 32).

Tolerances: the Laplace route (Thm 3.2) converges to ≲1e-12 relative (its own level test) and
the Fourier route to ≲1e-13 (nested tanh-sinh levels, measured ≲2e-14 against Laplace), so two
independent routes agreeing to 1e-10 leaves a margin of 100× over both error budgets while a
formula error (wrong weight, wrong branch) shows up at 1e-3 or more (negative tests below).
"""
import math

import numpy as np
import pytest
from scipy import special

import bnlab.theory.fourier as fourier
from bnlab.activations import get_activation
from bnlab.theory._linalg import bsb1, im_g_basis
from bnlab.theory.batchnorm_map import batchnorm_transform, batchnorm_transform_montecarlo
from bnlab.theory.fourier import fourier_general_transform, fourier_transform, fourier_weight
from bnlab.theory.laplace import laplace_transform
from bnlab.theory.spherical import isotropic_transform_entries, qmc_transform

HOMOGENEOUS = ["relu", "identity", "alpha_relu(0.5)"]


def _act(spec):
    if spec.startswith("alpha_relu("):
        return get_activation("alpha_relu", alpha=float(spec[len("alpha_relu(") : -1]))
    return get_activation(spec)


def _generic(b, seed=0, rank=None):
    """Seeded non-BSB1 PSD Σ; with ``rank`` it is singular (rank(GΣG) = rank) but GΣG ≠ 0."""
    rng = np.random.default_rng(seed)
    if rank is None:
        a = rng.standard_normal((b, b))
        return a @ a.T / b + 0.2 * np.eye(b)
    a = rng.standard_normal((b, rank))
    return a @ a.T / rank + 0.5  # + constant: rank(Σ) = rank + 1, rank(GΣG) = rank


def _rel(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


# ---------------------------------------------------------------------------
# positive-homogeneous φ: closed s-integral, vs Laplace
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("phi", HOMOGENEOUS + ["alpha_relu(2)", "leaky_relu", "abs"])
@pytest.mark.parametrize("b", [4, 5, 8, 32])
def test_homogeneous_generic_sigma_vs_laplace(phi, b):
    act = _act(phi)
    s = _generic(b, seed=b)
    fo, err = fourier_general_transform(act, s)
    la, _ = laplace_transform(act, s)
    assert _rel(fo, la) < 1e-10
    assert err < 1e-10 * np.max(np.abs(fo))


@pytest.mark.parametrize("phi", HOMOGENEOUS)
@pytest.mark.parametrize("b, rank", [(5, 2), (8, 3), (32, 5)])
def test_homogeneous_rank_deficient_sigma_vs_laplace(phi, b, rank):
    act = _act(phi)
    s = _generic(b, seed=10 + b, rank=rank)
    assert np.linalg.matrix_rank(s) < b
    fo, _ = fourier_general_transform(act, s)
    la, _ = laplace_transform(act, s)
    assert _rel(fo, la) < 1e-10


@pytest.mark.parametrize("phi", HOMOGENEOUS + ["abs"])
def test_homogeneous_rank_one_exact(phi):
    # rank(GΣG) = 1: Gh = ζ W₁ with a scalar ζ, so B_φ(h) = φ(±√B W₁) and V = ½(φ(a)φ(a)ᵀ + φ(−a)φ(−a)ᵀ),
    # a = √B W₁.  The λ-integrand decays only like λ^{-3/2} (Laplace's s-tail is slow here too: it
    # reaches ~1e-10 only); the wide tanh-sinh range keeps the Fourier tail < 1e-18.  Every pair has
    # c = ±1, the branch point of √(1 − c²): rounding of c (≈1e-16) costs √1e-16 → ≈1e-10 here.
    act = _act(phi)
    b = 8
    s = _generic(b, seed=18, rank=1)
    mu, w = fourier._g_spectrum(s)
    assert mu.size == 1
    a = math.sqrt(b) * w[:, 0]
    exact = 0.5 * (np.outer(act(a), act(a)) + np.outer(act(-a), act(-a)))
    fo, _ = fourier_general_transform(act, s)
    assert np.max(np.abs(fo - exact)) < 1e-9 * np.max(np.abs(exact))


@pytest.mark.slow
@pytest.mark.parametrize("phi", HOMOGENEOUS)
def test_homogeneous_b128_vs_laplace(phi):
    act = _act(phi)
    s = _generic(128, seed=3)
    fo, _ = fourier_general_transform(act, s)
    la, _ = laplace_transform(act, s)
    assert _rel(fo, la) < 1e-10


@pytest.mark.parametrize("b", [4, 6, 9])
def test_identity_exact(b):
    # B_id(h) = √B Gh/‖Gh‖: tr V = B and V1 = 0 exactly for every Σ
    s = _generic(b, seed=20 + b)
    v, _ = fourier_general_transform("identity", s)
    assert np.trace(v) == pytest.approx(b, rel=1e-13)
    assert np.max(np.abs(v.sum(axis=1))) < 1e-13


def test_identity_exact_b4_carlson():
    # B = 4: V = B·W diag(E[ζ_k²/‖ζ‖²]) Wᵀ with ζ ~ N(0, diag μ) in R³ and
    # E[ζ_k²/‖ζ‖²] = ∫₀^∞ μ_k (1+2tμ_k)^{-1} Π_l (1+2tμ_l)^{-1/2} dt = ½ Π_l (2μ_l)^{-1/2} (2/3) R_D(x_a, x_b, x_k),
    # x_l = 1/(2μ_l) (Carlson's R_D, scipy.special.elliprd): an exact answer independent of both routes.
    b = 4
    s = _generic(b, seed=5)
    e = im_g_basis(b)
    mu, u = np.linalg.eigh(e.T @ s @ e)
    x = 1.0 / (2.0 * mu)
    pref = 0.5 * np.prod(1.0 / np.sqrt(2.0 * mu)) * 2.0 / 3.0
    m = [pref * special.elliprd(*np.delete(x, k), x[k]) for k in range(3)]
    exact = b * (e @ u) @ np.diag(m) @ (e @ u).T
    v, _ = fourier_general_transform("identity", s)
    assert np.max(np.abs(v - exact)) < 1e-13 * b


def test_batchnorm_transform_fourier_generic_sigma():
    s = _generic(6, seed=1)
    fo = batchnorm_transform("relu", s, method="fourier")
    la = batchnorm_transform("relu", s, method="laplace")
    assert _rel(fo, la) < 1e-10


# ---------------------------------------------------------------------------
# BSB1 Σ: forced general path vs the isotropic reduction
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("phi", HOMOGENEOUS + ["tanh"])
@pytest.mark.parametrize("b", [4, 8])
def test_bsb1_general_path_matches_isotropic(phi, b):
    act = _act(phi)
    s = bsb1(b, 1.3, 0.4)
    iso, _ = fourier_transform(act, s)  # isotropic reduction (GΣG ∝ G)
    gen, err = fourier_general_transform(act, s)  # forced general path
    # homogeneous: both ≲1e-13 → 1e-10; tanh: density route ≲1e-7 (its error estimate) → 1e-6
    assert _rel(gen, iso) < (1e-10 if act.homogeneity else 1e-6)
    d, o, _ = isotropic_transform_entries(act, b, mu=0.9)
    assert _rel(gen, bsb1(b, d, o)) < (1e-10 if act.homogeneity else 1e-6)


# ---------------------------------------------------------------------------
# general φ (density route), ε = 0
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("b", [4, 5])
def test_density_route_relu_vs_laplace(b):
    # the density route does not use the homogeneity: on relu it must reproduce Laplace
    # to its own accuracy (measured 3e-8 at B = 4, 2e-12 at B = 5)
    act = _act("relu")
    s = _generic(b, seed=30 + b)
    v, err = fourier._density_general(act, s)
    la, _ = laplace_transform(act, s)
    assert np.max(np.abs(v - la)) <= max(3 * err, 1e-12)
    assert _rel(v, la) < 1e-6


@pytest.mark.parametrize("phi", ["tanh", "sin"])
@pytest.mark.parametrize("b", [4, 5])
def test_general_phi_generic_sigma_vs_montecarlo_and_qmc(phi, b):
    act = _act(phi)
    s = _generic(b, seed=40 + b)
    fo, err = fourier_general_transform(act, s)
    assert err < 1e-6 * np.max(np.abs(fo))
    # Monte Carlo, 4e5 samples: SE ≈ 1.5e-3; 4 SE per entry.  Power: the value at the isotropic Σ
    # with the same trace (what a Σ-blind formula would give) differs by ≫ 4 SE.
    mc, se = batchnorm_transform_montecarlo(act, s, n_samples=400_000, seed=7)
    assert np.all(np.abs(mc - fo) <= 4 * se + 1e-12)
    iso = batchnorm_transform(act, bsb1(b, 1.0, 0.0), method="fourier")
    assert np.max(np.abs(iso - fo) / se) > 20
    # randomized QMC (8 scramblings, Student-t with 7 dof): 5 SE, SE ≈ 2e-6
    q, se_q = qmc_transform(act, s, seed=1, n_points=2**17)
    assert np.all(np.abs(q - fo) <= 5 * se_q + 1e-9)


def test_general_phi_rank3_singular_sigma_vs_montecarlo():
    act = _act("tanh")
    s = _generic(6, seed=50, rank=3)
    fo, _ = fourier_general_transform(act, s)
    mc, se = batchnorm_transform_montecarlo(act, s, n_samples=300_000, seed=8)
    assert np.all(np.abs(mc - fo) <= 4 * se + 1e-12)


# ---------------------------------------------------------------------------
# ε > 0
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("phi", HOMOGENEOUS)
@pytest.mark.parametrize("b, eps", [(4, 0.3), (8, 0.05), (8, 2.0), (32, 0.3)])
def test_eps_positive_vs_laplace(phi, b, eps):
    act = _act(phi)
    s = _generic(b, seed=60 + b)
    fo, _ = fourier_general_transform(act, s, eps=eps)
    la, _ = laplace_transform(act, s, eps=eps)
    assert _rel(fo, la) < 1e-10
    # ε matters at this scale
    assert _rel(fo, fourier_general_transform(act, s)[0]) > 1e-3


def test_eps_weight_closed_forms():
    lam = np.geomspace(1e-6, 1e4, 23)
    eps = 0.7
    # α = 1: ∫₀^∞ e^{iλt}/(t+ε) dt = e^{−iλε} E₁(−iλε)
    ref = np.exp(-1j * lam * eps) * special.exp1(-1j * lam * eps)
    assert np.max(np.abs(fourier_weight(1.0, lam, eps) - ref) / np.abs(ref)) < 1e-13
    # α = ½: ∫₀^∞ e^{−pt}(t+ε)^{−1/2} dt = e^{pε}√(π/p) erfc(√(pε)), p = −iλ
    p = -1j * lam
    ref = np.exp(p * eps) * np.sqrt(math.pi / p) * special.erfc(np.sqrt(p * eps))
    assert np.max(np.abs(fourier_weight(0.5, lam, eps) - ref) / np.abs(ref)) < 1e-12
    # ε → 0 tends to the ε = 0 weight Γ(1−α)(−iλ)^{α−1}
    # (the difference is the O(ε^{1−α}) = 1e-8 correction)
    assert np.allclose(fourier_weight(0.5, lam[-5:], 1e-16), fourier_weight(0.5, lam[-5:]), rtol=1e-5)


def test_general_phi_eps_positive_is_refused():
    with pytest.raises(ValueError, match="eps"):
        batchnorm_transform("tanh", _generic(5), method="fourier", eps=0.1)


# ---------------------------------------------------------------------------
# complex covariances: the analytically continued V_φ is the complex Gaussian integral
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("phi", ["relu", "alpha_relu(0.5)", "alpha_relu(2)", "abs", "leaky_relu"])
def test_complex_vphi_matches_complex_gaussian_integral(phi):
    # App. E.2: E_{N(0,M)} f := det(2πM)^{-1/2} ∫ f(u) e^{-uᵀM⁻¹u/2} du.  For f = φ(u₁)φ(u₂) of degree 2α
    # the radial integral is 2^α Γ(α+1) e(θ)^{-(α+1)}, e(θ) = ωᵀM⁻¹ω (Re > 0), leaving a θ-quadrature.
    act = _act(phi)
    alpha = float(act.homogeneity)
    b = 6
    s = _generic(b, seed=70)
    mu, w = fourier._g_spectrum(s)
    iu, ju = np.triu_indices(b)
    for lam in (0.03, 0.7, 5.0, 80.0):
        log_d, m_i, m_j, m_ij = fourier._pair_blocks(np.array([lam]), mu, w, b, iu, ju)
        closed = fourier._homogeneous_vphi_complex(act, m_i, m_j, m_ij, iu == ju)[0]
        for p in np.flatnonzero(iu != ju)[::3]:
            mm = np.array([[m_i[0, p], m_ij[0, p]], [m_ij[0, p], m_j[0, p]]])
            a = np.linalg.inv(mm)
            theta, wt = fourier.tanh_sinh_panel(np.arange(4) * math.pi / 2, np.arange(1, 5) * math.pi / 2, 6)
            theta, wt = theta.ravel(), wt.ravel()
            om = np.stack([np.cos(theta), np.sin(theta)])
            e_th = np.einsum("in,ij,jn->n", om, a, om)
            f = act(om[0]) * act(om[1])
            integral = np.sum(wt * f * 2.0**alpha * math.gamma(alpha + 1.0) * e_th ** (-(alpha + 1.0)))
            direct = integral / (2.0 * math.pi * np.sqrt(np.linalg.det(mm)))
            assert abs(direct - closed[p]) < 1e-11 * abs(direct)


# ---------------------------------------------------------------------------
# negative tests: a wrong formula must be caught
# ---------------------------------------------------------------------------
def test_perturbed_weight_is_caught(monkeypatch):
    s = _generic(8, seed=8)
    la, _ = laplace_transform(_act("relu"), s)
    good = fourier_general_transform("relu", s)[0]
    assert _rel(good, la) < 1e-10
    orig = fourier.fourier_weight
    # a constant added to the α = 1 weight is invisible — exactly because ∫F(λ)dλ = 0 (the a → 0
    # limit of Eq. 32 drops the log a term for that reason); this checks that claim
    monkeypatch.setattr(fourier, "fourier_weight", lambda a, lam, eps=0.0: orig(a, lam, eps) + 2 * np.euler_gamma)
    assert _rel(fourier_general_transform("relu", s)[0], la) < 1e-9
    # ... but a wrong slope or phase is caught: log λ scaled by 1.01, and the conjugate weight
    # (the e^{−iλs} convention, i.e. sign of the iπ/2 term flipped)
    monkeypatch.setattr(
        fourier, "fourier_weight", lambda a, lam, eps=0.0: orig(a, lam, eps) - 0.01 * np.log(np.asarray(lam))
    )
    assert _rel(fourier_general_transform("relu", s)[0], la) > 1e-3
    monkeypatch.setattr(fourier, "fourier_weight", lambda a, lam, eps=0.0: np.conj(orig(a, lam, eps)))
    assert _rel(fourier_general_transform("relu", s)[0], la) > 1e-3
    # (−iλ)^{α−1} with the phase dropped (|λ|^{α−1} only), α = ½
    monkeypatch.setattr(fourier, "fourier_weight", lambda a, lam, eps=0.0: np.abs(orig(a, lam, eps)))
    half = _act("alpha_relu(0.5)")
    assert _rel(fourier_general_transform(half, s)[0], laplace_transform(half, s)[0]) > 1e-3


def test_sqrt_of_product_branch_is_caught(monkeypatch):
    # D(λ) = Π (1 + 2iλμ_k/B)^{-1/2} factor by factor; the principal root of the product jumps
    # once Σ arg exceeds π (here B = 8, rank 7: at large λ the total argument reaches 7π/2)
    s = _generic(8, seed=9)
    la, _ = laplace_transform(_act("relu"), s)
    orig = fourier._pair_blocks

    def sqrt_of_product(lam, mu, w, b, iu, ju):
        log_d, m_i, m_j, m_ij = orig(lam, mu, w, b, iu, ju)
        prod = np.prod(1.0 + 2j * lam[:, None] * mu[None, :] / b, axis=1)
        return -np.log(np.sqrt(prod)), m_i, m_j, m_ij

    monkeypatch.setattr(fourier, "_pair_blocks", sqrt_of_product)
    assert _rel(fourier_general_transform("relu", s)[0], la) > 1e-3


# ---------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        (("relu", -np.eye(4)), {}, "Sigma"),
        (("relu", np.ones((4, 3))), {}, "Sigma"),
        (("relu", np.eye(4)), {"eps": -1.0}, "eps"),
        (("relu", np.eye(4)), {"tol": 0.0}, "tol"),
        (("relu", np.ones((4, 4))), {}, "eps"),
        (("tanh", np.eye(6) * 0 + _generic(6, seed=1, rank=2)), {}, "rank"),
        (("tanh", _generic(5)), {"eps": 0.2}, "eps"),
        (("no_such_phi", np.eye(4)), {}, "phi"),
    ],
)
def test_bad_input(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        fourier_general_transform(*args, **kwargs)
