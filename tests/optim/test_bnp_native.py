"""The optional compiled kernels (``BNPreconditioner(native=True)``, bnlab.optim._native).

The statistics kernel is checked against an independent route, the float64 sums of the same
shifted entries; BNP with the kernels (the one-call ``dense_step`` and the general route with the
one-pass statistics) against BNP's default eager route, which shares no arithmetic with them.
Building the kernels takes ~20 s the first time (then PyTorch caches them), so those tests are
``slow``; the fast tests check the argument validation and that a failed build degrades to the
eager route with a warning.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from bnlab import _kernel_cache
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


def test_native_must_be_bool():
    with pytest.raises(ValueError, match="native='yes'"):
        BNPreconditioner(_model(), native="yes")
    with pytest.raises(ValueError, match="native_statistics"):
        BNPreconditioner(_model(), native_statistics="yes")


def test_native_statistics_is_a_deprecated_alias(monkeypatch):
    monkeypatch.setattr(_native, "_STATE", {"kernel": None})  # as if the build had failed: no compiler needed
    with pytest.warns(DeprecationWarning, match="native="):
        pre = BNPreconditioner(_model(), native_statistics=True)
    assert pre.native is True
    assert BNPreconditioner(_model()).native is False


def test_cpu_tag_names_the_build_per_cpu():
    # The -march=native build is cached per CPU model and flags: a stable 12-hex-digit tag.
    tag = _kernel_cache.cpu_tag()
    assert len(tag) == 12 and int(tag, 16) >= 0
    assert tag == _kernel_cache.cpu_tag()


def test_failed_build_falls_back_to_eager(monkeypatch):
    import torch.utils.cpp_extension as ext

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(_native, "_STATE", {})
    monkeypatch.setattr(ext, "load_inline", broken)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(8, 300, generator=g, dtype=torch.float64) + 1.0 for _ in range(2)]
    with pytest.warns(RuntimeWarning, match="no compiler here"):
        pre = BNPreconditioner(model := _model(), native=True)
    assert all(s.handler.moments_kernel is None for s in pre._layers.values())
    got = _run(pre, model, batches)
    ref_model = _model()
    want = _run(BNPreconditioner(ref_model), ref_model, batches)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same eager route: same operations


@pytest.mark.slow  # builds the C++ kernel (~20 s once)
@pytest.mark.parametrize("n", [1, 7, 512])
def test_kernel_sums_against_float64(n):
    kernel = _native.kernels()
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


def _needs_kernels():
    if _native.kernels() is None:
        pytest.skip("the native kernels cannot be built here")


class _CountingKernels:
    """The compiled module with its ``dense_step`` calls counted (which route a step took)."""

    def __init__(self, module):
        self.module, self.dense_steps = module, 0

    def __getattr__(self, name):
        return getattr(self.module, name)

    def dense_step(self, *args):
        self.dense_steps += 1
        return self.module.dense_step(*args)


def _counting(pre):
    pre._native_kernel = _CountingKernels(pre._native_kernel)
    return pre._native_kernel


def _assert_same_bnp(native_model, native, eager_model, eager, rtol=1e-11):
    # Both routes are exact up to float64 rounding: the native sums carry ≤ (N + 2)u relative error
    # times the cancellation factor 1 + (μ_H - c)²/σ_H² (≤ ~2 for these inputs), the eager route's
    # two-pass variance less, and both transforms a few u per entry plus n_in·u on the bias' sum;
    # 1e-11 relative is > 100× those bounds (u = 1.1e-16, N ≤ 64, n_in = 300) and far below any
    # error of the formula (a wrong sign or a missing 1/q² changes entries by O(1)).
    for a, b in zip(native_model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=rtol, atol=rtol * b.grad.abs().max().item())
    for name in native.layers:
        for a, b in zip(native.statistics(name), eager.statistics(name)):
            torch.testing.assert_close(a, b, rtol=rtol, atol=rtol)


@pytest.mark.slow  # builds the C++ kernel (~20 s once)
@pytest.mark.parametrize("batch", [1, 2, 64])
@pytest.mark.parametrize("last_bias", [True, False])
def test_native_matches_eager_bnp(batch, last_bias):
    """The one-call route (steps 1-5 of every layer in dense_step) against the eager route, over
    several steps (the running statistics carry over), at N = 1 (variance about the running mean,
    §3.3), N = 2 and N = 64, with and without the last layer's bias (scaling only)."""
    _needs_kernels()
    g = torch.Generator().manual_seed(batch)
    # Inputs with mean 1 and standard deviation 2: the moments about the running mean c (0 at the
    # first step) cancel by at most 1 + (μ - c)²/σ² ≈ 1.25 (first step) in float64.
    batches = [torch.randn(batch, 300, generator=g, dtype=torch.float64) * 2.0 + 1.0 for _ in range(4)]

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(300, 20), nn.ReLU(), nn.Linear(20, 7), nn.Tanh(),
                             nn.Linear(7, 5, bias=last_bias)).double()

    native_model, eager_model = model(), model()
    native = BNPreconditioner(native_model, native=True, rho=0.5)
    eager = BNPreconditioner(eager_model, rho=0.5)
    assert all(s.handler.moments_kernel is not None for s in native._layers.values())
    calls = _counting(native)
    _run(native, native_model, batches)
    _run(eager, eager_model, batches)
    assert calls.dense_steps == len(batches)  # one kernel call per step, nothing eager
    assert native.steps == eager.steps == len(batches)
    _assert_same_bnp(native_model, native, eager_model, eager)


@pytest.mark.slow  # builds the C++ kernel (~20 s once)
def test_native_general_route_matches_eager():
    """Steps the one-call route does not take, against the eager route: a model with a convolution
    (eager) beside dense layers (their share by dense_step), a step with two forwards (the kept
    input's moments pooled with the second's), and a non-contiguous weight gradient (eager)."""
    _needs_kernels()

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.conv = nn.Conv1d(3, 4, 3, padding=1)
            self.fc1 = nn.Linear(40, 16)
            self.fc2 = nn.Linear(16, 5)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(torch.relu(self.conv(x)).flatten(1))))

    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(6, 3, 10, generator=g, dtype=torch.float64) + 0.5 for _ in range(5)]
    models = [Net().double(), Net().double()]
    pres = [BNPreconditioner(models[0], native=True, rho=0.3), BNPreconditioner(models[1], rho=0.3)]
    calls = _counting(pres[0])
    for k, x in enumerate(xs):
        for model, pre in zip(models, pres):
            model.zero_grad()
            if k == 2:  # two forwards before one step (gradient accumulation)
                (model(x[:4]).square().sum() + model(x[4:]).sum()).backward()
            else:
                model(x).square().sum().backward()
            if k == 3:  # a transposed copy: same values, not contiguous
                w = model.fc1.weight
                w.grad = w.grad.t().contiguous().t()
                assert not w.grad.is_contiguous()
            pre.step()
    # Steps 0, 1 and 4 give the dense layers to dense_step beside the eager convolution; step 2
    # pooled two forwards (moments, eager); step 3 takes fc2 alone to dense_step.
    assert calls.dense_steps == 4
    _assert_same_bnp(models[0], pres[0], models[1], pres[1])


@pytest.mark.slow  # builds the C++ kernel (~20 s once)
def test_native_errors():
    _needs_kernels()
    torch.manual_seed(0)
    # Zero variance with eps1 = eps2 = 0: the layer is named and no gradient is changed.
    model = _model()
    pre = BNPreconditioner(model, native=True, rho=0.0, eps1=0.0, eps2=0.0)
    x = torch.randn(4, 300, dtype=torch.float64)
    x[:, 7] = 1.0
    model(x).square().sum().backward()
    before = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="layer '0'.*zero variance"):
        pre.step()
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.grad, b)
    # The kept input modified in place before step() (possible when autograd does not keep it:
    # a frozen weight): named, not silently wrong statistics.
    model = _model()
    model[0].weight.requires_grad_(False)
    pre = BNPreconditioner(model, native=True)
    x = torch.randn(4, 300, dtype=torch.float64)
    model(x).square().sum().backward()
    x.add_(1.0)
    with pytest.raises(RuntimeError, match="layer '0'.*modified in place"):
        pre.step()


@pytest.mark.slow  # builds the C++ kernel (~20 s once)
def test_dense_step_float32_accuracy():
    """dense_step in float32 against Algorithm 2 evaluated in float64 on the same float32 data.

    Error budget (first order, u = 2⁻²⁴, Higham §3.1/§4.2): the moments about c carry ≤ (N + 2)u
    relative error (sums of N terms); μ ← c + (1-ρ)s1/N adds ≤ 2u|μ|; σ_H² = s2/N - (s1/N)² adds
    the cancellation factor κ = 1 + (μ_H - c)²/σ_H² (here c = 0, inputs 2 ± 3: κ ≤ ~1.5 per column,
    bounded by the data below); σ̃² and 1/(q²σ̃²) add ≤ 4u; step 4 ≤ 3u per entry beyond the error
    of μ and 1/(q²σ̃²); step 5 sums n_in products: ≤ (n_in + 2)u·Σ_j |G_w'(i, j) μ_j|.  A factor
    4 over the first-order sum covers second-order terms and the float64 reference's own error.
    """
    _needs_kernels()
    kernel = _native.kernels()
    g = torch.Generator().manual_seed(11)
    n, m, n_out, rho, eps1, eps2, q2 = 7, 300, 9, 0.9, 1e-2, 1e-4, 300 / 7
    x = torch.randn(n, m, generator=g) * 3.0 + 2.0
    mean = torch.randn(m, generator=g) * 0.1
    var = torch.rand(m, generator=g) + 0.5
    gw = torch.randn(n_out, m, generator=g)
    gb = torch.randn(n_out, generator=g)
    x64, c64, v64, gw64, gb64 = (t.double() for t in (x, mean, var, gw, gb))
    # Algorithm 2 in float64 (steps 1-5, Eq. 13's biased variance; the reference route).
    mu_h, var_h = x64.mean(0), x64.var(0, correction=0)
    a = 1 - rho
    mu64 = c64 + a * (mu_h - c64)
    var64 = v64 + a * (var_h - v64)
    inv64 = 1.0 / (q2 * (var64 + eps1 * var64.max() + eps2))
    gw_ref = (gw64 - torch.outer(gb64, mu64)) * inv64
    gb_ref = gb64 / q2 - gw_ref @ mu64
    mean_k, var_k, gw_k, gb_k = mean.clone(), var.clone(), gw.clone(), gb.clone()
    assert kernel.dense_step([x], [mean_k], [var_k], [gw_k], [gb_k], rho, eps1, eps2, [q2]) == -1
    u = 2.0 ** -24
    d = x64 - c64
    kappa = 1 + (mu_h - c64) ** 2 / var_h
    err_mu = a * (n + 2) * u * d.abs().sum(0) / n + 2 * u * mu64.abs()
    err_var = a * (n + 2) * u * kappa * var_h + 2 * u * var64.abs()
    assert ((mean_k.double() - mu64).abs() <= 4 * err_mu).all()
    assert ((var_k.double() - var64).abs() <= 4 * err_var).all()
    rel_inv = (err_var.max() / var64.min()).item() + 4 * u
    err_gw = ((gw64.abs() + torch.outer(gb64.abs(), mu64.abs())) * inv64 * (rel_inv + 3 * u)
              + torch.outer(gb64.abs(), err_mu) * inv64)
    assert ((gw_k.double() - gw_ref).abs() <= 4 * err_gw).all()
    err_gb = ((m + 2) * u * (gw_ref.abs() @ mu64.abs()) + err_gw @ mu64.abs() + gw_ref.abs() @ err_mu
              + u * gb_ref.abs())
    assert ((gb_k.double() - gb_ref).abs() <= 4 * err_gb).all()


@pytest.mark.slow  # builds the C++ kernel (~20 s once)
def test_auto_with_native_fuses_only_large_layers(monkeypatch):
    """gradient="auto" + native=True: the first dense layer decides; below 2²¹ weights the one-call
    native step (one pass over G_w) is taken, above it the fused route (no pass over G_w).  The
    threshold is lowered here to exercise both on a small layer; both equal the eager transform."""
    _needs_kernels()
    from bnlab.optim import bnp as bnp_module

    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(4, 300, generator=g, dtype=torch.float64) + 1.0 for _ in range(3)]
    for threshold, fused in ((1 << 21, False), (100, True)):
        monkeypatch.setattr(bnp_module, "_AUTO_FUSED_MIN_WEIGHTS_NATIVE", threshold)
        auto_model, ref_model = _model(), _model()
        auto = BNPreconditioner(auto_model, gradient="auto", native=True, rho=0.5)
        ref = BNPreconditioner(ref_model, rho=0.5)
        calls = _counting(auto)
        for x in xs:
            for model, pre in ((auto_model, auto), (ref_model, ref)):
                model.zero_grad()
                model(x).square().sum().backward()
                pre.step()
        assert calls.dense_steps == (0 if fused else len(xs))
        _assert_same_bnp(auto_model, auto, ref_model, ref)


@pytest.mark.slow  # builds the C++ kernel (~20 s once)
def test_native_parametrized_layer_skipped_the_others_match_the_eager_route():
    """A parametrized weight (weight_norm) is computed, not a parameter with a gradient BNP could rewrite:
    the layer is refused at registration (tests/optim/test_bnp_usage.py; before, it was listed and left
    unchanged on every route).  Skipped, the other layers still match the eager route."""
    _needs_kernels()
    from torch.nn.utils import parametrizations

    def model():
        torch.manual_seed(0)
        return nn.Sequential(parametrizations.weight_norm(nn.Linear(30, 8)), nn.ReLU(), nn.Linear(8, 3)).double()

    x = torch.randn(5, 30, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    native_model, eager_model = model(), model()
    with pytest.raises(ValueError, match="its weight is computed"):
        BNPreconditioner(model(), native=True)
    native = BNPreconditioner(native_model, native=True, skip=["0"])
    eager = BNPreconditioner(eager_model, skip=["0"])
    for m, pre in ((native_model, native), (eager_model, eager)):
        m(x).square().sum().backward()
        pre.step()
    _assert_same_bnp(native_model, native, eager_model, eager)


@pytest.mark.slow  # builds the C++ kernel (~20 s once)
def test_native_two_threads_split_rows_and_columns():
    """With two threads dense_step splits the column sums (tiles of 512 columns) and the rows of
    G_w (blocks of ⌈32768 / n_in⌉ rows) between them: a layer wide and tall enough for both splits
    against the eager route (same float64 bound as above)."""
    _needs_kernels()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        def model():
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(1100, 600), nn.ReLU(), nn.Linear(600, 4)).double()

        g = torch.Generator().manual_seed(9)
        xs = [torch.randn(6, 1100, generator=g, dtype=torch.float64) + 0.3 for _ in range(2)]
        native_model, eager_model = model(), model()
        native, eager = BNPreconditioner(native_model, native=True), BNPreconditioner(eager_model)
        _run(native, native_model, xs)
        _run(eager, eager_model, xs)
        _assert_same_bnp(native_model, native, eager_model, eager)
    finally:
        torch.set_num_threads(threads)
