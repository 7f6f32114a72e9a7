"""The Fisher paper's claims not covered elsewhere: the two-sided eigenvalue bound (Eq. 147) and the
learning-rate statements of Eq. 7 and footnote 1 (η* = 2(1+μ)/λmax; the optimum η*/2).

Routes: dense Jacobians and ``eigvalsh`` of the explicit Fisher for Eq. 147 (beside bnlab's matrix-free
``curvature_spectrum``); the exact 2×2 heavy-ball iteration matrix and a direct simulation for the
learning rates.  Each test says how it fails when the formula is perturbed; the perturbations are
asserted in the tests.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from bnlab.fisher import build_model, calibrate_batchnorm_, curvature_spectrum


def _dense_fisher(model, x):
    """I = (1/m) Σ_i J_iᵀ J_i (Eqs. 10, 148), J_i the (outputs × parameters) Jacobian of f(x_i), BN in eval
    mode (each sample's output depends on its own input only); and the per-sample, per-output gradient
    rows J_ic."""
    model = model.double().eval()
    names = [n for n, _ in model.named_parameters()]
    params = tuple(p.detach().clone() for p in model.parameters())

    def f(*ps):
        return torch.func.functional_call(model, dict(zip(names, ps)), (x,))

    jac = torch.autograd.functional.jacobian(f, params)  # tuple over parameters of (m, out, *shape)
    m, out = x.shape[0], jac[0].shape[1]
    rows = torch.cat([j.reshape(m, out, -1) for j in jac], dim=-1)  # (m, out, P)
    fisher = torch.einsum("icp,icq->pq", rows, rows) / m
    return fisher, rows


@pytest.mark.parametrize("norm", ["none", "bn"])
def test_eq147_lambda_max_between_the_mean_gradient_and_the_mean_squared_gradient(norm):
    """Eq. 147 (with Eqs. 148–153): E_{x,y}⟨∇f(x), ∇f(y)⟩ ≤ λmax(I_θ) ≤ E_x⟨∇f(x), ∇f(x)⟩ — for the
    empirical Fisher of m samples, (1/m²)‖Σ_i ∇f_c(x_i)‖² ≤ λmax ≤ (1/m) Σ_i Σ_c ‖∇f_c(x_i)‖² = tr I
    (the upper bound by convexity of λmax, the lower by the Rayleigh quotient at u = 1/√m on one output).

    Route: the dense Fisher of a fc:6-16-16-3 network (vanilla, and BN in eval mode calibrated on the
    batch), m = 40, float64, eigenvalues by ``eigvalsh``; ``curvature_spectrum(curvature="fisher",
    loss="mse", bn_mode="eval")`` must give the same λmax to 1e-6.  Perturbations, asserted: on a
    batch of nearly identical inputs (x_i = x_0 + 1e-3 noise) the Fisher is nearly rank one on one
    output's gradients and λmax is within 1 % of both bounds, so halving the upper bound or doubling the
    lower bound fails there.
    """
    torch.manual_seed(0)
    spec = "fc:6-16-16-3"
    model = build_model(spec, norm=norm, gamma=1.0, seed=3).double()
    x = torch.randn(40, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    calibrate_batchnorm_(model, x)
    fisher, rows = _dense_fisher(model, x)
    lam = float(torch.linalg.eigvalsh(fisher)[-1])
    upper = float(rows.pow(2).sum() / x.shape[0])
    assert upper == pytest.approx(float(torch.trace(fisher)), rel=1e-12)
    lower = max(float(rows[:, c].sum(0).pow(2).sum()) / x.shape[0] ** 2 for c in range(rows.shape[1]))
    assert lower <= lam * (1 + 1e-12) and lam <= upper * (1 + 1e-12)
    measured = curvature_spectrum(model, x, torch.zeros(40, 3, dtype=torch.float64), curvature="fisher",
                                  loss="mse", bn_mode="eval", tol=1e-10, dtype=torch.float64).lambda_max
    assert measured == pytest.approx(lam, rel=1e-6)
    # the bounds are tight on collapsed inputs: neither may be moved by a factor 2
    xc = x[:1] + 1e-3 * torch.randn(40, 6, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    model_c = build_model("fc:6-16-16-1", norm="none", seed=3).double()
    fisher_c, rows_c = _dense_fisher(model_c, xc)
    lam_c = float(torch.linalg.eigvalsh(fisher_c)[-1])
    upper_c = float(rows_c.pow(2).sum() / 40)
    lower_c = float(rows_c[:, 0].sum(0).pow(2).sum()) / 40**2
    assert lam_c > 0.99 * upper_c and lam_c < 1.01 * lower_c
    assert lam_c > upper_c / 2 and lam_c < 2 * lower_c


def _heavy_ball_radius(eta: float, lam: float, mu: float) -> float:
    """Spectral radius of θ ← θ − ηλθ + μ(θ − θ_prev) on one eigen-mode (Eq. 1 on ½λθ²): the roots of
    z² − (1 + μ − ηλ) z + μ = 0."""
    return float(max(abs(np.roots([1.0, -(1.0 + mu - eta * lam), mu]))))


@pytest.mark.parametrize("mu", [0.0, 0.5, 0.9])
def test_eq7_stability_limit_and_footnote1_optimum_on_a_quadratic(mu):
    """Eq. 7: on the quadratic approximation, momentum GD (Eq. 1) converges iff η < η* = 2(1+μ)/λmax;
    footnote 1: the optimal learning rate is η*/2.

    Routes: (a) the exact spectral radius of the 2×2 iteration matrix of the top mode on a log grid of η
    (η*·10^(k/40)); (b) 3 000 steps of the iteration on ½θᵀAθ, A = diag(λ), λ from 1e-3 to 5: the
    iterate blows up just above η* and not just below.  Checked: ρ < 1 below η*, ρ = 1 at η*, > 1 above
    (1e-9); the η minimizing the top mode's ρ is η*/2 for μ = 0 (ρ = 0), and for μ > 0 every η in
    [(1 − √μ)²/λ, (1 + √μ)²/λ] attains the minimum √μ and η*/2 = (1+μ)/λ is exactly that interval's
    midpoint.  Perturbations, asserted: the limit without the (1+μ) factor (2/λmax) is not the boundary
    for μ > 0 (ρ < 1 there: the iteration still converges); η* itself has ρ = 1, no convergence.
    """
    lams = np.array([1e-3, 0.1, 0.7, 2.0, 5.0])
    lam_max = lams.max()
    eta_star = 2 * (1 + mu) / lam_max
    for k in range(-80, 81):
        eta = eta_star * 10 ** (k / 40)
        rho = _heavy_ball_radius(eta, lam_max, mu)
        if k < 0:
            assert rho < 1 - 1e-9
        elif k == 0:
            assert rho == pytest.approx(1.0, abs=1e-9)
        else:
            assert rho > 1 + 1e-9
    # (b) direct iteration
    for eta, explodes in ((eta_star * 0.98, False), (eta_star * 1.02, True)):
        theta = np.ones_like(lams)
        prev = theta.copy()
        for _ in range(3000):
            theta, prev = theta - eta * lams * theta + mu * (theta - prev), theta
        assert (np.abs(theta).max() > 1e3) == explodes
    # footnote 1: η*/2 is the optimum for the top mode
    half = eta_star / 2
    best = math.sqrt(mu)
    assert _heavy_ball_radius(half, lam_max, mu) == pytest.approx(best, abs=1e-6)
    lo, hi = (1 - math.sqrt(mu)) ** 2 / lam_max, (1 + math.sqrt(mu)) ** 2 / lam_max
    assert (lo + hi) / 2 == pytest.approx(half, rel=1e-12)
    grid = np.linspace(0.01, 1.99, 397) * eta_star
    radii = np.array([_heavy_ball_radius(e, lam_max, mu) for e in grid])
    assert radii.min() >= best - 1e-6
    if mu == 0.0:
        assert grid[np.argmin(radii)] == pytest.approx(half, rel=0.01)
    else:
        assert _heavy_ball_radius(2 / lam_max, lam_max, mu) < 1  # 2/λmax is not the limit when μ > 0
    assert _heavy_ball_radius(eta_star, lam_max, mu) == pytest.approx(1.0, abs=1e-9)


def test_footnote1_half_eta_star_is_optimal_for_the_top_mode_not_for_a_wide_spectrum():
    """Footnote 1 ("in the quadratic approximation the optimal learning rate is η*/2", after LeCun et al.
    2012): true for the top-curvature mode alone — η = 1/λmax = η*/2 (μ = 0) solves that mode in one
    step — but not for the rate of a whole spectrum [λmin, λmax]: minimizing the slowest mode's rate
    max_λ |1 − ηλ| gives η_opt = 2/(λmin + λmax) = η*/(1 + 1/κ), between η*/2 (κ = 1) and η* (κ → ∞).

    Route: the minimizer of the exact worst-mode rate on a fine grid of η (units of 1/λmax), for κ = 1,
    10, 100, 10⁴.  Checked: η_opt = η*/(1 + 1/κ) to the grid step; η_opt = η*/2 only at κ = 1.  So the
    footnote is the top-mode statement; the paper's Fig. 2 "dark band at ≈ η*/2" (the lowest loss after
    5 epochs) is an empirical observation, not a consequence of this quadratic argument.  Perturbation,
    asserted: claiming η_opt = η*/2 for κ = 100 misses the minimax optimum by a factor 1.98.
    """
    for kappa in (1.0, 10.0, 100.0, 1e4):
        lam_max, lam_min = 1.0, 1.0 / kappa
        eta_star = 2.0 / lam_max
        grid = np.linspace(0.5, 2.0, 30_001)  # units of 1/λmax; step 5e-5
        worst = np.maximum(np.abs(1 - grid * lam_min), np.abs(1 - grid * lam_max))
        eta_opt = grid[np.argmin(worst)]
        assert eta_opt == pytest.approx(eta_star / (1 + 1 / kappa), abs=1e-4)
        assert (abs(eta_opt - eta_star / 2) < 1e-3) == (kappa == 1.0)
        if kappa == 100.0:
            assert eta_opt / (eta_star / 2) > 1.9
