"""The optional one-pass statistics kernel (``native_statistics=True``, bnlab.optim._native).

The kernel is checked against an independent route, the float64 sums of the same shifted entries;
BNP with the kernel against BNP with the default eager batch-norm kernel.  Building the kernel
takes ~20 s the first time (then PyTorch caches it), so those tests are ``slow``; the fast tests
check the argument validation and that a failed build degrades to the eager route with a warning.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from bnlab.optim import BNPreconditioner
from bnlab.optim import _native


def _model(dtype=torch.float64):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(300, 20), nn.ReLU(), nn.Linear(20, 5)).to(dtype)


def _run(pre, model, batches):
    for x in batches:
        model.zero_grad()
        model(x).square().sum().backward()
        pre.step()
    return [p.grad.clone() for p in model.parameters()]


def test_native_statistics_must_be_bool():
    with pytest.raises(ValueError, match="native_statistics"):
        BNPreconditioner(_model(), native_statistics="yes")


def test_failed_build_falls_back_to_eager(monkeypatch):
    import torch.utils.cpp_extension as ext

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(_native, "_STATE", {})
    monkeypatch.setattr(ext, "load_inline", broken)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(8, 300, generator=g, dtype=torch.float64) + 1.0 for _ in range(2)]
    with pytest.warns(RuntimeWarning, match="no compiler here"):
        pre = BNPreconditioner(model := _model(), native_statistics=True)
    assert all(s.handler.moments_kernel is None for s in pre._layers.values())
    got = _run(pre, model, batches)
    ref_model = _model()
    want = _run(BNPreconditioner(ref_model), ref_model, batches)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same eager route: same operations


@pytest.mark.slow  # builds the C++ kernel (~20 s once)
@pytest.mark.parametrize("n", [1, 7, 512])
def test_kernel_sums_against_float64(n):
    kernel = _native.moments_kernel()
    if kernel is None:
        pytest.skip("the native kernel cannot be built here")
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, 3072, generator=g) * 3.0 + 2.0
    c = torch.randn(3072, generator=g)
    s1, s2 = kernel.shifted_moments(x, c)
    d = x.double() - c.double()
    ref1, ref2 = d.sum(0), d.square().sum(0)
    # Error bound (Higham §3.1, §4.2, first order): fl(x - c) has relative error ≤ u, its square
    # ≤ 3u, and a recursive sum of n terms adds ≤ (n - 1)u·Σ|terms|; so |s2 - ref2| ≤ (n + 2)u·ref2
    # and |s1 - ref1| ≤ (n + 1)u·Σ|x - c|, with u = 2⁻²⁴ for float32.  A factor 2 covers the
    # second-order terms and the float64 reference's own error (~1e-16 relative).
    u = 2.0 ** -24
    assert ((s2.double() - ref2).abs() <= 2 * (n + 2) * u * ref2).all()
    assert ((s1.double() - ref1).abs() <= 2 * (n + 1) * u * d.abs().sum(0)).all()
    # μ_H, σ_H² from the same sums: μ_H = c + s1/n carries ≤ |s1 error|/n + u·|μ_H|; σ_H² = s2/n -
    # (s1/n)² adds the cancellation factor (s2/n)/σ_H² = 1 + (μ_H - c)²/σ_H² to the sums' error.
    mean, var = kernel.shifted_mean_var(x, c)
    ref_mean, ref_var = x.double().mean(0), x.double().var(0, correction=0)
    tol_sum = 2 * (n + 2) * u
    assert ((mean.double() - ref_mean).abs()
            <= tol_sum * d.abs().sum(0) / n + 2 * u * ref_mean.abs()).all()
    if n > 1:
        assert ((var.double() - ref_var).abs() <= 3 * tol_sum * ref2 / n).all()
    else:
        assert (var == 0).all()


@pytest.mark.slow  # builds the C++ kernel (~20 s once)
@pytest.mark.parametrize("batch", [1, 64])
def test_native_matches_eager_bnp(batch):
    if _native.moments_kernel() is None:
        pytest.skip("the native kernel cannot be built here")
    g = torch.Generator().manual_seed(batch)
    # Inputs with mean 1 and standard deviation 2: the moments about the running mean c (0 at the
    # first step) cancel by at most 1 + (μ - c)²/σ² ≈ 1.25 (first step) in float64.
    batches = [torch.randn(batch, 300, generator=g, dtype=torch.float64) * 2.0 + 1.0 for _ in range(4)]
    native_model, eager_model = _model(), _model()
    native = BNPreconditioner(native_model, native_statistics=True, rho=0.5)
    eager = BNPreconditioner(eager_model, rho=0.5)
    assert all(s.handler.moments_kernel is not None for s in native._layers.values())
    got, want = _run(native, native_model, batches), _run(eager, eager_model, batches)
    # Both routes are exact up to float64 rounding: the sums carry ≤ (N + 2)u relative error times
    # the cancellation factor (≤ ~2 here), the Eq. 15 transform is the same code; 1e-11 relative
    # is > 100× that bound at N = 64 (u = 1.1e-16) and far below any error of the formula.
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11 * b.abs().max().item())
    for name in native.layers:
        for a, b in zip(native.statistics(name), eager.statistics(name)):
            torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12)
