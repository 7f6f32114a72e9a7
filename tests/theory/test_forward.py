"""Forward eigenvalues λ_L↑, λ_M↑ (Yang et al. 2019, Thms 3.7, 3.8, F.22, F.24, App. F.3.1).

Routes compared: closed forms (relu Thm 3.7; identity (B−1)/(B+1)), spherical
integration, the Gegenbauer series, bnlab's Monte Carlo of the sphere, and a
*direct* Monte Carlo of the Jacobian of Σ ↦ V_Bφ(Σ) by central finite
differences with common random numbers on samples h ~ N(0, Σ*) pushed through
B_φ itself (no spherical reduction, no bracket algebra).  The direct-route
helpers live here and are imported by the backward and cross-batch tests.

Tolerances: closed vs sphere 1e-9 (sphere quadrature error ≈1e-11 measured);
closed/sphere vs Gegenbauer 1e-6 (series truncation: ≈1e-12 for smooth φ,
≤ 1e-8 for relu after Aitken extrapolation, ≤ 3e-7 for relu^0.5 at B ≤ 32);
Monte Carlo within 3 standard errors (+ the finite-difference bias
O(t²) ≈ 1e-4 relative at t = 0.02 q* for the direct route, added to the band).
"""
import math

import numpy as np
import pytest

from bnlab.activations import get_activation
from bnlab.theory import forward_eigenvalues
from bnlab.theory._checks import SmallBatchWarning


# ---------------------------------------------------------------------------
# direct routes (independent of bnlab's spherical reduction)
# ---------------------------------------------------------------------------


def sigma_star(act, b):
    """Σ* + q*·11ᵀ: batchnorm ignores the 11ᵀ direction (B_φ(h + c1) = B_φ(h)), and the shift
    makes Σ* positive definite for a Cholesky factor (identity: Σ* = B/(B−1) G is singular)."""
    from bnlab.theory import bsb1_fixed_point

    fp = bsb1_fixed_point(act, b)
    return fp.q_star * ((1 - fp.c_star) * np.eye(b) + (fp.c_star + 1.0) * np.ones((b, b)))


def bn_phi(act, h):
    b = h.shape[-1]
    gh = h - h.mean(axis=-1, keepdims=True)
    return act(math.sqrt(b) * gh / np.linalg.norm(gh, axis=-1, keepdims=True))


def eigen_directions(b):
    """Unit-norm representatives of L (G diag(1,−1,0..) G) and M (a signed 4-cycle), and G/|G|."""
    g = np.eye(b) - 1.0 / b
    dl = g @ np.diag([1.0, -1.0] + [0.0] * (b - 2)) @ g
    dm = np.zeros((b, b))
    for (i, j), s in {(0, 1): 1, (0, 2): -1, (1, 3): -1, (2, 3): 1}.items():
        dm[i, j] = dm[j, i] = s
    return {"G": g / np.linalg.norm(g), "L": dl / np.linalg.norm(dl), "M": dm / np.linalg.norm(dm)}


def forward_eigen_fd(act, b, n=400_000, n_batches=20, rel_step=0.02, seed=0):
    """⟨G (∂V_Bφ/∂Σ){Δ} G, Δ⟩ for Δ in L and M by central differences with common random numbers.

    Returns {name: (mean, standard error over batches)}.
    """
    rng = np.random.default_rng(seed)
    s0 = sigma_star(act, b)
    g = np.eye(b) - 1.0 / b
    t = rel_step * s0[0, 0]
    out = {}
    for name in ("L", "M"):
        d = eigen_directions(b)[name]
        vals = []
        for _ in range(n_batches):
            z = rng.standard_normal((n // n_batches, b))
            acc = 0.0
            for sign in (1.0, -1.0):
                ch = np.linalg.cholesky(s0 + sign * t * d)
                x = bn_phi(act, z @ ch.T)
                gx = x @ g
                acc += sign * np.mean(np.einsum("ni,ij,nj->n", gx, d, gx))
            vals.append(acc / (2 * t))
        vals = np.array(vals)
        out[name] = (vals.mean(), vals.std(ddof=1) / math.sqrt(n_batches))
    return out


def backward_eigen_autograd(act, b, n=20_000, n_batches=10, seed=0):
    """⟨Δ, G E[Jᵀ Δ J] G⟩ for Δ ∈ {G, L, M} (unit norm) with J = dB_φ(h)/dh by torch autograd, h ~ N(0, Σ*)."""
    import torch
    from torch.func import jacrev, vmap

    s0 = torch.tensor(sigma_star(act, b), dtype=torch.float64)
    ch = torch.linalg.cholesky(s0)
    gen = torch.Generator().manual_seed(seed)
    g = torch.eye(b, dtype=torch.float64) - 1.0 / b

    def bphi(h):
        gh = h - h.mean()
        return act.torch(math.sqrt(b) * gh / torch.linalg.norm(gh))

    dirs = {k: torch.tensor(v) for k, v in eigen_directions(b).items()}
    res = {k: [] for k in dirs}
    for _ in range(n_batches):
        h = torch.randn(n // n_batches, b, generator=gen, dtype=torch.float64) @ ch.T
        jac = vmap(jacrev(bphi))(h)  # (n, B, B): jac[n, i, j] = ∂B_i/∂h_j
        for k, d in dirs.items():
            m = torch.einsum("nia,ij,njb->nab", jac, d, jac)  # Jᵀ Δ J
            res[k].append(float(torch.einsum("ab,nab->n", g @ d @ g, m).mean()))
    out = {}
    for k, v in res.items():
        v = np.array(v)
        scale = 1.0
        out[k] = (v.mean() * scale, v.std(ddof=1) / math.sqrt(len(v)))
    return out


# ---------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------
BATCHES = [4, 5, 8, 32, 128]


@pytest.mark.parametrize("b", [8, 32, 128, 1024])
@pytest.mark.parametrize("name,kw", [("leaky_relu", {"slope": 0.2}), ("abs", {}), ("alpha_relu", {"alpha": 1.5})])
def test_kinked_gegenbauer_vs_laplace(name, kw, b):
    # Thm 3.8/F.22/F.24 by the Gegenbauer series (single-point tails summed through E f², E x² f²) vs
    # Thm F.33 (Laplace, ≈1e-13).  Measured ≤ 3e-14 (B ≤ 128), ≤ 2e-12 (B = 1024); before the tail
    # summation the extrapolated series was 5e-9 (leaky relu, B = 128) and 1.6e-6 (abs, B = 1024) off.
    act = get_activation(name, **kw)
    lap = forward_eigenvalues(act, b, method="laplace")
    geg = forward_eigenvalues(act, b, method="gegenbauer")
    for f in ("lambda_L", "lambda_M"):
        ref, val = getattr(lap, f), getattr(geg, f)
        assert val == pytest.approx(ref, rel=1e-9), f
        assert abs(val - ref) <= geg.truncation_error + 1e-11 * abs(ref), f


def test_relu_gegenbauer_at_b1024():
    # measured 3e-13 (λ_L), 7e-13 (λ_M) vs Thm 3.7; was 4.3e-7, 1.6e-7 with the extrapolated series (43 s)
    closed = forward_eigenvalues("relu", 1024, method="closed")
    geg = forward_eigenvalues("relu", 1024, method="gegenbauer")
    assert closed.lambda_L == pytest.approx(geg.lambda_L, rel=1e-11)
    assert closed.lambda_M == pytest.approx(geg.lambda_M, rel=1e-11)


def test_identity_closed_form_value():
    for b in (4, 10, 1000, 10**6):
        ev = forward_eigenvalues("identity", b)
        assert ev.lambda_L == ev.lambda_M == pytest.approx((b - 1) / (b + 1), rel=1e-15)


def test_relu_limits_thm_3_7():
    # λ_L↑ ↗ 1 and λ_M↑ ↗ π/(2(π−1)) as B → ∞ (Thm 3.7)
    prev = None
    for b in (4, 8, 64, 1024, 10**5, 10**7):
        ev = forward_eigenvalues("relu", b)
        if prev is not None:
            assert ev.lambda_L > prev.lambda_L and ev.lambda_M > prev.lambda_M
        prev = ev
    assert prev.lambda_L == pytest.approx(1.0, abs=1e-5)
    assert prev.lambda_M == pytest.approx(math.pi / (2 * (math.pi - 1)), abs=1e-5)


@pytest.mark.parametrize("b", [4, 5, 8, 32, 128])
def test_alpha_relu_laplace_closed_form_vs_sphere_and_gegenbauer(b):
    # Thm F.33 (Laplace method, J_φ hypergeometric) vs two numerical routes
    act = get_activation("alpha_relu", alpha=0.5)
    lap = forward_eigenvalues(act, b, method="laplace")
    sphere = forward_eigenvalues(act, b, method="sphere")
    assert lap.lambda_L == pytest.approx(sphere.lambda_L, rel=1e-9)
    assert lap.lambda_M == pytest.approx(sphere.lambda_M, rel=1e-9)
    # √-kink: b_l² ~ l^{-3}, yet with the single-point tails summed: measured ≤ 4e-10 (B = 4), ≤ 2e-13 (B ≥ 8)
    geg = forward_eigenvalues(act, b, method="gegenbauer")
    assert lap.lambda_L == pytest.approx(geg.lambda_L, rel=1e-8)
    assert lap.lambda_M == pytest.approx(geg.lambda_M, rel=1e-8)


@pytest.mark.parametrize("name,kw", [("relu", {}), ("leaky_relu", {"slope": 0.3}), ("alpha_relu", {"alpha": 1.5}), ("abs", {})])
def test_laplace_vs_sphere_for_homogeneous_phi(name, kw):
    act = get_activation(name, **kw)
    for b in (5, 16):
        lap, sphere = forward_eigenvalues(act, b, method="laplace"), forward_eigenvalues(act, b, method="sphere")
        assert lap.lambda_L == pytest.approx(sphere.lambda_L, rel=1e-9)
        assert lap.lambda_M == pytest.approx(sphere.lambda_M, rel=1e-9)


@pytest.mark.parametrize("name", ["tanh", "relu", "sin"])
def test_montecarlo_within_three_standard_errors(name):
    b = 8
    ref = forward_eigenvalues(name, b, method="sphere")
    mc = forward_eigenvalues(name, b, method="montecarlo", n_samples=200_000, seed=1)
    assert abs(mc.lambda_L - ref.lambda_L) < 3 * mc.stderr[0]
    assert abs(mc.lambda_M - ref.lambda_M) < 3 * mc.stderr[1]


@pytest.mark.parametrize("name,b", [("tanh", 6), ("relu", 5), ("identity", 6)])
def test_every_method_agrees_with_direct_jacobian_of_the_forward_map(name, b):
    act = get_activation(name)
    direct = forward_eigen_fd(act, b, n=200_000, n_batches=20, seed=2)
    for method in ("sphere", "gegenbauer", "montecarlo") + (("closed",) if name != "tanh" else ()):
        ev = forward_eigenvalues(act, b, method=method, n_samples=100_000)
        for key, val in (("L", ev.lambda_L), ("M", ev.lambda_M)):
            mean, se = direct[key]
            # 3 standard errors of the direct route, 1e-3 relative for the finite-difference bias
            assert abs(val - mean) < 3 * se + 1e-3 * abs(val), (method, key, val, mean, se)


def test_montecarlo_is_reproducible():
    a = forward_eigenvalues("tanh", 8, method="montecarlo", n_samples=5000, seed=7)
    b = forward_eigenvalues("tanh", 8, method="montecarlo", n_samples=5000, seed=7)
    # same draws; equal up to the rounding of BLAS sums, which no BLAS promises bit-identical
    assert a.method == b.method and a.stderr == pytest.approx(b.stderr, rel=1e-12, abs=1e-15)
    assert (a.lambda_G, a.lambda_L, a.lambda_M) == pytest.approx((b.lambda_G, b.lambda_L, b.lambda_M), rel=1e-12, abs=1e-15)


def test_b3_warns_and_has_no_m_eigenvalue():
    with pytest.warns(SmallBatchWarning):
        ev = forward_eigenvalues("tanh", 3)
    assert ev.lambda_M is None and 0 < ev.lambda_L < 1


@pytest.mark.parametrize("n_terms", [None, 600])
def test_gegenbauer_large_b_finite_and_matches_sphere(n_terms):
    # Regression: λ_M↑ used N_l = exp(log N_l), which overflows at B = 1024 beyond ~300 terms
    # (n_terms=600 raised "not finite").  In the orthonormal form the tanh series is complete to
    # < 1e-15 by 160 terms, so the only errors are the sphere's (≈1e-10 relative, module docstring)
    # and rounding; 1e-8 leaves margin (measured 4e-12 for both eigenvalues).
    b = 1024
    sphere = forward_eigenvalues("tanh", b, method="sphere")
    geg = forward_eigenvalues("tanh", b, method="gegenbauer", n_terms=n_terms)
    assert math.isfinite(geg.lambda_M) and math.isfinite(geg.lambda_L)
    assert geg.lambda_L == pytest.approx(sphere.lambda_L, rel=1e-8)
    assert geg.lambda_M == pytest.approx(sphere.lambda_M, rel=1e-8)


def test_gegenbauer_b3_clear_error():
    with pytest.warns(SmallBatchWarning):
        with pytest.raises(ValueError, match=r"batch_size >= 4.*method='sphere'"):
            forward_eigenvalues("tanh", 3, method="gegenbauer")
