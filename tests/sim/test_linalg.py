"""Blocked products and Cholesky (bnlab.sim._linalg) against the plain torch operations.

The blocked routines change only the order of the floating-point sums, so they must equal the
plain results to a few units of rounding: rtol = 64·u·(reduction length)^½ covers the usual
√n growth of summation error with a wide margin, and any indexing mistake (a wrong or missing
block) changes entries by O(1).
"""
import pytest
import torch

from bnlab.sim import _linalg
from bnlab.sim._linalg import cholesky, gram, lower_triangular_matmul

SIZES = [1, 5, 64, 65, 130, 200, 300]  # below, at and above _MIN_BLOCK; 2–3 recursion levels


def _rtol(dtype, n):
    return 64 * torch.finfo(dtype).eps * n**0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("m", SIZES)
def test_gram_equals_x_xT_and_is_exactly_symmetric(dtype, m):
    g = torch.Generator().manual_seed(m)
    x = torch.randn(3, 2, m, 70, generator=g, dtype=dtype)  # extra leading dims as batch_covariance uses
    got = gram(x)
    assert got.shape == (3, 2, m, m)
    torch.testing.assert_close(got, x @ x.transpose(-1, -2), rtol=_rtol(dtype, 70), atol=_rtol(dtype, 70) * 70)
    # exact symmetry is asserted because gram() builds the upper triangle as a copy of the lower
    # one (a plain bmm does not promise it: on an AMD EPYC its two triangles differ in the last bits)
    assert torch.equal(got, got.transpose(-1, -2))


def test_gram_is_exactly_symmetric_even_when_the_base_product_is_not(monkeypatch):
    # Simulate a BLAS whose x xᵀ differs between the triangles (as on an AMD EPYC): every bmm
    # perturbs the upper triangle of the diagonal block it computes (the last square block of a
    # row slab x₂xᵀ, or the whole of a base-case x xᵀ); gram() must still return a symmetric
    # matrix, equal to the lower triangle's (unperturbed) values.
    real_bmm = torch.bmm

    def skewed_bmm(a, b, out=None):
        res = real_bmm(a, b)
        rows, cols = res.shape[-2:]
        res = res + 1e-3 * torch.ones_like(res).triu(cols - rows + 1)
        if out is None:
            return res
        out.copy_(res)
        return out

    monkeypatch.setattr(_linalg.torch, "bmm", skewed_bmm)
    x = torch.randn(2, 150, 30, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    got = gram(x)
    assert torch.equal(got, got.transpose(-1, -2))
    torch.testing.assert_close(got, x @ x.transpose(-1, -2), rtol=1e-12, atol=1e-12)


def test_differentiable_gram_is_exactly_symmetric():
    x = torch.randn(2, 90, 30, dtype=torch.float32, requires_grad=True)
    got = gram(x)
    assert torch.equal(got, got.transpose(-1, -2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("m", SIZES)
def test_lower_triangular_matmul_equals_the_plain_product(dtype, m):
    g = torch.Generator().manual_seed(m)
    lower = torch.randn(4, m, m, generator=g, dtype=dtype).tril()
    z = torch.randn(4, m, 50, generator=g, dtype=dtype)
    scale = _rtol(dtype, m) * m**0.5
    torch.testing.assert_close(lower_triangular_matmul(lower, z), lower @ z, rtol=scale, atol=scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("m", SIZES)
def test_blocked_cholesky_equals_lapack(dtype, m):
    g = torch.Generator().manual_seed(m)
    a = torch.randn(3, m, 2 * m + 3, generator=g, dtype=dtype)
    spd = a @ a.transpose(1, 2)  # κ ≈ 30: the factor is well determined, so both routes agree
    got, info = cholesky(spd)
    want = torch.linalg.cholesky(spd)
    assert torch.all(info == 0)
    assert torch.equal(got, got.tril())  # upper triangle exactly zero (lower_triangular_matmul needs it)
    torch.testing.assert_close(got, want, rtol=0, atol=1e3 * torch.finfo(dtype).eps * want.abs().max().item())


def test_blocked_cholesky_reports_failures_per_matrix():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(4, 150, 400, generator=g, dtype=torch.float64)
    spd = a @ a.transpose(1, 2)
    spd[1, 0, 0] = -1.0  # fails in the first block
    spd[2, -1, -1] = -1e6  # fails in the last block (Schur complement)
    _, info = cholesky(spd)
    assert (info != 0).tolist() == [False, True, True, False]


def test_tensors_requiring_grad_take_the_differentiable_plain_products():
    x = torch.randn(2, 80, 30, dtype=torch.float64, requires_grad=True)
    gram(x).sum().backward()  # the blocked version writes into slices and would raise
    torch.testing.assert_close(x.grad, 2 * x.sum(1, keepdim=True).expand_as(x))
    lower = torch.randn(2, 80, 80, dtype=torch.float64).tril().requires_grad_(True)
    lower_triangular_matmul(lower, x.detach()).sum().backward()
    assert lower.grad is not None


def test_min_block_is_a_block_size_not_a_result(monkeypatch):
    # same results whatever the recursion depth (rounding aside)
    x = torch.randn(2, 257, 40, dtype=torch.float64)
    base = gram(x)
    monkeypatch.setattr(_linalg, "_MIN_BLOCK", 16)
    torch.testing.assert_close(gram(x), base, rtol=1e-13, atol=1e-12)
