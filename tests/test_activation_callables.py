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


@pytest.mark.parametrize("fn", [lambda x: np.exp(1j * np.asarray(x)), lambda x: torch.exp(1j * torch.as_tensor(x))],
                         ids=["numpy", "torch"])
def test_a_complex_valued_callable_is_refused(fn):
    """exp(i x) was analysed as its real part cos(x) (NumPy's cast only warned), and the simulator raised a
    NotImplementedError from deep inside; φ must be real."""
    with pytest.raises(ValueError, match="phi callable returned complex values .*phi must be real-valued"):
        activation_from_callable(fn)
    from bnlab.theory import analyze

    with pytest.raises(ValueError, match="complex values"):
        analyze(fn, 8)


def test_zero_derivative_phi_simulates_with_zero_gradients():
    """An integer-valued torch φ (a rounding) failed in the simulator's Cholesky ("Got Long"), and a φ whose
    derivative is 0 almost everywhere (sign) cut autograd's graph ("not used in the graph").  Both are real
    networks: the forward statistics are those of φ, every gradient below the readout layer is exactly 0."""
    from bnlab.sim import simulate

    rounded = simulate(lambda x: torch.round(x).to(torch.int64), 8, width=32, depth=4, networks=2, seed=0)
    as_float = simulate(lambda x: torch.round(x), 8, width=32, depth=4, networks=2, seed=0)
    np.testing.assert_allclose(rounded.q, as_float.q, rtol=1e-12)
    for res in (rounded, simulate("sign(x)", 8, width=32, depth=4, networks=2, seed=0)):
        assert np.all(res.grad_norm_sq[:, :-1] == 0) and np.all(res.grad_norm_sq[:, -1] > 0)
