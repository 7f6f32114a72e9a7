"""Thm E.62 (eigenvalues of a G-projected ultrasymmetric operator) against brute-force diagonalization.

Reference route: a dense B×B×B×B ultrasymmetric operator built from random
values per equality class (Defn E.53), the matrix of Σ ↦ G T{Σ} G in an
orthonormal basis of H_B^G, and numpy's eigvals.  Both routes are exact up to
rounding: the tolerance 1e-9 (absolute, values O(1), B ≤ 7) leaves room for
the O(B² ε‖T‖) rounding of the dense route.
"""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bnlab.theory.ultrasymmetric import (
    BRACKETS,
    bracket_pattern,
    dense_ultrasymmetric_operator,
    eigenvalues_on_projected_space,
    projected_eigenvalues,
)


def _random_operator(b, rng, symmetric_inputs=False):
    pats = sorted({bracket_pattern(*t) for t in np.ndindex(b, b, b, b)})
    vals = {}
    for p in pats:
        swapped = bracket_pattern(p[1], p[0], p[3], p[2])  # [kl|ij] = [lk|ji]
        vals[p] = vals[swapped] if swapped in vals else rng.standard_normal()
    if symmetric_inputs:  # T{X} depends on X + Xᵀ only: [kl|ij] = [kl|ji]
        for p in pats:
            q = bracket_pattern(p[0], p[1], p[3], p[2])
            vals[p] = vals[q] = 0.5 * (vals[p] + vals[q]) if p != q else vals[p]
    return dense_ultrasymmetric_operator(vals, b)


def _brackets(t):
    return {k: t[tuple(int(c) - 1 for c in k.replace("|", ""))] for k in BRACKETS}


def _check(t, b):
    dense = eigenvalues_on_projected_space(t)
    ev = projected_eigenvalues(_brackets(t), b)
    dims = {"G": 1, "L": b - 1, "M": b * (b - 3) // 2}
    expected = np.sort(np.repeat([ev.lambda_G, ev.lambda_L, ev.lambda_M], [dims["G"], dims["L"], dims["M"]]))
    np.testing.assert_allclose(dense, expected, atol=1e-9)


@pytest.mark.parametrize("b", [4, 5, 6, 7])
def test_projected_eigenvalues_match_dense_diagonalization(b):
    _check(_random_operator(b, np.random.default_rng(b)), b)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), b=st.integers(4, 6))
def test_projected_eigenvalues_property(seed, b):
    _check(_random_operator(b, np.random.default_rng(seed)), b)


def test_printed_ten_bracket_formula_is_wrong_when_12_13_differs_from_12_31():
    # Erratum: Thms E.61/E.62 use [12|13] for the class of [12|31]; with the two
    # distinct (as for the backward operator F) the printed formula fails.
    b = 6
    t = _random_operator(b, np.random.default_rng(0))
    br = _brackets(t)
    assert abs(br["12|13"] - br["12|31"]) > 1e-3
    printed = dict(br)
    printed["12|31"] = printed["12|13"]
    ev = projected_eigenvalues(printed, b)
    dense = eigenvalues_on_projected_space(t)
    assert min(abs(dense - ev.lambda_M)) > 1e-3


def test_ten_brackets_suffice_for_operators_on_symmetric_inputs():
    b = 5
    t = _random_operator(b, np.random.default_rng(3), symmetric_inputs=True)
    br = _brackets(t)
    ten = np.array([br[k] for k in BRACKETS[:10]])
    assert projected_eigenvalues(ten, b) == projected_eigenvalues(br, b)
    _check(t, b)


def test_vectorized_over_leading_axes():
    rng = np.random.default_rng(1)
    arr = rng.standard_normal((3, 11))
    ev = projected_eigenvalues(arr, 8)
    for i in range(3):
        one = projected_eigenvalues(arr[i], 8)
        assert ev.lambda_L[i] == pytest.approx(one.lambda_L, abs=1e-14)


def test_bad_input():
    with pytest.raises(ValueError, match="last axis"):
        projected_eigenvalues(np.zeros(7), 5)
    with pytest.raises(ValueError, match="missing"):
        projected_eigenvalues({"11|11": 1.0}, 5)
    with pytest.raises(ValueError, match="batch_size"):
        projected_eigenvalues(np.zeros(11), 2)
