"""BNP's fused route (``gradient="fused"``/"auto"): the weight gradient formed in step() as δᵀĤ.

Every test compares the fused route with the transform route (autograd's G_w rewritten by Eq. 15,
itself tested against the explicit (1/q²)PPᵀ in test_bnp_dense) on identical float64 copies of a
network, in the situations where the fused route has to leave its fast path: a stale bias or
weight gradient, a second forward before step(), a forward no backward reached, a frozen bias,
hooks on the weight's gradient.  Both routes sum the same O(1) float64 products in different
orders (~1e-15 relative); tolerance 1e-10, against differences of O(1) if a term were dropped.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from bnlab.optim import BNPreconditioner

TOL = 1e-10


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(inplace=True), nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3)).double()


def _pair(**kw):
    a = _mlp()
    b = copy.deepcopy(a)
    return (a, BNPreconditioner(a, rho=0.8, eps1=0.03, eps2=1e-3)), (b, BNPreconditioner(b, rho=0.8, eps1=0.03,
                                                                                          eps2=1e-3, **kw))


def _batch(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g, dtype=torch.float64) * 2 + 1, torch.randint(0, 3, (n,), generator=g)


def _assert_same_grads(a, b):
    compared = 0
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert (pa.grad is None) == (pb.grad is None)
        if pa.grad is not None:
            torch.testing.assert_close(pb.grad, pa.grad, rtol=TOL, atol=TOL)
            compared += 1
    assert compared > 0


def _loss(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


@pytest.mark.parametrize("gradient", ["fused", "auto"])
def test_fused_equals_transform_over_steps_and_batch_sizes(gradient):
    (a, pa), (b, pb) = _pair(gradient=gradient)
    for step, n in enumerate([1, 2, 4, 9, 1]):
        x, y = _batch(n, step)
        for model, pre in ((a, pa), (b, pb)):
            model.zero_grad()
            _loss(model, x, y).backward()
            pre.step()
        _assert_same_grads(a, b)
        assert all(p.requires_grad for p in b.parameters())
    for name in pa.layers:
        for sa, sb in zip(pa.statistics(name), pb.statistics(name)):
            torch.testing.assert_close(sb, sa, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("case", ["stale_bias", "stale_weight", "second_forward", "forward_without_backward",
                                  "retain_graph_twice"])
def test_fused_route_leaves_its_fast_path_exactly(case):
    """Accumulated gradients, pooled forwards and repeated backward passes as the transform route
    treats them: Eq. 15 applied to the total gradient, statistics of all the forwards pooled."""
    (a, pa), (b, pb) = _pair(gradient="fused")
    x, y = _batch(5, 1)
    x2, y2 = _batch(3, 2)
    for model, pre in ((a, pa), (b, pb)):
        model.zero_grad()
        if case == "stale_bias":  # a bias gradient present before the forward, none for the weight
            for m in model:
                if isinstance(m, nn.Linear):
                    m.bias.grad = torch.randn_like(m.bias, generator=torch.Generator().manual_seed(m.bias.numel()))
            _loss(model, x, y).backward()
        elif case == "stale_weight":  # zero_grad(set_to_none=False)-style existing gradients
            for p in model.parameters():
                p.grad = torch.randn_like(p, generator=torch.Generator().manual_seed(p.numel()))
            _loss(model, x, y).backward()
        elif case == "second_forward":  # two micro-batches before one step (the second via autograd)
            _loss(model, x, y).backward()
            _loss(model, x2, y2).backward()
        elif case == "forward_without_backward":  # a forward no backward reaches: statistics only
            model(x2)
            _loss(model, x, y).backward()
        elif case == "retain_graph_twice":
            loss = _loss(model, x, y)
            loss.backward(retain_graph=True)
            loss.backward()
        pre.step()
    _assert_same_grads(a, b)
    for name in pa.layers:
        for sa, sb in zip(pa.statistics(name), pb.statistics(name)):
            torch.testing.assert_close(sb, sa, rtol=TOL, atol=TOL)


def test_frozen_bias_weight_hooks_and_subclasses_take_the_transform_route():
    class MyLinear(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 3), MyLinear(3, 2), nn.Linear(2, 2, bias=False)).double()
    model[0].bias.requires_grad_(False)
    seen = []
    model[1].weight.register_hook(lambda g: seen.append(g.shape))
    pre = BNPreconditioner(model, gradient="fused")
    x = torch.randn(2, 4, dtype=torch.float64)
    model(x).sum().backward()
    # The fused route would have left these weight gradients to step(); the transform route ran.
    assert all(m.weight.grad is not None for m in model)
    assert seen == [torch.Size([3, 3])]
    pre.step()


def test_auto_route_is_decided_per_step_by_the_first_dense_layer():
    """N ≤ n_out of a first layer of ≥ 2¹⁷ weights: every layer fused (also the 2-wide output
    layer, N > 2); otherwise every layer on the transform route."""
    net = nn.Sequential(nn.Linear(4096, 40), nn.Tanh(), nn.Linear(40, 2))
    pre = BNPreconditioner(net, gradient="auto")
    for n, fused in [(40, True), (41, False), (1, True)]:
        net.zero_grad()
        net(torch.randn(n, 4096)).sum().backward()
        assert [net[k].weight.grad is None for k in (0, 2)] == [fused, fused]
        pre.step()
        assert net[0].weight.grad is not None and net[2].weight.grad is not None
    small = nn.Sequential(nn.Linear(64, 40), nn.Tanh(), nn.Linear(40, 2))  # 2 560 first-layer weights
    pre = BNPreconditioner(small, gradient="auto")
    small(torch.randn(4, 64)).sum().backward()
    assert small[0].weight.grad is not None
    pre.step()


def test_input_modified_in_place_after_forward_is_an_error():
    layer = nn.Linear(3, 2).double()
    pre = BNPreconditioner(layer, gradient="fused")
    x = torch.randn(4, 3, dtype=torch.float64)
    layer(x).sum().backward()
    x.mul_(2)
    with pytest.raises(RuntimeError, match="modified in place"):
        pre.step()


def test_requires_grad_restored_when_the_forward_raises():
    layer = nn.Linear(3, 2).double()
    pre = BNPreconditioner(layer, gradient="fused")

    def explode(module, args, kwargs):
        raise ValueError("boom")

    handle = layer.register_forward_pre_hook(explode, with_kwargs=True)  # runs after BNP's hook
    with pytest.raises(ValueError, match="boom"):
        layer(torch.randn(2, 3, dtype=torch.float64))
    handle.remove()
    assert layer.weight.requires_grad
    # The failed forward left nothing to fuse; the next one works normally.
    layer(torch.randn(2, 3, dtype=torch.float64)).sum().backward()
    pre.step()
    assert layer.weight.grad is not None and layer.weight.requires_grad


def test_bad_gradient_mode():
    with pytest.raises(ValueError, match="gradient"):
        BNPreconditioner(nn.Linear(2, 2), gradient="fast")
    assert "gradient='auto'" in repr(BNPreconditioner(nn.Linear(2, 2), gradient="auto"))


def test_a_network_mixing_both_routes_exactly():
    """A hook on one weight's gradient keeps that layer on the transform route, the others fused."""
    torch.manual_seed(2)
    a = nn.Sequential(nn.Linear(30, 8), nn.Tanh(), nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    b = copy.deepcopy(a)
    b[2].weight.register_hook(lambda g: g)
    pa, pb = BNPreconditioner(a, rho=0.5), BNPreconditioner(b, rho=0.5, gradient="fused")
    for seed in range(2):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(7, 30, generator=g, dtype=torch.float64)
        for model, pre in ((a, pa), (b, pb)):
            model.zero_grad()
            model(x).square().sum().backward()
            if model is b:
                assert [b[k].weight.grad is None for k in (0, 2, 4)] == [True, False, True]
            pre.step()
        _assert_same_grads(a, b)


def test_autocast_keeps_the_transform_route():
    """Under autocast the output (and δ) are bfloat16 while the input and weight are float32; the
    fused product would mix dtypes, so those forwards take the transform route."""
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    b = copy.deepcopy(a)
    pa, pb = BNPreconditioner(a), BNPreconditioner(b, gradient="fused")
    x = torch.randn(4, 6)
    for model, pre in ((a, pa), (b, pb)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        out.float().sum().backward()
        assert model[0].weight.grad is not None
        pre.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p.grad, q.grad)
