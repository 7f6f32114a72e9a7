"""Theorem 4 / Fig. 8 measurements (bnlab.optim.conditioning) against a dense autograd Hessian.

``neuron_hessian`` builds Prop. 2's Ĥᵀ S Ĥ from the layer input and S from a double backward; the
independent route is ``torch.autograd.functional.hessian`` of the mean loss as a function of the
neuron's [b_i, w_i] (the whole network re-run for every entry).  float64; the Hessians are sums of
N products of O(1) numbers, so the two agree to ~1e-14 relative; tolerance 1e-9.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn
from torch.func import functional_call

from bnlab.optim import (
    BNPreconditioner,
    ConditioningLogger,
    condition_number,
    layer_hessian_conditioning,
    neuron_hessian,
)


def _net(seed=0, widths=(6, 5, 4, 3)):
    torch.manual_seed(seed)
    layers = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1]).double()


def dense_hessian(model, layer_name, x, y, neuron):
    params = dict(model.named_parameters())
    w0 = params[f"{layer_name}.weight"].detach()
    b0 = params[f"{layer_name}.bias"].detach()

    def loss_of(w_hat):
        w = w0.clone()
        b = b0.clone()
        w = torch.cat([w[:neuron], w_hat[1:][None], w[neuron + 1:]])
        b = torch.cat([b[:neuron], w_hat[:1], b[neuron + 1:]])
        p = {k: v.detach() for k, v in params.items()}
        p[f"{layer_name}.weight"], p[f"{layer_name}.bias"] = w, b
        return nn.functional.cross_entropy(functional_call(model, p, (x,)), y)

    w_hat0 = torch.cat([b0[neuron:neuron + 1], w0[neuron]])
    return torch.autograd.functional.hessian(loss_of, w_hat0)


@pytest.mark.parametrize("layer_name,neuron,batch", [("4", 0, 7), ("4", 2, 3), ("2", 1, 9), ("0", 4, 5)])
def test_neuron_hessian_equals_dense_autograd_hessian(layer_name, neuron, batch):
    model = _net()
    g = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, 6, generator=g, dtype=torch.float64) * 2
    y = torch.randint(0, 3, (batch,), generator=g)
    layer = dict(model.named_modules())[layer_name]
    hess, h_hat, s = neuron_hessian(model, layer, x, y, neuron=neuron)
    want = dense_hessian(model, layer_name, x, y, neuron)
    torch.testing.assert_close(hess, want, rtol=1e-9, atol=1e-12)
    assert h_hat.shape == (batch, layer.in_features + 1)


def test_condition_number_definition():
    a = torch.diag(torch.tensor([4.0, 2.0, 0.5, 0.0], dtype=torch.float64))
    assert condition_number(a) == pytest.approx(8.0)  # the zero singular value is not counted
    assert condition_number(torch.zeros(2, 2)) == math.inf
    r = torch.randn(5, 3, dtype=torch.float64)
    s = torch.linalg.svdvals(r)
    assert condition_number(r) == pytest.approx(float(s[0] / s[-1]))
    with pytest.raises(ValueError, match="2-D"):
        condition_number(torch.ones(3))
    with pytest.raises(ValueError, match="NaN"):
        condition_number(torch.tensor([[float("nan")]]))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n_in=st.integers(2, 6), spread=st.floats(0.0, 4.0),
       shift=st.floats(-5.0, 5.0))
def test_theorem4_inequalities(seed, n_in, spread, shift):
    """κ(ĤU) ≤ κ(Ĥ) and κ(Ĝ) ≤ √(n+1)·κ(ĤU·D₀) for D₀ = I (a member of Theorem 4's minimum),
    on a full-column-rank Ĥ (N = 3(n+1) rows) with badly scaled, shifted columns."""
    g = torch.Generator().manual_seed(seed)
    n = 3 * (n_in + 1)
    scales = torch.exp(spread * torch.randn(n_in, generator=g, dtype=torch.float64))
    x = (torch.randn(n, n_in, generator=g, dtype=torch.float64) + shift) * scales
    model = nn.Sequential(nn.Linear(n_in, 2)).double()
    y = torch.randint(0, 2, (n,), generator=g)
    res = layer_hessian_conditioning(model, model[0], x, y)
    assert res.kappa_HU <= res.kappa_H_hat * (1 + 1e-9)
    assert res.kappa_G_hat <= math.sqrt(n_in + 1) * res.kappa_HU * (1 + 1e-9)
    # and the consequence the paper draws: κ(ĤU) ≤ κ(Ĝ)·κ(D)
    assert res.kappa_HU <= res.kappa_G_hat * res.kappa_D * (1 + 1e-9)


def test_preconditioned_hessian_is_theorem3_matrix():
    """With batch statistics Pᵀ(ĤᵀSĤ)P = ĜᵀSĜ (Theorem 3): compare κ against a direct build."""
    model = _net(1)
    x = torch.randn(20, 6, dtype=torch.float64) * torch.tensor([0.1, 1, 10, 1, 3, 0.3], dtype=torch.float64) + 2
    y = torch.randint(0, 3, (20,))
    layer = model[0]
    hess, h_hat, s = neuron_hessian(model, layer, x, y, neuron=0)
    h = h_hat[:, 1:]
    g_hat = torch.cat([torch.ones(20, 1, dtype=torch.float64), (h - h.mean(0)) / h.std(0, unbiased=False)], 1)
    direct = g_hat.T @ (s[:, None] * g_hat)
    res = layer_hessian_conditioning(model, layer, x, y)
    assert res.kappa_preconditioned == pytest.approx(condition_number(direct), rel=1e-8)
    # Badly scaled inputs: the preconditioned block is far better conditioned (Theorem 4's κ(D)² effect).
    d = torch.cat([torch.ones(1, dtype=torch.float64), 1 / h.std(0, unbiased=False)])  # D of Eq. 12
    assert res.kappa_D == pytest.approx(float(d.max() / d.min()), rel=1e-12)
    assert res.kappa_hessian > 100 * res.kappa_preconditioned


def test_running_statistics_use_the_preconditioner_and_record_nothing():
    model = _net(2)
    pre = BNPreconditioner(model)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randint(0, 3, (8,))
    model(x).sum().backward()
    pre.step()
    res = layer_hessian_conditioning(model, model[2], x, y, preconditioner=pre)
    assert res.statistics == "running"
    with pytest.raises(RuntimeError, match="before any forward pass"):
        pre.step()  # the probe's forward pass recorded nothing
    with pytest.raises(ValueError, match="statistics='running'"):
        layer_hessian_conditioning(model, model[2], x, y, statistics="running")
    with pytest.raises(ValueError, match="nn.Linear"):
        layer_hessian_conditioning(model, model[1], x, y)
    with pytest.raises(ValueError, match="neuron=7"):
        layer_hessian_conditioning(model, model[2], x, y, neuron=7)


def test_conditioning_logger_during_training_fig8_setting():
    """Fig. 8's network (two hidden layers of 100, batch 60) with BNP: the logger records the
    output layer's first neuron every 2 steps, and κ of the BNP-preconditioned block stays below
    κ of the raw block (inputs with feature scales over three decades; the paper reports a
    reduction of roughly κ(D)²)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(30, 100), nn.ReLU(), nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 10))
    pre = BNPreconditioner(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scales = torch.logspace(-1.5, 1.5, 30)
    probe_x, probe_y = torch.randn(60, 30) * scales + 1.0, torch.randint(0, 10, (60,))
    logger = ConditioningLogger(model, model[4], probe_x, probe_y, preconditioner=pre, every=2)
    for step in range(6):
        x, y = torch.randn(60, 30) * scales + 1.0, torch.randint(0, 10, (60,))
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        pre.step()
        opt.step()
        logger(type("Info", (), {"step": step})())
    assert [r["step"] for r in logger.records] == [0, 2, 4]
    for r in logger.records:
        assert r["kappa_preconditioned"] < r["kappa_hessian"]
        assert r["kappa_D"] > 1
