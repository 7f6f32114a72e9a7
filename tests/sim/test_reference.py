"""The test references agree between two independent routes (closed form vs Gegenbauer quadrature)."""
import numpy as np
import pytest

from tests.sim import _reference as ref


@pytest.mark.parametrize("b", [5, 8, 32])
def test_relu_closed_forms_match_gegenbauer(b):
    g = ref.gegenbauer_theory(lambda x: np.maximum(x, 0.0), b)
    q, c = ref.relu_bsb1(b)
    # q*, c*, λ_M̃ depend on the low-order coefficients only: quadrature error of the kink ~1e-5
    assert g["q_star"] == pytest.approx(q, rel=2e-5)
    assert g["c_star"] == pytest.approx(c, rel=1e-4)
    assert g["cross_rate"] == pytest.approx(ref.relu_cross_batch_rate(b), rel=1e-4)
    # λ_G weights coefficient l by l(l+B−3): the relu tail a_l² ~ l^-3 converges slowly; with
    # lmax = 120 the truncated sum is low by ~1% (measured: 0.5% at B=8, 1.0% at B=32)
    assert g["grad_rate"] == pytest.approx(ref.relu_grad_rate(b), rel=1.5e-2)
    assert g["grad_rate"] < ref.relu_grad_rate(b)


@pytest.mark.parametrize("b", [5, 8, 32, 100])
def test_identity_closed_forms_match_gegenbauer(b):
    g = ref.gegenbauer_theory(lambda x: x, b, lmax=4, nodes=50)
    assert g["grad_rate"] == pytest.approx(ref.identity_grad_rate(b), rel=1e-12)
    assert g["cross_rate"] == pytest.approx(ref.identity_cross_batch_rate(b), rel=1e-12)
    assert g["c_star"] == pytest.approx(-1.0 / (b - 1), rel=1e-12)


def test_relu_rates_large_batch_limits():
    # Thm 3.10: λ_G → π/(π−1); Thm H.14 at α=1: λ_M̃ → π/(2(π−1)) as B → ∞
    assert ref.relu_grad_rate(10**6) == pytest.approx(np.pi / (np.pi - 1), rel=1e-5)
    assert ref.relu_cross_batch_rate(10**6) == pytest.approx(np.pi / (2 * (np.pi - 1)), rel=1e-5)


def test_tanh_quadrature_converged():
    a = ref.gegenbauer_theory(np.tanh, 8, lmax=60, nodes=400)
    b = ref.gegenbauer_theory(np.tanh, 8, lmax=120, nodes=1500)
    for key in a:
        assert a[key] == pytest.approx(b[key], rel=1e-10)
