"""The route chooser and the compiled route (``BNPreconditioner(compiled=...)``) against the eager route.

The compiled route runs Algorithm 2 steps 1-5 of all dense layers as one function of the
functional core (``bnlab.optim._functional.dense_steps``) handed to ``torch.compile``.  It shares
the formulas with the eager route but not the operators: its statistics come from
``torch.var_mean`` (eager on CPU: the batch-norm statistics kernel), 1/(q²σ̃²) is (1/q²)/σ̃²
(eager: 1/(q²·σ̃²)), and steps 4-5 are one elementwise expression and a row sum (eager: ``addr_``,
``mul_``, ``addmv_``).  So the two agree to rounding, not bit for bit.

Tolerance (float64, u = 2⁻⁵³, Higham §3.1/§4.2, first order): each statistic is a sum of N terms
(≤ N·u relative, both routes), the running update and σ̃², 1/(q²σ̃²) a few u; step 4 a few u per
entry beyond those; step 5 a sum of n_in products, ≤ n_in·u relative to Σ_j |G_w'(i, j) μ_j|.
Relative to the O(1) entries here that is ≤ (N + n_in + 10)·u per route and step; over the 4
steps (the running statistics carry errors forward, damped by ρ) and with the products' growth a
factor 100 covers it: ``100·(N + n_in + 10)·u`` ≈ 4e-12 for n_in = 300 — still ~10¹¹ below an
error of the formula (a wrong sign or a missing 1/q² changes entries by O(1)).

The fast tests replace ``torch.compile`` by the uncompiled functional core (the route's Python
glue and the core's arithmetic are then checked without a C++ build); the tests marked slow
compile it with inductor (~40 s on this 2-core machine).
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from bnlab.optim import BNPreconditioner
from bnlab.optim import _compiled
from bnlab.optim import _functional as F
from bnlab.optim import bnp as bnp_module

U64 = 2.0 ** -53


def _tol(n, n_in):
    return 100 * (n + n_in + 10) * U64


@pytest.fixture
def uncompiled(monkeypatch):
    """The compiled route with torch.compile replaced by the functional core itself."""
    monkeypatch.setattr(_compiled, "_STATE", {"fn": F.dense_steps_})


def _mlp(last_bias=True, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(300, 20), nn.ReLU(), nn.Linear(20, 7), nn.Tanh(),
                         nn.Linear(7, 5, bias=last_bias)).double()


def _train(model, pre, batches):
    for x in batches:
        model.zero_grad()
        model(x).square().sum().backward()
        pre.step()


def _assert_same(a_model, a_pre, b_model, b_pre, tol):
    compared = 0
    for p, q in zip(a_model.parameters(), b_model.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=tol, atol=tol * q.grad.abs().max().item())
            compared += 1
    assert compared > 0
    for name in a_pre.layers:
        for s, t in zip(a_pre.statistics(name), b_pre.statistics(name)):
            torch.testing.assert_close(s, t, rtol=tol, atol=tol)


# ---------------------------------------------------------------------------------------------- chooser


def test_route_chooser_by_device_and_flags(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    choose = bnp_module._default_kept_route
    assert choose(cpu, native_kernel=None, compiled=None) is None  # CPU default: eager
    assert choose(cpu, native_kernel=object(), compiled=None) == "native"
    assert choose(cpu, native_kernel=object(), compiled=True) == "native"  # native=True covers CPU layers
    assert choose(cpu, native_kernel=None, compiled=True) == "compiled"
    assert choose(cuda, native_kernel=object(), compiled=None) in ("compiled", None)  # native is CPU-only
    monkeypatch.setattr(_compiled, "available", lambda device: True)
    assert choose(cuda, native_kernel=None, compiled=None) == "compiled"  # the GPU default
    assert choose(cuda, native_kernel=None, compiled=False) is None
    monkeypatch.setattr(_compiled, "available", lambda device: False)  # no Triton: eager
    assert choose(cuda, native_kernel=None, compiled=None) is None


def test_routes_property_and_validation():
    assert set(BNPreconditioner(_mlp()).routes.values()) == {"eager"}
    assert set(BNPreconditioner(_mlp(), compiled=True).routes.values()) == {"compiled"}
    routes = BNPreconditioner(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2, bias=False)), gradient="fused").routes
    assert routes == {"0": "fused", "1": "eager"}
    with pytest.raises(ValueError, match="compiled='yes'"):
        BNPreconditioner(_mlp(), compiled="yes")
    assert "compiled=True" in repr(BNPreconditioner(_mlp(), compiled=True))


# ---------------------------------------------------------------------------------------------- compiled = eager


@pytest.mark.parametrize("batch", [1, 2, 16])
@pytest.mark.parametrize("last_bias", [True, False])
def test_compiled_route_glue_equals_eager(uncompiled, batch, last_bias):
    """The compiled route's Python (kept inputs, one call per step, write-backs) with the uncompiled
    core, against the eager route over 4 steps (N = 1: the variance about the running mean)."""
    g = torch.Generator().manual_seed(batch)
    batches = [torch.randn(batch, 300, generator=g, dtype=torch.float64) * 2.0 + 1.0 for _ in range(4)]
    a, b = _mlp(last_bias), _mlp(last_bias)
    pa, pb = BNPreconditioner(a, compiled=True, rho=0.5), BNPreconditioner(b, rho=0.5)
    calls = []
    real = _compiled.dense_steps_
    _compiled.dense_steps_ = lambda *args: calls.append(len(args[0])) or real(*args)
    try:
        _train(a, pa, batches)
    finally:
        _compiled.dense_steps_ = real
    _train(b, pb, batches)
    assert calls == [3] * 4  # one call per step for the three dense layers
    _assert_same(a, pa, b, pb, _tol(batch, 300))


def test_compiled_route_beside_convolutions_and_pooled_forwards(uncompiled):
    """A convolution (eager) beside dense layers (compiled), a step with two forwards (pooled
    moments, eager) and a frozen weight (eager bias scaling), against the eager route."""

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
    xs = [torch.randn(6, 3, 10, generator=g, dtype=torch.float64) + 0.5 for _ in range(4)]
    models = [Net().double(), Net().double()]
    pres = [BNPreconditioner(models[0], compiled=True, rho=0.3), BNPreconditioner(models[1], rho=0.3)]
    for k, x in enumerate(xs):
        for model, pre in zip(models, pres):
            model.zero_grad()
            model.fc2.weight.requires_grad_(k != 3)
            if k == 2:
                (model(x[:4]).square().sum() + model(x[4:]).sum()).backward()
            else:
                model(x).square().sum().backward()
            pre.step()
    _assert_same(models[0], pres[0], models[1], pres[1], _tol(6, 40))


def test_compiled_route_with_zero_eps_stays_eager(uncompiled):
    """eps1 = eps2 = 0 (any eps2 < 1e-30): the zero-variance error must come before any gradient changes,
    so the compiled route is not taken (the eager route raises, naming the layer)."""
    model = nn.Linear(3, 2).double()
    pre = BNPreconditioner(model, compiled=True, rho=0.0, eps1=0.0, eps2=0.0)
    model(torch.ones(4, 3, dtype=torch.float64)).sum().backward()
    before = model.weight.grad.clone()
    with pytest.raises(RuntimeError, match="zero variance"):
        pre.step()
    assert torch.equal(model.weight.grad, before)


def test_compiled_route_mixed_precision(uncompiled):
    """bfloat16 layers: float32 statistics, the transform in float32, written back in bfloat16; equal
    to the eager route's mixed precision to bfloat16 rounding (2⁻⁸ relative per rounding, a few
    roundings per entry: 5e-2)."""
    torch.manual_seed(0)
    x = torch.randn(16, 300) * 3 + 1
    a, b = _mlp().to(torch.bfloat16), _mlp().to(torch.bfloat16)
    pa, pb = BNPreconditioner(a, compiled=True), BNPreconditioner(b)
    _train(a, pa, [x.to(torch.bfloat16)])
    _train(b, pb, [x.to(torch.bfloat16)])
    assert pa.statistics("0")[0].dtype == torch.float32 and a[0].weight.grad.dtype == torch.bfloat16
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p.grad.float(), q.grad.float(), rtol=5e-2, atol=5e-2 * q.grad.float().abs().max())
    # the statistics of the bfloat16 input in float32: the same data, two float32 routes (N = 16: 1e-5)
    torch.testing.assert_close(pa.statistics("0")[1], pb.statistics("0")[1], rtol=1e-5, atol=1e-5)


def test_failed_compilation_warns_and_runs_the_core_uncompiled(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no inductor here")

    monkeypatch.setattr(_compiled, "_STATE", {"fn": broken})
    g = torch.Generator().manual_seed(3)
    batches = [torch.randn(4, 300, generator=g, dtype=torch.float64) + 1.0 for _ in range(2)]
    a, b = _mlp(), _mlp()
    pa, pb = BNPreconditioner(a, compiled=True), BNPreconditioner(b)
    with pytest.warns(RuntimeWarning, match="no inductor here"):
        _train(a, pa, batches)
    _train(b, pb, batches)
    _assert_same(a, pa, b, pb, _tol(4, 300))


# ---------------------------------------------------------------------------------------------- real compile


@pytest.mark.slow  # torch.compile with inductor's C++ backend: ~40 s on this machine
def test_torch_compile_of_the_core_equals_eager():
    """torch.compile (inductor, CPU) of the dense step against the eager route, float64, over batch
    sizes 16, 16, 1, 5 (a recompilation for each new shape), with and without the last bias."""
    _compiled._STATE.clear()
    g = torch.Generator().manual_seed(7)
    sizes = [16, 16, 1, 5]
    batches = [torch.randn(n, 300, generator=g, dtype=torch.float64) * 2.0 + 1.0 for n in sizes]
    a, b = _mlp(), _mlp()
    pa, pb = BNPreconditioner(a, compiled=True, rho=0.5), BNPreconditioner(b, rho=0.5)
    _train(a, pa, batches)
    _train(b, pb, batches)
    # compiled throughout: neither a failed build nor a failed check of a new program against the core
    # (bnlab.optim._compiled: the first call of batch 16, 1 and 5 each)
    assert "failed" not in _compiled._STATE
    assert [c["agrees"] for c in _compiled._STATE["checks"]] == [True, True, True]
    _assert_same(a, pa, b, pb, _tol(16, 300))


@pytest.mark.slow
def test_torch_compile_keeps_a_nan_batch_out():
    _compiled._STATE.clear()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    pre = BNPreconditioner(model, compiled=True, rho=0.5)
    x = torch.randn(8, 6, dtype=torch.float64)
    model(x).sum().backward()
    pre.step()
    before = pre.statistics("0")
    x[3, 2] = float("nan")
    model.zero_grad()
    model(x).sum().backward()
    with pytest.warns(RuntimeWarning, match="non-finite"):
        pre.step()
    after = pre.statistics("0")
    assert torch.isfinite(after[0]).all() and torch.isfinite(after[1]).all()
    assert after[1][2] == before[1][2] and after[1][0] != before[1][0]
    assert pre.nonfinite_batches == {"0": 1, "2": 1}


def test_route_follows_the_model_to_another_device(monkeypatch):
    """A preconditioner built before the model moved: the route is chosen again for the device its
    inputs arrive on (here a stand-in: the chooser is asked for the new device's route)."""
    asked = []

    def chooser(device, *, native_kernel, compiled):
        asked.append(device.type)
        return "compiled" if device.type == "meta" else None

    model = _mlp()
    pre = BNPreconditioner(model)
    monkeypatch.setattr(bnp_module, "_default_kept_route", chooser)
    layer = pre._layers["0"]
    assert pre._route(layer, torch.randn(2, 300, dtype=torch.float64)) == "eager" and asked == []
    assert pre._route(layer, torch.empty(2, 300, dtype=torch.float64, device="meta")) == "eager"
    assert asked == ["meta"] and layer.kept_route == "compiled"  # kept once the statistics follow


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_default_route_is_compiled_and_equals_eager():
    """On CUDA the default route is the compiled one (with Triton); float64 against compiled=False,
    the eager route on the same device, with the tolerance above; a NaN batch kept out on the device."""
    _compiled._STATE.clear()
    g = torch.Generator().manual_seed(11)
    batches = [(torch.randn(n, 300, generator=g, dtype=torch.float64) * 2 + 1).cuda() for n in (16, 16, 1)]
    a, b = _mlp().cuda(), _mlp().cuda()
    pa, pb = BNPreconditioner(a, rho=0.5), BNPreconditioner(b, rho=0.5, compiled=False)
    expected = "compiled" if _compiled.available(torch.device("cuda")) else "eager"
    assert set(pa.routes.values()) == {expected} and set(pb.routes.values()) == {"eager"}
    _train(a, pa, batches)
    _train(b, pb, batches)
    if expected == "compiled":  # compiled throughout: its checks against the core agreed
        assert "failed" not in _compiled._STATE and all(c["agrees"] for c in _compiled._STATE["checks"])
    _assert_same(a, pa, b, pb, _tol(16, 300))
    x = batches[0].clone()
    x[0, 0] = float("nan")
    _train(a, pa, [x])
    with pytest.warns(RuntimeWarning, match="non-finite"):
        assert pa.nonfinite_batches["0"] == 1
    assert all(torch.isfinite(t).all() for t in pa.statistics("0"))
