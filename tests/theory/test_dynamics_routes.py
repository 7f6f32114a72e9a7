"""What the forward, backward and cross-batch dynamics share: their routes agree with each other, and
one prologue (bnlab.theory._dynamics_common._choose_route) resolves φ, checks B and the method and
chooses the route for all three (Yang et al. 2019, Thms 3.7, 3.10, 3.11, G.12, H.6).

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
def test_auto_picks_closed_for_relu_and_identity_and_sphere_otherwise(dynamics):
    fn = DYNAMICS[dynamics][0]
    assert fn("relu", 16).method == "closed"
    assert fn("identity", 16).method == "closed"
    # a positive multiple of relu is relu to batchnorm (scale invariance): still closed
    assert fn(get_activation("relu", gamma=2.0), 16).method == "closed"
    assert fn("tanh", 16).method == "sphere"
    assert fn("leaky_relu", 16).method == "sphere"


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


@pytest.mark.parametrize("dynamics", list(DYNAMICS))
def test_phi_is_resolved_once_and_handed_down(dynamics, monkeypatch):
    # the entry resolves φ with get_activation exactly once; the routes below take the Activation
    import bnlab.activations as activations

    calls = []
    real = activations.get_activation

    def counting(phi, **kw):
        calls.append(phi)
        return real(phi, **kw)

    monkeypatch.setattr(activations, "get_activation", counting)
    DYNAMICS[dynamics][0]("tanh", 8, method="sphere")
    assert calls == ["tanh"]


def test_an_activation_resolves_to_itself():
    act = get_activation("tanh")
    assert get_activation(act) is act
    assert get_activation(act, gamma=2.0) is not act
