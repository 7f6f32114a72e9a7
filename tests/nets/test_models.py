"""Tests of bnlab.nets.models: the BN-MLP of Yang et al. 2019 (Eq. 7) against torch.nn.BatchNorm1d and ghost
batches; the general MLP (placement, parameter counts), the papers' CNNs, VGG/ResNet builders, bad input."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from bnlab.activations import get_activation
from bnlab.nets import BNMLP, ghost_batch_norm

torch.set_num_threads(1)


def _reference_net(model: BNMLP):
    """An independent implementation: nn.Linear(bias=False) + nn.BatchNorm1d(affine=False) + φ per layer."""
    layers = []
    for w in model.weights:
        lin = nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
        with torch.no_grad():
            lin.weight.copy_(w)
        bn = nn.BatchNorm1d(w.shape[0], eps=model.eps, momentum=model.momentum, affine=False, dtype=w.dtype)
        layers.append((lin, bn))
    return layers


def _reference_forward(layers, readout, x, phi):
    hs = []
    a = x
    for lin, bn in layers:
        h = lin(a)
        hs.append(h)
        a = phi(bn(h))
    return hs, readout(a)


@pytest.mark.parametrize("phi,gamma,beta,eps", [("relu", 1.0, 0.0, 1e-3), ("tanh", 0.7, 0.3, 0.5)])
def test_forward_matches_torch_batchnorm1d_layer_by_layer(phi, gamma, beta, eps):
    # Both routes are float64 and compute the same arithmetic in a different
    # order/kernels; differences are rounding only: ~depth * 1e-15 relative,
    # so rtol 1e-10 is generous yet fails for any real discrepancy (e.g. the
    # sqrt(var+eps)^2 typo of Eq. 7 or an unbiased batch variance: ~1/B ≈ 6%).
    torch.manual_seed(0)
    model = BNMLP(20, 3, depth=5, width=16, phi=phi, gamma=gamma, beta=beta, eps=eps, seed=3, dtype=torch.float64)
    ref = _reference_net(model)
    act = get_activation(phi, gamma=gamma, beta=beta)
    x = torch.randn(16, 20, dtype=torch.float64)
    for _ in range(3):  # train-mode passes also update the running statistics
        out = model(x, record=True)
        hs, ref_out = _reference_forward(ref, model.readout, x, act.torch)
        for layer, (h, h_ref) in enumerate(zip(model.recorded_preactivations, hs)):
            torch.testing.assert_close(h, h_ref, rtol=1e-10, atol=1e-12, msg=f"layer {layer}")
        torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)
        x = x + 0.1 * torch.randn_like(x)
    for layer, (_, bn) in enumerate(ref):
        torch.testing.assert_close(model.running_mean[layer], bn.running_mean, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(model.running_var[layer], bn.running_var, rtol=1e-10, atol=1e-12)
    model.eval()
    for _, bn in ref:
        bn.eval()
    _, ref_eval = _reference_forward(ref, model.readout, x, act.torch)
    torch.testing.assert_close(model(x), ref_eval, rtol=1e-10, atol=1e-12)


def test_ghost_batch_statistics_equal_bn_per_sub_batch():
    # A batch of 4 sub-batches of B=8 with ghost statistics must equal the
    # plain model applied to each sub-batch on its own (float64 rounding only).
    x = torch.randn(32, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ghost = BNMLP(10, 4, depth=4, width=12, sub_batch_size=8, seed=5, dtype=torch.float64)
    plain = BNMLP(10, 4, depth=4, width=12, seed=5, dtype=torch.float64)
    out = ghost(x)
    per = torch.cat([plain(chunk) for chunk in x.split(8)])
    torch.testing.assert_close(out, per, rtol=1e-10, atol=1e-12)
    # first layer against torch's functional BN per chunk (an independent route)
    h = x @ ghost.weights[0].T
    ref = torch.cat([nn.functional.batch_norm(c, None, None, training=True, eps=ghost.eps) for c in h.split(8)])
    ghost(x, record=True)
    got, _, _ = ghost_batch_norm(ghost.recorded_preactivations[0], 8, ghost.eps)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    # the whole-batch statistics differ (the test can fail)
    assert not torch.allclose(plain(x), out)


def test_trainable_affine_starts_like_frozen_and_learns_gamma_beta():
    x = torch.randn(16, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    frozen = BNMLP(6, 3, depth=3, width=8, phi="tanh", gamma=0.5, beta=0.2, seed=1, dtype=torch.float64)
    train = BNMLP(6, 3, depth=3, width=8, phi="tanh", gamma=0.5, beta=0.2, affine="trainable", seed=1, dtype=torch.float64)
    torch.testing.assert_close(frozen(x), train(x), rtol=1e-12, atol=1e-14)
    train(x).sum().backward()
    assert train.bn_scale.grad is not None and train.bn_scale.grad.abs().sum() > 0
    assert not any(n.startswith("bn_") for n, _ in frozen.named_parameters())


def test_activation_object_and_weight_variance():
    act = get_activation("relu", beta=2.0)
    m = BNMLP(5, 2, depth=2, width=4000, phi=act, sigma_w2=2.0, seed=0)
    assert m.beta == 2.0 and m.activation.beta == 2.0
    # empirical weight variance × fan_in = σ_w² (4000·5 draws: rel. std sqrt(2/20000) ≈ 1%; 5σ)
    assert m.weights[0].var().item() * 5 == pytest.approx(2.0, rel=0.05)


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(depth=0), "depth"),
        (dict(width=-1), "width"),
        (dict(eps=-1e-3), "eps"),
        (dict(phi="nonexistent_phi"), "phi"),
        (dict(affine="sometimes"), "affine"),
        (dict(sub_batch_size=1), "sub_batch_size"),
        (dict(sigma_w2=0.0), "sigma_w2"),
    ],
)
def test_bad_model_arguments(kwargs, name):
    base = dict(depth=2, width=4)
    base.update(kwargs)
    with pytest.raises(ValueError, match=name):
        BNMLP(3, 2, **base)


