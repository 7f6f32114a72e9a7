"""Batched ensemble training (bnlab.fisher.train_ensemble) against training each network on its own."""
import pytest
import torch

from bnlab.fisher import build_model, train_ensemble
from bnlab.fisher.ensemble import _batch_stat_copy


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 12, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return x[:150], y[:150], x[150:], y[150:]


def test_ensemble_equals_sequential_torch_sgd():
    # same minibatches, same init: each network of the ensemble follows torch.optim.SGD(momentum=0.9)
    # on its own up to float32 rounding of a vmapped vs a plain matmul (≈1e-6 relative per step, 40 steps)
    x, y, xt, yt = _data()
    configs = [dict(eta=0.05, gamma=0.5, seed=1), dict(eta=0.2, gamma=2.0, seed=2), dict(eta=1e4, gamma=1.0, seed=3)]
    res = train_ensemble("fc:12-16-16-3", configs, x, y, xt, yt, steps=40, batch_size=16, data_seed=5)
    for i, c in enumerate(configs[:2]):
        m = _batch_stat_copy(build_model("fc:12-16-16-3", gamma=c["gamma"], seed=c["seed"]))
        opt = torch.optim.SGD(m.parameters(), lr=c["eta"], momentum=0.9)
        gen = torch.Generator().manual_seed(5)
        for _ in range(40):
            idx = torch.randint(0, 150, (16,), generator=gen)
            loss = torch.nn.functional.cross_entropy(m(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            ref = float(torch.nn.functional.cross_entropy(m(xt), yt))
        assert res.test_loss[i] == pytest.approx(ref, rel=1e-4)
        assert res.exploded[i] is False
    assert res.exploded[2] is True and res.exploded_at[2] >= 0  # η = 1e4 explodes
    d = res.to_dict()
    assert d["steps"] == 40 and len(d["test_loss"]) == 3


def test_bad_input():
    x, y, xt, yt = _data()
    with pytest.raises(ValueError, match="configs"):
        train_ensemble("fc:12-4-3", [], x, y, xt, yt)
    with pytest.raises(ValueError, match="eta"):
        train_ensemble("fc:12-4-3", [dict(eta=-1.0)], x, y, xt, yt)
    with pytest.raises(ValueError, match="momentum"):
        train_ensemble("fc:12-4-3", [dict(eta=0.1)], x, y, xt, yt, momentum=1.0)
