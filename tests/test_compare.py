"""bnlab.compare.compare_with_theory: a simulated ensemble beside the theory.

The theory side is checked against closed forms computed apart from bnlab.theory
(tests/sim/_reference.py: Thms 3.5, 3.10, H.14 for relu).  The simulated side is checked on
synthetic ensembles whose rates are known exactly: gradient norms built as products of iid
gains u·λ with E u = 1 (the step-ratio estimator is unbiased for them, bnlab.sim.fit), a
cross-batch correlation ρ₀λ^l with mean-one noise, and q, c with mean-zero noise, so that
every interval either must cover the theory (data made with the theory's values) or must not
(data made 10 % off, far outside intervals of half-width < 1 %).  A real simulation against the
same references is in tests/sim/test_theory_agreement.py.
"""
import json
import math

import numpy as np
import pytest

from bnlab.compare import QUANTITIES, compare_with_theory
from bnlab.sim import EnsembleResult, simulate
from tests.sim import _reference as ref

B = 32
N_NETS, DEPTH = 60, 20


def _synthetic(*, grad_rate, cross_rate, q, c, batch_size=B, eps=0.0, norm="bn", phi="relu",
               num_batches=2, seed=0):
    """An EnsembleResult whose per-layer data follow the given rates and fixed point exactly in law."""
    rng = np.random.default_rng(seed)
    n, depth = N_NETS, DEPTH
    # ‖δ^l‖² = ∏_{j ≥ l} λ u_j (u uniform on [0.8, 1.2], mean 1): each step ratio has mean exactly λ
    gains = grad_rate * rng.uniform(0.8, 1.2, size=(n, depth))
    gains[:, -1] = 1.0
    g = np.cumprod(gains[:, ::-1], axis=1)[:, ::-1]
    # ρ_l = ρ₀ λ^l (1 + 0.01 z): the log of the mean over networks is log ρ₀λ^l up to 1e-3/√n
    layers = np.arange(1, depth + 1)
    rho = 0.1 * cross_rate**layers * (1 + 0.01 * rng.standard_normal((n, depth)))
    qs = q * (1 + 0.02 * rng.standard_normal((n, depth)))
    cs = c + 0.002 * rng.standard_normal((n, depth))
    zeros = np.zeros((n, depth))
    config = dict(phi={"phi": phi} if isinstance(phi, str) else phi, batch_size=batch_size, width=1000,
                  depth=depth, networks=n, norm=norm, init="gaussian", eps=eps, sigma_w2=1.0,
                  sigma_b2=0.0, bn_gamma=1.0, bn_beta=0.0, residual_scale=None, num_batches=num_batches,
                  input_correlation=0.1, input_dim=1000, seed=seed)
    return EnsembleResult(
        config=config, q=qs, c=cs, bsb1_residual_sq=zeros, diag_var=zeros, offdiag_var=zeros,
        mean_covariance=np.zeros((depth, batch_size, batch_size)), final_covariance=np.zeros((n, batch_size, batch_size)),
        grad_norm_sq=g, weight_grad_norm_sq=g * 2.0, cross_batch_corr=rho if num_batches > 1 else None,
    )


def _relu_theory(b):
    q_star, c_star = ref.relu_bsb1(b)
    return dict(q_star=q_star, c_star=c_star, grad_explosion_rate=ref.relu_grad_rate(b),
                weight_grad_explosion_rate=ref.relu_grad_rate(b), cross_batch_rate=ref.relu_cross_batch_rate(b))


def test_theory_values_are_the_closed_forms_for_relu():
    th = _relu_theory(B)
    comp = compare_with_theory(_synthetic(grad_rate=1.5, cross_rate=0.7, q=0.5, c=0.3))
    assert comp.theory_applies and comp.theory_source == "bnlab.theory.analyze"
    assert list(comp.quantities) == list(QUANTITIES)
    for name, value in th.items():
        # closed forms both ways: rounding only
        assert comp[name].theory == pytest.approx(value, rel=1e-9), name


def test_agrees_where_the_data_follow_the_theory():
    th = _relu_theory(B)
    comp = compare_with_theory(_synthetic(grad_rate=th["grad_explosion_rate"], cross_rate=th["cross_batch_rate"],
                                          q=th["q_star"], c=th["c_star"]))
    for name in QUANTITIES:
        qc = comp[name]
        assert qc.ci_covers_theory is True, (name, qc)
        assert qc.ci[0] < qc.simulated < qc.ci[1]
        assert qc.rel_diff == pytest.approx(qc.simulated / qc.theory - 1, rel=1e-12)
        # every interval is narrower than 2 %, so agreement is not a wide interval's doing
        assert (qc.ci[1] - qc.ci[0]) / qc.theory < 0.02, name
    # the windows: q, c over the last 20 % of the layers; the gradient fit past the transients
    assert comp["q_star"].layers == (17, 20)
    assert comp["grad_explosion_rate"].layers == (3, 18)
    assert comp["grad_explosion_rate"].estimator == "step_ratio"
    assert comp["grad_explosion_rate"].ci_method == "percentile_bootstrap"  # tail index 15.5 at B = 32
    assert comp["q_star"].simulated == pytest.approx(np.mean(comp.per_layer["q"][-4:]), rel=1e-12)


def test_reports_disagreement():
    th = _relu_theory(B)
    comp = compare_with_theory(_synthetic(grad_rate=1.1 * th["grad_explosion_rate"], cross_rate=th["cross_batch_rate"],
                                          q=1.1 * th["q_star"], c=th["c_star"]))
    for name in ("grad_explosion_rate", "weight_grad_explosion_rate", "q_star"):
        qc = comp[name]
        assert qc.ci_covers_theory is False, name
        # the estimators are unbiased for these data: 10 % off within the interval's half-width (< 1 %)
        assert qc.rel_diff == pytest.approx(0.1, abs=0.01), name
    assert comp["c_star"].ci_covers_theory and comp["cross_batch_rate"].ci_covers_theory


def test_where_the_theory_does_not_apply():
    th = _relu_theory(B)
    args = dict(grad_rate=th["grad_explosion_rate"], cross_rate=th["cross_batch_rate"], q=0.5, c=0.3)
    none = compare_with_theory(_synthetic(norm="none", **args))
    assert not none.theory_applies and none.theory_source is None
    assert all(none[k].theory is None and none[k].ci_covers_theory is None for k in QUANTITIES)
    assert none["grad_explosion_rate"].simulated is not None  # the simulation is still reported
    assert any("norm='bn' without residuals only" in n for n in none.notes)
    # B = 2: the dynamics are degenerate, analyze refuses and says why
    two = compare_with_theory(_synthetic(batch_size=2, **args))
    assert not two.theory_applies and any("batch_size=2" in n for n in two.notes)
    # symmetry breaking: relu^2 at B = 8 converges to a BSB2 fixed point (App. J, K)
    bsb2 = compare_with_theory(_synthetic(batch_size=8, phi={"phi": "alpha_relu", "alpha": 2.0}, **args))
    assert bsb2["grad_explosion_rate"].theory is None and any("BSB2" in n for n in bsb2.notes)
    # ε > 0: the fixed point and λ_G include ε, the cross-batch theory is for ε = 0 only
    eps = compare_with_theory(_synthetic(eps=1e-3, **args))
    assert eps["grad_explosion_rate"].theory is not None and eps["cross_batch_rate"].theory is None
    assert any("eps=0.001 > 0" in n for n in eps.notes)
    # one batch: no cross-batch measurement
    one = compare_with_theory(_synthetic(num_batches=1, **args))
    assert one["cross_batch_rate"].simulated is None and one["cross_batch_rate"].theory is not None
    assert any("num_batches=1" in n for n in one.notes)


def test_tail_index_note_at_small_batch():
    res = simulate("relu", 4, 32, 8, 20, seed=2, dtype="float32")
    comp = compare_with_theory(res)
    g = comp["grad_explosion_rate"]
    assert g.ci_method == "tail_bootstrap_t" and comp.grad_norm_tail_index == 1.5
    assert any("tail index 1.5" in n for n in g.notes) and any("tail index 1.5" in n for n in comp.notes)
    assert g.theory == pytest.approx(ref.relu_grad_rate(4), rel=1e-9)
    json.dumps(comp.to_dict(), allow_nan=False)  # JSON-ready


def test_options_and_bad_input():
    res = simulate("tanh", 8, 32, 10, 4, num_batches=2, seed=1)
    comp = compare_with_theory(res, quantities=("q_star",), state_layers=(3, 10))
    assert list(comp.quantities) == ["q_star"]
    assert comp["q_star"].simulated == pytest.approx(res.q[:, 2:].mean(), rel=1e-12)
    log_mean = compare_with_theory(res, quantities="grad_explosion_rate", rate_options={"estimator": "log_mean"})
    assert log_mean["grad_explosion_rate"].simulated == pytest.approx(
        res.grad_explosion_rate(estimator="log_mean").rate, rel=1e-12)
    with pytest.raises(ValueError, match="quantities"):
        compare_with_theory(res, quantities=("lambda",))
    with pytest.raises(ValueError, match="state_layers"):
        compare_with_theory(res, state_layers=(0, 3))
    with pytest.raises(ValueError, match="confidence"):
        compare_with_theory(res, confidence=1.0)
    with pytest.raises(ValueError, match="rate_options"):
        compare_with_theory(res, rate_options={"weights": True})
    with pytest.raises(ValueError, match="result"):
        compare_with_theory(res.config)


def test_callable_phi_must_be_passed_again():
    from bnlab.activations import activation_from_callable

    act = activation_from_callable(np.tanh, lambda x: 1 / np.cosh(x) ** 2, torch_fn=__import__("torch").tanh)
    res = simulate(act, 8, 16, 6, 3, seed=0)
    with pytest.raises(ValueError, match="phi=None"):
        compare_with_theory(res)
    comp = compare_with_theory(res, phi=act)
    assert comp["grad_explosion_rate"].theory == pytest.approx(compare_with_theory(
        simulate("tanh", 8, 16, 6, 3, seed=0))["grad_explosion_rate"].theory, rel=1e-9)
    assert math.isfinite(comp["q_star"].theory)
