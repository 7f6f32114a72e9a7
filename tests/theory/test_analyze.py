"""analyze(): one call, every quantity, the method used for each, and clear refusals (Yang et al. 2019).

The numbers themselves are validated route by route in test_forward.py,
test_backward.py, test_cross_batch.py; here: that analyze() assembles them
consistently (identical to the building blocks), records methods, handles
BSB2, B = 2/3, ε > 0, and rejects bad input with ValueError.
"""
import json
import math

import pytest

from bnlab.activations import get_activation
from bnlab.theory import (
    METHODS,
    TheoryResult,
    analyze,
    backward_eigenvalues,
    bsb1_fixed_point,
    cross_batch_rate,
    depth_scale,
    forward_eigenvalues,
    max_trainable_depth,
)
from bnlab.theory._checks import SmallBatchWarning

FIELDS = [
    "phi", "batch_size", "eps", "sigma_w2", "method", "methods_used", "fixed_point_kind", "q_star", "c_star",
    "forward_lambda_G", "forward_lambda_L", "forward_lambda_M", "grad_explosion_rate", "backward_lambda_L",
    "backward_lambda_M", "cross_batch_c_star", "cross_batch_rate", "depth_scale", "max_trainable_depth", "warnings",
]


def test_relu_matches_building_blocks_and_closed_values():
    r = analyze("relu", 32)
    assert isinstance(r, TheoryResult)
    assert list(r.to_dict()) == FIELDS
    assert r.fixed_point_kind == "BSB1" and r.warnings == ()
    assert r.q_star == pytest.approx(0.5, rel=1e-12)  # Thm 3.5
    fw, bw = forward_eigenvalues("relu", 32), backward_eigenvalues("relu", 32)
    assert (r.forward_lambda_L, r.forward_lambda_M) == (fw.lambda_L, fw.lambda_M)
    assert (r.grad_explosion_rate, r.backward_lambda_L, r.backward_lambda_M) == (bw.lambda_G, bw.lambda_L, bw.lambda_M)
    assert r.cross_batch_rate == cross_batch_rate("relu", 32)
    assert r.depth_scale == pytest.approx(1 / math.log(bw.lambda_G), rel=1e-15)
    assert r.max_trainable_depth == pytest.approx(16 * r.depth_scale, rel=1e-15)
    assert r.methods_used["forward"] == "closed"


def test_tanh_auto_vs_sphere_vs_gegenbauer():
    auto = analyze("tanh", 16)
    geg = analyze("tanh", 16, method="gegenbauer")
    assert auto.methods_used["forward"] == "sphere"
    assert geg.methods_used["backward_L_M"] == "sphere" and any("Gegenbauer form" in w for w in geg.warnings)
    for f in ("q_star", "c_star", "forward_lambda_L", "forward_lambda_M", "grad_explosion_rate", "cross_batch_rate"):
        assert getattr(auto, f) == pytest.approx(getattr(geg, f), rel=1e-6), f


def test_phi_forms_and_family_parameters():
    a = analyze("alpha_relu", 16, alpha=0.75)
    b = analyze(get_activation("alpha_relu", alpha=0.75), 16)
    assert a.phi == b.phi == "alpha_relu(alpha=0.75)" and a.fixed_point_kind == "BSB1"
    assert a.grad_explosion_rate == pytest.approx(b.grad_explosion_rate, rel=1e-14)
    c = analyze("tanh(x)", 8)
    assert c.grad_explosion_rate == pytest.approx(analyze("tanh", 8).grad_explosion_rate, rel=1e-12)
    d = analyze(lambda x: x * (x > 0), 8)  # a callable: relu without the registry's closed forms
    assert d.methods_used["forward"] == "sphere"
    # without the homogeneity the quadrature cannot absorb the kink exactly and φ' comes from central
    # differences: algebraic convergence, measured 1.5e-6 relative (documented ≈1e-5)
    assert d.grad_explosion_rate == pytest.approx(analyze("relu", 8).grad_explosion_rate, rel=1e-5)


def test_gamma_beta_make_phi_more_linear():
    # Fig. 5a: γ → 0 makes tanh linear and the rate tends to the identity's (B−2)/(B−3)
    r_small = analyze("tanh", 16, gamma=0.05).grad_explosion_rate
    assert r_small == pytest.approx(14 / 13, rel=1e-3)
    assert r_small < analyze("tanh", 16).grad_explosion_rate


def test_bsb2_returns_no_bsb1_numbers():
    r = analyze("alpha_relu", 8, alpha=2.0)
    assert r.fixed_point_kind == "BSB2"
    for f in FIELDS[7:-1]:
        assert getattr(r, f) is None, f
    assert any("BSB2" in w for w in r.warnings)


def test_small_batches():
    with pytest.raises(ValueError, match="batch_size=2"):
        analyze("relu", 2)
    with pytest.warns(SmallBatchWarning):
        r = analyze("tanh", 3)
    assert r.grad_explosion_rate is None and r.forward_lambda_L is not None
    assert any("diverges" in w for w in r.warnings)


def test_eps_positive():
    r = analyze("relu", 16, eps=0.5, sigma_w2=2.0)
    from bnlab.theory import epsilon_analysis

    e = epsilon_analysis("relu", 16, 0.5, sigma_w2=2.0)
    assert r.grad_explosion_rate == e.grad_explosion_rate and r.q_star == e.q_star
    assert r.forward_lambda_L is None and any("eps=0.5" in w for w in r.warnings)


def test_infinite_rate_for_alpha_half():
    r = analyze("alpha_relu", 8, alpha=0.5)
    assert r.grad_explosion_rate is None and any("not square integrable" in w for w in r.warnings)
    assert r.forward_lambda_L is not None


def test_method_that_does_not_apply_raises():
    for m in ("closed", "laplace"):
        with pytest.raises(ValueError, match="does not apply"):
            analyze("tanh", 8, method=m)
    with pytest.raises(ValueError, match="closed"):
        analyze("alpha_relu", 8, alpha=0.75, method="closed")
    lap = analyze("alpha_relu", 8, alpha=0.75, method="laplace")
    assert lap.methods_used["forward"] == "laplace"
    # auto = sphere here; its φ'² ∝ |x|^{−1/2} line singularity limits it to ≈1e-8 (measured 6.5e-9)
    assert lap.grad_explosion_rate == pytest.approx(analyze("alpha_relu", 8, alpha=0.75).grad_explosion_rate, rel=1e-7)
    with pytest.raises(ValueError, match="method"):
        analyze("relu", 8, method="nope")
    assert set(METHODS) == {"auto", "closed", "laplace", "fourier", "sphere", "gegenbauer", "montecarlo"}


def test_fourier_and_laplace_record_routes():
    f = analyze("tanh", 8, method="fourier")
    assert f.methods_used["fixed_point"] == "fourier" and f.methods_used["forward"] == "sphere"
    assert f.grad_explosion_rate == pytest.approx(analyze("tanh", 8).grad_explosion_rate, rel=1e-12)
    lap = analyze("relu", 8, method="laplace")
    assert lap.methods_used["fixed_point"] == "laplace"
    assert lap.q_star == pytest.approx(0.5, rel=1e-9)


def test_bad_input():
    with pytest.raises(ValueError, match="eps"):
        analyze("relu", 8, eps=-0.1)
    with pytest.raises(ValueError, match="eps"):
        analyze("relu", 8, eps=float("nan"))
    with pytest.raises(ValueError, match="sigma_w2"):
        analyze("relu", 8, sigma_w2=0)
    with pytest.raises(ValueError):
        analyze("no_such_phi", 8)
    with pytest.raises(ValueError):
        analyze("__import__('os')", 8)


def test_depth_scale_and_max_depth():
    assert depth_scale(math.e) == pytest.approx(1.0)
    assert max_trainable_depth(math.e**2) == pytest.approx(8.0)
    assert depth_scale(1.0) == math.inf and depth_scale(0.5) == math.inf
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="rate"):
            depth_scale(bad)
    # relu, B → ∞: 16ξ → 16/log(π/(π−1)) ≈ 41.8 (Fig. 3: "deeper than about 50 layers untrainable")
    assert analyze("relu", 10**6, method="closed").max_trainable_depth == pytest.approx(16 / math.log(math.pi / (math.pi - 1)), rel=1e-4)


def test_to_dict_is_json_serializable():
    d = analyze("relu", 8).to_dict()
    json.dumps(d, allow_nan=False)


def test_montecarlo_refused_up_front_when_it_would_take_minutes():
    """B = 2048 by Monte Carlo (issue 18: it ran for minutes with no progress) is refused before any route
    runs, naming batch_size and the way out; a feasible B still runs that route."""
    # the whole-analysis message (not a single route's "n_samples <= ..."): refused before any route ran
    with pytest.raises(ValueError, match=r"batch_size=2048 .*method='montecarlo': its 200000 samples per route"):
        analyze("tanh", 2048, method="montecarlo")
    from bnlab.theory import backward_eigenvalues

    with pytest.raises(ValueError, match=r"batch_size=512 .*n_samples <= "):
        backward_eigenvalues("tanh", 512, method="montecarlo")
    assert backward_eigenvalues("tanh", 512, method="montecarlo", n_samples=200) is not None


@pytest.mark.parametrize("phi", ["tanh", "sin", "erf", "sigmoid", "tanh(2*x)+0.1*x"])  # BSB1 at every B here
@pytest.mark.parametrize("b", [4, 5, 8, 32, 256])
def test_smooth_fixed_point_shared_with_forward_route(phi, b):
    # auto takes q* = E f_1², q*c* = E f_1 f_2 of a smooth φ from the forward route's 2-D rule (issue 25); the
    # independent route is the Gegenbauer series on its own 1-D rule (Thm 3.4; within 3e-16 of a 30-digit mpmath
    # quadrature for tanh at B = 256).  Measured apart: ≤ 1.3e-13 relative (q*, and c* relative to max(|c*|, 1e-2))
    # over these φ and B; 5e-13 leaves room for rounding on another CPU while a 1-D-vs-2-D rule error of the size
    # the sphere route shows at B = 1024 (8e-13) or any wrong moment would fail it
    r = analyze(phi, b)
    geg = bsb1_fixed_point(phi, b, method="gegenbauer")
    assert r.methods_used["fixed_point"] == "sphere (2-D rule, moments shared with the forward route)"
    assert r.q_star == pytest.approx(geg.q_star, rel=5e-13)
    assert abs(r.c_star - geg.c_star) <= 5e-13 * max(abs(geg.c_star), 1e-2)


def test_smooth_fixed_point_beyond_shared_range_is_gegenbauer():
    # B = 1024: the 2-D rule's E f_1² is 8e-13 off (the series: 3e-16), so auto keeps the Gegenbauer fixed point
    r = analyze("tanh", 1024)
    assert r.methods_used["fixed_point"] == "gegenbauer"
    assert r.q_star == bsb1_fixed_point("tanh", 1024, method="gegenbauer").q_star
