"""No wrong number with exit 0 (issue 13, item 4): every case the issue lists, through analyze and the CLI.

Each φ below used to produce a number that cannot be right (a rate of 0 read as "gradients blow up at
once", q* = 8e15 for 1/x, BSB2 after an overflow, an OverflowError traceback).  Now: the right answer
where an exact invariance gives it (batchnorm makes φ and cφ + d equivalent; |γ| of a homogeneous φ
drops out; both exact at ε = 0, so compared to 1e-12), else a ValueError that says why, or the forward
quantities with the gradient quantities left out and the reason in ``warnings``.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest

from bnlab.theory import analyze
from bnlab.theory.symmetry import fixed_point_kind

KEYS = ("q_star", "c_star", "forward_lambda_L", "forward_lambda_M", "grad_explosion_rate", "backward_lambda_L",
        "backward_lambda_M", "cross_batch_rate")


def _same(r, ref, keys=KEYS, rtol=1e-12):
    for k in keys:
        a, b = getattr(r, k), getattr(ref, k)
        assert a is not None and b is not None, k
        assert abs(a - b) <= rtol * abs(b) + 1e-15, (k, a, b)


def test_huge_eps_is_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"eps=1e\+308.*overflows"):
        analyze("relu", 8, eps=1e308)


def test_vanishing_rate_is_not_called_a_blow_up():
    r = analyze("relu", 8, eps=1e100)
    assert 0 < r.grad_explosion_rate < 1e-90 and r.depth_scale == math.inf
    assert not any("blow up" in w for w in r.warnings)


def test_homogeneous_phi_with_huge_gamma_is_scale_invariant():
    # relu(1e308 x) = 1e308 relu(x): batchnorm ignores the factor (ε = 0)
    _same(analyze("relu", 8, gamma=1e308), analyze("relu", 8))
    _same(analyze("relu", 8, gamma=-1e-300), analyze("relu", 8, gamma=-1.0))


def test_output_scale_drops_out():
    # x*1e300 is finite but its squares overflow: divided by its maximum, it is the identity
    r = analyze("x*1e300", 8)
    assert any("equivalent" in w for w in r.warnings)
    _same(r, analyze("identity", 8), keys=KEYS[2:])
    _same(analyze("x*1e-200", 8), analyze("identity", 8), keys=KEYS[2:])


@pytest.mark.parametrize(
    "phi,kw,match",
    [
        ("x*1e308", {}, "not finite|real and finite"),
        ("exp(exp(exp(x)))", {}, "not finite|real and finite"),
        ("1/x", {}, "not finite|real and finite|pole"),
        ("1/(x - 0.123456)", {}, "not finite|pole|unbounded"),
        ("alpha_relu", {"alpha": 1e308}, "not finite"),
        ("0*x + 1", {}, "constant"),
        ("relu", {"beta": 1e308}, "constant"),
        ("tanh", {"beta": 1e10}, "constant"),
    ],
)
def test_inadmissible_phi_is_a_value_error(phi, kw, match):
    with pytest.raises(ValueError, match=match):
        analyze(phi, 8, **kw)


@pytest.mark.parametrize("phi,kw", [("sign(x)", {}), ("tanh", {"gamma": 1e308})])
def test_jump_leaves_out_the_gradient_quantities(phi, kw):
    # a jump of φ puts a Dirac mass in φ': E φ'² is undefined.  The forward quantities stay, and equal
    # those of sign(x) (tanh(1e308 x) is sign(x) in float64 away from |x| < 1e-308)
    r = analyze(phi, 8, **kw)
    assert r.grad_explosion_rate is None and r.backward_lambda_L is None and r.cross_batch_rate is None
    assert any("jumps" in w for w in r.warnings)
    ref = analyze("sign(x)", 8)
    _same(r, ref, keys=("q_star", "c_star", "forward_lambda_L", "forward_lambda_M"), rtol=1e-10)


def test_non_square_integrable_derivative():
    # √|x|: φ' ~ |x|^{−1/2} is integrable (cross-batch rate defined) but not square integrable
    r = analyze("sqrt(abs(x))", 8)
    assert r.grad_explosion_rate is None and any("not square integrable" in w for w in r.warnings)
    assert r.cross_batch_rate is not None and r.forward_lambda_L is not None


def test_overflow_never_reads_as_bsb2():
    import warnings

    from bnlab.activations import get_activation

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the overflow is reported by the ValueError alone, not NumPy warnings
        with pytest.raises(ValueError, match="not finite"):
            fixed_point_kind(get_activation("x*1e300"), 8, depth=None)


def test_bsb1_stability_of_an_overflowing_phi_is_an_error_not_nan():
    import warnings

    from bnlab.activations import get_activation
    from bnlab.theory.symmetry import bsb1_stability

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="phi='x\\*1e300' at batch_size=8 are not finite"):
            bsb1_stability(get_activation("x*1e300"), 8)


@pytest.mark.parametrize("args", [["--phi", "1/x"], ["--phi", "alpha_relu", "--alpha", "1e308"], ["--eps", "1e308"]])
def test_cli_exits_2_with_the_reason(args):
    out = subprocess.run(
        [sys.executable, "-m", "bnlab", "theory", "--batch-size", "8", *args],
        capture_output=True, text=True, env=dict(os.environ), timeout=120,
    )
    assert out.returncode == 2, (out.returncode, out.stderr[-500:])
    assert "Traceback" not in out.stderr and "error" in out.stderr


@pytest.mark.parametrize("phi,kw", [("tanh", {}), ("relu", {"beta": 1.0}), ("relu(x - 0.3) + 0.1*x", {}),
                                    ("abs", {"beta": -0.3}), ("relu", {"beta": 100.0})])
@pytest.mark.parametrize("b", [4, 17, 32, 1024])
def test_support_probe_and_median_are_the_plain_numpy_ones(phi, kw, b):
    # the probe and the median are written without np.unique / np.median for speed (issue 25): the same
    # arrays and values as those (exact: both only sort and select, no arithmetic to round differently)
    from bnlab.activations import get_activation
    from bnlab.theory._admissible import _median, _support_probe

    act = get_activation(phi, **kw)
    r = math.sqrt(b - 1.0)
    pts = [np.linspace(-r, r, 4097), np.array([0.0])]
    for k in act.kinks:
        if abs(k) <= r:
            d = 1e-9 * max(1.0, abs(k))
            pts.append(np.array([k - d, k, k + d]))
    want = np.unique(np.concatenate(pts))
    got = _support_probe(act, b)
    assert np.array_equal(got, want)
    vals = np.abs(act(want))
    for v in (vals, vals[:-1], vals[:3], vals[:1]):
        assert _median(v) == float(np.median(v))
