"""Forward-hook measurement, rank-raising pre-training (Algorithm 1) and gradient alignment (Prop. 19)."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bnlab.rank import (
    gradient_alignment,
    layer_rank_measures,
    rank_lower_bound,
    rank_measures,
    rank_pretrain,
    record_representations,
    rescale_to_unit_trace,
)


def _mlp(depth, width, d_in=20, classes=5, bn=False, seed=0, init="xavier"):
    torch.manual_seed(seed)
    layers = [nn.Linear(d_in, width)]
    for i in range(depth):
        if bn:
            layers.append(nn.BatchNorm1d(width))
        layers.append(nn.ReLU())
        layers.append(nn.Linear(width, width if i < depth - 1 else classes))
    model = nn.Sequential(*layers).double()
    if init == "xavier":
        for m in model:
            if isinstance(m, nn.Linear):
                nn.init.xavier_normal_(m.weight)
                nn.init.zeros_(m.bias)
    return model


def _hook_count(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


# ---------------------------------------------------------------- hooks

def test_recorded_representations_match_a_manual_forward():
    model = _mlp(3, 8)
    x = torch.randn(10, 20, dtype=torch.float64)
    with record_representations(model, ["1", "4"]) as store:
        model(x)
    torch.testing.assert_close(store["1"], model[1](model[0](x)).T)
    torch.testing.assert_close(store["4"], model[:5](x).T)
    with record_representations(model, "3", capture="input") as store:
        model(x)
    torch.testing.assert_close(store["3"], model[:3](x).T)
    assert _hook_count(model) == 0


def test_conv_outputs_are_flattened_per_sample():
    conv = nn.Sequential(nn.Conv2d(2, 3, 3))
    x = torch.randn(4, 2, 5, 5)
    with record_representations(conv, "0") as store:
        y = conv(x)
    assert store["0"].shape == (3 * 3 * 3, 4)
    torch.testing.assert_close(store["0"], y.reshape(4, -1).T)


def test_hooks_are_removed_on_error():
    model = _mlp(2, 8)
    with pytest.raises(RuntimeError):
        with record_representations(model, ["0", "2"]):
            model(torch.randn(3, 7, dtype=torch.float64))  # wrong input width: the forward raises
    assert _hook_count(model) == 0
    with pytest.raises(KeyError):
        with record_representations(model, ["0"]):
            raise KeyError("user code failed")
    assert _hook_count(model) == 0


def test_unknown_layer_name_is_a_clear_error_and_registers_nothing():
    model = _mlp(2, 8)
    with pytest.raises(ValueError, match=r"layer 'fc9' is not allowed.*named submodules: '0'"):
        with record_representations(model, ["0", "fc9"]):
            pass
    assert _hook_count(model) == 0
    with pytest.raises(ValueError, match="fc9"):
        layer_rank_measures(model, torch.randn(4, 20, dtype=torch.float64), ["fc9"])


def test_layer_rank_measures_default_layers_and_values():
    model = _mlp(3, 8)
    x = torch.randn(16, 20, dtype=torch.float64)
    out = layer_rank_measures(model, x)
    assert list(out) == ["0", "2", "4", "6"]  # the Linear layers
    h = model[:3](x).T.detach()
    ref = rank_measures(rescale_to_unit_trace(h))
    assert int(out["2"].soft_rank) == int(ref.soft_rank)
    assert float(out["2"].rank_lower_bound) == pytest.approx(float(rank_lower_bound(h)), rel=1e-10)
    assert _hook_count(model) == 0


# ---------------------------------------------------------------- pre-training

@pytest.fixture(scope="module")
def fashion_inputs():
    try:
        from bnlab.data import load_dataset

        data = load_dataset("fashion_mnist")
    except Exception as exc:  # pragma: no cover - the dataset is installed by install.sh
        pytest.skip(f"Fashion-MNIST not available: {exc}")
    return data.x[:512].reshape(512, -1).double()


def _fashion_mlp(depth, width, seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    layers = [nn.Linear(784, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, 10))
    model = nn.Sequential(*layers).to(dtype)
    for m in model:
        if isinstance(m, nn.Linear):
            nn.init.xavier_normal_(m.weight)  # the authors' script's initialization
            nn.init.zeros_(m.bias)
    return model


def test_pretraining_raises_the_last_layer_rank_5x(fashion_inputs):
    """Depth-32 vanilla ReLU MLP (32 hidden layers, width 64, Xavier-normal, seed 0, float32) on
    64 Fashion-MNIST images: layer-wise Algorithm 1 with T = 50 steps per layer (the paper's
    Fig. 6 uses 25 and 75), SGD lr 1e-2, one minibatch.  r(H_L) starts at ≈ 1.03 (collapsed);
    measured ≈ 7.6× (float64 seeds 0 and 1: 7.6×, 7.9×).  Width 128: the slow test below."""
    model = _fashion_mlp(32, 64, dtype=torch.float32)
    res = rank_pretrain(model, fashion_inputs.float(), layer="layerwise", steps=50, batch_size=64,
                        optimizer=functools.partial(torch.optim.SGD, lr=1e-2), seed=0)
    assert res.initial_r < 1.1
    assert res.final_r >= 5 * res.initial_r, (res.initial_r, res.final_r)
    assert len(res.history) == 32 * 50
    assert res.layer == "64" and res.layers[0] == "2"


@pytest.mark.slow
@pytest.mark.parametrize("steps", [25, 75])
def test_pretraining_paper_width_128(fashion_inputs, steps):
    """Width 128 as in Fig. 6, T = 25 and 75 per layer, SGD lr 1e-2, seed 0 (~15–30 s each).
    Measured: 1.06 → 9.0 (T = 25) and → 11.4 (T = 75)."""
    model = _fashion_mlp(32, 128)
    res = rank_pretrain(model, fashion_inputs, layer="layerwise", steps=steps, batch_size=64,
                        optimizer=functools.partial(torch.optim.SGD, lr=1e-2), seed=0)
    assert res.final_r >= 5 * res.initial_r, (res.initial_r, res.final_r)


def test_pretraining_optimizer_instance_and_factory_agree(fashion_inputs):
    a = _fashion_mlp(4, 16)
    b = _fashion_mlp(4, 16)
    ra = rank_pretrain(a, fashion_inputs, steps=5, minibatches=2, batch_size=32,
                       optimizer=functools.partial(torch.optim.SGD, lr=0.05), seed=3)
    rb = rank_pretrain(b, (fashion_inputs, torch.zeros(len(fashion_inputs))), steps=5, minibatches=2, batch_size=32,
                       optimizer=torch.optim.SGD(b.parameters(), lr=0.05), seed=3)
    assert ra.r_history == pytest.approx(rb.r_history, rel=1e-12)
    assert len(ra.history) == 10 and ra.layer == "8"
    assert ra.history[-1]["minibatch"] == 1


def test_pretraining_objective_is_the_rank_bound_of_the_named_layer():
    # The first recorded r equals r(H) of that layer computed independently.
    model = _mlp(3, 8)
    x = torch.randn(40, 20, dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randperm(40, generator=gen)[:16]
    expected = float(rank_lower_bound(model[:5](x[idx]).T.detach()))
    res = rank_pretrain(model, x, layer="4", steps=1, batch_size=16, seed=0)
    assert res.history[0]["r"] == pytest.approx(expected, rel=1e-12)
    assert res.capture == "output"


def test_pretraining_bad_input():
    model = _mlp(2, 8)
    x = torch.randn(20, 20, dtype=torch.float64)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="nope"):
        rank_pretrain(model, x, layer=["0", "nope"], batch_size=8)
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q)  # nothing trained before the names were checked
    with pytest.raises(ValueError, match="batch_size"):
        rank_pretrain(model, x, batch_size=21)
    with pytest.raises(ValueError, match="optimizer"):
        rank_pretrain(model, x, optimizer="adam", batch_size=8)
    with pytest.raises(ValueError, match="objective"):
        rank_pretrain(model, x, objective="r", batch_size=8)
    with pytest.raises(ValueError, match="data"):
        rank_pretrain(model, [1, 2, 3])


@pytest.mark.parametrize("scale", [0.0, 1e300])
def test_pretraining_data_that_give_a_zero_or_overflowing_representation_is_a_value_error(scale):
    """Zero inputs through bias-free layers (H = 0, r(H) = 0) or inputs of 1e300 (H overflows) before any
    step: the data's fault, a ValueError naming data, not the FloatingPointError's "lower the step size"
    (found by fuzzing rank_pretrain); nothing is trained."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.ReLU(),
                                torch.nn.Linear(16, 16, bias=False), torch.nn.ReLU(), torch.nn.Linear(16, 3)).double()
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(64, 8, dtype=torch.float64) * scale
    with pytest.raises(ValueError, match="data is not allowed.*before any pre-training step"):
        rank_pretrain(model, x, layer="layerwise", steps=3)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


# ---------------------------------------------------------------- gradient alignment

def test_per_sample_gradients_match_autograd_with_train_mode_bn():
    """vmap(grad) on the last layer vs autograd of each L_i from the full-batch forward (BN in train mode)."""
    model = _mlp(2, 8, bn=True)
    model.train()
    x = torch.randn(6, 20, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 3, 4, 0])
    running = model[1].running_mean.clone()
    res = gradient_alignment(model, x, y)
    torch.testing.assert_close(model[1].running_mean, running)  # no side effect on BN statistics
    out = model(x)
    w = model[-1].weight
    for i in range(6):
        (g,) = torch.autograd.grad(F.cross_entropy(out[i : i + 1], y[i : i + 1]), w, retain_graph=True)
        torch.testing.assert_close(res.grads[i], g, rtol=1e-10, atol=1e-12)
    # and a naive vmap over single samples through the whole model would be wrong here:
    # BN of one sample is 0/0-degenerate, so the batch's forward pass is essential.
    assert res.cosine.shape == (6, 6)
    torch.testing.assert_close(torch.diagonal(res.cosine), torch.ones(6, dtype=torch.float64))


def test_rank_one_representation_aligns_every_neuron_gradient():
    """Prop. 19: if H_L has rank one, |cos| between samples' gradient rows of each neuron is 1."""
    torch.manual_seed(0)
    u = torch.randn(8, dtype=torch.float64)

    class RankOne(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Linear(20, 1).double()
            self.head = nn.Linear(8, 5).double()

        def forward(self, x):
            return self.head(self.scale(x) * u)  # h_i = c_i u

    x = torch.randn(12, 20, dtype=torch.float64)
    y = torch.randint(0, 5, (12,))
    res = gradient_alignment(RankOne(), x, y)
    assert res.mean_abs_neuron_cosine == pytest.approx(1.0, abs=1e-12)
    # generic full-rank features are far from aligned
    generic = gradient_alignment(_mlp(1, 32, seed=1), torch.randn(12, 20, dtype=torch.float64), y)
    assert generic.mean_abs_neuron_cosine < 0.9


def test_alignment_rejects_a_model_whose_output_is_not_the_last_layer():
    model = nn.Sequential(nn.Linear(20, 8), nn.ReLU(), nn.Linear(8, 5), nn.BatchNorm1d(5)).double()
    with pytest.raises(ValueError, match="nothing .*follows it"):
        gradient_alignment(model, torch.randn(6, 20, dtype=torch.float64), torch.zeros(6, dtype=torch.long))
    with pytest.raises(ValueError, match="expected an nn.Linear"):
        gradient_alignment(model, torch.randn(6, 20, dtype=torch.float64), torch.zeros(6, dtype=torch.long),
                           layer="3")
    with pytest.raises(ValueError, match="N >= 2"):
        gradient_alignment(_mlp(1, 8), torch.randn(1, 20, dtype=torch.float64), torch.zeros(1, dtype=torch.long))
    assert _hook_count(model) == 0


def test_zero_representations_are_left_out_of_the_mean():
    """Samples whose last hidden representation is exactly 0 (a dead ReLU batch) have no gradient
    direction: the mean |cos| is over the other samples' pairs, and zero_fraction reports them."""

    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(3, 2).double()

        def forward(self, x):
            h = torch.zeros(x.shape[0], 3, dtype=torch.float64)
            h[:2] = x[:2, :3]  # samples 2.. have h_i = 0
            return self.head(h)

    x = torch.randn(6, 3, dtype=torch.float64)
    x[1] = -2.5 * x[0]  # the two live samples are collinear: |cos| = 1 (Prop. 19)
    res = gradient_alignment(Gate(), x, torch.tensor([0, 1, 0, 1, 0, 1]))
    assert res.zero_fraction == pytest.approx(4 / 6)
    assert res.mean_abs_cosine == pytest.approx(1.0, abs=1e-12)
    assert res.mean_abs_neuron_cosine == pytest.approx(1.0, abs=1e-12)
