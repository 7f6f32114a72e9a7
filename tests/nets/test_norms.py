"""Tests of bnlab.nets.norms: every layer against a direct formula or torch's own layer, in float64, in
train and eval mode; Batch Renorm against each known mistake of public versions (ANCHORS.md).

Tolerances: both routes are float64 with O(10) operations per value, so they agree to ~1e-15
relative; rtol 1e-12 leaves room for reordered reductions and still fails for any real difference
(a biased/unbiased variance swap is ~1/m ≈ 1e-2, ε moved out of the square root ≈ ε/σ ≈ 1e-1).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from bnlab.nets import (
    BatchNorm4Things1d,
    BatchNorm4Things2d,
    NORMALIZATIONS,
    BatchNormNoMean1d,
    BatchNormNoMean2d,
    BatchRenorm1d,
    BatchRenorm2d,
    GhostBatchNorm1d,
    GhostBatchNorm2d,
    make_norm,
)

torch.set_num_threads(1)
F64 = torch.float64
TOL = dict(rtol=1e-12, atol=1e-12)


def _x(shape, seed=0, loc=0.7, scale=2.0):
    return torch.randn(*shape, dtype=F64, generator=torch.Generator().manual_seed(seed)) * scale + loc


def _randomize_affine(layer, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.weight.copy_(torch.rand(layer.weight.shape, generator=g, dtype=F64) + 0.5)
        layer.bias.copy_(torch.randn(layer.bias.shape, generator=g, dtype=F64))


def _cv(t, x):
    """Per-channel vector t viewed for broadcasting against x (N, C, ...)."""
    return t.reshape((1, -1) + (1,) * (x.ndim - 2))


def _dims(x):
    return (0,) + tuple(range(2, x.ndim))


# ----------------------------------------------------------------------------- make_norm
@pytest.mark.parametrize("dims", [1, 2])
def test_make_norm_types(dims):
    kinds = {
        "none": nn.Identity,
        "bn": nn.BatchNorm1d if dims == 1 else nn.BatchNorm2d,
        "bn_nomean": BatchNormNoMean1d if dims == 1 else BatchNormNoMean2d,
        "ghost_bn": GhostBatchNorm1d if dims == 1 else GhostBatchNorm2d,
        "brn": BatchRenorm1d if dims == 1 else BatchRenorm2d,
        "ln": nn.LayerNorm if dims == 1 else nn.GroupNorm,
        "gn": nn.GroupNorm,
        "bn4": BatchNorm4Things1d if dims == 1 else BatchNorm4Things2d,
    }
    assert set(kinds) == set(NORMALIZATIONS)
    x = _x((8, 8) if dims == 1 else (4, 8, 3, 3))
    for name, cls in kinds.items():
        layer = make_norm(name, 8, dims=dims, num_groups=4, dtype=F64,
                          ghost_batch_size=4 if name == "ghost_bn" else None)
        assert type(layer) is cls, name
        assert layer(x).shape == x.shape


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(name="batchnorm"), "name"),
        (dict(num_features=0), "num_features"),
        (dict(dims=3), "dims"),
        (dict(eps=-1.0), "eps"),
        (dict(momentum=1.5), "momentum"),
        (dict(affine="yes"), "affine"),
        (dict(name="ghost_bn"), "ghost_batch_size"),
        (dict(name="bn", ghost_batch_size=4), "ghost_batch_size"),
        (dict(name="ghost_bn", ghost_batch_size=0), "ghost_batch_size"),
        (dict(name="gn", num_groups=3), "num_groups"),
        (dict(name="bn", r_max=2.0), "r_max"),
        (dict(name="brn", rmax=2.0), "rmax"),
        (dict(name="brn", r_max=0.5), "r_max"),
        (dict(name="brn", d_max=-1.0), "d_max"),
        (dict(name="brn", warmup_start=10, r_max_at=5), "r_max_at"),
    ],
)
def test_make_norm_bad_arguments(kwargs, match):
    args = dict(name="bn", num_features=8)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        make_norm(args.pop("name"), args.pop("num_features"), **args)


@pytest.mark.parametrize("name", ["bn_nomean", "ghost_bn", "brn"])
@pytest.mark.parametrize("dims", [1, 2])
def test_wrong_input_shape_is_rejected(name, dims):
    layer = make_norm(name, 4, dims=dims, ghost_batch_size=2 if name == "ghost_bn" else None)
    bad = torch.randn(4, 5) if dims == 1 else torch.randn(4, 4, 3)
    with pytest.raises(ValueError, match="not allowed"):
        layer(bad)


@pytest.mark.parametrize("name", ["bn", "bn_nomean", "ghost_bn", "brn"])
def test_batch_of_one_is_rejected_in_training_but_not_in_eval(name):
    layer = make_norm(name, 4, ghost_batch_size=1 if name == "ghost_bn" else None)
    with pytest.raises(ValueError, match="1 value per channel|more than 1 value"):
        layer(torch.randn(1, 4) if name != "ghost_bn" else torch.randn(6, 4))
    layer.eval()
    assert torch.isfinite(layer(torch.randn(1, 4))).all()


# ----------------------------------------------------------------------------- BN without mean
@pytest.mark.parametrize("shape", [(16, 5), (6, 5, 7), (4, 5, 3, 3)])
def test_bn_nomean_train_and_eval_against_the_formula(shape):
    layer = (BatchNormNoMean2d if len(shape) == 4 else BatchNormNoMean1d)(5, eps=0.3, momentum=0.2, dtype=F64)
    _randomize_affine(layer)
    expected_sq = torch.ones(5, dtype=F64)
    for step in range(3):
        x = _x(shape, seed=step)
        m2 = (x**2).mean(dim=_dims(x))
        want = x / torch.sqrt(_cv(m2, x) + 0.3) * _cv(layer.weight, x) + _cv(layer.bias, x)
        torch.testing.assert_close(layer(x), want, **TOL)
        expected_sq = 0.8 * expected_sq + 0.2 * m2
    torch.testing.assert_close(layer.running_sq, expected_sq, **TOL)
    assert int(layer.num_batches_tracked) == 3
    layer.eval()
    x = _x(shape, seed=9)
    want = x / torch.sqrt(_cv(expected_sq, x) + 0.3) * _cv(layer.weight, x) + _cv(layer.bias, x)
    torch.testing.assert_close(layer(x), want, **TOL)


def test_bn_nomean_is_daneshmand_eq2_matrix_form():
    # Daneshmand et al. 2020, Eq. (2) with ε = 0, α = 0, β = 1: diag(H Hᵀ/N)^{-1/2} H for H = xᵀ (d × N),
    # computed with the matrix product (an independent route to the per-neuron root mean square)
    x = _x((12, 6), loc=3.0, scale=1.0)
    h = x.T
    m = h @ h.T / h.shape[1]
    want = torch.diag(torch.diag(m) ** -0.5) @ h
    got = BatchNormNoMean1d(6, eps=0.0, affine=False, dtype=F64)(x)
    torch.testing.assert_close(got.T, want, **TOL)
    # no centering: the output keeps a mean (BN's would be 0) — the test fails for a centering layer
    assert got.mean(0).abs().min() > 0.5  # ≈ E x/sqrt(E x²) = 3/sqrt(10)


# ----------------------------------------------------------------------------- ghost BN
@pytest.mark.parametrize("shape,b", [((24, 5), 6), ((8, 3, 4), 2), ((12, 3, 4, 4), 3)])
def test_ghost_bn_equals_functional_batch_norm_per_ghost_batch(shape, b):
    x = _x(shape)
    layer = (GhostBatchNorm2d if len(shape) == 4 else GhostBatchNorm1d)(shape[1], b, eps=1e-3, momentum=0.3,
                                                                          dtype=F64)
    _randomize_affine(layer)
    want = torch.cat([nn.functional.batch_norm(c, None, None, layer.weight, layer.bias, training=True, eps=1e-3)
                      for c in x.split(b)])
    torch.testing.assert_close(layer(x), want, **TOL)
    # running statistics: one update with the ghost-averaged mean and unbiased variance
    m = b * int(np.prod(shape[2:]))
    means = torch.stack([c.mean(dim=_dims(c)) for c in x.split(b)])
    uvars = torch.stack([c.var(dim=_dims(c), unbiased=True) for c in x.split(b)])
    torch.testing.assert_close(layer.running_mean, 0.3 * means.mean(0), **TOL)
    torch.testing.assert_close(layer.running_var, 0.7 + 0.3 * uvars.mean(0), **TOL)
    assert m > 1
    layer.eval()
    want = nn.functional.batch_norm(x, layer.running_mean, layer.running_var, layer.weight, layer.bias,
                                    training=False, eps=1e-3)
    torch.testing.assert_close(layer(x), want, **TOL)


@pytest.mark.parametrize("dims", [1, 2])
def test_one_ghost_batch_is_torch_batchnorm(dims):
    shape = (10, 4) if dims == 1 else (5, 4, 3, 3)
    ghost = make_norm("ghost_bn", 4, dims=dims, ghost_batch_size=shape[0], dtype=F64)
    bn = make_norm("bn", 4, dims=dims, dtype=F64)
    for step in range(3):
        x = _x(shape, seed=step)
        torch.testing.assert_close(ghost(x), bn(x), **TOL)
    for key in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(ghost, key), getattr(bn, key), **TOL)
    ghost.eval(), bn.eval()
    torch.testing.assert_close(ghost(x), bn(x), **TOL)


def test_ghost_bn_rejects_a_batch_it_does_not_divide():
    with pytest.raises(ValueError, match="multiple"):
        GhostBatchNorm1d(3, 4)(torch.randn(10, 3))


@settings(max_examples=25, deadline=None)
@given(g=st.integers(1, 4), b=st.integers(2, 6), c=st.integers(1, 4), loc=st.floats(-5, 5), seed=st.integers(0, 99))
def test_ghost_bn_each_ghost_batch_is_standardized(g, b, c, loc, seed):
    # property: with ε = 0 and no affine, every ghost batch has per-channel mean 0 and biased variance 1
    x = _x((g * b, c), seed=seed, loc=loc)
    y = GhostBatchNorm1d(c, b, eps=0.0, affine=False, dtype=F64)(x).reshape(g, b, c)
    torch.testing.assert_close(y.mean(1), torch.zeros(g, c, dtype=F64), rtol=0, atol=1e-12)
    torch.testing.assert_close(y.var(1, unbiased=False), torch.ones(g, c, dtype=F64), rtol=1e-10, atol=1e-10)


# ----------------------------------------------------------------------------- Batch Renorm
def _brn_reference(x, running_mean, running_var, eps, r_max, d_max, weight, bias):
    """Ioffe 2017, Algorithm 1, written out in NumPy (float64): returns y, r, d."""
    xn = x.detach().numpy()
    axes = (0,) + tuple(range(2, xn.ndim))
    shape = (1, -1) + (1,) * (xn.ndim - 2)
    mu_b = xn.mean(axis=axes)
    sigma_b = np.sqrt(xn.var(axis=axes) + eps)
    sigma = np.sqrt(running_var.numpy() + eps)
    r = np.clip(sigma_b / sigma, 1 / r_max, r_max)
    d = np.clip((mu_b - running_mean.numpy()) / sigma, -d_max, d_max)
    xhat = (xn - mu_b.reshape(shape)) / sigma_b.reshape(shape) * r.reshape(shape) + d.reshape(shape)
    return torch.from_numpy(xhat * weight.detach().numpy().reshape(shape) + bias.detach().numpy().reshape(shape)), r, d


def _relaxed_brn(cls, c, **kw):
    # warm-up finished at step 0: the limits are r_max, d_max from the first step
    return cls(c, warmup_start=0, r_max_at=0, d_max_at=0, dtype=F64, **kw)


@pytest.mark.parametrize("cls,shape", [(BatchRenorm1d, (16, 5)), (BatchRenorm2d, (6, 5, 3, 3))])
def test_brn_train_and_eval_against_algorithm_1_with_clipping(cls, shape):
    layer = _relaxed_brn(cls, 5, eps=0.5, momentum=0.25, r_max=1.5, d_max=0.4)
    _randomize_affine(layer)
    with torch.no_grad():  # running stats far from the batch's, so r and d are clipped for some channels
        layer.running_mean.copy_(torch.tensor([0.0, 0.5, 3.0, -2.0, 0.7], dtype=F64))
        layer.running_var.copy_(torch.tensor([4.0, 0.1, 9.0, 1.0, 30.0], dtype=F64))
    mean0, var0 = layer.running_mean.clone(), layer.running_var.clone()
    x = _x(shape)
    want, r, d = _brn_reference(x, mean0, var0, 0.5, 1.5, 0.4, layer.weight, layer.bias)
    assert (np.abs(r - 1.5) < 1e-12).any() or (np.abs(r - 1 / 1.5) < 1e-12).any()  # clipping is exercised
    assert (np.abs(np.abs(d) - 0.4) < 1e-12).any() and (np.abs(d) < 0.4).any()
    torch.testing.assert_close(layer(x), want, **TOL)
    # the running VARIANCE (not std) moves towards the unbiased batch variance, the mean towards μ_B
    m = x.numel() // x.shape[1]
    bvar = x.var(dim=_dims(x), unbiased=False)
    torch.testing.assert_close(layer.running_var, 0.75 * var0 + 0.25 * bvar * m / (m - 1), **TOL)
    torch.testing.assert_close(layer.running_mean, 0.75 * mean0 + 0.25 * x.mean(dim=_dims(x)), **TOL)
    # inference: ε once inside the square root of the running variance (not added twice, not to the std)
    layer.eval()
    y = layer(x)
    want = (x - _cv(layer.running_mean, x)) / torch.sqrt(_cv(layer.running_var, x) + 0.5)
    want = want * _cv(layer.weight, x) + _cv(layer.bias, x)
    torch.testing.assert_close(y, want, **TOL)
    wrong_std = (x - _cv(layer.running_mean, x)) / (torch.sqrt(_cv(layer.running_var, x)) + 0.5)
    assert not torch.allclose(y, wrong_std * _cv(layer.weight, x) + _cv(layer.bias, x), rtol=1e-3)


def test_brn_eps_inside_the_square_root_in_training():
    # a layer adding ε to σ_B instead (ludvb/batchrenorm) gives a visibly different output at ε = 0.5
    layer = _relaxed_brn(BatchRenorm1d, 3, eps=0.5, affine=False)
    x = _x((8, 3), scale=0.8)
    y = layer(x)
    mu, var = x.mean(0), x.var(0, unbiased=False)
    sigma_b, sigma = torch.sqrt(var + 0.5), torch.sqrt(torch.ones(3, dtype=F64) + 0.5)
    r = (sigma_b / sigma).clamp(1 / 3, 3)
    d = ((mu - 0) / sigma).clamp(-5, 5)
    torch.testing.assert_close(y, (x - mu) / sigma_b * r + d, **TOL)
    sb_wrong, s_wrong = torch.sqrt(var) + 0.5, 1.0 + 0.5
    wrong = (x - mu) / sb_wrong * (sb_wrong / s_wrong).clamp(1 / 3, 3) + ((mu / s_wrong).clamp(-5, 5))
    assert not torch.allclose(y, wrong, rtol=1e-3)


def test_brn_unclipped_training_output_equals_inference_with_the_old_running_stats():
    # Ioffe 2017 §3: with r, d unclipped, (x − μ_B)/σ_B·r + d = (x − μ)/σ — the train output equals the
    # eval output computed with the running statistics before the update
    layer = _relaxed_brn(BatchRenorm1d, 4, r_max=100.0, d_max=100.0)
    with torch.no_grad():
        layer.running_mean.fill_(0.3)
        layer.running_var.fill_(2.0)
    x = _x((10, 4))
    ref = make_norm("brn", 4, dtype=F64)
    ref.load_state_dict(layer.state_dict())
    ref.eval()
    want = ref(x)
    torch.testing.assert_close(layer(x), want, **TOL)
    plain_bn = nn.functional.batch_norm(x, None, None, training=True, eps=layer.eps)
    assert not torch.allclose(want, plain_bn, rtol=1e-3)


@pytest.mark.parametrize("dims", [1, 2])
def test_brn_during_warmup_is_exactly_torch_batchnorm(dims):
    # r_max = 1, d_max = 0 (before warmup_start): BN in outputs, gradients, running buffers and eval
    shape = (8, 3) if dims == 1 else (4, 3, 2, 2)
    brn = make_norm("brn", 3, dims=dims, dtype=F64, warmup_start=5)
    bn = make_norm("bn", 3, dims=dims, dtype=F64)
    for step in range(4):
        x = _x(shape, seed=step).requires_grad_(True)
        xb = x.detach().clone().requires_grad_(True)
        a, b = brn(x), bn(xb)
        torch.testing.assert_close(a, b, **TOL)
        (a**3).sum().backward(), (b**3).sum().backward()
        torch.testing.assert_close(x.grad, xb.grad, **TOL)
        torch.testing.assert_close(brn.weight.grad, bn.weight.grad, **TOL)
    for key in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(brn, key), getattr(bn, key), **TOL)
    brn.eval(), bn.eval()
    torch.testing.assert_close(brn(x), bn(x), **TOL)


def test_brn_r_and_d_carry_no_gradient():
    # Route 1: the layer's autograd.  Route 2: the formula with r, d detached (constants).  Route 3 (must
    # differ): the same formula with gradients flowing through r and d.
    layer = _relaxed_brn(BatchRenorm1d, 3, r_max=10.0, d_max=10.0, affine=False)
    with torch.no_grad():
        layer.running_mean.fill_(0.4)
        layer.running_var.fill_(3.0)
    x = _x((6, 3), seed=4).requires_grad_(True)
    weights = _x((6, 3), seed=5)
    (layer(x) * weights).sum().backward()

    def manual(x, detach):
        mu, sb = x.mean(0), torch.sqrt(x.var(0, unbiased=False) + layer.eps)
        sigma = torch.sqrt(torch.full((3,), 3.0, dtype=F64) + layer.eps)
        r, d = sb / sigma, (mu - 0.4) / sigma
        if detach:
            r, d = r.detach(), d.detach()
        return (x - mu) / sb * r + d

    for detach in (True, False):
        x2 = x.detach().clone().requires_grad_(True)
        (manual(x2, detach) * weights).sum().backward()
        if detach:
            torch.testing.assert_close(x.grad, x2.grad, **TOL)
        else:
            assert not torch.allclose(x.grad, x2.grad, rtol=1e-3)


def test_brn_recomputes_r_and_d_every_step():
    # keras-contrib #127: r and d computed once make the layer plain BN.  Here the second batch's
    # output must follow Algorithm 1 with the running statistics updated by the first batch.
    layer = _relaxed_brn(BatchRenorm1d, 3, momentum=0.5, r_max=2.0, d_max=1.0, affine=False)
    x1, x2 = _x((8, 3), seed=1, loc=3.0, scale=5.0), _x((8, 3), seed=2, loc=-1.0, scale=0.5)
    y1 = layer(x1)
    mean1, var1 = layer.running_mean.clone(), layer.running_var.clone()
    one = torch.ones(3, dtype=F64)
    y2 = layer(x2)
    want1, r1, d1 = _brn_reference(x1, 0 * one, one, layer.eps, 2.0, 1.0, one, 0 * one)
    want2, r2, d2 = _brn_reference(x2, mean1, var1, layer.eps, 2.0, 1.0, one, 0 * one)
    torch.testing.assert_close(y1, want1, **TOL)
    torch.testing.assert_close(y2, want2, **TOL)
    assert not np.allclose(r1, r2) and not np.allclose(d1, d2)
    assert not torch.allclose(y2, nn.functional.batch_norm(x2, None, None, training=True, eps=layer.eps))


def test_brn_affine_parameters_exist_only_with_affine_true_and_are_used():
    # ludvb/batchrenorm created weight and bias even with affine=False
    assert [n for n, _ in BatchRenorm1d(3, affine=False).named_parameters()] == []
    layer = BatchRenorm2d(3, dtype=F64)
    assert sorted(n for n, _ in layer.named_parameters()) == ["bias", "weight"]
    x = _x((4, 3, 2, 2))
    layer(x).pow(2).sum().backward()
    assert layer.weight.grad.abs().min() > 0 and layer.bias.grad is not None


def test_brn_warmup_schedule_is_configurable_and_follows_the_layers_own_counter():
    layer = BatchRenorm1d(2, r_max=3.0, d_max=5.0, warmup_start=10, r_max_at=30, d_max_at=20)
    assert layer.clip_limits(0) == (1.0, 0.0)
    assert layer.clip_limits(10) == (1.0, 0.0)
    assert layer.clip_limits(20) == pytest.approx((2.0, 5.0))
    assert layer.clip_limits(25) == pytest.approx((2.5, 5.0))
    assert layer.clip_limits(100) == (3.0, 5.0)
    default = BatchRenorm1d(2)  # Ioffe 2017 §4: 5k steps of BN, r_max 3 at 40k, d_max 5 at 25k
    assert default.clip_limits(5000) == (1.0, 0.0)
    assert default.clip_limits(25000) == pytest.approx((1 + 2 * 20 / 35, 5.0))
    assert default.clip_limits(40000) == (3.0, 5.0)
    for _ in range(15):
        layer(torch.randn(4, 2))
    layer.eval()
    layer(torch.randn(4, 2))  # eval passes do not advance the schedule
    assert int(layer.num_batches_tracked) == 15 and layer.clip_limits() == pytest.approx((1.5, 2.5))
    # the limits the forward pass uses (computed on the device, no host sync) are the documented ones
    for step in (0, 10, 12, 20, 25, 29, 30, 31, 100):
        layer.num_batches_tracked.fill_(step)
        on_device = [float(t) for t in layer._limits_on_device(torch.zeros((), dtype=F64))]
        assert on_device == pytest.approx(list(layer.clip_limits()), rel=1e-12), step
    layer.num_batches_tracked.fill_(15)
    copy = BatchRenorm1d(2, r_max=3.0, d_max=5.0, warmup_start=10, r_max_at=30, d_max_at=20)
    copy.load_state_dict(layer.state_dict())
    assert copy.clip_limits() == layer.clip_limits()


# ----------------------------------------------------------------------------- LN, GN (PyTorch's)
def test_layer_norm_and_group_norm_against_the_formula():
    x = _x((5, 12))
    y = make_norm("ln", 12, eps=1e-3, dtype=F64)(x)
    want = (x - x.mean(1, keepdim=True)) / torch.sqrt(x.var(1, unbiased=False, keepdim=True) + 1e-3)
    torch.testing.assert_close(y, want, **TOL)
    x4 = _x((3, 6, 2, 2))
    for name, groups in (("gn", 3), ("ln", 1)):
        y = make_norm(name, 6, dims=2, num_groups=groups, eps=1e-3, dtype=F64)(x4)
        g = x4.reshape(3, groups, -1)
        want = ((g - g.mean(2, keepdim=True)) / torch.sqrt(g.var(2, unbiased=False, keepdim=True) + 1e-3))
        torch.testing.assert_close(y, want.reshape(x4.shape), **TOL)


def test_brn_limits_on_device_with_an_instant_schedule():
    layer = BatchRenorm1d(2, warmup_start=5, r_max_at=5, d_max_at=5)
    for step, want in ((4, (1.0, 0.0)), (5, (3.0, 5.0)), (6, (3.0, 5.0))):
        layer.num_batches_tracked.fill_(step)
        assert [float(t) for t in layer._limits_on_device(torch.zeros(()))] == list(want) == list(layer.clip_limits())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["bn_nomean", "ghost_bn", "brn"])
def test_cuda_matches_cpu(name):
    # float64 on both devices: reductions in another order, agreement to ~1e-15 relative
    layer = make_norm(name, 4, dims=2, dtype=F64, ghost_batch_size=2 if name == "ghost_bn" else None)
    gpu = make_norm(name, 4, dims=2, dtype=F64, ghost_batch_size=2 if name == "ghost_bn" else None).cuda()
    for step in range(3):
        x = _x((4, 4, 3, 3), seed=step)
        torch.testing.assert_close(gpu(x.cuda()).cpu(), layer(x), rtol=1e-10, atol=1e-12)
    for (k, a), (_, b) in zip(layer.state_dict().items(), gpu.state_dict().items()):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-10, atol=1e-12, msg=k)


# ----------------------------------------------------------------------------- ensembles under vmap
@pytest.mark.parametrize("name, kwargs", [("bn_nomean", {}), ("ghost_bn", {"ghost_batch_size": 4}),
                                          ("brn", {}),
                                          ("bn4", {"num_groups": 2, "ghost_batch_size": 4, "example_weight": 0.25})])
def test_an_ensemble_under_vmap_updates_its_running_statistics_as_each_layer_alone(name, kwargs, recwarn):
    # torch.func.stack_module_state + vmap is how an ensemble of these layers runs (the chunked Daneshmand
    # cells): every running statistic must follow nn.BatchNorm's (1 − m)·running + m·batch per network, and
    # without functorch's "performance drop" fallback (a loop over the networks: lerp_ has no batching rule)
    from torch.func import functional_call, stack_module_state, vmap

    layers = [make_norm(name, 4, dims=1, dtype=F64, **kwargs) for _ in range(3)]
    params, buffers = stack_module_state(layers)
    base = make_norm(name, 4, dims=1, dtype=F64, **kwargs).to("meta")
    xs = torch.stack([_x((8, 4), seed=s) for s in range(3)])

    def one(p, b, x):
        return functional_call(base, (p, b), (x,))

    for _ in range(2):
        out = vmap(one, in_dims=(0, 0, 0))(params, buffers, xs)
        alone = torch.stack([layer(x) for layer, x in zip(layers, xs)])
        torch.testing.assert_close(out, alone, **TOL)
    for key, stacked in buffers.items():
        torch.testing.assert_close(stacked, torch.stack([layer.state_dict()[key] for layer in layers]), **TOL)
    assert not [w for w in recwarn if "performance drop" in str(w.message)]
