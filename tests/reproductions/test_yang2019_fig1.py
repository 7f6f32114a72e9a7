"""Yang et al. 2019 Fig. 1 reproductions: grids, cells (called directly), plots and comparisons."""
from __future__ import annotations

import json
import math

import pytest

from bnlab.reproductions import yang2019_fig1 as fig1
from bnlab.experiments.spec import Record

EXPS = {e.name: e for e in fig1.EXPERIMENTS}


def _relu_rate(b):
    """Thm 3.10 (Eq. 19), written out here independently of bnlab.theory."""
    c = -1.0 / (b - 1)
    j1 = (math.sqrt(1 - c * c) + (math.pi - math.acos(c)) * c) / math.pi
    j1p = (math.pi - math.acos(c)) / math.pi
    return ((b - 1 + j1p) / (1 - j1) - 1) / (b - 3)


@pytest.mark.parametrize("scale", ["small", "paper"])
@pytest.mark.parametrize("name", sorted(EXPS))
def test_grids_json_seeded_and_paper_sizes(name, scale):
    cells = EXPS[name].grid(scale)
    assert cells and all("seed" in c for c in cells)
    json.dumps(cells)
    assert len({json.dumps(c, sort_keys=True) for c in cells}) == len(cells)
    if scale == "paper" and name == "yang2019-fig1ab":
        assert all(c["width"] == 1000 and c["networks"] == 200 for c in cells)  # the caption's sizes


def test_bad_scale():
    with pytest.raises(ValueError, match="scale"):
        EXPS["yang2019-fig1ab"].grid("huge")


def test_gradient_cells_plot_and_compare(tmp_path):
    # Tiny cells (width 96, 12 networks): CI half-width ≈ 2-3 %, finite-width bias ≈ 2/96 ≈ 2 %;
    # the compare criterion (theory in CI or within 3 %) is checked against the closed form.
    recs = []
    for b in (8, 16):
        p = dict(phi="relu", batch_size=b, width=96, depth=16, networks=12, seed=b)
        m = fig1.run_gradient_cell(p)
        json.dumps(m)
        assert m["theory_grad_rate"] == pytest.approx(_relu_rate(b), rel=1e-9)
        lo, hi = m["grad_rate_ci"]
        assert lo <= m["grad_rate"] <= hi
        assert abs(m["grad_rate"] - _relu_rate(b)) <= (hi - lo) + 4.0 / 96
        assert len(m["grad_norm_sq_mean"]) == 16
        recs.append(Record(p, m))
    paths = EXPS["yang2019-fig1ab"].plot(recs, tmp_path)
    assert {p.suffix for p in paths} == {".png", ".svg"} and all(p.stat().st_size > 1000 for p in paths)
    rows = EXPS["yang2019-fig1ab"].compare(recs)
    assert len(rows) == 2 and all(r.agrees for r in rows)


def test_alpha_cells_show_the_transition(tmp_path):
    # B = 8: theory α_transition ≈ 1.62.  relu (α = 1) is BSB1: the normalized variance of the
    # diagonal of Σ^L is O(sqrt(2/N)) ≈ 0.1; α = 2.6 is BSB2, a dominant block gives O(1).
    recs = []
    for i, a in enumerate((1.0, 2.6)):
        p = dict(phi="alpha_relu", alpha=a, batch_size=8, width=64, depth=16, networks=4, seed=i)
        recs.append(Record(p, fig1.run_alpha_cell(p)))
    lo, hi = recs[0].metrics, recs[1].metrics
    assert hi["diag_var"] > 10 * lo["diag_var"]
    assert len(lo["example_covariance"]) == 8
    if lo["theory_alpha_transition"] is not None:
        assert 1.0 < lo["theory_alpha_transition"] < 2.6
    assert fig1.estimated_transition(recs) == pytest.approx(1.8)
    paths = EXPS["yang2019-fig1cd"].plot(recs, tmp_path)
    assert all(p.exists() for p in paths)
    rows = EXPS["yang2019-fig1cd"].compare(recs)
    # two grid points give one step and no control step: the jump check says it cannot judge
    assert len(rows) == 2 and all(r.agrees is None and "not testable" in r.bnlab for r in rows)


_ALPHAS = [1.0, 1.3, 1.5, 1.8, 2.2, 2.6]  # the small grid; α_transition(8) ≈ 1.62 lies in the step 1.5–1.8


def _alpha_records(diag, offdiag, at=1.619):
    return [Record(dict(alpha=a), dict(diag_var=d, offdiag_var=o, theory_alpha_transition=at))
            for a, d, o in zip(_ALPHAS, diag, offdiag)]


def test_jump_check_fails_for_a_gradual_rise_and_a_flat_curve():
    # The small-scale measurement itself (a gradual rise and a flat off-diagonal curve): must fail.
    recs = _alpha_records([0.08, 0.22, 0.35, 1.3, 1.9, 2.5], [0.011, 0.011, 0.012, 0.013, 0.011, 0.006])
    rows = EXPS["yang2019-fig1cd"].compare(recs)
    assert [r.agrees for r in rows] == [False, False]
    # A pure exponential in α has the same log-slope on every step: never a jump, however steep.
    steep = [math.exp(8 * a) for a in _ALPHAS]
    assert fig1.jump_at_transition(_ALPHAS, steep, 1.619)["jump"] is False


def test_jump_check_passes_a_step_at_the_transition_and_not_elsewhere():
    step = [0.01, 0.011, 0.012, 1.3, 1.4, 1.5]
    rows = EXPS["yang2019-fig1cd"].compare(_alpha_records(step, [0.01, 0.01, 0.011, 0.5, 0.55, 0.6]))
    assert [r.agrees for r in rows] == [True, True]
    # the same step one grid interval too late (at 1.8–2.2) is not a jump *at* α_transition
    late = [0.01, 0.011, 0.012, 0.013, 1.4, 1.5]
    assert fig1.jump_at_transition(_ALPHAS, late, 1.619)["jump"] is False
    assert fig1.jump_at_transition(_ALPHAS, step, None) is None
    assert fig1.jump_at_transition(_ALPHAS, step, 3.0) is None  # outside the grid


@pytest.mark.slow
def test_small_scale_rows(tmp_path):
    # Fig. 1a,b agrees at the small scale; Fig. 1c,d's jump check is expected to fail there (see
    # its `limitations`), so only that it judges is asserted.
    from tests.reproductions._small import small_scale_rows

    for e in EXPS.values():
        rows = small_scale_rows(e, tmp_path)
        if e.name == "yang2019-fig1ab":
            assert rows and all(r.agrees is not False for r in rows), rows
        else:
            assert rows and all(r.agrees is not None for r in rows), rows
