"""BNP on dense layers (Lange et al. Eq. 15, Algorithm 2, Prop. 7) against independent routes.

The independent routes are (a) the explicit (n_in+1)×(n_in+1) matrix (1/q²)·P·Pᵀ of Eq. 15 built
densely and applied to [G_b, G_w] per neuron, with the statistics computed by torch's mean/var
(not by the implementation's moments about a shift), and (b) for Prop. 7, one gradient step of a
hand-written post-activation BN network with detached statistics.  Everything runs in float64:
each route sums at most a few hundred products of O(1) numbers, so both agree to ~1e-14 relative;
the tolerances (1e-10) leave four orders of margin and are still ~1e8 times smaller than the
differences the tests guard against (asserted where it matters, so a test cannot pass vacuously).
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from bnlab.optim import BNPreconditioner, bnp_precondition_, regularized_variance

RTOL = 1e-10


def dense_pp_t(mean, var_tilde):
    """P·Pᵀ of Eq. 15 as an explicit matrix: P = [[1, -μᵀ], [0, I]] · diag(1, 1/σ̃)."""
    n = mean.numel()
    u = torch.eye(n + 1, dtype=torch.float64)
    u[0, 1:] = -mean
    d = torch.diag(torch.cat([torch.ones(1, dtype=torch.float64), 1.0 / torch.sqrt(var_tilde)]))
    p = u @ d
    return p @ p.T


def dense_reference(gw, gb, mean, var_tilde, q2):
    ghat = torch.cat([gb[:, None], gw], dim=1)  # one row [G_b(i), G_w(i, :)] per neuron
    new = ghat @ dense_pp_t(mean, var_tilde).T / q2
    return new[:, 1:], new[:, 0]


@settings(max_examples=30, deadline=None)
@given(
    n_out=st.integers(1, 6),
    n_in=st.integers(1, 7),
    seed=st.integers(0, 2**31 - 1),
    q2=st.floats(1.0, 50.0),
)
def test_functional_core_equals_dense_eq15(n_out, n_in, seed, q2):
    g = torch.Generator().manual_seed(seed)
    gw = torch.randn(n_out, n_in, generator=g, dtype=torch.float64)
    gb = torch.randn(n_out, generator=g, dtype=torch.float64)
    mean = 3 * torch.randn(n_in, generator=g, dtype=torch.float64)
    var_tilde = torch.exp(2 * torch.randn(n_in, generator=g, dtype=torch.float64))
    want_w, want_b = dense_reference(gw, gb, mean, var_tilde, q2)
    bnp_precondition_(gw, gb, mean, var_tilde, q2)
    torch.testing.assert_close(gw, want_w, rtol=RTOL, atol=RTOL)
    torch.testing.assert_close(gb, want_b, rtol=RTOL, atol=RTOL)


def test_functional_core_is_a_descent_direction():
    # PPᵀ is positive definite, so <G, PPᵀG> > 0: BNP never turns the step uphill.
    g = torch.Generator().manual_seed(1)
    gw = torch.randn(5, 4, generator=g, dtype=torch.float64)
    gb = torch.randn(5, generator=g, dtype=torch.float64)
    flat = torch.cat([gb[:, None], gw], 1)
    mean = torch.randn(4, generator=g, dtype=torch.float64)
    vt = torch.rand(4, generator=g, dtype=torch.float64) + 0.1
    nw, nb = gw.clone(), gb.clone()
    bnp_precondition_(nw, nb, mean, vt, 2.0)
    assert float((flat * torch.cat([nb[:, None], nw], 1)).sum(1).min()) > 0


def test_no_bias_applies_only_the_scaling():
    gw = torch.randn(3, 4, dtype=torch.float64)
    vt = torch.rand(4, dtype=torch.float64) + 0.5
    want = gw / (2.0 * vt)
    bnp_precondition_(gw, None, torch.randn(4, dtype=torch.float64), vt, 2.0)
    torch.testing.assert_close(gw, want, rtol=RTOL, atol=RTOL)


def _mlp(widths, seed=0):
    torch.manual_seed(seed)
    layers = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1]).double()


@pytest.mark.parametrize("gradient,block", [("transform", None), ("transform", 1), ("transform", 40),
                                            ("fused", None), ("auto", None)])
@pytest.mark.parametrize("batch,widths", [(1, [7, 6, 5, 3]), (3, [7, 6, 5, 3]), (16, [7, 6, 5, 3]),
                                          (4, [2, 9, 30, 3])])
def test_algorithm2_three_steps_against_dense_reference(batch, widths, gradient, block, monkeypatch):
    """Running statistics (ρ = 0.9), σ̃ (ε₁, ε₂), q² and Eq. 15 over three steps, every layer
    (widths growing with depth make the hooks' shared scratch buffer grow mid-forward).

    ``block`` shrinks the hooks' cache blocks (``_BLOCK_ELEMENTS``; the blocked route is the one
    off CPU, which these tests reach for convolutions and mixed precision) so that the statistics
    are accumulated over several blocks of samples.  ``gradient="fused"`` forms G_w' = δᵀĤ in
    step() instead of transforming autograd's G_w; "auto" does so where N ≤ n_out (here the
    layers of width ≥ N), so a network mixes both routes.  The raw gradients come from an
    untouched copy of the network (on the fused route the weight's .grad is not formed by
    backward())."""
    if block is not None:
        monkeypatch.setattr("bnlab.optim._layers._BLOCK_ELEMENTS", block)
    rho, eps1, eps2 = 0.9, 0.05, 1e-3
    model = _mlp(widths)
    twin = copy.deepcopy(model)
    pre = BNPreconditioner(model, rho=rho, eps1=eps1, eps2=eps2, gradient=gradient)
    linears = [m for m in model if isinstance(m, nn.Linear)]
    twin_linears = [m for m in twin if isinstance(m, nn.Linear)]
    ref_stats = [(torch.zeros(m.in_features, dtype=torch.float64), torch.ones(m.in_features, dtype=torch.float64))
                 for m in linears]
    g = torch.Generator().manual_seed(batch)
    for _ in range(3):
        x = 2 + 3 * torch.randn(batch, widths[0], generator=g, dtype=torch.float64)
        y = torch.randint(0, widths[-1], (batch,), generator=g)
        inputs = []
        hooks = [m.register_forward_hook(lambda mod, a, o: inputs.append(a[0].detach())) for m in linears]
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        for h in hooks:
            h.remove()
        if gradient == "fused":  # the route was taken: backward() left the weight gradients out
            assert all(m.weight.grad is None and m.weight.requires_grad for m in linears)
        twin.zero_grad()
        nn.functional.cross_entropy(twin(x), y).backward()
        raw = [(m.weight.grad.clone(), m.bias.grad.clone()) for m in twin_linears]
        pre.step()
        for i, (m, h) in enumerate(zip(linears, inputs)):
            mu_old, var_old = ref_stats[i]
            mu_b = h.mean(0)
            # Eq. 13 (biased variance); at N = 1 the variance about the running mean before the update.
            var_b = h.var(0, unbiased=False) if batch > 1 else (h[0] - mu_old) ** 2
            mu = rho * mu_old + (1 - rho) * mu_b
            var = rho * var_old + (1 - rho) * var_b
            ref_stats[i] = (mu, var)
            vt = var + eps1 * var.max() + eps2
            q2 = max(m.in_features / batch, 1.0)
            want_w, want_b = dense_reference(raw[i][0], raw[i][1], mu, vt, q2)
            torch.testing.assert_close(m.weight.grad, want_w, rtol=RTOL, atol=RTOL)
            torch.testing.assert_close(m.bias.grad, want_b, rtol=RTOL, atol=RTOL)
            got_mu, got_var = pre.statistics(pre_name(pre, m))
            torch.testing.assert_close(got_mu, mu, rtol=RTOL, atol=RTOL)
            torch.testing.assert_close(got_var, var, rtol=RTOL, atol=RTOL)


def pre_name(pre, module):
    return next(k for k, m in pre.layers.items() if m is module)


def test_regularized_variance_formula():
    var = torch.tensor([4.0, 1.0, 0.0], dtype=torch.float64)
    torch.testing.assert_close(regularized_variance(var, 0.01, 1e-4), var + 0.04 + 1e-4)


def test_gradient_accumulation_pools_the_statistics():
    """Two forward passes of 4 rows before one step give the statistics of the 8 rows together."""
    model = _mlp([5, 4])
    pre = BNPreconditioner(model, rho=0.0)
    x = torch.randn(8, 5, dtype=torch.float64) * 3 + 1
    model(x[:4]).sum().backward()
    model(x[4:]).sum().backward()
    pre.step()
    mu, var = pre.statistics("0")
    torch.testing.assert_close(mu, x.mean(0), rtol=RTOL, atol=RTOL)
    torch.testing.assert_close(var, x.var(0, unbiased=False), rtol=RTOL, atol=RTOL)


def test_statistics_not_recorded_in_eval_no_grad_or_paused():
    model = _mlp([5, 4])
    pre = BNPreconditioner(model)
    x = torch.randn(3, 5, dtype=torch.float64)
    with torch.no_grad():
        model(x)
    model.eval()
    model(x)
    model.train()
    with pre.paused():
        model(x)
    with pytest.raises(RuntimeError, match="before any forward pass"):
        pre.step()


# ------------------------------------------------------------------------------------------------
# Proposition 7
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gradient", ["transform", "fused"])
def test_proposition7_bn_step_equals_bnp_step(gradient):
    """Lange et al. Prop. 7 in float64.

    A post-activation BN network a_l = W_l B_{0,1}(h_{l-1}) + b_l (B applied to every layer input,
    its μ_H, σ_H detached) is the vanilla network with Ŵ = W diag(1/σ_H), b̂ = b - W (μ_H/σ_H).
    One gradient step of the BN network in {W, b}, mapped with the *same* μ_H, σ_H, must equal
    one BNP step (mini-batch statistics: ρ = 0; ε₁ = ε₂ = 0; N ≥ n_in so q = 1) of the vanilla
    network.  Tolerance: both sides are O(10) float64 operations on O(1) numbers (~1e-15); 1e-10.
    """
    torch.manual_seed(3)
    widths = [5, 4, 4, 3]
    n = 9  # N ≥ every n_in, so q² = max(n_in/N, 1) = 1
    lr = 0.3
    x = torch.randn(n, widths[0], dtype=torch.float64) * torch.tensor([1.0, 5.0, 0.2, 2.0, 1.0]) + 2.0
    y = torch.randint(0, widths[-1], (n,))
    ws = [torch.randn(b, a, dtype=torch.float64, requires_grad=True) for a, b in zip(widths[:-1], widths[1:])]
    bs = [torch.randn(b, dtype=torch.float64, requires_grad=True) for b in widths[1:]]

    # BN network with detached statistics.
    h, stats = x, []
    for i, (w, b) in enumerate(zip(ws, bs)):
        mu = h.detach().mean(0)
        sigma = h.detach().var(0, unbiased=False).sqrt()
        stats.append((mu, sigma))
        a = ((h - mu) / sigma) @ w.T + b
        h = torch.relu(a) if i < len(ws) - 1 else a
    bn_out = h
    nn.functional.cross_entropy(bn_out, y).backward()
    with torch.no_grad():
        w_new = [w - lr * w.grad for w in ws]
        b_new = [b - lr * b.grad for b in bs]
        expected = [(wn / sig, bn - wn @ (mu / sig)) for wn, bn, (mu, sig) in zip(w_new, b_new, stats)]

    # The equivalent vanilla network.
    vanilla = _mlp(widths)
    linears = [m for m in vanilla if isinstance(m, nn.Linear)]
    with torch.no_grad():
        for m, w, b, (mu, sig) in zip(linears, ws, bs, stats):
            m.weight.copy_(w / sig)
            m.bias.copy_(b - w @ (mu / sig))
    plain_net = copy.deepcopy(vanilla)
    pre = BNPreconditioner(vanilla, rho=0.0, eps1=0.0, eps2=0.0, gradient=gradient)
    out = vanilla(x)
    torch.testing.assert_close(out, bn_out.detach(), rtol=RTOL, atol=RTOL)  # first claim of Prop. 7

    opt = torch.optim.SGD(vanilla.parameters(), lr=lr)
    nn.functional.cross_entropy(out, y).backward()
    nn.functional.cross_entropy(plain_net(x), y).backward()
    plain = [(m.weight - lr * m.weight.grad).detach() for m in plain_net if isinstance(m, nn.Linear)]
    pre.step()
    opt.step()
    for m, (w_exp, b_exp), w_plain in zip(linears, expected, plain):
        torch.testing.assert_close(m.weight.detach(), w_exp, rtol=RTOL, atol=RTOL)
        torch.testing.assert_close(m.bias.detach(), b_exp, rtol=RTOL, atol=RTOL)
        # The comparison has teeth: plain SGD on the vanilla network lands elsewhere.
        assert float((w_plain - w_exp).abs().max()) > 1e-3


def test_proposition7_fails_with_running_statistics():
    """The equivalence needs ρ = 0: with ρ = 0.99 the BNP gradient differs from the mini-batch one."""
    torch.manual_seed(0)
    model = _mlp([3, 2])
    x = torch.randn(6, 3, dtype=torch.float64) * 4 + 3
    pre = BNPreconditioner(model, rho=0.99, eps1=0.0, eps2=0.0)
    model(x).sum().backward()
    g_raw = model[0].weight.grad.clone()
    gb = model[0].bias.grad.clone()
    pre.step()
    want = (g_raw - gb[:, None] * x.mean(0)) / x.var(0, unbiased=False)  # step 4 with batch statistics
    assert float((model[0].weight.grad - want).abs().max()) > 1e-2
