"""The user's own parameter-free modules: an activation bnlab does not know is an unknown φ, never linear (the
audit's D3: x·sigmoid(1.7x) made the rank verdict a [theorem] of the linear-network papers), a custom reshape
passes the data on, and nothing prints as None."""
import torch
from torch import nn

from bnlab.advice import advise
from bnlab.advice.structure import DANESHMAND, YANG

ONLY_STRUCTURE = ("gradients", "learning_rate", "rank", "batch_size")


class Swishish(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(1.7 * x)


class Flat(nn.Module):
    def forward(self, x):
        return x.reshape(x.shape[0], -1)


def _mlp(act):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.BatchNorm1d(16), act(), nn.Linear(16, 16), nn.BatchNorm1d(16), act(),
                         nn.Linear(16, 3))


def test_a_custom_activation_module_is_an_unknown_nonlinear_phi():
    x = torch.randn(16, 12, generator=torch.Generator().manual_seed(0))
    a = advise(_mlp(Swishish), x, skip=("gradients", "learning_rate", "batch_size"))
    s = a.structure
    assert s.placement == "pre" and [layer.activation for layer in s.layers[:-1]] == ["Swishish", "Swishish"]
    assert s.activation_spec is None  # bnlab's theory does not know it
    linear = next(r for r in s.assumptions if r.paper == DANESHMAND and r.statement.startswith("linear layers"))
    assert linear.holds is False and linear.detail == "Swishish"
    assert a.rank.basis == "extrapolation"
    assert not any(ok for p, ok in s.theorem.items() if p in (YANG, DANESHMAND))
    assert "None" not in a.to_text()


def test_a_custom_reshape_module_passes_the_data_on():
    torch.manual_seed(0)
    body = [nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU()]
    x = torch.randn(8, 1, 6, 6, generator=torch.Generator().manual_seed(0))
    ref = advise(nn.Sequential(*body, nn.Flatten(), nn.Linear(64, 3)), x, skip=ONLY_STRUCTURE).structure
    got = advise(nn.Sequential(*body, Flat(), nn.Linear(64, 3)), x, skip=ONLY_STRUCTURE).structure
    assert got.activations == ref.activations == ("relu",)
    assert [(l.norm, l.placement, l.activation, l.input_source) for l in got.layers] == \
        [(l.norm, l.placement, l.activation, l.input_source) for l in ref.layers]


def test_a_linear_bn_network_prints_no_none():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.BatchNorm1d(16), nn.Linear(16, 16), nn.BatchNorm1d(16),
                          nn.Linear(16, 3))
    a = advise(model, torch.randn(16, 12), skip=("gradients", "learning_rate", "batch_size"))
    assert a.structure.placement == "no φ" and a.rank.basis == "theorem"
    assert "None" not in a.to_text()
