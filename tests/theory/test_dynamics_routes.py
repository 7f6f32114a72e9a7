"""What the forward, backward and cross-batch dynamics share: their routes agree with each other, and
one prologue (bnlab.theory._routes.plan_route) checks B and the method and chooses one route object
for φ's class that answers all three (Yang et al. 2019, Thms 3.7, 3.10, 3.11, G.12, H.6).

Each dynamics is described once (``DYNAMICS``): its public function and the quantities it returns.
Tolerances (per route, measured against the closed forms):
* closed vs sphere: 1e-9 (the sphere quadrature is ≈1e-11 relative for every quantity here);
* closed vs Gegenbauer for relu: 1e-9 (single-point tails summed through the moments; measured
  ≤ 5e-12 at B = 4 and ≤ 1e-13 for B ≥ 8 forward, ≤ 2e-12 / 8e-14 cross-batch); the backward
  Gegenbauer route at B ≤ 5 is checked against its own bound in test_backward.py;
* analytic φ, sphere vs Gegenbauer: 1e-10 for the eigenvalues (geometric convergence, measured
  ≤ 1.3e-12), 1e-6 for the cross-batch quantities (its c* = a_0² route, measured ≤ 2e-8).
"""
import pytest

from bnlab.activations import get_activation
from bnlab.theory import backward_eigenvalues, forward_eigenvalues
from bnlab.theory.cross_batch import cross_batch_analysis

# dynamics -> (public function, the quantities compared, rel. tolerance sphere vs Gegenbauer for analytic φ)
DYNAMICS = {
    "forward": (forward_eigenvalues, ("lambda_L", "lambda_M"), 1e-10),
    "backward": (backward_eigenvalues, ("lambda_G", "lambda_L", "lambda_M"), 1e-10),
    "cross_batch": (cross_batch_analysis, ("rate", "c_star"), 1e-6),
}
# the Gegenbauer route of the backward dynamics gives λ_G↓ only (no form of λ_L↓, λ_M↓ in the paper)
GEGENBAUER_FIELDS = {"forward": ("lambda_L", "lambda_M"), "backward": ("lambda_G",), "cross_batch": ("rate", "c_star")}
BATCHES = [4, 5, 8, 32, 128]


def _assert_fields_close(a, b, fields, rel, abs_tol=0.0):
    for f in fields:
        assert getattr(a, f) == pytest.approx(getattr(b, f), rel=rel, abs=abs_tol), f


@pytest.mark.parametrize("dynamics", list(DYNAMICS))
@pytest.mark.parametrize("b", BATCHES)
@pytest.mark.parametrize("name", ["relu", "identity"])
def test_closed_forms_agree_with_sphere(dynamics, name, b):
    fn, fields, _ = DYNAMICS[dynamics]
    closed, sphere = fn(name, b, method="closed"), fn(name, b, method="sphere")
    # c_CB* = 0 exactly for the identity (odd φ): the sphere gives rounding there, hence the abs. term
    _assert_fields_close(closed, sphere, fields, 1e-9, abs_tol=1e-15)
    if dynamics == "forward":
        assert abs(sphere.lambda_G) < 1e-10  # batchnorm removes the RG component in one step


@pytest.mark.parametrize("dynamics", ["forward", "cross_batch"])
@pytest.mark.parametrize("b", BATCHES)
def test_relu_closed_forms_agree_with_gegenbauer(dynamics, b):
    fn, _, _ = DYNAMICS[dynamics]
    closed, geg = fn("relu", b, method="closed"), fn("relu", b, method="gegenbauer")
    _assert_fields_close(closed, geg, GEGENBAUER_FIELDS[dynamics], 1e-9)
    main = GEGENBAUER_FIELDS[dynamics][0]
    if dynamics == "cross_batch":  # its bound covers the rate (c* = a_0² is not a series)
        assert abs(getattr(closed, main) - getattr(geg, main)) <= geg.truncation_error


@pytest.mark.parametrize("b", [4, 32])
def test_identity_closed_form_agrees_with_gegenbauer(b):
    # a single Gegenbauer coefficient: checked at two B to keep the run short
    closed, geg = forward_eigenvalues("identity", b, method="closed"), forward_eigenvalues("identity", b, method="gegenbauer")
    _assert_fields_close(closed, geg, ("lambda_L", "lambda_M"), 1e-9)


@pytest.mark.parametrize("dynamics", list(DYNAMICS))
@pytest.mark.parametrize("name", ["tanh", "sin", "gelu", "sigmoid"])
@pytest.mark.parametrize("b", [4, 8, 32, 128])
def test_smooth_phi_sphere_vs_gegenbauer(dynamics, name, b):
    fn, _, rel = DYNAMICS[dynamics]
    sphere, geg = fn(name, b, method="sphere"), fn(name, b, method="gegenbauer")
    _assert_fields_close(sphere, geg, GEGENBAUER_FIELDS[dynamics], rel, abs_tol=1e-14 if dynamics == "cross_batch" else 0.0)
    if dynamics == "backward":
        # the tail summation is not engaged (the head's Parseval tail is < 1e-12): the bound is the rounding floor
        assert geg.truncation_error <= 1.01e-12 * geg.lambda_G
        assert sphere.lambda_G > 1.0  # Thm 3.9: explosion for every non-constant φ


# ---------------------------------------------------------------------------
# the one prologue
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dynamics", list(DYNAMICS))
def test_auto_picks_closed_for_relu_and_identity_laplace_for_homogeneous_and_sphere_otherwise(dynamics):
    fn = DYNAMICS[dynamics][0]
    assert fn("relu", 16).method == "closed"
    assert fn("identity", 16).method == "closed"
    # a positive multiple of relu is relu to batchnorm (scale invariance): still closed
    assert fn(get_activation("relu", gamma=2.0), 16).method == "closed"
    assert fn("tanh", 16).method == "sphere"
    # other positive-homogeneous φ: the Laplace closed forms where they apply ((B−1)/2 > α) …
    assert fn("leaky_relu", 16).method == "laplace"
    assert fn(get_activation("alpha_relu", alpha=0.75), 16).method == "laplace"
    # … and the sphere where they do not (α = 2 at B = 5: (B−1)/2 = 2)
    if dynamics != "backward":
        assert fn(get_activation("alpha_relu", alpha=2.0), 5).method == "sphere"
    # shifted relu is not homogeneous: the kink-split sphere
    assert fn(get_activation("leaky_relu", beta=0.5), 16).method == "sphere"


def _planned(phi, b, method, **kw):
    """The route object that the one prologue chooses for each dynamics."""
    from bnlab.theory._routes import plan_route
    from bnlab.theory.backward import _BACKWARD
    from bnlab.theory.cross_batch import _CROSS_BATCH
    from bnlab.theory.forward import _FORWARD

    act = get_activation(phi)
    return {d: plan_route(act, b, method, dyn, **kw) for d, dyn in
            (("forward", _FORWARD), ("backward", _BACKWARD), ("cross_batch", _CROSS_BATCH))}


@pytest.mark.parametrize("phi, route", [("relu", "ClosedRoute"), ("identity", "ClosedRoute"),
                                        ("leaky_relu", "LaplaceRoute"), ("tanh", "SphereRoute")])
def test_auto_chooses_one_route_object_per_class_of_phi_for_all_three_dynamics(phi, route):
    planned = _planned(phi, 16, "auto")
    assert {type(r).__name__ for r in planned.values()} == {route}
    assert len({r for r in planned.values()}) == 1  # equal objects: the same route, whichever dynamics asks


# each route object's answers are the public functions' (fields in the right order, nothing dropped):
# rel. 1e-12 although the code path is the same, because no BLAS promises bit-identical sums
ROUTE_ANSWERS = {  # dynamics -> the result's fields in the order the route object returns them
    "forward": ("lambda_L", "lambda_M", "stderr", "truncation_error"),
    "backward": ("lambda_G", "lambda_L", "lambda_M", "stderr", "truncation_error"),
    "cross_batch": ("c_star", "rate", "stderr", "truncation_error"),
}


@pytest.mark.parametrize("phi, method", [("relu", "closed"), ("leaky_relu", "laplace"), ("tanh", "sphere"),
                                         ("tanh", "gegenbauer"), ("tanh", "montecarlo")])
def test_a_route_object_answers_what_the_public_functions_return(phi, method):
    b, kw = 8, {"n_samples": 2000, "seed": 3} if method == "montecarlo" else {}
    planned = _planned(phi, b, method, **kw)
    for dynamics, route in planned.items():
        assert route.method == method
        fn = DYNAMICS[dynamics][0]
        res = fn(phi, b, method=method, **kw)
        assert res.method == method
        answer = getattr(route, dynamics)()
        assert len(answer) == len(ROUTE_ANSWERS[dynamics])
        for field, value in zip(ROUTE_ANSWERS[dynamics], answer):
            expected = getattr(res, field)
            if value is None or expected is None:
                assert value is None and expected is None, (dynamics, field)
            else:
                assert value == pytest.approx(expected, rel=1e-12), (dynamics, field)


BAD_INPUT = [  # (phi, batch_size, keyword arguments, what the message must say)
    ("relu", 2, {}, "batch_size=2"),
    ("tanh", 8, {"method": "closed"}, r"method='closed' is not available for phi='tanh'.*relu and identity"),
    ("tanh", 8, {"method": "laplace"}, "method='laplace' does not apply to phi='tanh'"),
    ("relu", 8, {"method": "fourier"}, "fourier"),
    ("relu", 8, {"method": "bogus"}, "method"),
    ("tanh", 4096, {"method": "gegenbauer"}, "batch_size=4096 is not allowed for method='gegenbauer'"),
    ("tanh", 4096, {"method": "sphere"}, "batch_size=4096 is not allowed for the quadrature methods"),
    ("tanh", 8, {"method": "gegenbauer", "n_terms": 2}, "n_terms"),
    ("tanh", 8, {"method": "montecarlo", "n_samples": 10}, "n_samples"),
    ("not_an_activation", 8, {}, "phi"),
]


@pytest.mark.parametrize("dynamics", list(DYNAMICS))
@pytest.mark.parametrize("phi,b,kwargs,match", BAD_INPUT)
def test_one_refusal_per_bad_input(dynamics, phi, b, kwargs, match):
    with pytest.raises(ValueError, match=match):
        DYNAMICS[dynamics][0](phi, b, **kwargs)


def _count_resolutions(monkeypatch) -> list:
    """Replace get_activation wherever a theory module looks it up by a counting wrapper; the list of calls."""
    import sys

    import bnlab.activations as activations
    import bnlab.theory  # noqa: F401  (every module below is imported by the calls anyway)

    calls = []
    real = activations.get_activation

    def counting(phi, **kw):
        calls.append(phi)
        return real(phi, **kw)

    monkeypatch.setattr(activations, "get_activation", counting)
    for name, module in list(sys.modules.items()):
        if name.startswith("bnlab.theory") and getattr(module, "get_activation", None) is real:
            monkeypatch.setattr(module, "get_activation", counting)
    return calls


@pytest.mark.parametrize("dynamics", list(DYNAMICS))
def test_phi_is_resolved_once_and_handed_down(dynamics, monkeypatch):
    # the entry resolves φ with get_activation exactly once; the routes below take the Activation
    import bnlab.theory.analyze  # noqa: F401  (load every theory module before the counter is installed)

    calls = _count_resolutions(monkeypatch)
    DYNAMICS[dynamics][0]("tanh", 8, method="sphere")
    assert calls == ["tanh"]


@pytest.mark.parametrize("call", [
    lambda T: T.analyze("tanh", 8),
    lambda T: T.analyze("relu", 8, beta=0.5),
    lambda T: T.analyze("relu", 8, method="laplace"),
    lambda T: T.analyze("tanh", 8, method="gegenbauer"),
    lambda T: T.analyze("tanh", 8, eps=0.1),
    lambda T: T.bsb1_fixed_point("tanh", 8),
    lambda T: T.bsb1_stability("relu", 8),
    lambda T: T.fixed_point_kind("relu", 8, depth=None),
    lambda T: T.gradient_explosion_rate("tanh", 8),
    lambda T: T.gradient_explosion_rate("tanh", 8, eps=0.1),
    lambda T: T.cross_batch_fixed_point("tanh", 8),
    lambda T: T.cross_batch_rate("tanh", 8),
    lambda T: T.weight_gradient_norms("tanh", 8, 3),
    lambda T: T.iterate_batch_covariance("tanh", __import__("numpy").eye(5), 2),
    lambda T: T.nngp_kernel(__import__("numpy").eye(5), 3, "tanh"),
], ids=["analyze", "analyze-kinked", "analyze-laplace", "analyze-gegenbauer", "analyze-eps", "bsb1_fixed_point",
        "bsb1_stability", "fixed_point_kind", "gradient_explosion_rate", "gradient_explosion_rate-eps",
        "cross_batch_fixed_point", "cross_batch_rate", "weight_gradient_norms", "iterate_batch_covariance", "nngp_kernel"])
def test_every_public_function_resolves_phi_once(call, monkeypatch):
    # get_activation's promise ("resolved once and handed down"): one resolution per public call, however many
    # building blocks the call runs (analyze runs the fixed point, the three dynamics and the verdict)
    import bnlab.theory as T
    import bnlab.theory.analyze  # noqa: F401

    calls = _count_resolutions(monkeypatch)
    call(T)
    assert len(calls) == 1, calls


def test_an_activation_resolves_to_itself():
    act = get_activation("tanh")
    assert get_activation(act) is act
    assert get_activation(act, gamma=2.0) is not act


# ---------------------------------------------------------------------------
# the spherical brackets summed per run of equal u_1 (_forward_sphere_brackets, _backward_sphere_brackets)
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("b", [3, 4, 9, 40])
def test_conditional_moments_as_polynomials(b):
    # e3, e33, e34 written as polynomials in (u_1, u_2) are an algebraic identity of _conditional_moments:
    # only rounding separates them (terms O(1), so 1e-14 absolute)
    import numpy as np

    from bnlab.theory._quadrature.sphere import conditional_coefficients as _conditional_coefficients
    from bnlab.theory._quadrature.sphere import conditional_moments as _conditional_moments

    rng = np.random.default_rng(0)
    x, y = rng.uniform(-0.6, 0.6, (2, 50))
    e3, e33, e34 = _conditional_moments(x, y, b)
    c1, c2 = _conditional_coefficients(b)
    np.testing.assert_allclose(-c1 * (x + y), e3, rtol=0, atol=1e-14)
    np.testing.assert_allclose(c1 * (1 - x * x - y * y), e33, rtol=0, atol=1e-14)
    np.testing.assert_allclose(c2 * (2 * x * x + 2 * x * y + 2 * y * y - 1), e34, rtol=0, atol=1e-14)


@pytest.mark.parametrize("spec,radial", [(dict(phi="relu", beta=1.0), 0.0), (dict(phi="selu"), 0.0),
                                         (dict(phi="alpha_relu", alpha=0.6), -0.4), (dict(phi="tanh"), 0.0)])
@pytest.mark.parametrize("b", [4, 32])
def test_run_sums_equal_the_node_by_node_sums(spec, radial, b):
    # the brackets summed per run of equal u_1 (φ evaluated once per run) against the plain weighted sum
    # over every node of the same rule, written as the routes were before (explicit integrands with the
    # conditional moments): the same numbers reordered, so agreement to rounding (1e-13 relative to the
    # largest bracket; the sums have ~5e4 terms of either sign)
    import math

    import numpy as np

    from bnlab.theory._quadrature.sphere import conditional_moments as _conditional_moments
    from bnlab.theory._quadrature.sphere import sphere_grid_for
    from bnlab.theory._sphere_route import _backward_sphere_brackets as sphere_brackets_backward
    from bnlab.theory._sphere_route import _forward_sphere_brackets as sphere_brackets_forward
    from bnlab.theory._sphere_route import _sphere_marginals as sphere_marginals

    d = dict(spec)
    act = get_activation(d.pop("phi"), **d)
    grid = sphere_grid_for(act, b, float(act.homogeneity) - 1.0 if act.homogeneity is not None else radial)
    sb = math.sqrt(b)
    x, y = grid.x, grid.y
    e3, e33, e34 = _conditional_moments(x, y, b)
    f1, f2 = act(sb * x), act(sb * y)
    g1, g2 = act.derivative(sb * x), act.derivative(sb * y)
    f11, f12, g11, g12 = f1 * f1, f1 * f2, g1 * g1, g1 * g2
    ox, oy = 1 - x * x, 1 - y * y
    fwd = grid.expect(np.stack([f11, f12, f11 * x * x, f11 * y * y, f11 * x * y, f11 * y * e3, f12 * x * x, f12 * e33,
                                f12 * x * y, f12 * x * e3, f12 * e34]))
    bwd = grid.expect(np.stack([g11 * ox * ox, g11 * x * x * y * y, -g12 * ox * x * y, g12 * x * y * e33,
                                -g11 * ox * x * y, g11 * x * x * y * e3, g12 * ox * oy, g12 * x * x * y * y,
                                -g12 * ox * y * e3, g12 * x * y * e34, g12 * x * x * y * e3]))
    xd = grid.x_distinct
    assert grid.starts is None or xd.size < x.size / 20  # the kink rule has runs (φ once per run)
    got_f = sphere_brackets_forward(grid, act(sb * xd), f2)
    got_b = sphere_brackets_backward(grid, act.derivative(sb * xd), g2)
    np.testing.assert_allclose(got_f, fwd, rtol=0, atol=1e-13 * np.abs(fwd).max())
    np.testing.assert_allclose(got_b, bwd, rtol=0, atol=1e-13 * np.abs(bwd).max())
    m0, m2 = sphere_marginals(grid, act(sb * xd))
    assert m0 == pytest.approx(float(grid.expect(f1)), rel=1e-13, abs=1e-15)
    assert m2 == pytest.approx(float(grid.expect(f1 * x * x)), rel=1e-13, abs=1e-15)
