"""Tests of bnlab.theory.epsilon: BN mean field theory at ε > 0 (Yang et al. 2019, §3.1.2, Fig. 5c,d).

Independent routes used here:
* closed forms at ε = 0 (Thm 3.5: relu fixed point; Thm 3.10: relu rate; Thm 3.9: linear rate);
* Monte Carlo of the finite-batch map written directly from Eq. 7 ((h − mean)/sqrt(var + ε)),
  with torch autograd for the backward Jacobian — no shared code with the quadrature.
"""
from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from bnlab.activations import get_activation
from bnlab.theory import SmallBatchWarning
from bnlab.theory._quadrature.rules import chi2_log_rule as _chi2_log_rule
from bnlab.theory._quadrature.sphere import pair_rule as _pair_rule
from bnlab.theory.epsilon import epsilon_analysis


def _j1(c):
    return (math.sqrt(1 - c * c) + (math.pi - math.acos(c)) * c) / math.pi


def _j1p(c):
    return (math.pi - math.acos(c)) / math.pi


# ---------------------------------------------------------------- quadrature rules
@pytest.mark.parametrize("b", [3, 4, 5, 8, 33, 2000, 100_000])  # B > 400 uses the Gauss–Laguerre radial rule
def test_pair_rule_reproduces_sphere_moments(b):
    # exact moments of two coordinates of v ~ Unif(S^{n-1}), n = B-1, along unit vectors
    # with cosine -1/(B-1): E x1² = 1/n, E x1x2 = -1/n², E x1⁴ = 3/(n(n+2)).  The rule is exact
    # for these polynomials up to rounding (1e-13).
    n = b - 1
    x1, x2, w = _pair_rule(b)
    assert w.sum() == pytest.approx(1.0, abs=1e-14)
    assert w @ (x1 * x1) == pytest.approx(1 / n, rel=1e-12)
    assert w @ (x1 * x2) == pytest.approx(-1 / n**2, rel=1e-10)
    assert w @ x1**4 == pytest.approx(3 / (n * (n + 2)), rel=1e-12)
    assert w @ (x1**2 * x2**2) == pytest.approx(w @ (x2**2 * x1**2), abs=1e-15)


@pytest.mark.parametrize("dof", [2, 3, 7, 100])
def test_chi2_rule_against_exact_expectations(dof):
    # E[Q/(Q+s)] has the closed form 1 - s E[1/(Q+s)], and E[1/(Q+s)] = ∫ e^{-st} (1+2t)^{-dof/2} dt;
    # checked against scipy quad (error < 1e-10) and E[Q] = dof exactly (trapezoid error < 1e-12).
    from scipy import integrate

    q, w = _chi2_log_rule(dof)
    assert w @ q == pytest.approx(dof, rel=1e-12)
    for s in (1e-3, 0.7, 50.0):
        ref = integrate.quad(lambda t: math.exp(-s * t) * (1 + 2 * t) ** (-dof / 2), 0, math.inf, epsabs=1e-14)[0]
        assert w @ (1 / (q + s)) == pytest.approx(ref, rel=1e-10)


# ---------------------------------------------------------------- ε = 0 closed forms
@pytest.mark.parametrize("b", [4, 6, 8, 32, 5000])
def test_relu_eps0_matches_thm_3_5_and_3_10(b):
    # Quadrature error for relu (kinks on arc ends) is < 1e-12; tolerance 1e-10.
    r = epsilon_analysis("relu", b, 0.0)
    c = -1.0 / (b - 1)
    assert r.q_star == pytest.approx(0.5, abs=1e-10)
    assert r.c_star == pytest.approx(_j1(c), abs=1e-10)
    rate = ((b - 1 + _j1p(c)) / (1 - _j1(c)) - 1) / (b - 3)
    assert r.grad_explosion_rate == pytest.approx(rate, rel=1e-10)


@pytest.mark.parametrize("b", [4, 5, 10])
def test_identity_eps0_rate_is_b_minus_2_over_b_minus_3(b):
    r = epsilon_analysis("identity", b, 0.0)
    assert r.grad_explosion_rate == pytest.approx((b - 2) / (b - 3), rel=1e-12)


def test_alpha_relu_homogeneous_route_matches_generic_quadrature():
    # The homogeneous path (exact Beta radial moments) vs the generic 2-D rule applied to
    # the same function given as an expression (no homogeneity metadata).  The generic rule
    # converges algebraically for relu^1.5 (φ' ~ x^0.5): measured rate error 1.9e-5, 2.4e-6,
    # 3.1e-7 at 32, 64, 128 nodes per direction, towards the homogeneous value → tolerance 5e-5.
    phi_h = get_activation("alpha_relu", alpha=1.5)
    phi_g = get_activation("relu(x)**1.5")
    assert phi_g.homogeneity is None
    for eps in (0.0, 0.2):
        a, g = epsilon_analysis(phi_h, 8, eps), epsilon_analysis(phi_g, 8, eps)
        assert a.q_star == pytest.approx(g.q_star, rel=1e-5)
        assert a.c_star == pytest.approx(g.c_star, rel=1e-5, abs=1e-6)
        assert a.grad_explosion_rate == pytest.approx(g.grad_explosion_rate, rel=5e-5)


# ---------------------------------------------------------------- continuity ε → 0
@pytest.mark.parametrize("name", ["relu", "tanh"])
def test_continuity_at_eps_to_zero(name):
    # the ε-dependence is analytic in s = Bε/μ with O(s) leading term: at ε = 1e-9 the
    # difference from ε = 0 must be < 1e-6 (c·s with c = O(1)).
    r0 = epsilon_analysis(name, 8, 0.0)
    r1 = epsilon_analysis(name, 8, 1e-9)
    assert r1.q_star == pytest.approx(r0.q_star, rel=1e-6)
    assert r1.c_star == pytest.approx(r0.c_star, rel=1e-6, abs=1e-7)
    assert r1.grad_explosion_rate == pytest.approx(r0.grad_explosion_rate, rel=1e-6)


# ---------------------------------------------------------------- Monte Carlo of Eq. 7
def _bn_eps_numpy(h, eps):
    mean = h.mean(axis=1, keepdims=True)
    var = ((h - mean) ** 2).mean(axis=1, keepdims=True)
    return (h - mean) / np.sqrt(var + eps)


def _bsb1(b, q, c):
    return q * ((1 - c) * np.eye(b) + c * np.ones((b, b)))


@pytest.mark.parametrize(
    "name,kw,eps,sw2,sb2", [("tanh", {}, 0.3, 1.5, 0.2), ("relu", {"beta": 2.0}, 0.5, 1.0, 0.0), ("relu", {}, 0.05, 1.0, 0.1)]
)
def test_fixed_point_against_monte_carlo(name, kw, eps, sw2, sb2):
    # One step of σ_w² E φ(BN_ε(h))^{⊗2} + σ_b² from h ~ N(0, Σ*) must return Σ* (fixed point);
    # averaged diagonal and off-diagonal entries compared within 3 standard errors of the
    # per-sample averages (quadrature error ≤ 1e-4 is far below the SE ≈ 1e-3).
    phi = get_activation(name, **kw)
    b = 8
    r = epsilon_analysis(phi, b, eps, sigma_w2=sw2, sigma_b2=sb2)
    assert r.converged and not r.collapsed
    sigma = _bsb1(b, r.q_star, r.c_star)
    rng = np.random.default_rng(7)
    n = 400_000
    h = rng.standard_normal((n, b)) @ np.linalg.cholesky(sigma).T
    x = phi(_bn_eps_numpy(h, eps))
    diag = sw2 * (x * x).mean(axis=1) + sb2
    s = x.sum(axis=1)
    off = sw2 * (s * s - (x * x).sum(axis=1)) / (b * (b - 1)) + sb2
    for stat, target in ((diag, r.q_star), (off, r.q_star * r.c_star)):
        se = stat.std(ddof=1) / math.sqrt(n)
        assert abs(stat.mean() - target) < 3 * se + 1e-4 * abs(target), (stat.mean(), target, se)


def test_iterated_monte_carlo_dynamics_converge_to_the_fixed_point():
    # From a generic (non-BSB1) Σ⁰, 12 layers of the MC map (n = 2e5 per layer) reach the
    # fixed point; the last 4 layers are averaged.  Per-layer MC noise on the mean diagonal
    # ≈ 2e-3 relative; the tolerance 2e-2 also covers residual transients (contraction ≈ 0.3/layer).
    phi = get_activation("tanh")
    b, eps, sw2 = 6, 0.4, 2.0
    r = epsilon_analysis(phi, b, eps, sigma_w2=sw2)
    rng = np.random.default_rng(3)
    a = rng.standard_normal((b, b))
    sigma = a @ a.T + 0.5 * np.eye(b)
    diags, offs = [], []
    for layer in range(12):
        h = rng.standard_normal((200_000, b)) @ np.linalg.cholesky(sigma + 1e-12 * np.eye(b)).T
        x = phi(_bn_eps_numpy(h, eps))
        sigma = sw2 * (x.T @ x) / h.shape[0]
        if layer >= 8:
            diags.append(np.diag(sigma).mean())
            offs.append(sigma[~np.eye(b, dtype=bool)].mean())
    assert np.mean(diags) == pytest.approx(r.q_star, rel=2e-2)
    assert np.mean(offs) == pytest.approx(r.q_star * r.c_star, rel=5e-2, abs=2e-3)


def _rate_monte_carlo(phi, b, eps, sw2, sigma, n, seed):
    """σ_w² tr(Jᵀ G J)/(B − 1) per sample, J from torch autograd through BN_ε (Eq. 7)."""
    gen = torch.Generator().manual_seed(seed)
    chol = torch.linalg.cholesky(torch.as_tensor(sigma))
    h = torch.randn(n, b, generator=gen, dtype=torch.float64) @ chol.T

    def layer(v):
        m = v.mean()
        return phi.torch((v - m) / torch.sqrt(((v - m) ** 2).mean() + eps))

    jac = torch.func.vmap(torch.func.jacrev(layer))(h)  # (n, B, B): d out_j / d in_i
    g = torch.eye(b, dtype=torch.float64) - 1.0 / b
    t = sw2 * torch.einsum("nji,jk,nki->n", jac, g, jac) / (b - 1)
    return t.numpy()


@pytest.mark.parametrize("name,kw,eps,sw2", [("tanh", {}, 0.3, 1.0), ("relu", {}, 0.1, 1.0), ("relu", {"beta": 2.0}, 0.2, 2.0)])
def test_gradient_rate_against_autograd_monte_carlo(name, kw, eps, sw2):
    # Mean of the per-sample backward factor vs quadrature, within 3 standard errors
    # (SE ≈ 3e-3 with 1e5 samples; ε > 0 bounds 1/‖Gh‖² so the variance is finite).
    phi = get_activation(name, **kw)
    b = 8
    r = epsilon_analysis(phi, b, eps, sigma_w2=sw2)
    t = _rate_monte_carlo(phi, b, eps, sw2, _bsb1(b, r.q_star, r.c_star), 100_000, 11)
    se = t.std(ddof=1) / math.sqrt(t.size)
    assert abs(t.mean() - r.grad_explosion_rate) < 3 * se + 1e-4, (t.mean(), r.grad_explosion_rate, se)


# ---------------------------------------------------------------- Fig. 5c,d claims
@pytest.mark.parametrize("name,kw", [("relu", {}), ("tanh", {}), ("relu", {"beta": 2.0})])
def test_larger_eps_reduces_gradient_explosion(name, kw):
    # Fig. 5c,d: λ_G↓ decreases monotonically with ε and stays > 1 while the BSB1 fixed point
    # is non-degenerate (ε below the collapse threshold).
    phi = get_activation(name, **kw)
    eps_grid = [0.0, 1e-3, 0.01, 0.05, 0.1, 0.2]
    rates = [epsilon_analysis(phi, 8, e).grad_explosion_rate for e in eps_grid]
    assert all(r1 > r2 for r1, r2 in zip(rates, rates[1:])), rates
    assert rates[-1] > 1.0


def test_tanh_transition_at_eps_over_sigma_w2_equal_one():
    # For φ'(0) = 1 the linearized BN gain at μ → 0 is σ_w²/ε: the non-degenerate fixed point
    # exists iff ε/σ_w² < 1, and λ_G↓ → 1 at the transition (Fig. 5c's "transition near ε ~ 1").
    below = epsilon_analysis("tanh", 8, 0.98)
    above = epsilon_analysis("tanh", 8, 1.02)
    assert not below.collapsed and 1.0 < below.grad_explosion_rate < 1.01
    assert above.collapsed and above.c_star == 1.0
    assert above.grad_explosion_rate == pytest.approx(1 / 1.02, rel=1e-12)


def test_dynamics_depend_only_on_eps_over_sigma_w2():
    a = epsilon_analysis("tanh", 8, 0.2, sigma_w2=1.0)
    b = epsilon_analysis("tanh", 8, 0.6, sigma_w2=3.0, sigma_b2=0.5)
    assert b.grad_explosion_rate == pytest.approx(a.grad_explosion_rate, rel=1e-10)
    assert b.mu_star == pytest.approx(3.0 * a.mu_star, rel=1e-10)
    assert b.q_star == pytest.approx(3.0 * a.q_star + 0.5, rel=1e-10)
    assert b.eps_ratio == pytest.approx(0.2)


# ---------------------------------------------------------------- small batches and bad input
def test_small_batches():
    with pytest.raises(ValueError, match="batch_size=2"):
        epsilon_analysis("relu", 2, 0.1)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        r0 = epsilon_analysis("relu", 3, 0.0)
        r1 = epsilon_analysis("relu", 3, 0.1)
    assert any(issubclass(w.category, SmallBatchWarning) for w in rec)
    assert r0.grad_explosion_rate == math.inf  # E[1/Q], Q ~ χ²_2, diverges
    # relu^α, α ≤ 1/2: E φ'² = ∫ |x|^{2α−2} diverges
    assert epsilon_analysis(get_activation("alpha_relu", alpha=0.5), 8, 0.1).grad_explosion_rate == math.inf
    assert math.isfinite(r1.grad_explosion_rate) and r1.grad_explosion_rate > 1


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"eps": -1e-3}, "eps"),
        ({"eps": float("nan")}, "eps"),
        ({"sigma_w2": 0.0}, "sigma_w2"),
        ({"sigma_w2": -1.0}, "sigma_w2"),
        ({"sigma_b2": -0.1}, "sigma_b2"),
        ({"method": "laplace"}, "method"),
        ({"batch_size": 1}, "batch_size"),
        ({"batch_size": 4.5}, "batch_size"),
    ],
)
def test_bad_input(kwargs, match):
    args = {"phi": "relu", "batch_size": 8, "eps": 0.1}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        epsilon_analysis(args.pop("phi"), args.pop("batch_size"), args.pop("eps"), **args)


# ---------------------------------------------------------------- cross-checks with the core modules
def test_eps0_agrees_with_core_fixed_point_and_backward_rate():
    # The core computes the ε = 0 fixed point and λ_G↓ by its own routes (Gegenbauer/sphere/closed
    # forms); both sides claim ≤ 1e-9 for smooth φ → tolerance 1e-7.
    fixed_point = pytest.importorskip("bnlab.theory.fixed_point")
    backward = pytest.importorskip("bnlab.theory.backward")
    for name in ("relu", "tanh"):
        mine = epsilon_analysis(name, 8, 0.0)
        fp = fixed_point.bsb1_fixed_point(name, 8)
        assert mine.q_star == pytest.approx(fp.q_star, rel=1e-7)
        assert mine.c_star == pytest.approx(fp.c_star, rel=1e-7, abs=1e-9)
        rate = backward.backward_eigenvalues(name, 8).lambda_G
        assert mine.grad_explosion_rate == pytest.approx(rate, rel=1e-7)


@pytest.mark.parametrize(
    "name,kw",
    [("tanh", {}), ("alpha_relu", {"alpha": 1.5}), pytest.param("relu", {"beta": 2.0}, marks=pytest.mark.slow)],
)
def test_eps_fixed_point_is_fixed_under_core_transform(name, kw):
    # σ_w² V_ε(Σ*) + σ_b² = Σ* with V_ε from the core's deterministic isotropic route at ε > 0
    # (≈1e-13) — an independent quadrature of the same map; my error ≤ 1e-6 (kinked φ) → 1e-5.
    bm = pytest.importorskip("bnlab.theory.batchnorm_map")
    phi = get_activation(name, **kw)
    b, eps, sw2, sb2 = 7, 0.3, 1.7, 0.2
    r = epsilon_analysis(phi, b, eps, sigma_w2=sw2, sigma_b2=sb2)
    sigma = _bsb1(b, r.q_star, r.c_star)
    out = sw2 * np.asarray(bm.batchnorm_transform(phi, sigma, eps=eps)) + sb2
    assert np.allclose(out, sigma, rtol=1e-5, atol=1e-6 * r.q_star)


def test_callable_phi_matches_registered_tanh():
    # a plain callable gets a central-difference derivative (relative error ≈ 1e-9, activations.py)
    a = epsilon_analysis(np.tanh, 6, 0.2)
    b = epsilon_analysis("tanh", 6, 0.2)
    assert a.q_star == pytest.approx(b.q_star, rel=1e-12)
    assert a.grad_explosion_rate == pytest.approx(b.grad_explosion_rate, rel=1e-7)


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=20, deadline=None)
@given(
    ratio=st.floats(1e-4, 0.3),
    sw2=st.floats(0.1, 10.0),
    sb2=st.floats(0.0, 2.0),
    b=st.integers(4, 12),
    alpha=st.sampled_from([1.0, 1.5, 2.0]),
)
def test_scaling_law_property(ratio, sw2, sb2, b, alpha):
    # V_ε(tΣ) = V_{ε/t}(Σ): (ε, σ_w², σ_b²) and (ε/σ_w², 1, 0) give the same rate and
    # μ*(ε, σ_w²) = σ_w² μ*(ε/σ_w², 1); q* shifts by σ_b².  Exact up to the root finder (1e-12).
    phi = get_activation("alpha_relu", alpha=alpha)
    ref = epsilon_analysis(phi, b, ratio)
    r = epsilon_analysis(phi, b, ratio * sw2, sigma_w2=sw2, sigma_b2=sb2)
    assert r.collapsed == ref.collapsed
    assert r.grad_explosion_rate == pytest.approx(ref.grad_explosion_rate, rel=1e-9)
    assert r.mu_star == pytest.approx(sw2 * ref.mu_star, rel=1e-9, abs=1e-300)
    assert r.q_star == pytest.approx(sw2 * ref.q_star + sb2, rel=1e-9)


# ---------------------------------------------------------------- kink-aligned rule (relu(x + β))
@pytest.mark.parametrize("b", [4, 8, 32])
@pytest.mark.parametrize("k", [0.05, 0.3, 0.9, 1.5])
def test_kinked_pair_rule_reproduces_sphere_moments(b, k):
    from bnlab.theory._quadrature.sphere import kinked_pair_nodes as _kinked_pair_nodes

    n = b - 1
    x1, x2, w = (a[0] for a in _kinked_pair_nodes(b, np.array([k])))
    assert w.sum() == pytest.approx(1.0, abs=1e-13)
    assert w @ (x1 * x1) == pytest.approx(1 / n, rel=1e-12)
    assert w @ (x1 * x2) == pytest.approx(-1 / n**2, rel=1e-12)
    assert w @ x1**4 == pytest.approx(3 / (n * (n + 2)), rel=1e-12)


def test_shifted_relu_is_affine_on_the_b4_sphere():
    # B = 4: |u_i| ≤ √3 < 2, so relu(u + 2) = u + 2 on every batch: the rate is the linear one,
    # (B−2)/(B−3) = 2 (Thm 3.9), exactly — a check that the kink handling adds no error.
    r = epsilon_analysis(get_activation("relu", beta=2.0), 4, 0.0)
    assert r.grad_explosion_rate == pytest.approx(2.0, rel=1e-12)


@pytest.mark.parametrize(
    "b,eps", [(32, 0.0), (8, 0.1), pytest.param(8, 0.0, marks=pytest.mark.slow), pytest.param(32, 0.5, marks=pytest.mark.slow)]
)
def test_shifted_relu_self_convergence(b, eps, monkeypatch):
    # kink-aligned rule (20 radial × 16 angular per arc) vs 40 × 40: measured ≤ 2e-6 relative
    # (the unaligned rule was 4e-4 at B = 32) → tolerance 1e-5.
    from bnlab.theory._quadrature import sphere as S

    phi = get_activation("relu", beta=2.0)
    coarse = epsilon_analysis(phi, b, eps)
    orig = S.kinked_pair_nodes
    monkeypatch.setattr(S, "kinked_pair_nodes", lambda bb, k, n_radial=40, n_angular=40: orig(bb, k, n_radial, n_angular))
    fine = epsilon_analysis(phi, b, eps)
    assert coarse.q_star == pytest.approx(fine.q_star, rel=1e-8)
    assert coarse.c_star == pytest.approx(fine.c_star, rel=1e-7)
    assert coarse.grad_explosion_rate == pytest.approx(fine.grad_explosion_rate, rel=1e-5)


def test_fixed_point_by_iterating_core_montecarlo_map():
    # The brief's route (a): iterate σ_w² V_ε(Σ) + σ_b² with the core's batchnorm_transform_montecarlo
    # from a generic Σ⁰; average the last 4 of 14 layers.  Its stderr (≈1e-3 relative at 1e5 samples)
    # and the contracted transient (≈0.3^10) give the tolerance 1e-2 relative.
    bm = pytest.importorskip("bnlab.theory.batchnorm_map")
    phi = get_activation("tanh")
    b, eps, sw2, sb2 = 6, 0.25, 1.3, 0.1
    r = epsilon_analysis(phi, b, eps, sigma_w2=sw2, sigma_b2=sb2)
    a = np.random.default_rng(8).standard_normal((b, b))
    sigma = a @ a.T / b + 0.2 * np.eye(b)
    diags, offs = [], []
    for layer in range(14):
        v, _ = bm.batchnorm_transform_montecarlo(phi, sigma, n_samples=100_000, seed=100 + layer, eps=eps)
        sigma = sw2 * np.asarray(v) + sb2
        if layer >= 10:
            diags.append(np.diag(sigma).mean())
            offs.append(sigma[~np.eye(b, dtype=bool)].mean())
    assert np.mean(diags) == pytest.approx(r.q_star, rel=1e-2)
    assert np.mean(offs) == pytest.approx(r.q_star * r.c_star, rel=3e-2, abs=3e-3)


def test_sub_linear_alpha_relu_rate_converges(monkeypatch):
    # relu^0.75: φ'² ~ |x|^{-1/2} at the arc ends; the graded angular rule (256 nodes/arc) vs 1024:
    # measured 2e-9 relative → tolerance 1e-7 (ungraded Gauss–Legendre was 1.4e-3 off).
    from bnlab.theory import epsilon as E

    phi = get_activation("alpha_relu", alpha=0.75)
    coarse = epsilon_analysis(phi, 8, 0.1).grad_explosion_rate
    orig = E.angle_rule
    monkeypatch.setattr(E, "angle_rule", lambda b, n=256, graded=False: orig(b, 1024, graded))
    E._homogeneous_angular.cache_clear()
    try:
        fine = epsilon_analysis(phi, 8, 0.1).grad_explosion_rate
    finally:
        E._homogeneous_angular.cache_clear()
    assert coarse == pytest.approx(fine, rel=1e-7)


def test_the_example_table_of_the_docs_is_what_the_code_gives():
    """docs/theory-epsilon-symmetry-nngp.md's table of λ_G↓ at B = 8 is the code's, to its 5 digits: each
    cell is parsed (value and "(collapsed)") and recomputed, so a change of the numerics shows up here and
    not as a stale page.  The page states ≤ 1e-11 accuracy for these φ, far below the table's rounding
    (half a unit of the 5th digit, 5e-6 absolute; 1.5e-5 allows the rounding of values printed with fewer
    digits such as 0.5)."""
    from pathlib import Path

    page = Path(__file__).resolve().parents[2] / "docs" / "theory-epsilon-symmetry-nngp.md"
    lines = page.read_text(encoding="utf-8").split("| ε | relu λ_G↓ | tanh λ_G↓ | relu(x+2) λ_G↓ |")[1].splitlines()
    rows = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in lines[2:] if ln.startswith("|")]
    assert len(rows) == 6
    phis = (get_activation("relu"), get_activation("tanh"), get_activation("relu", beta=2.0))
    for eps_txt, *cells in rows:
        for phi, cell in zip(phis, cells):
            r = epsilon_analysis(phi, 8, float(eps_txt))
            value = float(cell.split()[0])
            assert abs(r.grad_explosion_rate - value) <= 1.5e-5, (eps_txt, phi.name, r.grad_explosion_rate, cell)
            assert r.collapsed == ("(collapsed)" in cell), (eps_txt, phi.name, cell)


@pytest.mark.parametrize("beta", [0.5, 1.0, -0.5, 2.0])
@pytest.mark.parametrize("b", [3, 4, 5, 8, 16])
def test_shifted_relu_eps_to_zero_within_stated_accuracy(beta, b):
    """ε → 0 for relu(x + β) against the ε = 0 sphere routes (kink-split).  The ε route's aligned pair rule is cut
    where its two kink lines cross (T* = 2k²(B−1)/(B−2)) and is kink-aligned at B = 3 too; without the cut it
    converged algebraically (λ_G↓ 6e-5, c* 2e-6, 2e-3 at B = 3).  Measured (bnlab.theory.epsilon,
    docs/theory-epsilon-symmetry-nngp.md): at ε = 0 (the pair rule alone) λ_G↓ ≤ 3e-10 (the sphere route's own
    error at B = 4: relu(x + 2) there is exactly 2), q*, c* ≤ 1e-14; at ε = 1e-12 q*, c* ≤ 6.2e-10 (ε's own
    effect at B = 3, ~s log(1/s), s = Bε/μ*), λ_G↓ ≤ 1e-11 for B ≥ 8 and 2.4e-9 at B = 5 (as for relu: the ε → 0
    limit of E 1/(Q + s)); at B = 4 that limit is ~5e-6 away at ε = 1e-12 (relu: 4e-6), so λ_G↓ is checked at
    ε = 0 only there."""
    from bnlab.theory import backward_eigenvalues, bsb1_fixed_point

    act = get_activation("relu", beta=beta)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        e = epsilon_analysis(act, b, 1e-12)
        e0 = epsilon_analysis(act, b, 0.0)
        fp = bsb1_fixed_point(act, b, method="sphere")
    assert abs(e0.q_star / fp.q_star - 1.0) <= 1e-12
    assert abs(e0.c_star / fp.c_star - 1.0) <= 1e-12
    assert abs(e.q_star / fp.q_star - 1.0) <= 2e-9
    assert abs(e.c_star / fp.c_star - 1.0) <= 2e-9
    if b >= 4:
        lam = backward_eigenvalues(act, b, method="sphere").lambda_G
        assert abs(e0.grad_explosion_rate / lam - 1.0) <= 1e-9
        if b >= 5:
            assert abs(e.grad_explosion_rate / lam - 1.0) <= (1e-8 if b == 5 else 1e-10)


def test_a_batch_beyond_the_quadratures_reach_is_refused():
    """Past B = 1e8 the ε quadrature drifted silently (relu, ε = 0.1: 3e-7 at 1e9, 26 % at 1e14, q* = 0 from
    1e15, an IndexError from 1e40); up to it λ_G↓ converges like 1/B (1e7 → 1e8 moves it 2.7e-8, the next
    step of a 1/B sequence is a tenth of that), so 1e8 is within 1e-8 of the B → ∞ value (Thm 3.10's limit
    at ε = 0 is π/(π−1); at ε > 0 the large-B map is the ε-regularized one)."""
    from bnlab.theory import analyze
    from bnlab.theory.epsilon import MAX_EPSILON_BATCH_SIZE

    relu = get_activation("relu")
    at_max = epsilon_analysis(relu, MAX_EPSILON_BATCH_SIZE, 0.1).grad_explosion_rate
    tenth = epsilon_analysis(relu, MAX_EPSILON_BATCH_SIZE // 10, 0.1).grad_explosion_rate
    assert abs(at_max - tenth) < 1e-7 * at_max
    for call in (lambda: epsilon_analysis(relu, MAX_EPSILON_BATCH_SIZE + 1, 0.1),
                 lambda: analyze("relu", 10**14, eps=0.1)):
        with pytest.raises(ValueError, match="batch_size=.* is not allowed for the ε analysis: expected batch_size <= 1e"):
            call()
