"""yang2019-fig5c-sigma4 and the scale identity behind it: BN(σh; ε) = BN(h; ε/σ²)."""
import math

import numpy as np
import pytest
import torch

from bnlab.experiments.registry import get_experiment
from bnlab.experiments.spec import Record

EXP = get_experiment("yang2019-fig5c-sigma4")


def test_bn_networks_depend_on_eps_over_sigma_w2_only():
    """The identity the explanation rests on, on finite networks: a BN-MLP (Yang Eq. 7, tanh) with weight
    variance σ_w² and BN constant ε has the hidden BN outputs of the same network (same seed) at σ_w² = 1
    and ε/σ_w² — exactly (float64, 1e-12: the logits differ only by the readout's own scale σ_w) — and ``bnlab.sim.simulate``'s per-layer q(1 − c)/σ_w² and gradient
    norms at (σ_w², ε) equal those at (1, ε/σ_w²) to 1e-6 relative.  Measured (width 128, depth 30, 16 nets,
    B = 32, tanh): per-layer decay of q(1 − c) over layers 10–29 is 1.000, 0.999, 0.941, 0.334 at
    ε/σ_w² = 0.1, 0.3, 1, 3, identically at σ_w² = 0.25, 1, 4 — the collapse is set by ε/σ_w², i.e. it starts at
    ε = σ_w², as the explanation says.  Perturbation, asserted: at the same ε (not the same ratio) the two
    variances give different q(1 − c)/σ_w² (by > 10 %).
    """
    from bnlab.nets import BNMLP
    from bnlab.sim import simulate

    x = torch.randn(32, 20, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    outs = {}
    for s2, eps in ((4.0, 0.8), (1.0, 0.2)):
        m = BNMLP(20, 10, depth=6, width=32, phi="tanh", eps=eps, sigma_w2=s2, seed=3, dtype=torch.float64)
        with torch.no_grad():
            outs[s2] = (m(x),)
    # logits differ by the readout's scale σ_w only (its input, the last BN+φ output, is identical)
    torch.testing.assert_close(outs[4.0][0], 2.0 * outs[1.0][0], rtol=1e-12, atol=1e-12)
    a = simulate("tanh", 32, 64, 12, 8, eps=4.0 * 0.5, sigma_w2=4.0, seed=1, dtype="float64")
    b = simulate("tanh", 32, 64, 12, 8, eps=0.5, sigma_w2=1.0, seed=1, dtype="float64")
    np.testing.assert_allclose(a.q * (1 - a.c) / 4.0, b.q * (1 - b.c), rtol=1e-6)
    np.testing.assert_allclose(a.grad_norm_sq[:, :-1] / a.grad_norm_sq[:, -1:], b.grad_norm_sq[:, :-1] / b.grad_norm_sq[:, -1:],
                               rtol=1e-6)
    c = simulate("tanh", 32, 64, 12, 8, eps=0.5, sigma_w2=4.0, seed=1, dtype="float64")
    assert np.abs(c.q * (1 - c.c) / 4.0 / (b.q * (1 - b.c)) - 1).max() > 0.1


def test_grid_and_declarations():
    small = EXP.grid("small")
    assert all(c["sigma_w2"] == 4.0 for c in small) and sorted({c["eps"] for c in small}) == [1e-3, 1.0, 4.0]
    assert {c["sigma_w2"] for c in EXP.grid("paper")} == {0.25, 4.0}
    assert EXP.settings and EXP.checks and EXP.limitations


def _records(acc_by_eps: dict[float, list[float]], depths=(5, 10, 20, 40, 60)):
    recs = []
    for eps, accs in acc_by_eps.items():
        nets = [dict(depth=d, seed=0, test_accuracy=a, diverged=False, skipped=False, chance=0.1)
                for d, a in zip(depths, accs)]
        recs.append(Record(dict(dataset="mnist", phi="tanh", eps=eps, sigma_w2=4.0, depths=list(depths), seeds=[0],
                                width=128, bn_batch=32, batch_size=32, lr=0.096, steps=150, n_train=10_000,
                                n_test=2_000), {"networks": nets, "skipped": False}))
    return recs


def test_worst_column_check_passes_and_fails():
    good = _records({1e-3: [0.9, 0.9, 0.8, 0.5, 0.3], 0.1: [0.9, 0.9, 0.8, 0.6, 0.4],
                     1.0: [0.9, 0.9, 0.85, 0.6, 0.4], 4.0: [0.9, 0.7, 0.3, 0.1, 0.1]})
    rows = {r.quantity: r.agrees for r in EXP.compare(good)}
    assert rows["worst ε column at σ_w² = 4 (mean accuracy, depths > 10)"] is True
    assert rows["ε = 1 at σ_w² = 4 trains like the small ε columns"] is True
    bad = _records({1e-3: [0.9, 0.9, 0.8, 0.5, 0.3], 0.1: [0.9, 0.9, 0.8, 0.6, 0.4],
                    1.0: [0.9, 0.7, 0.2, 0.1, 0.1], 4.0: [0.9, 0.8, 0.5, 0.3, 0.2]})
    rows = {r.quantity: r.agrees for r in EXP.compare(bad)}
    assert rows["worst ε column at σ_w² = 4 (mean accuracy, depths > 10)"] is False
    assert rows["ε = 1 at σ_w² = 4 trains like the small ε columns"] is False
