"""Python callables as φ: written for NumPy or for torch (issue 13, item 3).

A torch callable gets φ' by autograd (exact), so its theory results equal the registry's tanh to
rounding (1e-12: the sphere rule is the same, only the last bits of tanh differ between libraries);
a NumPy callable without a derivative uses a central difference (≈1e-10 relative, documented), so its
results agree to 1e-8.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from bnlab.activations import activation_from_callable, get_activation
from bnlab.theory import analyze


def test_torch_callable_matches_the_registry():
    ref = analyze("tanh", 32)
    r = analyze(lambda x: torch.tanh(x), 32)
    for k in ("q_star", "c_star", "forward_lambda_L", "forward_lambda_M", "grad_explosion_rate", "cross_batch_rate"):
        assert abs(getattr(r, k) - getattr(ref, k)) <= 1e-12 * abs(getattr(ref, k)), k


def test_numpy_callable_matches_the_registry():
    ref = analyze("tanh", 16)
    r = analyze(lambda x: np.tanh(x), 16)
    for k in ("q_star", "forward_lambda_L", "grad_explosion_rate"):
        assert abs(getattr(r, k) - getattr(ref, k)) <= 1e-8 * abs(getattr(ref, k)), k


def test_torch_callable_has_exact_derivative_and_a_torch_implementation():
    act = get_activation(lambda x: torch.nn.functional.gelu(x))
    x = np.linspace(-3, 3, 13)
    np.testing.assert_allclose(act.derivative(x), get_activation("gelu").derivative(x), rtol=1e-12, atol=1e-15)
    assert act.deriv_is_exact
    t = torch.linspace(-1, 1, 5, dtype=torch.float64, requires_grad=True)
    act.torch(t).sum().backward()  # usable by bnlab.sim
    assert t.grad is not None


def test_scalar_only_callable_error_says_how_to_adapt():
    with pytest.raises(ValueError, match="np.vectorize") as err:
        get_activation(lambda x: math.tanh(x))
    assert "torch.tanh" in str(err.value) and "np.tanh" in str(err.value)
    # the adaptation the message suggests works
    act = get_activation(np.vectorize(math.tanh))
    np.testing.assert_allclose(act(np.array([0.5])), [math.tanh(0.5)])


def test_non_elementwise_callable_is_refused():
    with pytest.raises(ValueError, match="elementwise"):
        get_activation(lambda x: np.sum(x) + 0 * x[:1])


def test_declared_kinks_and_homogeneity_of_a_callable():
    act = activation_from_callable(lambda x: np.maximum(x, 0.0), homogeneity=1.0, homogeneous_coeffs=(1.0, 0.0))
    assert act.kinks == (0.0,)  # a homogeneous φ that is not linear is kinked at 0
    lin = activation_from_callable(lambda x: 2 * x, homogeneity=1.0, homogeneous_coeffs=(2.0, 2.0))
    assert lin.kinks == ()
    assert activation_from_callable(np.tanh, kinks=[0.5, -1]).kinks == (-1.0, 0.5)


def test_a_numpy_error_that_mentions_elementwise_still_tries_torch():
    """Only bnlab's own shape refusal stops the NumPy attempt (caught by its type, not by its text): a
    user's NumPy error whose message says "elementwise" falls through to the torch attempt as any other."""

    def torch_only(x):
        if not torch.is_tensor(x):
            raise ValueError("elementwise ops are defined on tensors only")
        return torch.tanh(x)

    act = activation_from_callable(torch_only)
    xs = np.linspace(-2.0, 2.0, 9)
    np.testing.assert_allclose(act(xs), np.tanh(xs), rtol=1e-12)
