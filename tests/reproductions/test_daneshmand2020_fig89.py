"""daneshmand2020-fig89 (Figs. 8–9): grid, a tiny cell, and its checks on synthetic records that pass and fail."""
import math

import pytest

from bnlab.experiments.registry import get_experiment
from bnlab.experiments.spec import Record

EXP = get_experiment("daneshmand2020-fig89")


def test_grid_settings_and_checks_are_declared():
    small, paper = EXP.grid("small"), EXP.grid("paper")
    assert {c["width"] for c in small} == {8, 16, 32, 64}
    assert {c["depth"] for c in paper} == {100_000}  # L = 10⁵ as the captions state
    assert small != paper
    assert EXP.settings and EXP.checks and EXP.limitations
    names = [c.name for c in EXP.checks]
    rows = EXP.compare(_records({8: 0.91, 16: 0.885, 32: 0.862}))
    for row in rows:
        assert any(row.quantity.startswith(n) for n in names), row.quantity
    with pytest.raises(ValueError, match="scale"):
        EXP.grid("huge")


def test_run_cell_tiny():
    m = EXP.run_cell(dict(width=6, residual_gamma=1.0, depth=60, burn_in=10, seed=1))
    assert 0 < m["alpha"] < 1 and m["means"]["frobenius2"] > 0
    assert m["lemma13_bound"] == pytest.approx(6**1.5 / math.sqrt(1 - m["alpha"]))


def _records(alpha_by_d, frob_exponent=1.43, se=0.001):
    recs = []
    for d, a in alpha_by_d.items():
        f = 0.7 * d**frob_exponent
        bound = d**1.5 / math.sqrt(1 - a) if a < 1 else math.inf
        recs.append(Record(dict(width=d, residual_gamma=1.0, depth=2000, burn_in=100, seed=0),
                           dict(alpha=a, alpha_stderr=se, means={"frobenius2": f}, stderr={"frobenius2": 0.01 * f},
                                lemma13_bound=bound)))
    return recs


def test_checks_pass_on_the_papers_picture_and_fail_on_a_contradiction():
    good = {r.quantity: r.agrees for r in EXP.compare(_records({8: 0.91, 16: 0.885, 32: 0.862, 64: 0.846}))}
    assert good["α below 0.9 for d > 10, γ = 1, d = 8 (L = 2000)"] is None  # no claim at d ≤ 10
    assert all(v for k, v in good.items() if v is not None)
    bad = {r.quantity: r.agrees for r in EXP.compare(_records({8: 0.91, 16: 0.92, 32: 0.93, 64: 0.95},
                                                              frob_exponent=1.9))}
    assert bad["α below 0.9 for d > 10, γ = 1, d = 16 (L = 2000)"] is False
    assert bad["α decreases with d, γ = 1"] is False
    assert bad["exponent of E‖M‖²_F in d, γ = 1 (d = 8…64)"] is False
