"""A weight layer used twice in one forward pass (the audit's D14: σ_w² "-", BNP "2 of 4 weight layers", the
internal text "sigma_w2[1]=nan is not allowed" in the mean field row)."""
import math

import torch
from torch import nn

from bnlab.advice import advise
from bnlab.advice.structure import DANESHMAND, FISHER, YANG


def _shared():
    torch.manual_seed(0)
    shared = nn.Linear(16, 16)
    return nn.Sequential(nn.Linear(12, 16), nn.BatchNorm1d(16), nn.ReLU(), shared, nn.BatchNorm1d(16), nn.ReLU(),
                         shared, nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3)), shared


def test_a_layer_used_twice_is_measured_as_two_layers_with_its_weights():
    model, shared = _shared()
    x = torch.randn(16, 12, generator=torch.Generator().manual_seed(1))
    a = advise(model, x, draws=2, skip=("rank",))
    s = a.structure
    assert [l.name for l in s.layers] == ["0", "3", "3#2", "9"]
    want = 16 * float(shared.weight.detach().double().var(unbiased=False))
    assert s.layers[1].sigma_w2 == s.layers[2].sigma_w2 == want
    assert all(math.isfinite(l.sigma_w2) for l in s.layers)
    assert all(l.scale_invariant for l in s.layers[:-1])  # the shared weights feed BN both times
    assert a.batch_size.bnp_supported == 4 and not a.batch_size.bnp_unsupported
    for paper in (YANG, FISHER, DANESHMAND):
        row = next(r for r in s.assumptions if r.paper == paper and r.statement.startswith("every weight layer is used"))
        assert row.holds is False and "3" in row.detail
        assert s.theorem[paper] is False
    assert "is not allowed" not in a.to_text()
