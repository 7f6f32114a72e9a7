"""Activations: values, derivatives (vs an independent finite difference and vs
torch autograd), homogeneity decompositions, expressions, and bad input."""
import pickle

import numpy as np
import pytest
import torch

from bnlab.activations import (
    Activation,
    activation_from_callable,
    get_activation,
    list_activations,
)

NAMES = list(list_activations())
# Points avoiding the kinks at 0 so finite differences are valid everywhere.
X = np.concatenate([np.linspace(-4, -0.05, 40), np.linspace(0.05, 4, 40)])


def _fd(f, x, h=1e-6):
    return (f(x + h) - f(x - h)) / (2 * h)


@pytest.mark.parametrize("name", NAMES)
def test_derivative_matches_finite_difference(name):
    # Central difference with h=1e-6 has error O(h²·f''') + O(ε/h) ≈ 1e-10·|f|,
    # so 1e-6 relative leaves four orders of margin and still catches a wrong formula.
    act = get_activation(name)
    np.testing.assert_allclose(act.derivative(X), _fd(act, X), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("name", NAMES)
def test_torch_matches_numpy(name):
    act = get_activation(name)
    xt = torch.tensor(X, dtype=torch.float64, requires_grad=True)
    y = act.torch(xt)
    np.testing.assert_allclose(y.detach().numpy(), act(X), rtol=1e-12, atol=1e-12)
    (g,) = torch.autograd.grad(y.sum(), xt)
    np.testing.assert_allclose(g.numpy(), act.derivative(X), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "name,params,alpha",
    [("identity", {}, 1.0), ("relu", {}, 1.0), ("alpha_relu", {"alpha": 0.5}, 0.5), ("alpha_relu", {"alpha": 2}, 2.0),
     ("leaky_relu", {"slope": 0.2}, 1.0), ("abs", {}, 1.0)],
)
@pytest.mark.parametrize("gamma", [1.0, 2.5, -0.7])
def test_homogeneous_decomposition(name, params, alpha, gamma):
    act = get_activation(name, gamma=gamma, **params)
    assert act.homogeneity == alpha
    a, b = act.homogeneous_coeffs
    expected = a * np.maximum(X, 0) ** alpha - b * np.maximum(-X, 0) ** alpha
    np.testing.assert_allclose(act(X), expected, rtol=1e-13)
    c = 3.0
    np.testing.assert_allclose(act(c * X), c**alpha * act(X), rtol=1e-12)


def test_shift_breaks_homogeneity_and_is_applied():
    act = get_activation("relu", beta=0.3, gamma=2.0)
    assert act.homogeneity is None and act.homogeneous_coeffs is None
    np.testing.assert_allclose(act(X), np.maximum(2 * X + 0.3, 0))
    np.testing.assert_allclose(act.derivative(X), 2.0 * (2 * X + 0.3 > 0))


@pytest.mark.parametrize("name", ["tanh", "sin", "gelu", "sigmoid", "erf", "silu", "softplus", "elu", "selu"])
def test_not_homogeneous(name):
    assert get_activation(name).homogeneity is None


def test_expression_value_and_exact_derivative():
    act = get_activation("tanh(2*x)+0.1*x")
    np.testing.assert_allclose(act(X), np.tanh(2 * X) + 0.1 * X, rtol=1e-14)
    np.testing.assert_allclose(act.derivative(X), 2 / np.cosh(2 * X) ** 2 + 0.1, rtol=1e-13)
    act2 = get_activation("x**2 - pi*relu(x) + exp(-x*x/2)")
    np.testing.assert_allclose(act2(X), X**2 - np.pi * np.maximum(X, 0) + np.exp(-X * X / 2), rtol=1e-13)


def test_expression_with_affine():
    act = get_activation("sin(x)", gamma=3.0, beta=0.5)
    np.testing.assert_allclose(act(X), np.sin(3 * X + 0.5), rtol=1e-14)
    np.testing.assert_allclose(act.derivative(X), 3 * np.cos(3 * X + 0.5), rtol=1e-13)


@pytest.mark.parametrize(
    "expr,fragment",
    [
        ("__import__('os').system('true')", "not allowed"),
        ("x.__class__", "Attribute"),
        ("x.T", "Attribute"),
        ("open('/etc/passwd')", "call of 'open' is not allowed"),
        ("y + 1", "unknown name 'y'"),
        ("lambda x: x", "Lambda"),
        ("[x for x in ()]", "not allowed"),
        ("x[0]", "Subscript"),
        ("'a' * 3", "not allowed"),
        ("1 + 2", "does not use the variable x"),
        ("x +", "valid expression"),
        ("tanh(x, y=2)", "positional"),
        ("x if x else 1", "IfExp"),
    ],
)
def test_unsafe_or_malformed_expression_rejected(expr, fragment):
    with pytest.raises(ValueError, match=None) as info:
        get_activation(expr)
    assert fragment in str(info.value)


def test_unknown_name_says_it_is_not_registered():
    with pytest.raises(ValueError, match="not a registered activation .*relu.*tanh"):
        get_activation("tahn")


def test_bad_parameters():
    with pytest.raises(ValueError, match="alpha"):
        get_activation("alpha_relu", alpha=-1)
    with pytest.raises(ValueError, match="not allowed for phi='relu'"):
        get_activation("relu", alpha=2)
    with pytest.raises(ValueError, match="gamma=0"):
        get_activation("relu", gamma=0)
    with pytest.raises(ValueError, match="finite"):
        get_activation("relu", beta=float("nan"))
    with pytest.raises(ValueError):
        get_activation(3)


def test_pickle_roundtrip_and_config():
    for act in [get_activation("alpha_relu", alpha=2, gamma=2.0), get_activation("tanh(x)+x", beta=0.1)]:
        back = pickle.loads(pickle.dumps(act))
        assert back == act
        np.testing.assert_allclose(back(X), act(X))
        assert get_activation(**{"phi": act.to_config()["phi"], **{k: v for k, v in act.to_config().items() if k != "phi"}}) == act


def test_callable_activation():
    act = activation_from_callable(np.tanh)
    assert isinstance(act, Activation)
    # finite-difference derivative: documented ~1e-10 relative for smooth functions
    np.testing.assert_allclose(act.derivative(X), 1 / np.cosh(X) ** 2, rtol=1e-8)
    with pytest.raises(ValueError, match="elementwise"):
        activation_from_callable(lambda x: np.sum(x))
    with pytest.raises(ValueError, match="homogeneity"):
        activation_from_callable(np.tanh, homogeneity=1.0, homogeneous_coeffs=(1.0, 0.0))
    hom = activation_from_callable(lambda x: np.maximum(x, 0) * 2, homogeneity=1.0, homogeneous_coeffs=(2.0, 0.0))
    assert hom.homogeneity == 1.0
