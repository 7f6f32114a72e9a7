"""Yang et al. 2019 Fig. 2 reproduction: circle minibatches, cross-batch decay rate, plots, comparisons."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy import special

from bnlab.reproductions import yang2019_fig2 as fig2
from bnlab.experiments.spec import Record

EXP = fig2.EXPERIMENTS[0]


def test_paper_rate_formula_equals_beta_form():
    # Thm 3.11 with P(a, x) = Γ(a+x)/Γ(a) equals (B−1)·Beta(B/2, 1/2)²/(2π) (Eq. 24 with a_1 only)
    for b in (5, 8, 64, 1000):
        beta_form = (b - 1) * special.beta(b / 2, 0.5) ** 2 / (2 * math.pi)
        assert fig2.paper_cross_batch_rate_identity(b) == pytest.approx(beta_form, rel=1e-12)
    assert fig2.paper_cross_batch_rate_identity(64) < 1


def test_circle_minibatches_differ_in_one_point():
    x = fig2.circle_minibatches(64, seed=1)
    assert x.shape == (2, 64, 2)
    diff = np.abs(x[0] - x[1]).sum(1)
    assert np.count_nonzero(diff) == 1 and np.argmax(diff) == 32  # θ = π, the leftmost point


@pytest.mark.parametrize("scale", ["small", "paper"])
def test_grid(scale):
    cells = EXP.grid(scale)
    json.dumps(cells)
    assert {c["kind"] for c in cells} == {"circle", "gaussian"} and all(c["batch_size"] == 64 for c in cells)


def test_cells_plot_compare(tmp_path):
    circle = dict(kind="circle", batch_size=64, width=48, depth=30, networks=2, seed=0)
    gauss = dict(kind="gaussian", batch_size=16, width=256, depth=30, networks=6, input_correlation=0.3,
                 num_batches=4, seed=1)
    mc = fig2.run_cell(circle)
    # nearly identical batches: correlation ≈ 1 at layer 1 (one point of 64 moved by ~0.05)
    assert mc["corr_mean"][0] > 0.99
    assert mc["corr_mean"][-1] < 0.5
    assert set(mc["pca"]) == {str(l) for l in mc["pca_layers"]}
    mg = fig2.run_cell(gauss)
    theory = fig2.paper_cross_batch_rate_identity(16)
    # B = 16: λ_M̃ = 0.968; finite width bias of 1−λ ≈ B/N relative ≈ 6 %, CI ~ ±1 %: 5 % on λ is generous,
    # so check 1 − λ to 25 %
    assert abs((1 - mg["rate"]) / (1 - theory) - 1) < 0.25, (mg["rate"], theory)
    recs = [Record(circle, mc), Record(gauss, mg)]
    json.dumps([r.metrics for r in recs])
    paths = EXP.plot(recs, tmp_path)
    assert len(paths) == 4 and all(p.stat().st_size > 1000 for p in paths)
    rows = EXP.compare(recs)
    # the circle row agrees; the decay row is judged against its CI (the ≈ 6 % finite-width bias at
    # B/N = 1/16 may or may not fit the CI of 6 networks, so only that it is judged is asserted)
    assert len(rows) == 2 and rows[0].agrees is True and rows[1].agrees is not None


def test_decay_check_fails_when_the_ci_excludes_the_theory():
    # The small-scale measurement of issue #17: rate 0.99325 [0.99263, 0.99385] against 0.99210.
    # On λ it is 0.1 % off (a 5 % window on λ passed it); on the decay 1 − λ it is 15 % off and the
    # decay's CI [0.00615, 0.00737] excludes the theory's 0.00790: the check must fail.
    c = fig2.decay_check(0.99325, [0.99263, 0.99385], 0.99210)
    assert c["agrees"] is False and c["rel_diff"] == pytest.approx(-0.146, abs=0.002)
    assert c["ci"] == pytest.approx((0.00615, 0.00737))
    row = EXP.compare([Record(dict(kind="gaussian", batch_size=64, width=512, networks=8),
                              dict(rate=0.99325, rate_ci=[0.99263, 0.99385], paper_rate=0.99210, theory_rate=0.99210,
                                   theory_source="test", fit_layers=[3, 40]))])[0]
    assert row.agrees is False and "−15 %" in row.bnlab.replace("-", "−")
    # a CI that holds the theory's decay passes
    assert fig2.decay_check(0.99200, [0.99150, 0.99250], 0.99210)["agrees"] is True


@pytest.mark.slow
def test_small_scale_rows(tmp_path):
    from tests.reproductions._small import small_scale_rows

    rows = small_scale_rows(EXP, tmp_path)
    # the decay check is expected to fail at width 512 (see the experiment's `limitations`)
    assert rows and rows[0].agrees is True and all(r.agrees is not None for r in rows), rows
