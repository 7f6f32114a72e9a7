"""Rank measures against matrices with known answers, Lemma 1's inequalities, stacks, bad input.

Tolerances: the singular values from LAPACK's SVD are backward stable, |σ̂_i − σ_i| ≤
c·max(d, N)·eps·σ_1 with a small c, so closed forms built from prescribed singular values of
order one agree to ~1e-13 in float64 (we allow 1e-10 relative) and ~1e-5 in float32.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bnlab.rank import (
    effective_rank,
    numerical_rank,
    rank_lower_bound,
    rank_measures,
    soft_rank,
    stable_rank,
)


def _orthogonal(n, gen, dtype=torch.float64):
    q, r = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=dtype))
    return q * torch.sign(torch.diagonal(r))


def _with_singular_values(s, d, n, gen, dtype=torch.float64):
    """U diag(s) Vᵀ with Haar-random U (d × d), V (N × N): singular values exactly s (up to rounding)."""
    u = _orthogonal(d, gen, dtype)[:, : len(s)]
    v = _orthogonal(n, gen, dtype)[:, : len(s)]
    return (u * torch.as_tensor(s, dtype=dtype)) @ v.T


def test_orthogonal_rows_have_full_rank_in_every_measure():
    gen = torch.Generator().manual_seed(0)
    d, n = 8, 16
    h = math.sqrt(n) * _orthogonal(n, gen)[:d]  # rows orthogonal, each of norm √N: M = I_d
    m = rank_measures(h, tau=0.5)
    assert int(m.soft_rank) == d
    assert int(soft_rank(h, tau=1.0 + 1e-9)) == 0  # every λ_i = 1: none reaches τ > 1
    for v in (m.rank_lower_bound, m.stable_rank, m.effective_rank, rank_lower_bound(h)):
        assert float(v) == pytest.approx(d, rel=1e-10)
    assert int(m.numerical_rank) == d


@pytest.mark.parametrize("dtype,rel", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
def test_prescribed_singular_values_closed_forms(dtype, rel):
    gen = torch.Generator().manual_seed(1)
    s = np.array([3.0, 2.0, 1.0, 0.5, 0.25])
    d, n = 12, 9
    h = _with_singular_values(s, d, n, gen, dtype)
    lam = s**2
    p = s / s.sum()
    expected = {
        "rank_lower_bound": lam.sum() ** 2 / (lam**2).sum(),
        "stable_rank": lam.sum() / lam[0],
        "effective_rank": math.exp(-(p * np.log(p)).sum()),
    }
    m = rank_measures(h, tau=0.5)
    for key, val in expected.items():
        assert float(getattr(m, key)) == pytest.approx(val, rel=rel), key
    assert float(rank_lower_bound(h)) == pytest.approx(expected["rank_lower_bound"], rel=rel)
    assert int(m.numerical_rank) == 5  # rank-5 matrix, the rest at rounding level
    # λ_i = s_i²/N = 1, 0.444, 0.111, ...: rank_τ counts λ_i ≥ τ
    assert int(soft_rank(h, tau=0.4)) == 2
    assert int(soft_rank(h, tau=1.0 - 1e-6)) == 1
    assert m.singular_values.dtype == dtype


def test_rank_k_product():
    gen = torch.Generator().manual_seed(2)
    for k in (1, 3, 7):
        h = torch.randn(20, k, generator=gen, dtype=torch.float64) @ torch.randn(k, 30, generator=gen,
                                                                                  dtype=torch.float64)
        m = rank_measures(h)
        assert int(m.numerical_rank) == k
        assert float(m.rank_lower_bound) <= k + 1e-9
        assert float(m.effective_rank) <= k + 1e-9
        assert float(m.stable_rank) <= k + 1e-9
        assert int(m.numerical_rank) == int(torch.linalg.matrix_rank(h))


def test_nearly_collinear_columns():
    # H = u 1ᵀ + δ E: algebraically full rank, but r(H) = 1 + O(δ²) and one soft-rank direction.
    gen = torch.Generator().manual_seed(3)
    d, n, delta = 16, 16, 1e-6
    u = torch.randn(d, 1, generator=gen, dtype=torch.float64)
    h = u @ torch.ones(1, n, dtype=torch.float64) + delta * torch.randn(d, n, generator=gen, dtype=torch.float64)
    h = h * math.sqrt(d * n) / h.norm()  # tr M = d
    m = rank_measures(h, tau=0.5)
    assert int(m.numerical_rank) == d  # δ = 1e-6 ≫ rtol = 16·eps
    assert int(m.soft_rank) == 1
    # r − 1 ≤ 2 Σ_{i≥2} λ_i/λ_1 ≈ 2 δ²·(d N)/|u|²N ~ 1e-10 here; allow 1e-8.
    assert 1.0 <= float(m.rank_lower_bound) < 1.0 + 1e-8
    assert float(m.effective_rank) < 1.0 + 1e-4


def test_effective_rank_is_entropy_not_softmax():
    # σ = (1, 0, 0): the ℓ1-normalized distribution is (1, 0, 0), entropy 0, effective rank 1.
    # (A softmax of (1, 0, 0) would give exp(H) ≈ 2.6.)
    h = torch.zeros(3, 3, dtype=torch.float64)
    h[0, 0] = 1.0
    assert float(effective_rank(h)) == pytest.approx(1.0, abs=1e-12)
    # Two equal singular values: effective rank exactly 2.
    h[1, 1] = 1.0
    assert float(effective_rank(h)) == pytest.approx(2.0, rel=1e-12)


def test_zero_matrix_gives_zero_not_nan():
    h = torch.zeros(4, 5, dtype=torch.float64)
    m = rank_measures(h)
    for key in ("soft_rank", "rank_lower_bound", "numerical_rank", "stable_rank", "effective_rank"):
        assert float(getattr(m, key)) == 0.0, key
    assert float(rank_lower_bound(h)) == 0.0


def test_stack_matches_per_matrix_loop_and_matrix_rank():
    gen = torch.Generator().manual_seed(4)
    # (layers, chains, d, N) with ranks varying from 1 to 6
    mats = []
    for i in range(12):
        k = 1 + i % 6
        mats.append(torch.randn(10, k, generator=gen, dtype=torch.float64)
                    @ torch.randn(k, 7, generator=gen, dtype=torch.float64))
    stack = torch.stack(mats).reshape(3, 4, 10, 7)
    m = rank_measures(stack, tau=0.3)
    assert m.soft_rank.shape == (3, 4)
    flat = stack.reshape(12, 10, 7)
    for i in range(12):
        one = rank_measures(flat[i], tau=0.3)
        assert int(m.soft_rank.reshape(-1)[i]) == int(one.soft_rank)
        assert float(m.rank_lower_bound.reshape(-1)[i]) == pytest.approx(float(one.rank_lower_bound), rel=1e-12)
    torch.testing.assert_close(m.numerical_rank, torch.linalg.matrix_rank(stack))
    # Two independent routes to r(H): the Gram matrix (no decomposition) and the singular values.
    torch.testing.assert_close(rank_lower_bound(stack), m.rank_lower_bound, rtol=1e-10, atol=0)
    torch.testing.assert_close(stable_rank(stack), m.stable_rank)
    torch.testing.assert_close(numerical_rank(stack), m.numerical_rank)


def test_rank_lower_bound_is_differentiable():
    gen = torch.Generator().manual_seed(5)
    h = torch.randn(6, 9, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(rank_lower_bound, (h,))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_matches_cpu():  # pragma: no cover - runs where a GPU is present
    gen = torch.Generator().manual_seed(6)
    h = torch.randn(5, 16, 32, generator=gen, dtype=torch.float64)
    a, b = rank_measures(h), rank_measures(h.cuda())
    assert b.soft_rank.device.type == "cuda"
    torch.testing.assert_close(a.rank_lower_bound, b.rank_lower_bound.cpu())
    torch.testing.assert_close(a.soft_rank, b.soft_rank.cpu())


matrices = st.tuples(st.integers(1, 8), st.integers(1, 8), st.integers(0, 2**31 - 1), st.floats(-3, 3))


@settings(max_examples=60, deadline=None)
@given(matrices)
def test_lemma1_rank_bounds_r(args):
    """Lemma 1 (part 1): rank(H) ≥ r(H) for every H (any scale, any shape)."""
    d, n, seed, log_scale = args
    gen = torch.Generator().manual_seed(seed)
    k = int(torch.randint(1, min(d, n) + 1, (1,), generator=gen))
    h = torch.randn(d, k, generator=gen, dtype=torch.float64) @ torch.randn(k, n, generator=gen, dtype=torch.float64)
    h = h * 10.0**log_scale
    m = rank_measures(h)
    # r ≤ rank with the rounding of σ's (relative 1e-12) as slack
    assert float(m.rank_lower_bound) <= float(m.numerical_rank) * (1 + 1e-12)
    assert float(m.effective_rank) <= float(m.numerical_rank) * (1 + 1e-12)


@settings(max_examples=60, deadline=None)
@given(matrices, st.floats(0.01, 0.99))
def test_lemma1_soft_rank_bound_at_unit_trace(args, tau):
    """Lemma 1 (part 2): rank_τ(H) ≥ (1 − τ)² r(H) when every row has mean square one (tr M = d)."""
    d, n, seed, _ = args
    gen = torch.Generator().manual_seed(seed)
    k = int(torch.randint(1, min(d, n) + 1, (1,), generator=gen))
    h = torch.randn(d, k, generator=gen, dtype=torch.float64) @ torch.randn(k, n, generator=gen, dtype=torch.float64)
    h = h / h.pow(2).mean(dim=1, keepdim=True).sqrt()  # BN_{0,1} of Eq. 2: diag M = 1
    assert float(soft_rank(h, tau)) >= (1 - tau) ** 2 * float(rank_lower_bound(h)) - 1e-9


def test_lemma1_part2_needs_the_unit_trace_premise():
    # The soft rank is scale-dependent: at tr M = d/100 no eigenvalue reaches τ = 0.5, r is unchanged.
    h = math.sqrt(4) * torch.eye(4, 4, dtype=torch.float64)  # M = I (N = 4)
    assert int(soft_rank(h / 10)) == 0
    assert float(rank_lower_bound(h / 10)) == pytest.approx(4.0)


@pytest.mark.parametrize("tau", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_tau(tau):
    with pytest.raises(ValueError, match="tau"):
        soft_rank(torch.ones(2, 2), tau)
    with pytest.raises(ValueError, match="tau"):
        rank_measures(torch.ones(2, 2), tau)


@pytest.mark.parametrize(
    "fn", [soft_rank, rank_lower_bound, numerical_rank, stable_rank, effective_rank, rank_measures])
def test_bad_representations(fn):
    bad_nan = torch.ones(3, 3)
    bad_nan[1, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        fn(bad_nan)
    with pytest.raises(ValueError, match="width d = 0"):
        fn(torch.ones(0, 5))
    with pytest.raises(ValueError, match="batch size N = 0"):
        fn(torch.ones(5, 0))
    with pytest.raises(ValueError, match=r"shape \(\.\.\., d, N\)"):
        fn(torch.ones(5))
    with pytest.raises(ValueError, match="h is not allowed"):
        fn("not a matrix")


def test_numpy_and_int_inputs_become_float64():
    m = rank_measures(np.eye(3, dtype=np.int64))
    assert m.singular_values.dtype == torch.float64
    assert int(m.numerical_rank) == 3
