"""Simulated finite networks against the mean field theory (Yang et al. 2019).

References are the closed forms and the Gegenbauer quadrature of tests/sim/_reference.py
(independent of the simulator and of bnlab.theory).  The simulated values, their intervals and
bnlab.theory's predictions are read from bnlab.compare.compare_with_theory, the one function that
puts a simulation beside the theory (its own tests: tests/test_compare.py); the predictions are
checked against the references here as well.

Tolerances
----------
A simulated rate differs from the mean field value by (i) Monte Carlo error of the finite
ensemble, quantified by its bootstrap CI over networks, and (ii) a finite-width bias O(1/N).
The bias was measured with the 1/width scan (yang2019_width and the runs recorded in
docs/sim.md): |λ_G(N) − λ_G| ≈ 2/N at worst among relu/tanh at B ∈ {8, 32} (tanh, B = 32:
+0.019 at N = 128, +0.0078 at N = 256, +0.0035 at N = 512).  The default-run tests allow the
CI half-width plus 4/N (twice the measured bias).  The width-1000 tests (100 networks,
depth 30; ≈ 4 s each with conditional sampling of the Gaussian layers, bnlab.sim.conditional)
assert the 3 % criterion of the brief, and the CI criterion where the O(1/N) bias is below the
CI half-width (relu at B ∈ {8, 32}, tanh at B = 8; for tanh at B = 32 the bias ≈ 2/N = 0.002
exceeds the half-width ≈ 0.0008).

The default `weight_sampling="auto"` runs these on conditional sampling; the explicit-weight
route is checked against the theory in test_gradient_explosion_rate_explicit_weights.
"""
import numpy as np
import pytest

from bnlab.compare import compare_with_theory
from bnlab.sim import simulate
from tests.sim import _reference as ref


def _theory_grad_rate(phi, b):
    if phi == "relu":
        return ref.relu_grad_rate(b)
    return ref.gegenbauer_theory(np.tanh, b)["grad_rate"]


def _check_rate(comparison, reference, width):
    """The simulated rate within its interval's half-width plus 4/N of the independent reference,
    and bnlab.theory's prediction equal to the reference (closed forms: rounding; the tanh
    quadrature reference: ≤ 1e-9 at these B)."""
    assert comparison.theory == pytest.approx(reference, rel=1e-8)
    lo, hi = comparison.ci
    sim = comparison.simulated
    tol = max(sim - lo, hi - sim) + 4.0 / width
    assert abs(sim - reference) <= tol, (comparison, reference, tol)


@pytest.mark.parametrize("phi", ["relu", "tanh"])
@pytest.mark.parametrize("b", [8, 32])
def test_gradient_explosion_rate_small(phi, b):
    width = 256
    res = simulate(phi, b, width, 16, 16, seed=100 + b, dtype="float32")
    comp = compare_with_theory(res, quantities=("grad_explosion_rate", "weight_grad_explosion_rate"))
    _check_rate(comp["grad_explosion_rate"], _theory_grad_rate(phi, b), width)
    # App. L / §3.1: the weight gradients explode at the same rate
    _check_rate(comp["weight_grad_explosion_rate"], _theory_grad_rate(phi, b), width)


def test_gradient_explosion_rate_explicit_weights():
    # the same check on explicitly drawn weights (the route the naive reference pins exactly)
    width = 256
    res = simulate("relu", 8, width, 16, 16, seed=108, dtype="float32", weight_sampling="explicit")
    _check_rate(compare_with_theory(res, quantities="grad_explosion_rate")["grad_explosion_rate"],
                _theory_grad_rate("relu", 8), width)


@pytest.mark.parametrize("phi", ["relu", "tanh"])
@pytest.mark.parametrize("b", [8, 32])
def test_gradient_explosion_rate_width_1000(phi, b):
    # Criterion (the brief's): within 3 % of the theory, and inside the confidence interval.  The
    # fit's 95 % CI would fail 1 seed in 20 by construction (measured over seeds 0–4: tanh B = 8
    # once just outside), so the CI is widened to 99.9 % (half-width × 3.29/1.96).  Tanh at B = 32
    # has a finite-width bias ≈ +2/N (+0.12 … +0.23 % over seeds 0–4, larger than the CI
    # half-width ≈ 0.06 %; the width experiment measures its 1/N slope), added to its tolerance.
    res = simulate(phi, b, 1000, 30, 100, seed=7 + b, dtype="float32")
    assert res.config["weight_sampling"] == "conditional"
    fit = res.grad_explosion_rate()
    theory = _theory_grad_rate(phi, b)
    half_width = (fit.ci_high - fit.ci_low) / 2 * (3.29 / 1.96)
    bias = 2.0 / 1000 * theory if (phi == "tanh" and b == 32) else 0.0
    print(f"{phi} B={b}: simulated {fit.rate:.4f} CI {fit.ci} theory {theory:.4f} "
          f"deviation {fit.rate - theory:+.5f}, tolerance {half_width + bias:.5f}")
    assert abs(fit.rate / theory - 1) < 0.03
    assert abs(fit.rate - theory) <= half_width + bias


@pytest.mark.parametrize(
    "phi,b,width,networks,depth,rho0,theory",
    [
        ("identity", 8, 256, 16, 30, 0.3, ref.identity_cross_batch_rate(8)),
        ("relu", 32, 512, 32, 12, 0.1, ref.relu_cross_batch_rate(32)),
    ],
)
def test_cross_batch_correlation_decays_at_theory_rate(phi, b, width, networks, depth, rho0, theory):
    # The centered cross-batch correlation is the M̃ mode of the linearized Eq. 20 (Thm H.13).
    # Inputs start weakly correlated (ρ₀) so the fit window (ρ̄ ≤ 0.5 and ≥ 8 standard errors)
    # is in the linear regime (relu: the quadratic term of J_1 is ρ/π relative, < 3 % for ρ < 0.1).
    # 8 batches per network give 7 exchangeable pairs (0, j) for the average.
    res = simulate(phi, b, width, depth, networks, num_batches=8, input_correlation=rho0,
                   measure_gradients=False, seed=3, dtype="float32")
    x = compare_with_theory(res, quantities="cross_batch_rate")["cross_batch_rate"]
    assert x.theory == pytest.approx(theory, rel=1e-8)  # bnlab.theory's closed forms vs the reference's
    assert x.layers[1] - x.layers[0] >= 3
    assert abs(x.simulated / theory - 1) < 0.05, (x, theory)


@pytest.mark.parametrize("phi,b", [("relu", 8), ("tanh", 8), ("relu", 32)])
def test_covariance_approaches_bsb1_fixed_point(phi, b):
    if phi == "relu":
        q_star, c_star = ref.relu_bsb1(b)
    else:
        g = ref.gegenbauer_theory(np.tanh, b)
        q_star, c_star = g["q_star"], g["c_star"]
    width, n = 512, 16
    res = simulate(phi, b, width, 12, n, measure_gradients=False, seed=1, dtype="float32")
    # Past the transient (layers 6..12): average over 7 layers × 16 networks.  Each Σ^l entry has
    # sd ≈ q·sqrt(2/N) ≈ 0.06q; the mean of q over B diagonal entries and 112 samples has
    # sd ≈ 0.06q/sqrt(112·B) < 2e-3 q, the bias is O(B/N) (≈ 0.3 % at B=8, 1 % at B=32 for c).
    comp = compare_with_theory(res, quantities=("q_star", "c_star"), state_layers=(6, 12))
    # bnlab.theory's fixed point is the reference's (closed form for relu; quadrature ≤ 1e-9 for tanh)
    assert comp["q_star"].theory == pytest.approx(q_star, rel=1e-8)
    assert comp["c_star"].theory == pytest.approx(c_star, rel=1e-8)
    q_sim, c_sim = comp["q_star"].simulated, comp["c_star"].simulated
    assert q_sim == pytest.approx(q_star, rel=0.01 + 0.5 * b / width)
    assert c_sim == pytest.approx(c_star, abs=0.005 + 0.5 * b / width * abs(c_star))
    d = res.bsb1_distance(q_star, c_star).mean(0)
    # converges from the input covariance (≈ I) to a fluctuation floor ~ sqrt(2B²/N)/‖Σ*‖ relative
    assert d[-1] < 0.5 * d[0]
    assert d[-1] < 2.0 * np.sqrt(2.0 / width) * q_star * b / np.sqrt(b * q_star**2 + b * (b - 1) * (q_star * c_star) ** 2)


def test_agrees_with_theory_engine():
    res = simulate("relu", 8, 256, 20, 16, seed=9, dtype="float32")
    _check_rate(compare_with_theory(res)["grad_explosion_rate"], ref.relu_grad_rate(8), 256)


def test_theory_engine_cross_batch_rate_matches_references_when_present():
    theory = pytest.importorskip("bnlab.theory.cross_batch")
    for phi, b, expected in (("identity", 8, ref.identity_cross_batch_rate(8)),
                             ("relu", 32, ref.relu_cross_batch_rate(32))):
        val = theory.cross_batch_rate(phi, b)
        val = float(getattr(val, "rate", val))
        assert val == pytest.approx(expected, rel=1e-6)


def test_gradient_explosion_rate_heavy_tailed_batch_of_4():
    # At B = 4 a BN neuron's backward gain ∝ 1/χ²_3 has infinite variance, the gradient norms are
    # heavy-tailed across networks, and the log of the ensemble mean underestimates the rate
    # (bnlab.sim.fit).  Ten ensembles as in the paper's Fig. 1a (relu, width 1000, 200 networks),
    # depth 40: the step-ratio estimator, pooled over them (10 × 200 networks), is within 1.5 % of
    # Thm 3.10 (measured −0.4 % over 20 ensembles: the −5.7/N finite-width bias plus noise; the
    # sd of a 10-ensemble mean is ≈ 0.3 %), while the log-mean estimator's average is low by more
    # than 0.5 % (measured −1.3 % over 20 ensembles).  On the same ensembles the two differ by
    # 0.6–0.9 % (less noisy than either): > 0.3 % is required, so the test fails if λ_G falls back
    # to the log-mean estimator.
    theory = _theory_grad_rate("relu", 4)
    step, logm = [], []
    for seed in range(10):
        res = simulate("relu", 4, 1000, 40, 200, seed=500 + seed, dtype="float32")
        step.append(res.grad_explosion_rate().rate)
        logm.append(res.grad_explosion_rate(estimator="log_mean").rate)
    print(f"B=4: step ratio {np.mean(step):.4f}, log mean {np.mean(logm):.4f}, theory {theory:.4f}")
    assert abs(np.mean(step) / theory - 1) < 0.015
    assert np.mean(logm) / theory - 1 < -0.005
    assert (np.mean(step) - np.mean(logm)) / theory > 0.003
