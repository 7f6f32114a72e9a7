"""Tests of bnlab.nets.models: the BN-MLP of Yang et al. 2019 (Eq. 7) against torch.nn.BatchNorm1d and ghost
batches; the general MLP (placement, parameter counts), the papers' CNNs, VGG/ResNet builders, bad input."""
from __future__ import annotations

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




# ----------------------------------------------------------------------------- MLP
from bnlab.nets import (  # noqa: E402
    BNPCNN,
    MLP,
    NORMALIZATIONS,
    ActivationModule,
    BatchRenorm1d,
    FisherCNN,
    resnet,
    vgg,
)


def _n_params(model):
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("placement,order", [("pre", ("Linear", "BatchNorm1d", "ActivationModule")),
                                             ("post", ("Linear", "ActivationModule", "BatchNorm1d"))])
def test_mlp_placement_order_and_forward_against_a_direct_formula(placement, order):
    m = MLP(5, [7, 6], 3, phi="tanh", norm="bn", placement=placement, sigma_b2=0.3, seed=2, dtype=torch.float64)
    for block in m.blocks:
        assert tuple(type(layer).__name__ for layer in block) == order
    x = torch.randn(9, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    a = x
    for lin in m.hidden_layers:  # float64 on both routes: rounding only, rtol 1e-12
        h = a @ lin.weight.T + lin.bias
        bn = nn.functional.batch_norm
        a = torch.tanh(bn(h, None, None, training=True)) if placement == "pre" else bn(torch.tanh(h), None, None,
                                                                                        training=True)
    torch.testing.assert_close(m(x), a @ m.readout.weight.T + m.readout.bias, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("norm", NORMALIZATIONS)
@pytest.mark.parametrize("placement", ["pre", "post"])
def test_mlp_every_normalization_trains_a_step(norm, placement):
    kw = {"ghost_batch_size": 4} if norm == "ghost_bn" else ({"num_groups": 4} if norm == "gn" else {})
    m = MLP(6, [8, 8], 3, norm=norm, placement=placement, norm_kwargs=kw, seed=0)
    x = torch.randn(8, 6)
    m(x).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.hidden_layers[0].parameters())
    assert len(m.norms) == 2


def test_mlp_parameter_count_of_the_fisher_papers_fc_net():
    # Fisher paper §4: L = 4, N = 1000, BN after each linear layer except the output (MNIST input)
    m = MLP(784, [1000, 1000, 1000], 10, norm="bn")
    want = (784 * 1000 + 1000) + 2 * (1000 * 1000 + 1000) + (1000 * 10 + 10) + 3 * 2 * 1000
    assert _n_params(m) == want == 2_803_010


def test_mlp_gamma_beta_seed_and_init():
    m = MLP(4, [5], 2, gamma=0.3, beta=0.1, seed=1)
    assert torch.equal(m.norms[0].weight, torch.full((5,), 0.3)) and torch.equal(m.norms[0].bias, torch.full((5,), 0.1))
    same, other = MLP(4, [5], 2, gamma=0.3, beta=0.1, seed=1), MLP(4, [5], 2, seed=2)
    assert torch.equal(m.hidden_layers[0].weight, same.hidden_layers[0].weight)
    assert not torch.equal(m.hidden_layers[0].weight, other.hidden_layers[0].weight)
    asym = MLP(4, [50], 2, init="asymmetric_uniform", norm="none")
    assert float(asym.hidden_layers[0].weight.detach().min()) >= 0
    # the default σ_w² = 2 of "gaussian": 100·400 entries, ±5σ = ±3.5 % (see test_init.py)
    wide = MLP(400, [100], 2, seed=3, dtype=torch.float64)
    assert float(wide.hidden_layers[0].weight.detach().var()) * 400 == pytest.approx(2.0, rel=0.035)


def test_mlp_forward_hidden_and_input_checks():
    m = MLP(12, [6, 4], 3)
    logits, hidden = m.forward_hidden(torch.randn(5, 3, 4))  # flattened per sample
    assert logits.shape == (5, 3) and [h.shape for h in hidden] == [(5, 6), (5, 4)]
    with pytest.raises(ValueError, match="features"):
        m(torch.randn(5, 11))


@pytest.mark.parametrize("norm", ["bn_nomean", "ghost_bn", "brn", "bn"])
def test_batch_of_one_in_training_is_rejected_by_every_batch_norm(norm):
    kw = {"ghost_batch_size": 1} if norm == "ghost_bn" else {}
    m = MLP(3, [4], 2, norm=norm, norm_kwargs=kw)
    with pytest.raises(ValueError, match="value per channel|more than 1 value"):
        m(torch.randn(1, 3))
    m.eval()
    assert m(torch.randn(1, 3)).shape == (1, 2)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(widths=[]), "widths"),
        (dict(widths=[0]), "widths"),
        (dict(widths=5), "widths"),
        (dict(norm="batchnorm"), "norm"),  # ("batch" is the old spelling of "bn": tests/test_vocabulary.py)
        (dict(placement="middle"), "placement"),
        (dict(phi="nonexistent_phi"), "phi"),
        (dict(init="he"), "init"),
        (dict(sigma_w2=-1.0), "sigma_w2"),
        (dict(init="torch_default", sigma_w2=2.0), "sigma_w2"),
        (dict(norm="none", gamma=2.0), "gamma"),
        (dict(norm_kwargs={"dims": 2}), "norm_kwargs"),
        (dict(norm_kwargs=3), "norm_kwargs"),
        (dict(norm="ghost_bn"), "ghost_batch_size"),
        (dict(dtype=torch.int32), "dtype"),
        (dict(seed=-1), "seed"),
        (dict(bias=1), "bias"),
    ],
)
def test_mlp_bad_arguments(kwargs, match):
    args = dict(widths=[4])
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        MLP(3, args.pop("widths"), 2, **args)


def test_activation_module_resolves_once():
    mod = ActivationModule("tanh(2*x)+0.1*x")
    x = torch.linspace(-2, 2, 9, dtype=torch.float64)
    torch.testing.assert_close(mod(x), torch.tanh(2 * x) + 0.1 * x, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- CNNs
def test_fisher_cnn_architecture_and_parameter_count():
    # §4: three 3×3 stride-2 convolutions with 30, 60, 90 channels + FC; no padding (Suppl. §6.2: the
    # first layer of a CIFAR-10 net has 15×15 = 225 positions)
    m = FisherCNN()
    shapes = []
    m.features[0].register_forward_hook(lambda mod, i, o: shapes.append(tuple(o.shape[1:])))
    assert m(torch.randn(4, 3, 32, 32)).shape == (4, 10)
    assert shapes == [(30, 15, 15)] and m.feature_shape == (90, 3, 3)
    convs = (3 * 9 + 1) * 30 + (30 * 9 + 1) * 60 + (60 * 9 + 1) * 90
    assert _n_params(m) == convs + 2 * (30 + 60 + 90) + (810 + 1) * 10 == 74_260
    assert FisherCNN(in_shape=(1, 28, 28)).feature_shape == (90, 2, 2)
    assert _n_params(FisherCNN(norm="none")) == 74_260 - 360
    g = FisherCNN(gamma=0.5, seed=1)
    assert all(torch.equal(n.weight, torch.full_like(n.weight, 0.5)) for n in g.norms)
    # σ_b² = 0.5 by default (the paper's): biases are drawn, not zero
    assert float(m.features[0].bias.detach().abs().sum()) > 0


def test_bnp_cnn_parameter_counts():
    # the TensorFlow (2019) CNN tutorial's model (32-64-64) has 122,570 parameters; the paper's 32-64-32: 71,338
    assert _n_params(BNPCNN(norm="none", channels=(32, 64, 64))) == 122_570
    m = BNPCNN(norm="none")
    assert _n_params(m) == 896 + 18_496 + 18_464 + (512 * 64 + 64) + 650 == 71_338
    assert m.feature_shape == (32, 4, 4)
    bn = BNPCNN()
    assert _n_params(bn) == 71_338 + 2 * (32 + 64 + 32 + 64)
    assert bn(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert torch.count_nonzero(bn.head[0].bias) == 0  # zero biases (Appendix B)


def test_vgg_and_resnet_parameter_counts():
    # VGG-16 (config D) with BN and one Linear(512, 10): 14,728,266; VGG-11: 9,231,114.
    # ResNet-20: 269,722 ("0.27M", He et al. 2016 Table 6), ResNet-110: 1,727,962 ("1.7M"),
    # ResNet-18 (CIFAR stem): 11,173,962.
    assert _n_params(vgg(16)) == 14_728_266
    assert _n_params(vgg(11)) == 9_231_114
    assert _n_params(resnet(20)) == 269_722
    assert _n_params(resnet(110)) == 1_727_962
    assert _n_params(resnet(18)) == 11_173_962
    assert len(resnet(20).norms) == 19 and len(vgg(11).norms) == 8


def test_resnet50_bottleneck_parameter_count_and_structure():
    # ResNet-50 with the CIFAR stem, BN and Linear(2048, 10): 23,520,842 parameters — the count of the
    # widely used CIFAR ResNet-50 (e.g. kuangliu/pytorch-cifar), an independent tally of He et al. Table 1.
    # Recomputed by hand: stage with c_mid = c, blocks n: first block 1×1 (c_in·c) + 3×3 (9c²) + 1×1 (4c²)
    # + projection (c_in·4c), BN 2·(c + c + 4c + 4c); the others the same with c_in = 4c and no projection.
    def stage(c_in, c, n):
        first = c_in * c + 9 * c * c + 4 * c * c + c_in * 4 * c + 2 * (c + c + 4 * c + 4 * c)
        rest = 4 * c * c + 9 * c * c + 4 * c * c + 2 * (c + c + 4 * c)
        return first + (n - 1) * rest

    by_hand = (3 * 9 * 64 + 2 * 64 + stage(64, 64, 3) + stage(256, 128, 4) + stage(512, 256, 6)
               + stage(1024, 512, 3) + 2048 * 10 + 10)
    m = resnet(50)
    assert _n_params(m) == by_hand == 23_520_842
    assert len(m.norms) == 1 + 16 * 3 + 4  # stem, three per block, one per projection shortcut
    assert m(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_vgg_width_multiplier_scales_channels():
    v = vgg(11, in_channels=1, width_multiplier=1 / 8)
    convs = [c for c in v if isinstance(c, nn.Conv2d)]
    assert [c.out_channels for c in convs] == [8, 16, 32, 32, 64, 64, 64, 64]
    assert v[-1].in_features == 64 and len(v.norms) == 8
    assert v(torch.randn(2, 1, 32, 32)).shape == (2, 10)
    # a tiny multiplier keeps at least one channel per layer
    assert {c.out_channels for c in vgg(11, width_multiplier=1e-3) if isinstance(c, nn.Conv2d)} == {1}
    with pytest.raises(ValueError, match="width_multiplier"):
        vgg(11, width_multiplier=0.0)


def test_resnet_option_a_shortcut_subsamples_and_zero_pads():
    # with both convolutions zeroed a block in eval mode (running stats 0/1) outputs φ(shortcut(x)):
    # identity subsampled by 2 and zero-padded from 16 to 32 channels (He et al. 2016 §4.2, option A)
    m = resnet(20, dtype=torch.float64).eval()
    block = [b for b in m if type(b).__name__ == "BasicBlock"][3]  # first block of stage 2
    with torch.no_grad():
        block.conv1.weight.zero_()
        block.conv2.weight.zero_()
    x = torch.randn(2, 16, 8, 8, dtype=torch.float64)
    want = torch.relu(nn.functional.pad(x[:, :, ::2, ::2], (0, 0, 0, 0, 8, 8)))
    torch.testing.assert_close(block(x), want, rtol=0, atol=0)


@pytest.mark.parametrize("norm", ["bn", "ghost_bn", "brn", "gn", "ln", "bn_nomean", "none"])
def test_conv_nets_accept_every_normalization(norm):
    kw = {"ghost_batch_size": 2} if norm == "ghost_bn" else ({"num_groups": 2} if norm == "gn" else {})
    x = torch.randn(4, 3, 32, 32)
    for model in (FisherCNN(norm=norm, norm_kwargs=kw), resnet(20, norm=norm, norm_kwargs=kw)):
        assert model(x).shape == (4, 10)
    assert isinstance(FisherCNN(norm="brn").norms[0], torch.nn.Module)
    assert not isinstance(FisherCNN(norm="bn").norms[0], BatchRenorm1d)


@pytest.mark.parametrize(
    "build,match",
    [
        (lambda: FisherCNN(in_shape=(3, 32)), "in_shape"),
        (lambda: FisherCNN(in_shape=(3, 4, 4)), "in_shape"),
        (lambda: FisherCNN(channels=()), "channels"),
        (lambda: FisherCNN(norm="bn", gamma=float("nan")), "gamma"),
        (lambda: BNPCNN(channels=(32, 64)), "channels"),
        (lambda: BNPCNN(in_shape=(3, 8, 8)), "in_shape"),
        (lambda: vgg(12), "depth"),
        (lambda: resnet(51), "depth"),
        (lambda: resnet(20, norm="gn", norm_kwargs={"num_groups": 3}), "num_groups"),
    ],
)
def test_cnn_bad_arguments(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_cnn_bad_input_shapes():
    with pytest.raises(ValueError, match="not allowed"):
        FisherCNN()(torch.randn(2, 1, 28, 28))
    with pytest.raises(ValueError, match="not allowed"):
        resnet(20)(torch.randn(2, 1, 32, 32))
    assert FisherCNN()(torch.randn(2, 3 * 32 * 32)).shape == (2, 10)  # flat inputs are reshaped
