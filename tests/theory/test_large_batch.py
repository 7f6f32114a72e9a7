"""Very large batches: closed forms and the BSB1/BSB2 verdict stable to B = 1e12 (issue 13, item 2).

λ_L↑ of relu is 1 − 2.27/B: the sphere sums of bnlab.theory.symmetry cancel like B·1e-16, so
relu at B = 3e8 was classified BSB2.  Now the verdict for positive-homogeneous φ comes from the
closed forms, and relu's λ_L↑ is evaluated as 1 − gap with the gap free of cancellation.  The
reference gaps are exact: relu's from Thm 3.7 in 50-digit mpmath, the identity's 2/(B + 1).  A
float64 λ near 1 can carry its gap only to half an ulp of 1 (1.1e-16 absolute), so the tolerance
is one ulp of 1 (2.2e-16): the returned λ is correctly rounded (within one rounding).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from bnlab.theory import analyze, forward_eigenvalues
from bnlab.theory.symmetry import bsb1_stability, fixed_point_kind

ULP_OF_ONE = 2.220446049250313e-16
BIG = (10**6, 3 * 10**8, 10**9, 10**12)


def _relu_gap_exact(b: int) -> float:
    mp = pytest.importorskip("mpmath")
    mp.mp.dps = 50
    bb = mp.mpf(b)
    xi = -1 / (bb - 1)
    j1 = (mp.sqrt(1 - xi**2) + (mp.pi - mp.acos(xi)) * xi) / mp.pi
    dj = (mp.pi - mp.acos(xi)) / mp.pi
    lam_l = ((bb - 2) * (1 - j1) + bb / (bb - 1) * dj) / ((bb + 1) * (1 - j1))  # Thm 3.7, Eq. 13
    return float(1 - lam_l)


@pytest.mark.parametrize("b", BIG)
def test_relu_forward_lambda_L_is_one_minus_an_exact_gap(b):
    lam = forward_eigenvalues("relu", b, method="closed").lambda_L
    assert lam < 1.0
    assert abs((1.0 - lam) - _relu_gap_exact(b)) <= ULP_OF_ONE


@pytest.mark.parametrize("b", BIG)
def test_identity_forward_eigenvalues_near_one(b):
    fw = forward_eigenvalues("identity", b, method="closed")
    assert abs((1.0 - fw.lambda_L) - 2.0 / (b + 1.0)) <= ULP_OF_ONE
    assert fw.lambda_M < 1.0


@pytest.mark.parametrize("phi,kw", [("relu", {}), ("identity", {}), ("leaky_relu", {"slope": 0.2})])
@pytest.mark.parametrize("b", BIG)
def test_large_batch_is_bsb1(phi, kw, b):
    from bnlab.activations import get_activation

    act = get_activation(phi, **kw)
    st = bsb1_stability(act, b)
    assert st.lambda_L < 1.0 and st.lambda_M < 1.0
    assert fixed_point_kind(act, b, depth=None) == "BSB1"


def test_stability_matches_the_sphere_route_at_moderate_b():
    # the closed/Laplace path of bsb1_stability agrees with the sphere sums it replaced where they are
    # accurate (B ≤ 1000: cancellation ≤ 1e-13)
    from bnlab.activations import get_activation
    from bnlab.theory.symmetry import _sphere_terms  # noqa: F401  (the old path still serves other φ)

    for phi, b in [("relu", 8), ("relu", 1000), (get_activation("alpha_relu", alpha=1.5), 16)]:
        st = bsb1_stability(phi, b)
        fw = forward_eigenvalues(phi, b, method="sphere")
        assert abs(st.lambda_L - fw.lambda_L) <= 1e-10 and abs(st.lambda_M - fw.lambda_M) <= 1e-10


def test_analyze_relu_at_three_hundred_million():
    r = analyze("relu", 300_000_000)
    assert r.fixed_point_kind == "BSB1"
    assert r.forward_lambda_L < 1.0
    assert abs((1.0 - r.forward_lambda_L) - _relu_gap_exact(300_000_000)) <= ULP_OF_ONE


def test_cli_relu_at_three_hundred_million_is_bsb1():
    env = dict(os.environ)
    out = subprocess.run(
        [sys.executable, "-m", "bnlab", "theory", "--phi", "relu", "--batch-size", "300000000", "--json"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["fixed_point_kind"] == "BSB1" and d["forward_lambda_L"] < 1.0


@pytest.mark.parametrize("b", [10**400, 10**100 + 1])
@pytest.mark.parametrize("name", ["analyze", "gradient_explosion_rate", "bsb1_fixed_point", "forward_eigenvalues",
                                  "backward_eigenvalues", "cross_batch_rate", "epsilon_analysis"])
def test_astronomical_batch_size_refused_naming_batch_size(name, b):
    """B beyond 1e100 (bnlab.theory._checks.MAX_BATCH_SIZE) is a ValueError naming batch_size: the closed forms
    evaluate powers of B up to B³ in float64, and 10**400 raised OverflowError ("int too large to convert to
    float") from inside (10**150 already in λ_G↓'s cubic).  No tolerance: an exception or not."""
    import bnlab.theory as T

    fn = getattr(T, name)
    args = ("relu", b, 0.1) if name == "epsilon_analysis" else ("relu", b)
    with pytest.raises(ValueError, match=r"batch_size=1\.000e(400|100) \(an int of \d+ digits\) is not allowed"):
        fn(*args)


def test_batch_size_at_the_cap_still_answers():
    """B = 1e100 (the cap itself) still answers: λ_G↓ of relu equals its value at B = 1e20 (both the B → ∞ limit
    π/(π−1)·… to float64 rounding: the closed form's 1/B corrections are < 1e-16 there).  Tolerance 4 ulp
    (1e-15 relative): rounding of the closed form's few operations."""
    from bnlab.theory import gradient_explosion_rate

    assert gradient_explosion_rate("relu", 10**100) == pytest.approx(gradient_explosion_rate("relu", 10**20),
                                                                       rel=1e-15, abs=0.0)


def test_depth_scale_of_a_huge_integer_rate():
    """depth_scale(10**400) = 1/log(10**400) = 1/(400 ln 10): math.log takes a Python int of any size, where
    float(10**400) overflowed (OverflowError).  Tolerance 1e-15 relative: one log and one division."""
    from bnlab.theory import depth_scale

    assert depth_scale(10**400) == pytest.approx(1.0 / (400.0 * math.log(10.0)), rel=1e-15, abs=0.0)
