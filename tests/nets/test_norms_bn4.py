"""BatchNorm4Things ("BN with 4 things", Lange et al. §5 after Summers & Dinneen 2020) against torch's layers."""
import numpy as np
import pytest
import torch
from torch import nn

from bnlab.nets import (
    BatchNorm4Things1d,
    BatchNorm4Things2d,
    GhostBatchNorm2d,
    make_norm,
    norm_affine_parameters,
)

F64 = torch.float64


def _randomize_affine(*layers):
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        w = torch.rand(layers[0].weight.shape, generator=g, dtype=F64) + 0.5
        b = torch.randn(layers[0].bias.shape, generator=g, dtype=F64)
        for layer in layers:
            layer.weight.copy_(w)
            layer.bias.copy_(b)


@pytest.mark.parametrize("dims,shape", [(1, (12, 6)), (1, (12, 6, 4)), (2, (12, 6, 5, 3))])
def test_one_channel_per_group_no_ghosts_no_weighing_is_batchnorm(dims, shape):
    """num_groups = C, one ghost batch, a = 0: exactly nn.BatchNorm (outputs, running buffers, eval) — 1e-12."""
    x = torch.randn(*shape, dtype=F64) * 3 + 1
    ours = make_norm("bn4", 6, dims=dims, num_groups=6, dtype=F64)
    ref = (nn.BatchNorm1d if dims == 1 else nn.BatchNorm2d)(6, dtype=F64)
    _randomize_affine(ours, ref)
    for _ in range(3):
        torch.testing.assert_close(ours(x), ref(x), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours.running_mean, ref.running_mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours.running_var, ref.running_var, rtol=1e-12, atol=1e-12)
    ours.eval(), ref.eval()
    torch.testing.assert_close(ours(x), ref(x), rtol=1e-12, atol=1e-12)


def test_ghost_batches_match_ghost_batchnorm():
    x = torch.randn(12, 6, 4, 4, dtype=F64)
    ours = BatchNorm4Things2d(6, None, ghost_batch_size=4, dtype=F64)
    ref = GhostBatchNorm2d(6, 4, dtype=F64)
    torch.testing.assert_close(ours(x), ref(x), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours.running_var, ref.running_var, rtol=1e-12, atol=1e-12)


def test_batch_of_one_with_channel_groups_is_groupnorm_and_trains():
    """The GN combination makes batch 1 trainable: with N = 1 the batch × group statistics are one sample's
    group statistics, i.e. nn.GroupNorm's (affine off) — 1e-12.  A larger batch pools samples and group,
    checked against an explicit NumPy reshape."""
    x = torch.randn(1, 8, 5, 5, dtype=F64, requires_grad=True)
    ours = BatchNorm4Things2d(8, 2, affine=False, dtype=F64)
    torch.testing.assert_close(ours(x), nn.GroupNorm(2, 8, affine=False, dtype=F64, eps=1e-5)(x), rtol=1e-12, atol=1e-12)
    ours(x).pow(3).sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().max() > 0
    xb = torch.randn(3, 8, 2, 2, dtype=F64)
    y = BatchNorm4Things2d(8, 4, affine=False, eps=0.0, dtype=F64)(xb).numpy()
    a = xb.numpy().reshape(3, 4, 2, 2, 2)  # (N, G, C/G, H, W)
    mu = a.mean(axis=(0, 2, 3, 4), keepdims=True)
    sd = a.std(axis=(0, 2, 3, 4), keepdims=True)
    np.testing.assert_allclose(y, ((a - mu) / sd).reshape(xb.shape), rtol=1e-12, atol=1e-12)


def test_inference_example_weighing_is_the_mixture_of_example_and_population():
    """Eval mode with weight a: μ = aμ_x + (1−a)μ_run, σ² = aσ²_x + (1−a)σ²_run + a(1−a)(μ_x − μ_run)²;
    checked against the mean and variance of the explicit weighted distribution {the example's group values,
    weight a/K each} ∪ {μ_run ± σ_run, weight (1−a)/2 each}; a = 0 is the running statistics, a = 1 the
    example's own (GroupNorm)."""
    layer = BatchNorm4Things1d(6, 2, example_weight=0.3, affine=False, eps=0.0, dtype=F64)
    layer.running_mean.copy_(torch.tensor([0.5, -1.0], dtype=F64))
    layer.running_var.copy_(torch.tensor([2.0, 0.25], dtype=F64))
    layer.eval()
    x = torch.randn(4, 6, dtype=F64) * 2
    y = layer(x)
    for n in range(4):
        for g in range(2):
            vals = x[n, 3 * g:3 * g + 3].numpy()
            mr, sr = float(layer.running_mean[g]), float(layer.running_var[g]) ** 0.5
            pts = np.r_[vals, mr - sr, mr + sr]
            w = np.r_[np.full(3, 0.3 / 3), 0.35, 0.35]
            mu = (w * pts).sum()
            var = (w * (pts - mu) ** 2).sum()
            np.testing.assert_allclose(y[n, 3 * g:3 * g + 3].numpy(), (vals - mu) / np.sqrt(var), rtol=1e-12)
    layer.example_weight = 1.0
    torch.testing.assert_close(layer(x), nn.GroupNorm(2, 6, affine=False, eps=0.0, dtype=F64)(x), rtol=1e-12, atol=1e-12)


def test_bad_input_and_affine_parameters():
    with pytest.raises(ValueError, match="num_groups=4"):
        make_norm("bn4", 6, num_groups=4)
    with pytest.raises(ValueError, match="example_weight"):
        BatchNorm4Things1d(6, 2, example_weight=1.5)
    with pytest.raises(ValueError, match="example_weight"):
        make_norm("bn", 6, example_weight=0.2)
    with pytest.raises(ValueError, match="at least 2"):
        BatchNorm4Things1d(6, 6)(torch.randn(1, 6))
    with pytest.raises(ValueError, match="multiple"):
        BatchNorm4Things1d(6, 3, ghost_batch_size=4)(torch.randn(6, 6))
    model = nn.Sequential(nn.Linear(4, 6), make_norm("bn4", 6, num_groups=3), nn.Linear(6, 2), nn.LayerNorm(2))
    params = norm_affine_parameters(model)
    assert [tuple(p.shape) for p in params] == [(6,), (6,), (2,), (2,)]
