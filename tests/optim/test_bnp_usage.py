"""BNP beside ordinary PyTorch usage: copies of the model, activation checkpointing, a bad input caught by
the caller, computed (parametrized) and lazy weights, containers in ``skip``, gradients zeroed in place.

Each case was a defect found by an audit (2026-11-28); each test compares against a clean run of the same
model in float64, where the routes are exact to rounding (a few ulps of O(1) values: 1e-12 relative).
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from bnlab.optim import BNPreconditioner


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).double()


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def _clean_step(x, **kw):
    m = _mlp()
    pre = BNPreconditioner(m, **kw)
    m(x).sum().backward()
    pre.step()
    return _grads(m), pre.state_dict()


@pytest.mark.parametrize("gradient", ["transform", "fused"])
def test_a_deepcopy_made_after_registration_does_not_feed_the_original(gradient):
    """The copy carries the original's hooks: its forwards were recorded into the original's statistics and,
    on the fused route, switched off ``requires_grad`` of the original's weight (gradients off by 8)."""
    x = torch.randn(5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want, want_state = _clean_step(x, gradient=gradient)
    m = _mlp()
    pre = BNPreconditioner(m, gradient=gradient)
    twin = copy.deepcopy(m)
    twin(10 * torch.randn(5, 6, dtype=torch.float64)).sum().backward()  # e.g. a teacher or a probe in train mode
    assert m[0].weight.requires_grad and not pre._layers["0"].pending
    m(x).sum().backward()
    pre.step()
    for g, w in zip(_grads(m), want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(pre.state_dict()["layers"]["0"]["mean"], want_state["layers"]["0"]["mean"])


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_is_transparent(reentrant):
    """The recomputation inside backward ran the hook again: the batch counted twice (q² = max(n_in/N, 1)
    with 2N, the gradient 2x) without reentrancy; the reentrant checkpoint, whose first pass runs under
    no_grad, is recorded once, in the recomputation.  N = 4 < n_in = 64, so q² matters."""
    torch.manual_seed(0)
    a, b = nn.Linear(64, 8).double(), nn.Linear(8, 2).double()
    x = torch.randn(4, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    def run(ckpt):
        model = nn.ModuleDict({"a": copy.deepcopy(a), "b": copy.deepcopy(b)})
        pre = BNPreconditioner(model)
        block = lambda h: torch.relu(model["a"](h))  # noqa: E731
        xi = x.clone().requires_grad_(ckpt and reentrant)
        h = checkpoint(block, xi, use_reentrant=reentrant) if ckpt else block(xi)
        model["b"](h).sum().backward()
        pre.step()
        return _grads(model)

    for g, w in zip(run(True), run(False)):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-14)


def test_an_input_of_the_wrong_width_is_refused_before_it_is_recorded():
    """The hook recorded the 6-wide input's statistics before nn.Linear refused it; a caller that caught the
    error then failed on every later forward (a size mismatch inside the statistics)."""
    x = torch.randn(5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    want, _ = _clean_step(x)
    m = _mlp()
    pre = BNPreconditioner(m)
    with pytest.raises(ValueError, match=r"layer '0' \(Linear\) got an input of shape \(5, 7\): expected 6 features"):
        m(torch.randn(5, 7, dtype=torch.float64))
    assert not pre._layers["0"].pending
    m(x).sum().backward()
    pre.step()
    for g, w in zip(_grads(m), want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-14)
    conv = nn.Sequential(nn.Conv2d(3, 4, 3))
    BNPreconditioner(conv)
    with pytest.raises(ValueError, match=r"got an input of shape \(2, 5, 8, 8\): expected 3 features along dimension 1"):
        conv(torch.randn(2, 5, 8, 8))


def test_computed_and_lazy_weights_are_refused_at_registration():
    """A parametrized weight (weight_norm, spectral_norm) has no .grad of its own: the layer was listed as
    preconditioned and step() changed nothing.  A lazy layer was refused as having 'no input features'."""
    wn = nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Linear(4, 3)))
    with pytest.raises(ValueError, match=r"layer '0' .*its weight is computed .*skip=\['0'\]"):
        BNPreconditioner(wn)
    assert list(BNPreconditioner(nn.Sequential(wn[0], nn.Linear(3, 2)), skip=["0"]).layers) == ["1"]
    with pytest.raises(ValueError, match="lazy module whose weight is not initialized; run one forward pass"):
        BNPreconditioner(nn.Sequential(nn.LazyLinear(3)))


def test_a_container_name_in_skip_skips_the_layers_inside_it():
    model = nn.ModuleDict({"body": nn.Linear(4, 4), "head": nn.Sequential(nn.ReLU(), nn.Linear(4, 2)),
                           "heads": nn.ModuleList([nn.Linear(4, 2), nn.Linear(4, 2)])})
    pre = BNPreconditioner(model, skip=["head", "heads"])
    assert list(pre.layers) == ["body"]


def test_a_layer_unused_in_a_step_with_gradients_zeroed_in_place_is_left_alone():
    """zero_grad(set_to_none=False) leaves an unused layer a zero gradient: step() refused it as 'a gradient
    without a recorded input'.  Alternating heads then train as with set_to_none=True."""
    def run(set_to_none):
        torch.manual_seed(0)
        model = nn.ModuleDict({"a": nn.Linear(4, 2), "b": nn.Linear(4, 2)}).double()
        pre = BNPreconditioner(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step, head in enumerate("abab"):
            opt.zero_grad(set_to_none=set_to_none)
            x = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
            model[head](x).pow(2).sum().backward()
            pre.step()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    for p, q in zip(run(False), run(True)):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)
    model = nn.ModuleDict({"a": nn.Linear(4, 2), "b": nn.Linear(4, 2)})
    pre = BNPreconditioner(model)
    model["a"](torch.randn(3, 4)).sum().backward()
    model["b"].weight.grad = torch.ones_like(model["b"].weight)  # a real gradient without a recorded input
    with pytest.raises(RuntimeError, match="'b' has a gradient but its forward hook recorded no input"):
        pre.step()
