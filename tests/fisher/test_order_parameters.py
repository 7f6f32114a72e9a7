"""Order parameters and the λ̄max bound (bnlab.fisher.order_parameters) against independent routes.

Routes: (1) the paper's printed ReLU closed forms (Eqs. 20–25, 34–43), re-implemented here line by
line; (2) the generic-φ Gaussian-integral route (a ReLU given as a plain callable, which has no
closed form and goes through quadrature); (3) finite-width simulations of the paper's own model
(Gaussian weights, BN with population statistics = statistics of the whole sample, detached).
"""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bnlab.activations import activation_from_callable
from bnlab.fisher import fisher_order_parameters, parse_arch

SW2, SB2 = 2.0, 0.5


def _paper_fc_closed_forms(widths, norm, gamma):
    """Eqs. 20–25 with Claim 6.1's base case (q̂⁰ = 1, q̂⁰_xy = 0), f_l = N_{l-1} q̂^{l-1}_xy q̃^l_xy (Claim 3.1)."""
    L = len(widths) - 1
    qh, qhxy = [1.0], [0.0]
    q, qxy = [], []
    for l in range(1, L + 1):
        q.append(SB2 + SW2 * qh[-1])
        qxy.append(SB2 + SW2 * qhxy[-1])
        if norm == "bn":
            qh.append(gamma**2 / 2)
            qhxy.append(gamma**2 / (2 * math.pi))
        else:
            c = qxy[-1] / q[-1]
            qh.append(q[-1] / 2)
            qhxy.append(q[-1] / (2 * math.pi) * (math.sqrt(1 - c * c) + c * math.pi / 2 + c * math.asin(c)))
    qt, qtxy = [0.0] * L, [0.0] * L
    qt[-1] = qtxy[-1] = 1.0
    for l in range(L - 1, 0, -1):
        i = l - 1
        if norm == "bn":
            qt[i] = gamma**2 * SW2 / 2 * qt[l] / q[i]
            qtxy[i] = gamma**2 * SW2 / 4 * qtxy[l] / q[i]
        else:
            c = qxy[i] / q[i]
            qt[i] = SW2 / 2 * qt[l]
            qtxy[i] = SW2 * qtxy[l] / (2 * math.pi) * (math.pi / 2 + math.asin(c))
    f = [widths[l - 1] * qhxy[l - 1] * qtxy[l - 1] for l in range(1, L + 1)]
    return dict(q=q, q_xy=qxy, q_hat=qh[:-1], q_hat_xy=qhxy[:-1], q_tilde=qt, q_tilde_xy=qtxy, f=f)


@pytest.mark.parametrize("norm", ["bn", "none"])
@pytest.mark.parametrize("gamma", [0.3, 1.0, 2.5])
def test_paper_formula_reproduces_printed_relu_closed_forms(norm, gamma):
    # gaussian_kernel uses the arc-cosine closed form for ReLU (≲1e-14 relative): 1e-11 is ample
    widths = [784, 1000, 1000, 1000, 10]
    ref = _paper_fc_closed_forms(widths, norm, gamma)
    res = fisher_order_parameters("fc:" + "-".join(map(str, widths)), norm=norm, gamma=gamma, formula="paper")
    for key in ("q", "q_xy", "q_hat", "q_hat_xy", "q_tilde", "q_tilde_xy", "f"):
        got = [d[key] for d in res.layers]
        np.testing.assert_allclose(got, ref[key], rtol=1e-11, atol=1e-14, err_msg=key)
    assert res.lambda_max_bound == pytest.approx(sum(ref["f"]), rel=1e-12)
    assert res.eta_star == pytest.approx(2 * 1.9 / sum(ref["f"]), rel=1e-12)
    assert res.formula == "paper"


@pytest.mark.parametrize("formula", ["paper", "measured"])
@pytest.mark.parametrize("norm", ["bn", "none"])
@pytest.mark.parametrize("arch", ["fc:50-300-300-10", "conv:2x9x9-c20k3s2p1-c30k3-fc10"])
def test_generic_phi_quadrature_route_agrees_with_closed_forms(formula, norm, arch):
    # a ReLU given as a plain callable has no closed form: every Gaussian expectation goes through
    # tanh-sinh quadrature (≲1e-9 relative at the kink, docs of bnlab.theory.vphi) — 1e-7 leaves margin
    relu_cb = activation_from_callable(lambda x: np.maximum(x, 0.0), lambda x: (x > 0).astype(float))
    a = fisher_order_parameters(arch, norm=norm, formula=formula, gamma=0.7, beta=0.0)
    b = fisher_order_parameters(arch, norm=norm, formula=formula, gamma=0.7, beta=0.0, phi=relu_cb)
    np.testing.assert_allclose(b.per_layer_f, a.per_layer_f, rtol=1e-7, atol=1e-12)


@pytest.mark.parametrize("formula", ["paper", "measured"])
@pytest.mark.parametrize("norm", ["bn", "none"])
@pytest.mark.parametrize("phi", ["relu", "tanh"])
def test_conv_whose_kernel_covers_its_input_reduces_to_fc(formula, norm, phi):
    # one output position (|K| = 1) and no padding: the conv layer is an FC layer on C·k·k inputs
    conv = fisher_order_parameters("conv:3x5x5-c40k5-fc30-fc10", norm=norm, formula=formula, phi=phi)
    fc = fisher_order_parameters("fc:75-40-30-10", norm=norm, formula=formula, phi=phi)
    np.testing.assert_allclose(conv.per_layer_f, fc.per_layer_f, rtol=1e-12)
    for a, b in zip(conv.layers, fc.layers):
        for key in ("q", "q_xy", "q_hat", "q_hat_xy", "q_tilde", "q_tilde_xy"):
            assert a[key] == pytest.approx(b[key], rel=1e-12), key


@settings(max_examples=25, deadline=None)
@given(
    sw2=st.floats(0.5, 4.0),
    sb2=st.floats(0.0, 1.0),
    depth=st.integers(1, 4),
)
def test_vanilla_fc_paper_and_measured_coincide(sw2, sb2, depth):
    # the corrections (errata E2–E5) concern BN and conv layers only; Karakida's vanilla FC is untouched
    arch = "fc:" + "-".join(["20"] + ["30"] * depth + ["5"])
    a = fisher_order_parameters(arch, norm="none", sigma_w2=sw2, sigma_b2=sb2, formula="paper")
    b = fisher_order_parameters(arch, norm="none", sigma_w2=sw2, sigma_b2=sb2, formula="measured")
    np.testing.assert_allclose(a.per_layer_f, b.per_layer_f, rtol=1e-13)


@settings(max_examples=20, deadline=None)
@given(gamma=st.floats(0.05, 5.0), mu=st.floats(0.0, 0.99))
def test_bn_relu_bound_is_quadratic_in_gamma(gamma, mu):
    # exact algebra of the corrected recursions for ReLU (1-homogeneous): q̂^l = γ²/2 and q̂^l_xy =
    # γ²/(2π) for l ≥ 1, so q^l and q^l_xy grow by σ_w²·(γ²-terms) and s² = q − q_xy ∝ γ² (σ_b² cancels);
    # the backward gains γ²·E φ'²/s² do not depend on γ, hence f_l = N q̂^{l-1}_xy q̃^l_xy ∝ γ² for l ≥ 2
    # and f_1 = 0: the whole bound is γ² times its value at γ = 1, for any σ_b² (here 0 and 0.7)
    arch = "fc:30-40-40-40-10"
    for sb2 in (0.0, 0.7):
        r = fisher_order_parameters(arch, gamma=gamma, sigma_b2=sb2, momentum=mu)
        r1 = fisher_order_parameters(arch, gamma=1.0, sigma_b2=sb2, momentum=mu)
        assert r.lambda_max_bound == pytest.approx(gamma**2 * r1.lambda_max_bound, rel=1e-10)
    assert r.eta_star == pytest.approx(2 * (1 + mu) / r.lambda_max_bound, rel=1e-14)


def test_train_mode_keeps_only_layers_without_bn():
    ev = fisher_order_parameters("fc:784-1000-1000-1000-10", bn_mode="eval")
    tr = fisher_order_parameters("fc:784-1000-1000-1000-10", bn_mode="train")
    assert tr.per_layer_f[:-1] == (0.0, 0.0, 0.0)
    assert tr.per_layer_f[-1] == ev.per_layer_f[-1] == pytest.approx(1000 / (2 * math.pi), rel=1e-12)
    van = fisher_order_parameters("fc:784-100-10", norm="none", bn_mode="train")
    assert van.bn_mode == "none" and van.per_layer_f[1] > 0


# ----------------------------------------------------------------------------------------------
# Finite-width simulation of the paper's model (route 3)
# ----------------------------------------------------------------------------------------------
def _simulate_f(spec, norm, gamma, *, m, seed):
    """Per-layer ‖∇_{W_l} (1/m) Σ_x f_1(x)‖² of one random network on m iid N(0, 1) inputs; BN with the
    statistics of the whole sample, detached (population statistics: the paper's Eqs. 13–15)."""
    import torch

    from bnlab.fisher import ConvLayer

    a = parse_arch(spec)
    g = torch.Generator().manual_seed(seed)
    h = torch.randn((m,) + a.input_shape, generator=g, dtype=torch.float64)
    weights = []
    for l, layer in enumerate(a.layers):
        if isinstance(layer, ConvLayer):
            fan = h.shape[1] * layer.kernel**2
            W = torch.randn(layer.channels, h.shape[1], layer.kernel, layer.kernel, generator=g, dtype=torch.float64)
            W = (W * math.sqrt(SW2 / fan)).requires_grad_()
            b = torch.randn(layer.channels, generator=g, dtype=torch.float64) * math.sqrt(SB2)
            z = torch.nn.functional.conv2d(h, W, b, stride=layer.stride, padding=layer.padding)
            dims = (0, 2, 3)
        else:
            h = h.reshape(m, -1)
            W = torch.randn(layer.width, h.shape[1], generator=g, dtype=torch.float64)
            W = (W * math.sqrt(SW2 / h.shape[1])).requires_grad_()
            b = torch.randn(layer.width, generator=g, dtype=torch.float64) * math.sqrt(SB2)
            z = h @ W.T + b
            dims = (0,)
        weights.append(W)
        if l == a.depth - 1:
            break
        if norm == "bn":
            mu = z.mean(dims, keepdim=True).detach()
            s = z.var(dims, keepdim=True, unbiased=False).sqrt().detach()
            z = gamma * (z - mu) / s
        h = torch.relu(z)
    grads = torch.autograd.grad(z[:, 0].mean(), weights)
    return np.array([float((gr**2).sum()) for gr in grads])


@pytest.mark.parametrize(
    "spec,norm,gamma",
    [
        ("fc:300-600-600-600-10", "bn", 1.0),
        ("fc:300-600-600-600-10", "bn", 0.5),
        ("fc:300-600-600-600-10", "none", 1.0),
        ("conv:3x8x8-c64k3s1p1-c64k3-fc10", "bn", 1.0),
        ("conv:3x12x12-c64k3s2-c64k3s2-fc10", "bn", 1.0),
        ("conv:3x12x12-c64k3s2-c64k3s2-fc10", "none", 1.0),
    ],
)
def test_measured_formula_matches_finite_network_and_paper_bn_formula_does_not(spec, norm, gamma):
    # f_1 = 0 in theory (q̂⁰_xy = 0) and O(N0/m) in a finite sample: compare layers 2..L.
    # Tolerance from the simulation's own spread: f_l of one network is a squared sample mean whose
    # seed-to-seed spread at these sizes is 5–15 % (vanilla more than BN: the per-unit mean activation
    # does not concentrate); the mean of n seeds is held to 4 standard errors plus 8 % for the
    # O(1/√N + 1/m) finite-size bias (and, in the padded conv case, the position-homogeneity
    # approximation of errata E3, measured ≲ 10 %).
    n = 5
    m = 300 if spec.startswith("conv") else 600
    runs = np.array([_simulate_f(spec, norm, gamma, m=m, seed=s) for s in range(n)])
    sims, se = runs.mean(0), runs.std(0, ddof=1) / np.sqrt(n)
    meas = np.array(fisher_order_parameters(spec, norm=norm, gamma=gamma).per_layer_f)
    paper = np.array(fisher_order_parameters(spec, norm=norm, gamma=gamma, formula="paper").per_layer_f)
    systematic = 0.18 if spec.startswith("conv") else 0.08
    tol = 4 * se[1:] + systematic * meas[1:]
    assert np.all(np.abs(sims[1:] - meas[1:]) <= tol), (sims, meas, se)
    if norm == "bn":
        # the printed recursions (errata E2: 1/q instead of 1/(q − q_xy); E3/E4 for conv) miss the
        # second layer by more than a factor 2
        assert abs(paper[1] / sims[1] - 1) > 0.5


def test_base_case_of_section_3_is_inconsistent():
    # Errata E1: §3.1.1's q̂⁰ = 0, q̂⁰_xy = 1 would need ‖E x‖² > E‖x‖², impossible: rejected
    with pytest.raises(ValueError, match="input_q_xy"):
        fisher_order_parameters("fc:10-10-2", input_q=1e-300, input_q_xy=1.0)
    with pytest.raises(ValueError, match="input_q"):
        fisher_order_parameters("fc:10-10-2", input_q=0.0, input_q_xy=1.0)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(sigma_w2=-1.0), "sigma_w2"),
        (dict(sigma_b2=-0.1), "sigma_b2"),
        (dict(momentum=1.0), "momentum"),
        (dict(momentum=-0.1), "momentum"),
        (dict(gamma=0.0), "gamma"),
        (dict(formula="printed"), "formula"),
        (dict(norm="ln"), "norm"),
        (dict(bn_mode="test"), "bn_mode"),
        (dict(gamma=[1.0, 2.0, 3.0]), "gamma"),
        (dict(phi="nosuchphi"), "phi"),
    ],
)
def test_bad_input_is_rejected_with_a_named_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fisher_order_parameters("fc:10-10-10-2", **kwargs)


def test_to_dict_is_json_serializable():
    import json

    d = fisher_order_parameters("conv:1x8x8-c4k3s2p1-fc3").to_dict()
    text = json.dumps(d)
    for key in ("lambda_max_bound", "eta_star", "per_layer_f", "formula", "layers"):
        assert key in d
    assert isinstance(d["per_layer_f"], list) and "NaN" not in text


def test_odd_phi_with_bn_bound_is_exactly_zero_and_eta_star_unbounded():
    # E φ(u) = 0 for an odd φ with β = 0 (u ~ N(0,1) per unit after BN, Eqs. 56–60), so q̂_xy = (E φ)² = 0
    # in every layer and, with centred inputs (q̂⁰_xy = 0), every f_l = N q̂^{l-1}_xy q̃^l_xy = 0.  The
    # 2-d quadrature used to return ±1e-16 here (the sign depends on the CPU's rounding) and the
    # negative residue was refused; the even-part route gives 0 at every node.
    import json

    for phi in ("tanh", "sin", "erf", "x**3"):
        for kwargs in (dict(), dict(bn_mode="train"), dict(formula="paper")):
            res = fisher_order_parameters("fc:784-256-256-10", phi=phi, **kwargs)
            assert res.lambda_max_bound == 0.0 and res.per_layer_f == (0.0, 0.0, 0.0), (phi, kwargs)
            assert res.eta_star == math.inf and "bound is 0" in res.note, (phi, kwargs)
            assert json.loads(json.dumps(res.to_dict(), allow_nan=False))["eta_star"] is None
    # vanilla tanh with σ_b² = 0 on centred data: q_xy = 0 in every layer, the same symmetry
    assert fisher_order_parameters("fc:20-30-5", norm="none", phi="tanh", sigma_b2=0.0).lambda_max_bound == 0.0
    # a positive bound has no note
    assert fisher_order_parameters("fc:20-30-5", phi="relu").note is None


def test_odd_phi_zero_bound_is_the_limit_of_small_beta():
    # independent check that 0 is the value and not a clamp: for φ = tanh and small β,
    # E tanh(u + β) = β E tanh'(u) + O(β³), so every q̂_xy ∝ β² and the bound is C β² (1 + O(β²)):
    # bound(1e-3)/bound(1e-2) = 1e-2 up to O(1e-4) relative, and both are > 0
    b2 = fisher_order_parameters("fc:784-256-256-10", phi="tanh", beta=1e-2).lambda_max_bound
    b3 = fisher_order_parameters("fc:784-256-256-10", phi="tanh", beta=1e-3).lambda_max_bound
    assert b2 > 0 and b3 > 0
    assert b3 / b2 == pytest.approx(1e-2, rel=1e-3)


@pytest.mark.parametrize("phi", ["relu", "sigmoid", "softplus", "gelu", "selu", "abs", "x**2", "tanh(x+0.3)"])
def test_mean_squared_route_agrees_with_two_dimensional_quadrature(phi):
    # cov = 0: E φ(u)φ(v) = (E φ(u))² (independence).  The 2-d kernel route (bnlab.theory.gaussian_kernel,
    # ≲ 1e-12 relative to E φ² by its docs for φ smooth away from 0) and the 1-d even-part route must
    # agree to that accuracy; 1e-11 leaves a factor 10
    from bnlab.activations import get_activation
    from bnlab.fisher.order_parameters import _gaussian_mean
    from bnlab.theory import gaussian_kernel

    act = get_activation(phi)
    for var in (0.3, 1.0, 2.5):
        k = gaussian_kernel(act, np.array([[var, 0.0], [0.0, var]]))
        mean = _gaussian_mean(act, act.kinks, var)
        assert abs(mean * mean - k[0, 1]) <= 1e-11 * k[0, 0], (var, mean * mean, k[0, 1])


@pytest.mark.parametrize("shift", [0.4, -1.3])
def test_mean_route_at_a_kink_off_zero_matches_the_closed_form(shift):
    # E relu(σu − a) = σ p(a/σ) − a Q(a/σ) (p the normal density, Q its tail).  The 2-d kernel route is only
    # algebraically accurate at a kink off 0 (1e-3 relative here); the 1-d route splits its panels at the
    # kink and reaches QUADPACK's 1e-13 relative target: 1e-12 leaves margin
    from scipy.stats import norm as normal

    from bnlab.activations import get_activation
    from bnlab.fisher.order_parameters import _gaussian_mean

    act = get_activation("relu").with_affine(1.0, -shift)
    for var in (0.3, 1.0, 2.5):
        s = math.sqrt(var)
        exact = s * normal.pdf(shift / s) - shift * normal.sf(shift / s)
        assert _gaussian_mean(act, act.kinks, var) == pytest.approx(exact, rel=1e-12)


@pytest.mark.parametrize("arch", ["fc:784-256-256-10", "conv:1x28x28-c8k3s2-c8k3s2-fc10"])
def test_bn_bound_does_not_depend_on_the_bias_variance_even_where_it_dwarfs_the_data(arch):
    """A bias added before BN is removed with the batch mean, so under BN the bound cannot depend on σ_b²
    (Eqs. 56–60 use the data variance q − q_xy, in which σ_b² cancels).  Formed as the difference of two
    values that both carry σ_b², the variance lost its digits to cancellation: σ_b² = 1e15 moved λ̄max by
    13 % and 1e16 made it "not positive".  Now it is formed without σ_b²: equal to rounding (a few ulps of
    the O(1) recursions, 1e-12 relative) up to σ_b² = 1e300."""
    base = fisher_order_parameters(parse_arch(arch), sigma_b2=0.0).lambda_max_bound
    assert base > 0
    for sb2 in (0.5, 1e8, 1e15, 1e16, 1e300):
        got = fisher_order_parameters(parse_arch(arch), sigma_b2=sb2).lambda_max_bound
        assert got == pytest.approx(base, rel=1e-12), sb2
