"""Cross-batch fixed point c_CB* and decorrelation rate λ_M̃ (Yang et al. 2019, §3.2, Thms 3.11, H.3, H.6, I.5).

Routes: closed forms (Thm H.6 for c*, any positive-homogeneous φ; the rate for
relu and identity), spherical integration, the Gegenbauer forms (c* = a_0²,
Thm 3.11), bnlab's Monte Carlo, and direct Monte Carlo on h ~ N(0, Σ*) through
B_φ: c* = (E B_φ(h)_1)² and A = E[dB_φ/dh] by torch autograd,
λ = (tr(GAG)/(B−1))² (the off-diagonal block map Ξ ↦ AΞAᵀ).

Tolerances: closed vs sphere 1e-9; Gegenbauer 1e-6 (extrapolated series for
kinked φ, measured ≤ 2e-8 for the rate of relu^0.5 at B ≤ 32); Monte Carlo: 3
standard errors.
"""
import math

import numpy as np
import pytest
from scipy import special

from bnlab.activations import get_activation

try:  # the direct routes live in test_forward.py (works with and without tests/theory/__init__.py)
    from .test_forward import bn_phi, sigma_star
except ImportError:
    from test_forward import bn_phi, sigma_star
from bnlab.theory import cross_batch_fixed_point, cross_batch_rate
from bnlab.theory.cross_batch import cross_batch_analysis



def test_identity_rate_thm_3_11():
    # λ = (B−1)/2 · P(B/2, 1/2)⁻², P(a, b) = Γ(a+b)/Γ(a): increases to 1 from below
    prev = 0.0
    for b in (4, 8, 64, 1024, 10**5):
        p = special.poch(b / 2, 0.5)
        lam = cross_batch_rate("identity", b)
        assert lam == pytest.approx((b - 1) / 2 / p**2, rel=1e-12)
        assert prev < lam < 1.0
        prev = lam


@pytest.mark.parametrize("b", [4, 8, 32])
def test_identity_maximizes_the_rate(b):
    ident = cross_batch_rate("identity", b)
    for name in ("relu", "tanh", "sin", "gelu"):
        assert cross_batch_rate(name, b) < ident


@pytest.mark.parametrize("b", [4, 5, 8, 32])
def test_alpha_relu(b):
    act = get_activation("alpha_relu", alpha=0.5)
    closed_c = cross_batch_fixed_point(act, b, method="closed")  # Thm H.6
    sphere = cross_batch_analysis(act, b, method="sphere")
    geg = cross_batch_analysis(act, b, method="gegenbauer")
    assert closed_c == pytest.approx(sphere.c_star, rel=1e-9)
    assert closed_c == pytest.approx(geg.c_star, rel=1e-6)
    lap = cross_batch_analysis(act, b, method="laplace")  # Thm H.14
    assert lap.rate == pytest.approx(geg.rate, rel=1e-6)
    # the sphere's φ' ∝ x^{−1/2} singularity costs accuracy: measured 2e-8
    assert lap.rate == pytest.approx(sphere.rate, rel=1e-6)


@pytest.mark.parametrize("name", ["relu", "gelu", "sigmoid"])
def test_montecarlo_within_three_standard_errors(name):
    ref = cross_batch_analysis(name, 8, method="sphere")
    mc = cross_batch_analysis(name, 8, method="montecarlo", n_samples=100_000, seed=5)
    assert abs(mc.c_star - ref.c_star) < 3 * mc.stderr[0]
    assert abs(mc.rate - ref.rate) < 3 * mc.stderr[1]


def _direct(act, b, n=40_000, n_batches=10, seed=6):
    import torch
    from torch.func import jacrev, vmap

    s0 = sigma_star(act, b)
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((n, b)) @ np.linalg.cholesky(s0).T
    m = bn_phi(act, h).mean(axis=1).reshape(n_batches, -1).mean(axis=1)  # E B_φ(h)_i, averaged over i
    c_vals = m.mean() ** 2, 2 * abs(m.mean()) * m.std(ddof=1) / math.sqrt(n_batches)

    def bphi(x):
        gx = x - x.mean()
        return act.torch(math.sqrt(b) * gx / torch.linalg.norm(gx))

    jac = vmap(jacrev(bphi))(torch.tensor(h))
    g = torch.eye(b, dtype=torch.float64) - 1.0 / b
    p = torch.einsum("ij,njk,ki->n", g, jac, g).numpy() / (b - 1)  # tr(G J G)/(B−1) per sample
    pb = p.reshape(n_batches, -1).mean(axis=1)
    lam = pb.mean() ** 2
    return c_vals, (lam, 2 * abs(pb.mean()) * pb.std(ddof=1) / math.sqrt(n_batches))


@pytest.mark.parametrize("name,b", [("relu", 6), ("tanh", 5), ("sigmoid", 8)])
def test_every_method_agrees_with_direct_monte_carlo(name, b):
    act = get_activation(name)
    (c_mc, c_se), (lam_mc, lam_se) = _direct(act, b)
    methods = ["sphere", "gegenbauer", "montecarlo"] + (["closed"] if name == "relu" else [])
    for m in methods:
        r = cross_batch_analysis(act, b, method=m, n_samples=50_000)
        assert abs(r.rate - lam_mc) < 3 * lam_se + 1e-12, (m, r.rate, lam_mc, lam_se)
        assert abs(r.c_star - c_mc) < 3 * c_se + 1e-12, (m, r.c_star, c_mc, c_se)

