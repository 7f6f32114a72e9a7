"""Lange, Helfrich & Ye (BNP): the formula claims not covered elsewhere, each against an independent route.

Thm 1 (convergence on a scale-invariant manifold) against gradient descent on a ReLU network with a
dense autograd Hessian; Prop. 5 (the 1/q scaling) by Monte Carlo; Prop. 11 on random and
rank-deficient matrices; Thm 4's minimum over diagonal D₀ (numerical minimization; exact for a
Property-A Gram) and its strictness condition; Prop. 6's BN cost and the crossover 28N vs 6n′
(symbolic, and against the paper's own Table 1); the §4 remark on N = 1 (a one-row Ĥ against a
convolution's 𝓗̂).  Each test says how it fails when its formula is perturbed; the perturbations
were applied and seen to fail, and most are asserted in the test itself.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy.optimize import minimize

from bnlab.optim import condition_number


@pytest.fixture(autouse=True)
def _one_thread():
    # matrices of a few dozen entries: intra-op threads only add synchronization on a loaded machine
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _kappa(a: np.ndarray) -> float:
    s = np.linalg.svd(a, compute_uv=False)
    s = s[s > max(a.shape) * np.finfo(float).eps * s[0]]
    return float(s[0] / s[-1])


# --- Theorem 1 ---------------------------------------------------------------------------------------


class _TwoLayerReLU:
    """f(x) = vᵀ relu(W x) with W ∈ ℝ^{k×n}, v ∈ ℝ^k: positively scale-invariant per hidden unit
    (W_j → t W_j, v_j → v_j / t), the §3.2 example.  Teacher θ* = (W*, v*), targets y = f_θ*(X), loss
    L(θ) = ½ mean (f(x) − y)², so θ* and its whole manifold θ*(t) are global minimizers."""

    def __init__(self, seed=7, n=3, k=2, m=100):
        g = torch.Generator().manual_seed(seed)
        self.n, self.k = n, k
        self.x = torch.randn(m, n, generator=g, dtype=torch.float64)
        self.w_star = torch.randn(k, n, generator=g, dtype=torch.float64)
        self.v_star = torch.randn(k, generator=g, dtype=torch.float64)
        self.theta_star = torch.cat([self.w_star.reshape(-1), self.v_star])
        self.y = self.f(self.theta_star)
        self.gen = g

    def f(self, theta):
        w = theta[: self.k * self.n].reshape(self.k, self.n)
        return torch.relu(self.x @ w.T) @ theta[self.k * self.n:]

    def loss(self, theta):
        return 0.5 * (self.f(theta) - self.y).pow(2).mean()

    def tangent(self):
        """D_t θ*(t) at t = 1: one column per unit, (W*_j in W_j's block, −v*_j in v_j's slot)."""
        k, n = self.k, self.n
        d = torch.zeros(k * n + k, k, dtype=torch.float64)
        for j in range(k):
            d[j * n:(j + 1) * n, j] = self.w_star[j]
            d[k * n + j, j] = -self.v_star[j]
        return d

    def distance_to_manifold(self, theta) -> float:
        """min_t ‖θ − θ*(t)‖, separable per unit; each 1-D minimum is a root of the quartic
        t⁴‖W*_j‖² − t³ W*_j·W_j + t v_j v*_j − v*_j² = 0 (the derivative set to zero)."""
        k, n = self.k, self.n
        w = theta[: k * n].reshape(k, n).numpy()
        v = theta[k * n:].numpy()
        ws, vs = self.w_star.numpy(), self.v_star.numpy()
        total = 0.0
        for j in range(k):
            roots = np.roots([ws[j] @ ws[j], -ws[j] @ w[j], 0.0, v[j] * vs[j], -vs[j] ** 2])
            total += min(((w[j] - t.real * ws[j]) ** 2).sum() + (v[j] - vs[j] / t.real) ** 2
                         for t in roots if abs(t.imag) < 1e-9 and t.real > 0)
        return math.sqrt(total)


def test_theorem1_null_space_and_convergence_rate_on_the_scale_invariant_manifold():
    """Thm 1: (a) the Hessian at a minimizer annihilates Col(D_t θ*(t)); (b) under the assumption that this
    is the whole null space, gradient descent converges to the manifold at the rate
    r = max(|1 − αλ*_min|, |1 − αλ_max|), λ*_min the smallest *nonzero* eigenvalue.

    Routes: the dense autograd Hessian (float64) for (a) and for the spectrum; for (b) 200 steps of
    gradient descent from θ* + 1e-4·noise at α = 1/λ_max, measuring the exact distance to the manifold
    (per-unit quartic).  Network: 3 inputs, 2 ReLU units, 100 samples (seed 7: κ* = 35, nullity 2).
    Checked: ‖H D‖ ≤ 1e-12‖H‖; nullity = k (the assumption); every step's distance ratio ≤ r + 1e-3
    (the ε of the theorem: the iterates approach θ*(t) with t ≠ 1, whose spectrum differs slightly from
    θ*'s, and the O(‖θ − θ*‖²) remainder); the rate over the last 50 steps within 1e-3 of r (the bound is
    attained by the slowest mode).  Measured: r = 0.971398, largest step ratio r + 1e-7, last-50 rate
    r − 1e-7; the distance falls from 1.8e-4 to 1.4e-7.  Perturbations, asserted:
    (1) a direction that scales W_j alone (no 1/t on v_j) is not in the null space; (2) r computed with
    the second-smallest nonzero eigenvalue (0.946) lies below the observed rate; (3) with λ_min = 0
    the classical rate (Eq. 5) is 1 — no linear convergence — while the observed rate is < 0.98.
    """
    net = _TwoLayerReLU()
    hess = torch.autograd.functional.hessian(net.loss, net.theta_star)
    d = net.tangent()
    assert float((hess @ d).abs().max()) <= 1e-12 * float(hess.abs().max())
    not_scaling = d.clone()
    not_scaling[net.k * net.n:, :] = 0.0  # scale W_j without compensating v_j
    assert float((hess @ not_scaling).norm()) > 1e-3 * float(hess.norm())
    ev = torch.linalg.eigvalsh(hess)
    zero = ev <= 1e-10 * ev.max()
    assert int(zero.sum()) == net.k
    nonzero = ev[~zero]
    lam_min, lam_2, lam_max = float(nonzero[0]), float(nonzero[1]), float(ev[-1])
    alpha = 1.0 / lam_max
    r = max(abs(1 - alpha * lam_min), abs(1 - alpha * lam_max))
    r_second = max(abs(1 - alpha * lam_2), abs(1 - alpha * lam_max))
    theta = net.theta_star + 1e-4 * torch.randn(net.theta_star.shape, generator=net.gen, dtype=torch.float64)
    dist = []
    for _ in range(200):
        dist.append(net.distance_to_manifold(theta))
        theta.requires_grad_(True)
        (grad,) = torch.autograd.grad(net.loss(theta), theta)
        theta = (theta - alpha * grad).detach()
    ratios = np.array(dist[1:]) / np.array(dist[:-1])
    late = float(np.exp(np.log(ratios[-50:]).mean()))
    assert ratios.max() <= r + 1e-3
    assert abs(late - r) <= 1e-3
    assert late > r_second + 0.01
    assert late < 0.98


# --- Proposition 5 ------------------------------------------------------------------------------------


def test_prop5_scaled_normalized_matrix_norm_is_bounded_independently_of_the_width():
    """Prop. 5: for G ∈ ℝ^{N×n} with iid zero-mean unit-variance entries (n ≥ 3), E‖(1/q)[e, G]‖ ≤ C√N
    with C independent of n, q² = max(n/N, 1).  And (§3.3) when G's columns are centered, e ⊥ G and
    ‖[e, G]‖ = max(√N, ‖G‖) exactly.

    Routes: Monte Carlo (20 draws per n, N = 16, n from 3 to 1 024, Gaussian and Rademacher entries);
    the exact identity by SVD to 1e-12.  Measured: E‖(1/q)Ĝ‖/√N between 1.11 (n = 1 024) and 1.88 (n = N = 16), a
    constant C ≈ 1.9 ≤ √5 (the bound from Gordon's E‖G‖ ≤ √N + √n).  Checked: all ≤ 2.3, and the
    spread max/min ≤ 2.  Perturbation, asserted: without the 1/q scaling (q = 1) the ratio grows like
    √(n/N) and exceeds 8 at n = 1 024 — no n-independent C.
    """
    rng = np.random.default_rng(0)
    n_batch = 16
    scaled, unscaled = {}, {}
    for n in (3, 8, 16, 64, 256, 1024):
        q = math.sqrt(max(n / n_batch, 1.0))
        vals, raw = [], []
        for draw in range(20):
            g = rng.standard_normal((n_batch, n)) if draw % 2 == 0 else rng.choice([-1.0, 1.0], size=(n_batch, n))
            g_hat = np.hstack([np.ones((n_batch, 1)), g])
            norm = np.linalg.norm(g_hat, 2)
            vals.append(norm / q / math.sqrt(n_batch))
            raw.append(norm / math.sqrt(n_batch))
        scaled[n], unscaled[n] = float(np.mean(vals)), float(np.mean(raw))
    assert max(scaled.values()) <= 2.3
    assert max(scaled.values()) / min(scaled.values()) <= 2.0
    assert unscaled[1024] > 8.0
    # exact: centered columns are orthogonal to e
    g = rng.standard_normal((n_batch, 40))
    gc = (g - g.mean(0)) / g.std(0)
    g_hat = np.hstack([np.ones((n_batch, 1)), gc])
    assert np.linalg.norm(g_hat, 2) == pytest.approx(max(math.sqrt(n_batch), np.linalg.norm(gc, 2)), rel=1e-12)


# --- Proposition 11 -----------------------------------------------------------------------------------


@pytest.mark.parametrize("m,n,rank,seed", [(20, 5, 5, 0), (6, 10, 6, 1), (30, 8, 4, 2), (12, 12, 12, 3)])
def test_prop11_kappa_of_hts_h_at_most_kappa_h_squared_times_kappa_s(m, n, rank, seed):
    """Prop. 11: κ(ĤᵀSĤ) ≤ κ(Ĥ)² κ(S) for S SPD and any Ĥ ∈ ℝ^{m×n}, κ over the nonzero singular values
    (§1's definition for singular or rectangular matrices: ``bnlab.optim.condition_number``).

    Route: random Ĥ of the given rank (tall, wide, rank-deficient, square) with column scales over four
    decades and S = diag of values over three decades, and S a dense SPD matrix; dense SVD.  Checked
    with 1e-9 slack.  Perturbation, asserted: the product form κ(Ĥ)κ(S) (no square, the rule for square
    invertible factors) fails already with S = I, where κ(ĤᵀĤ) = κ(Ĥ)² exactly.
    """
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((m, rank)) @ rng.standard_normal((rank, n)) * np.exp(rng.uniform(-4.6, 4.6, size=n))
    ht = torch.tensor(h)
    for s in (np.diag(np.exp(rng.uniform(-3.5, 3.5, size=m))),
              (lambda a: a @ a.T + 0.1 * np.eye(m))(rng.standard_normal((m, m)))):
        st = torch.tensor(s)
        lhs = condition_number(ht.T @ st @ ht)
        assert lhs <= condition_number(ht) ** 2 * condition_number(st) * (1 + 1e-9)
    eye = torch.eye(m, dtype=torch.float64)
    assert condition_number(ht.T @ eye @ ht) == pytest.approx(condition_number(ht) ** 2, rel=1e-6)
    if condition_number(ht) > 2:
        assert condition_number(ht.T @ ht) > condition_number(ht) * condition_number(eye)


# --- Theorem 4: min over D₀ and strictness --------------------------------------------------------------


def _bnp_parts(h: np.ndarray):
    n_rows = h.shape[0]
    e = np.ones((n_rows, 1))
    mu = h.mean(0)
    hc = h - mu
    return np.hstack([e, h]), np.hstack([e, hc]), np.hstack([e, hc / hc.std(0)]), mu, hc


def _min_over_diagonal(hu: np.ndarray, starts: np.ndarray) -> float:
    """min over positive diagonal D₀ of κ(ĤU D₀) by Nelder–Mead on log D₀ (first entry fixed to 1: κ is
    scale invariant), best of several starts: an upper bound on the true minimum."""
    f = lambda z: math.log(_kappa(hu * np.exp(np.r_[0.0, z])))
    opts = dict(xatol=1e-10, fatol=1e-13, maxiter=20_000, maxfev=20_000)
    return math.exp(min(minimize(f, x0, method="Nelder-Mead", options=opts).fun for x0 in starts))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_theorem4_equilibration_is_the_minimum_over_d0_when_property_a_holds(seed):
    """Thm 4's remark: if UᵀĤᵀĤU has Property A the scaling D is optimal, κ(Ĝ) = min_{D₀} κ(ĤUD₀)
    (Forsythe–Straus).  With n = 2 features the Gram [[N, 0, 0], [0, c₁₁, c₁₂],
    [0, c₁₂, c₂₂]] is bipartite ({e, h₁} | {h₂}), so Property A holds.

    Route: min over D₀ by multi-start Nelder–Mead on log D₀ (10 starts); equality to 1e-7 relative.
    Perturbation: giving Ĝ one column scaled by 1.1 (a non-equilibrated D) raises κ above the minimum —
    asserted (> 1e-3 relative).
    """
    rng = np.random.default_rng(seed)
    h = (rng.standard_normal((12, 2)) + 3 * rng.standard_normal(2)) * np.exp(2 * rng.standard_normal(2))
    _, hu, g_hat, _, _ = _bnp_parts(h)
    best = _min_over_diagonal(hu, rng.standard_normal((10, 2)) * 3)
    assert _kappa(g_hat) == pytest.approx(best, rel=1e-7)
    off = g_hat * np.array([1.0, 1.1, 1.0])
    assert _kappa(off) > best * (1 + 1e-3)


def test_theorem4_bound_against_the_best_diagonal_scaling_found():
    """Thm 4: κ(Ĝ) ≤ √(n+1) · min_{D₀} κ(ĤUD₀) — tested against the best D₀ a multi-start Nelder–Mead
    finds (an upper bound on the minimum, so a violation here would disprove the theorem), started
    from D itself so that the best found is never worse than the equilibration.

    10 random Ĥ (N = 20, n = 6, correlated features, means and column scales over two decades).
    Measured: κ(Ĝ)/min between 1.02 and 1.14 against √7 = 2.65 (30 instances, 6 starts each: ≤ 1.19) — the factor is pessimistic, as the paper says.
    Perturbation, asserted: dropping the factor (claiming D is optimal for every Ĥ) fails — on some
    instance κ(Ĝ) exceeds the best κ(ĤUD₀) by more than 5 %.
    """
    rng = np.random.default_rng(0)
    worst = 0.0
    for _ in range(10):
        n = 6
        h = (rng.standard_normal((20, n)) @ rng.standard_normal((n, n)) + 3 * rng.standard_normal(n)) * np.exp(
            1.5 * rng.standard_normal(n))
        _, hu, g_hat, _, hc = _bnp_parts(h)
        best = _min_over_diagonal(hu, -np.log(hc.std(0))[None, :])  # started from the equilibration itself
        ratio = _kappa(g_hat) / best
        assert ratio <= math.sqrt(n + 1) * (1 + 1e-9)
        worst = max(worst, ratio)
    assert worst > 1.05


def test_theorem4_strictness_needs_mu_not_orthogonal_to_the_principal_component():
    """Thm 4: κ(ĤU) ≤ κ(Ĥ), strict if μ_H ≠ 0 is not orthogonal to x_max (the top principal direction
    of the centered data).

    Route: dense SVD of Ĥ = [e, H] and ĤU = [e, H − eμᵀ] with H = centered data + a shift s.  Checked:
    s = 5·x_max: strict, by > 10 % (measured 35 %); s = 0: equal to 1e-12.  Perturbation of the condition (claiming
    strictness whenever μ ≠ 0), asserted to fail: s = 2·x_mid (a middle principal direction, ⊥ x_max)
    gives κ(Ĥ) = κ(ĤU) to 1e-12 although μ ≠ 0.
    """
    rng = np.random.default_rng(0)
    hc = rng.standard_normal((15, 3)) * np.array([5.0, 1.0, 0.3])
    hc = hc - hc.mean(0)
    _, vecs = np.linalg.eigh(hc.T @ hc)
    x_max, x_mid = vecs[:, -1], vecs[:, 1]
    for shift, strict in ((5 * x_max, True), (np.zeros(3), False), (2 * x_mid, False)):
        h_hat, hu, _, mu, _ = _bnp_parts(hc + shift)
        assert _kappa(hu) <= _kappa(h_hat) * (1 + 1e-12)
        if strict:
            assert _kappa(h_hat) > 1.1 * _kappa(hu)
        else:
            assert _kappa(h_hat) == pytest.approx(_kappa(hu), rel=1e-12)
    assert np.linalg.norm(2 * x_mid) > 1  # μ ≠ 0 in the third case


# --- Proposition 6: BN's cost and the crossover ----------------------------------------------------------


def test_prop6_bn_cost_and_the_28n_vs_6n_crossover():
    """Prop. 6 and §3.3: BNP costs 4n N + 6n n′ + 2n′ + 8n per step; BN costs (4nN + 7n) for the statistics
    and running averages + 4nN for normalization + (24nN − 3n) for the backward pass = 32nN + 4n; so,
    ignoring first-order terms, BN is cheaper iff 28N < 6n′ (n = n_{ℓ−1} inputs, n′ = n_ℓ outputs).

    Routes: symbolic (sympy) sums and the exact crossover of the two polynomials; then the paper's own
    Table 1 (seconds per epoch of its 2×100 network): BN faster at mini-batch 16, BNP at 256 and 512 —
    the crossover N* = 6n′/28 = 21.4 for n′ = 100 separates them.  Perturbations, asserted: a BN total of
    28nN + 4n (dropping the forward normalization's 4nN) moves the crossover to 24N = 6n′ (N* = 25), and
    the exact crossover n′* = (28N n − 4n)/(6n + 2) approaches (28N − 4)/6 as n → ∞ and 28N/6 only when
    N is large too.
    Also recorded (not a perturbation): the paper's own FC runs at mini-batch 6 and 1 have 28N = 168, 28
    < 6n′ = 600, so by Prop. 6 BN is the cheaper there — "we expect 28N > 6n′" holds for its batch-60 runs.
    """
    import sympy as sp

    n, n_out, nb = sp.symbols("n n_out N", positive=True)
    bnp = 4 * n * nb + 6 * n * n_out + 2 * n_out + 8 * n
    bn_parts = (4 * n * nb + 7 * n) + 4 * n * nb + (24 * n * nb - 3 * n)
    assert sp.expand(bn_parts - (32 * n * nb + 4 * n)) == 0
    diff = sp.expand(bnp - bn_parts)
    assert sp.expand(diff - (n * (6 * n_out - 28 * nb) + 2 * n_out + 4 * n)) == 0
    # leading-order crossover 6 n′ = 28 N
    leading = sp.Poly(diff, n).coeff_monomial(n)
    assert sp.simplify(leading - (6 * n_out - 28 * nb + 4)) == 0
    exact = sp.solve(sp.Eq(diff, 0), n_out)[0]
    assert sp.simplify(exact - (28 * nb * n - 4 * n) / (6 * n + 2)) == 0
    assert sp.simplify(sp.limit(exact, n, sp.oo) - (28 * nb - 4) / 6) == 0
    assert sp.limit(sp.limit(exact, n, sp.oo) / nb, nb, sp.oo) == sp.Rational(28, 6)
    # the perturbed BN total (no forward normalization) moves the crossover
    perturbed = sp.solve(sp.Eq(sp.Poly(sp.expand(bnp - (28 * n * nb + 4 * n)), n).coeff_monomial(n), 0), n_out)[0]
    assert sp.simplify(perturbed - (24 * nb - 4) / 6) == 0
    # Table 1 (n′ = 100): BN 16.08 vs BNP 16.69 s at N = 16; 10.81 vs 10.70 at 256; 10.67 vs 10.57 at 512
    table1 = {16: (16.08, 16.69), 256: (10.81, 10.70), 512: (10.67, 10.57)}
    n_star = 6 * 100 / 28
    for batch, (t_bn, t_bnp) in table1.items():
        assert (t_bn < t_bnp) == (batch < n_star)
    # the paper's own mini-batches: 60 (MNIST/CIFAR FC) is on BNP's side, 6 and 1 on BN's
    assert [28 * b > 6 * 100 for b in (60, 6, 1)] == [True, False, False]


# --- §4: mini-batch size 1 --------------------------------------------------------------------------------


def test_section4_n1_fc_cannot_be_improved_but_a_convolution_can():
    """§4: with N = 1 the FC layer's Ĥ has one row, so κ(Ĥ) = 1 and preconditioning cannot reduce it; a
    convolution's 𝓗̂ (Lemma 8, Eq. 18) has N·r·s rows, and BNP's P (Prop. 9's per-column μ_H, σ_H over
    the r·s positions) still improves it.

    Routes: Ĥ = [1, hᵀ] for one FC input (κ by SVD = 1, also after any P); for the convolution, 𝓗
    built by ``F.unfold`` (im2col, 3×3 kernel, zero padding 1) from one 3-channel 8×8 input whose
    channels have means 3, 0, −1 and scales 10, 1, 0.1, then 𝓗̂P = [e, (𝓗 − eμ_Hᵀ)/σ_H].  Measured:
    κ(𝓗̂) = 270, κ(𝓗̂P) = 8.6.  Checked: the FC κ equals 1 to 1e-12 before and after; the conv κ drops
    by more than 20×.  Perturbation: give the convolution a 1×1 kernel on a 1×1 map (r = s = k = 1, one
    row like the FC layer) and κ = 1 again — no improvement possible, asserted.
    """
    rng = np.random.default_rng(0)
    h = rng.standard_normal(50) * np.exp(rng.uniform(-3, 3, size=50)) + 2
    h_hat = np.r_[1.0, h][None, :]
    running_mu, running_sd = h - rng.standard_normal(50), np.exp(rng.uniform(-1, 1, 50))
    p_diag = np.r_[1.0, 1 / running_sd]
    u = np.eye(51)
    u[0, 1:] = -running_mu
    assert _kappa(h_hat) == pytest.approx(1.0, abs=1e-12)
    assert _kappa(h_hat @ u @ np.diag(p_diag)) == pytest.approx(1.0, abs=1e-12)

    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 3, 8, 8, generator=g, dtype=torch.float64)
    x = x * torch.tensor([10.0, 1.0, 0.1], dtype=torch.float64)[None, :, None, None] + torch.tensor(
        [3.0, 0.0, -1.0], dtype=torch.float64)[None, :, None, None]
    cols = F.unfold(x, kernel_size=3, padding=1)[0].T.numpy()  # (r·s, C·k²) = (64, 27)
    conv_hat = np.hstack([np.ones((cols.shape[0], 1)), cols])
    mu, sd = cols.mean(0), cols.std(0)
    conv_p = np.hstack([np.ones((cols.shape[0], 1)), (cols - mu) / sd])
    assert _kappa(conv_hat) > 20 * _kappa(conv_p)
    one = F.unfold(x[:, :, :1, :1], kernel_size=1)[0].T.numpy()
    assert one.shape[0] == 1 and _kappa(np.hstack([[[1.0]], one])) == pytest.approx(1.0, abs=1e-12)


# --- §3.1 Eqs. 5-6 and §3.4's over-parametrization -----------------------------------------------------


def test_eq6_optimal_step_gives_rate_kappa_minus_one_over_kappa_plus_one():
    """§3.1, Eqs. 5-6: gradient descent at α = 2/(λ_min + λ_max) contracts ‖θ_k − θ*‖ asymptotically by
    r = (κ − 1)/(κ + 1), κ = λ_max/λ_min, and r(α) = max(|1 − αλ_min|, |1 − αλ_max|) is minimized there.

    Route: 400 steps on a random SPD quadratic (n = 12, κ = 50, float64), the rate over the last 100 steps;
    r(α) on a grid of α.  Checked: measured rate within 1e-6 of r; the grid minimum at 2/(λ_min + λ_max)
    (to the grid step).  Perturbation, asserted: r = (κ − 1)/κ (the rate at α = 1/λ_max, 0.98) misses the
    measured 0.9608 by more than 0.01.
    """
    rng = np.random.default_rng(0)
    q, _ = np.linalg.qr(rng.standard_normal((12, 12)))
    lam = np.geomspace(1.0, 50.0, 12)
    a = q @ np.diag(lam) @ q.T
    kappa = lam.max() / lam.min()
    alpha = 2 / (lam.min() + lam.max())
    theta = rng.standard_normal(12)
    norms = []
    for _ in range(400):
        norms.append(np.linalg.norm(theta))
        theta = theta - alpha * a @ theta
    rate = (norms[-1] / norms[-101]) ** (1 / 100)
    r = (kappa - 1) / (kappa + 1)
    assert rate == pytest.approx(r, abs=1e-6)
    grid = np.linspace(0.5, 1.5, 2001) * alpha
    rs = np.maximum(np.abs(1 - grid * lam.min()), np.abs(1 - grid * lam.max()))
    assert grid[np.argmin(rs)] == pytest.approx(alpha, rel=1e-3)
    assert abs(rate - (kappa - 1) / kappa) > 0.01


def test_section34_post_activation_bn_is_an_overparametrized_b01():
    """§3.4: W·B_{β,γ}(h) + b = Ŵ·B_{0,1}(h) + b̂ with Ŵ = W diag(γ), b̂ = Wβ + b, so the post-activation BN
    layer with re-scaling and re-centering is an over-parametrized B_{0,1}.

    Route: ``nn.BatchNorm1d`` with random affine parameters (train mode, batch 32, float64) against the
    re-parametrized layer with ``affine=False``; 1e-12.  Perturbation, asserted: b̂ = b + β (β not passed
    through W) does not match.
    """
    g = torch.Generator().manual_seed(0)
    n_in, n_out = 7, 5
    h = torch.randn(32, n_in, generator=g, dtype=torch.float64) * 3 + 1
    bn = torch.nn.BatchNorm1d(n_in, dtype=torch.float64)
    bn0 = torch.nn.BatchNorm1d(n_in, affine=False, dtype=torch.float64)
    with torch.no_grad():
        bn.weight.copy_(torch.rand(n_in, generator=g, dtype=torch.float64) + 0.5)
        bn.bias.copy_(torch.randn(n_in, generator=g, dtype=torch.float64))
    w = torch.randn(n_out, n_in, generator=g, dtype=torch.float64)
    b = torch.randn(n_out, generator=g, dtype=torch.float64)
    with torch.no_grad():
        lhs = bn(h) @ w.T + b
        w_hat, b_hat = w * bn.weight, w @ bn.bias + b
        rhs = bn0(h) @ w_hat.T + b_hat
        wrong = bn0(h) @ w_hat.T + (b + bn.bias[:n_out])
    torch.testing.assert_close(lhs, rhs, rtol=1e-12, atol=1e-12)
    assert float((lhs - wrong).abs().max()) > 1e-3
