"""Architecture spec grammar (bnlab.fisher.architecture) and the model builder."""
import pytest
import torch

from bnlab.fisher import Architecture, ConvLayer, FCLayer, build_model, parse_arch


def test_parse_fc_and_conv_specs_round_trip():
    a = parse_arch("fc:784-1000-1000-1000-10")
    assert a.input_shape == (784,) and [l.width for l in a.layers] == [1000, 1000, 1000, 10]
    assert parse_arch(a.to_spec()) == a
    c = parse_arch("conv:1x28x28-c32k3s2p1-c64k3s2p1-c64k3s2p1-fc10")
    assert c.layers[0] == ConvLayer(32, 3, 2, 1) and c.layers[-1] == FCLayer(10)
    assert parse_arch(c.to_spec()) == c
    geo = c.geometry()
    assert [g["out_size"] for g in geo[:3]] == [14, 7, 4]
    assert geo[3]["in_units"] == 64 * 16 and geo[0]["fan_in"] == 9


def test_geometry_matches_torch_shapes():
    spec = "conv:3x11x11-c5k3s2p1-c4k2s3-fc7"
    model = build_model(spec, seed=0)
    out = model(torch.randn(4, 3, 11, 11))
    assert out.shape == (4, 7)
    geo = parse_arch(spec).geometry()
    h = torch.randn(2, 3, 11, 11)
    for layer, g in zip([m for m in model if isinstance(m, torch.nn.Conv2d)], geo):
        h = layer(h)
        assert h.shape[-1] == g["out_size"]


@pytest.mark.parametrize(
    "spec,match",
    [
        ("fc:784", "at least two"),
        ("fc:784-x-10", "at least two"),
        ("mlp:784-10", "expected"),
        ("conv:1x28-c3k3-fc10", "CxHxW"),
        ("conv:1x28x28-c3q3-fc10", "cannot parse"),
        ("conv:1x28x28-c3k3", "output layer"),
        ("conv:1x4x4-c3k3s9-fc2", "stride 9 is larger"),
        ("conv:1x4x4-c3k9-fc2", "kernel 9 is larger"),
        ("conv:1x28x28-fc10-c3k3-fc2", "conv layer after an fc"),
        ("conv:1x28x20-c3k3-fc2", "square"),
        ("fc:0-10", "widths"),
        ("", "expected"),
    ],
)
def test_bad_specs_are_rejected(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_arch(spec)


def test_bad_layers_are_rejected():
    with pytest.raises(ValueError, match="stride"):
        ConvLayer(3, 3, 0)
    with pytest.raises(ValueError):
        Architecture((10,), ())
    with pytest.raises(ValueError, match="arch"):
        parse_arch(123)


def test_build_model_draws_the_papers_ensemble():
    # W ~ N(0, σ_w²/fan_in): the empirical variance of 1000×1000 entries is within 1 % (5 s.e. ≈ 0.6 %)
    m = build_model("fc:1000-1000-10", sigma_w2=2.0, sigma_b2=0.5, gamma=0.3, seed=1)
    w = m[0].weight.detach().double()
    assert float(w.var()) * 1000 == pytest.approx(2.0, rel=0.01)
    assert float(m[1].weight[0]) == pytest.approx(0.3)
    assert isinstance(m[1], torch.nn.BatchNorm1d) and len(m) == 4
    m2 = build_model("fc:1000-1000-10", norm="none")
    assert not any(isinstance(x, torch.nn.BatchNorm1d) for x in m2)


def test_build_model_matches_the_nets_fisher_cnn_and_mlp_shapes():
    # bnlab.fisher.build_model follows the spec grammar (padding, any conv stack, per-layer γ);
    # for the paper's networks it must have the same parameter shapes as bnlab.nets' builders
    from bnlab.nets import MLP, FisherCNN

    ours = build_model("conv:1x28x28-c30k3s2-c60k3s2-c90k3s2-fc10", seed=0)
    theirs = FisherCNN((1, 28, 28), 10, seed=0)
    assert sorted(tuple(p.shape) for p in ours.parameters()) == sorted(tuple(p.shape) for p in theirs.parameters())
    ours = build_model("fc:784-100-100-10", seed=0)
    theirs = MLP(784, [100, 100], 10, norm="bn", seed=0)
    assert sorted(tuple(p.shape) for p in ours.parameters()) == sorted(tuple(p.shape) for p in theirs.parameters())
