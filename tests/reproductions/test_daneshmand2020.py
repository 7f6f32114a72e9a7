"""Daneshmand et al. 2020 reproductions (Figs. 2, 3a, 3b, Lemma 3): grids, fits, cells, plots, comparisons."""
from __future__ import annotations

import json

import numpy as np
import pytest

from bnlab.experiments.spec import Record
from bnlab.reproductions import daneshmand2020_fig2 as f2
from bnlab.reproductions import daneshmand2020_fig3 as f3
from bnlab.reproductions import daneshmand2020_lemma3 as l3

from bnlab.reproductions import daneshmand2020_fig1 as f1
from bnlab.reproductions import daneshmand2020_fig4 as f4
from bnlab.reproductions import daneshmand2020_fig5 as f5
from bnlab.reproductions import daneshmand2020_fig6 as f6
from bnlab.reproductions import daneshmand2020_fig89 as f89
from bnlab.reproductions import daneshmand2020_pretrain as pre

ALL = [f1.EXPERIMENTS[0], f2.EXPERIMENTS[0], f3.EXPERIMENTS[0], f3.EXPERIMENTS[1], l3.EXPERIMENTS[0],
       f5.EXPERIMENTS[0], f6.EXPERIMENTS[0], f4.EXPERIMENTS[0], *f89.EXPERIMENTS, *pre.EXPERIMENTS]


def test_every_rank_reproduction_declares_a_paper_scale():
    # issue 15: every Daneshmand reproduction has `small` and `paper` scales, and the paper grid is a
    # different (larger) sweep, not a copy of the small one
    from bnlab.experiments.registry import list_experiments

    found = {name: e for name, e in list_experiments().items() if name.startswith("daneshmand2020-")}
    assert set(found) == {e.name for e in ALL}
    for exp in found.values():
        small, paper = exp.grid("small"), exp.grid("paper")
        assert paper and paper != small, exp.name


@pytest.mark.parametrize("exp", ALL, ids=lambda e: e.name)
@pytest.mark.parametrize("scale", ["small", "paper"])
def test_grids_are_json_and_seeded(exp, scale):
    cells = exp.grid(scale)
    json.dumps(cells)
    assert cells and all("seed" in c for c in cells)
    with pytest.raises(ValueError, match="scale"):
        exp.grid("huge")


def test_fit_exponent_recovers_a_power_law():
    w = np.array([8, 16, 32, 64, 128])
    slope, lo, hi = f3.fit_exponent(w, 2.0 * w**0.5)
    assert slope == pytest.approx(0.5, abs=1e-12) and hi - lo < 1e-10
    noisy = 2.0 * w**0.5 * np.array([1.05, 0.97, 1.02, 0.96, 1.01])
    slope, lo, hi = f3.fit_exponent(w, noisy)
    assert lo < 0.5 < hi
    with pytest.raises(ValueError, match="widths"):
        f3.fit_exponent([8, 16], [1, 2])


def test_fig2_cells_small(tmp_path):
    recs = []
    for p in f2.EXPERIMENTS[0].grid("small"):
        p = dict(p, depth=120, chains=2)
        m = f2.run_cell(p)
        json.dumps(m)
        recs.append(Record(p, m))
    by = {(r.params["norm"], r.params["activation"]): r.metrics for r in recs}
    # depth 120 is enough for the linear vanilla chain to fall below BN's rank (seeded; BN ≈ 7, vanilla ≤ 3)
    assert by[("bn", "linear")]["final_soft_rank"] > by[("none", "linear")]["final_soft_rank"]
    lo, hi = by[("bn", "linear")]["soft_rank_ci"]
    assert all(a <= m + 1e-12 and m <= b + 1e-12 for a, m, b in zip(lo, by[("bn", "linear")]["soft_rank"], hi))
    assert all(p.exists() for p in f2.EXPERIMENTS[0].plot(recs, tmp_path))
    assert len(f2.EXPERIMENTS[0].compare(recs)) == 4


def test_fig3_cells(tmp_path):
    exp = f3.EXPERIMENTS[0]
    recs = [Record(p, exp.run_cell(p)) for p in
            [dict(width=w, batch_size=w, depth=200, measure_every=2, chains=2, residual_gamma="inf", seed=w)
             for w in (8, 16, 32)]]
    rows = exp.compare(recs)
    assert len(rows) == 1 and "exponent" in rows[0].quantity
    assert all(p.exists() for p in exp.plot(recs, tmp_path))
    exp_b = f3.EXPERIMENTS[1]
    recs_b = [Record(p, exp_b.run_cell(p)) for p in exp_b.grid("small")]
    rows_b = exp_b.compare(recs_b)
    # BN amplifies σ_2 of nearly collinear inputs (×138 measured at seed 31), vanilla does not (×2)
    assert all(r.agrees for r in rows_b), [r.bnlab for r in rows_b]
    assert all(p.exists() for p in exp_b.plot(recs_b, tmp_path))


def test_lemma3_cells(tmp_path):
    exp = l3.EXPERIMENTS[0]
    recs = [Record(dict(p, depth=400, chains=2), l3.run_cell(dict(p, depth=400, chains=2)))
            for p in exp.grid("small") if p["residual_gamma"] in (1.0, "inf")]
    for r in recs:
        json.dumps(r.metrics)
        # collapsed by depth 400 at γ ≥ 1 (σ_2/σ_1 ~ e^{−0.016 ℓ} for γ = ∞)
        assert r.metrics["final_soft_rank"] == 1.0
    assert all(p.exists() for p in exp.plot(recs, tmp_path))
    assert len(exp.compare(recs)) == len(recs)
    # a chain whose σ_2/σ_1 has not reached 1e-8 (γ = 0.1 at small scale) says so, not "from layer None"
    slow = Record(recs[0].params, dict(recs[0].metrics, collapse_layer=None))
    (row,) = exp.compare([slow])
    assert "None" not in row.bnlab and "not yet < 1e-8 at L = 400" in row.bnlab


@pytest.mark.slow
@pytest.mark.parametrize("exp", [e for e in ALL if e.name != "daneshmand2020-fig4"], ids=lambda e: e.name)
def test_small_scale_all_rows_agree(exp, tmp_path):
    # ~30–60 s each on a busy 2-core machine.  Measured: Fig. 2 BN rank_1/2 7.0 (linear), 11.3 (ReLU) at
    # L = 1000, vanilla 1; Fig. 3a exponents 0.615 [0.596, 0.635] (γ = 0.1), 0.649 [0.634, 0.665] (γ = ∞).
    recs = [Record(p, exp.run_cell(p)) for p in exp.grid("small")]
    exp.plot(recs, tmp_path)
    # "SGD preserves the initial rank" (Fig. 6's row, and pretrain-lr's "r(H_L) preserved by SGD") is
    # contradicted at this budget — the pre-trained nets' rank falls — and the claim ledger says so; every
    # other judged row must agree (agrees None: not judged, e.g. fig89's d = 8 ≤ 10, where Fig. 8 claims
    # nothing; those failed this test before, which read None as a disagreement)
    rows = [r for r in exp.compare(recs) if not r.quantity.startswith(("rank through training",
                                                                       "r(H_L) preserved by SGD"))]
    judged = [r for r in rows if r.agrees is not None]
    bad = [r for r in judged if not r.agrees]
    assert judged and not bad, [(r.quantity, r.bnlab) for r in bad]
    if exp.name == "daneshmand2020-fig3a":
        for r in rows:
            assert "CI" in r.bnlab


def test_fig6_cells_tiny(tmp_path):
    from bnlab.reproductions import daneshmand2020_fig6 as f6

    exp = f6.EXPERIMENTS[0]
    for scale in ("small", "paper"):
        json.dumps(exp.grid(scale))
    recs = []
    for kind in ("vanilla", "pretrain25", "bn", "bn_asym", "bn_nomean"):
        p = dict(kind=kind, depth=3, width=16, lr=0.01, batch_size=16, steps=8, n_train=300, n_eval=100,
                 n_test=100, seed=0, track_steps=[0, 1, 3, 8])
        m = f6.run_cell(p)
        if m.get("skipped"):
            pytest.skip(m["skip_reason"])
        json.dumps(m)
        assert 0 <= m["train_accuracy"] <= 1
        for key in ("r_through_training", "alignment_through_training", "accuracy_through_training"):
            assert [s for s, _ in m[key]] == [0, 1, 3, 8], key
        assert m["alignment_end"] == m["alignment_through_training"][-1][1]
        assert m["alignment_start"] == m["alignment_through_training"][0][1]
        recs.append(Record(p, m))
    assert "pretrain_final_r" in recs[1].metrics
    paths = exp.plot(recs, tmp_path)
    assert {p.name for p in paths} >= {"daneshmand2020_fig6.png", "daneshmand2020_fig10.png"}
    assert all(p.exists() for p in paths)
    rows = exp.compare(recs)
    assert len(rows) == 7  # … and "rank through training" (issue 23: SGD preserves the initial rank)
    # every row is explained by a declared check (its name starts the row's quantity)
    assert all(any(r.quantity.startswith(c.name) for c in exp.checks) for r in rows), [r.quantity for r in rows]


def test_fig6_tracking_does_not_change_training():
    # the Fig. 10 curve is measured between steps (forward passes, running statistics restored, no random
    # draws): the losses must be the same numbers with and without it (same process, same operations)
    p = dict(kind="bn", depth=3, width=16, lr=0.05, batch_size=16, steps=12, n_train=300, n_eval=100, n_test=100,
             seed=0)
    plain = f6.run_cell(p)
    if plain.get("skipped"):
        pytest.skip(plain["skip_reason"])
    tracked = f6.run_cell(dict(p, track_steps=list(range(13))))
    assert tracked["loss_curve"] == plain["loss_curve"] and tracked["train_accuracy"] == plain["train_accuracy"]
    assert len(tracked["alignment_through_training"]) == 13 and len(plain["alignment_through_training"]) == 4


def test_fig6_alignment_through_training_row_can_fail():
    exp = f6.EXPERIMENTS[0]

    def recs(vanilla, bn):
        out = []
        for kind, curve in (("vanilla", vanilla), ("bn", bn)):
            m = dict(train_accuracy=0.5, alignment_start=curve[0], r_init=1.0, r_start=1.0,
                     alignment_through_training=[[10 * i, v] for i, v in enumerate(curve)])
            out.append(Record(dict(kind=kind, seed=0), m))
        return out

    def row(rs):
        return next(r for r in exp.compare(rs) if r.quantity.startswith("gradient alignment through training"))

    assert row(recs([0.98, 1.0, 0.99], [0.3, 0.32, 0.31])).agrees is True
    # the vanilla net's gradients de-align at one of three points (a third of training): Fig. 10's claim fails
    assert row(recs([0.98, 0.5, 0.99], [0.3, 0.32, 0.31])).agrees is False
    # one late dip in ten points (seed 0 at small scale: 0.845 at step 400) leaves it aligned through training; three
    # do not (the share is 3/4)
    ten = [0.98, 1.0, 1.0, 1.0, 1.0, 1.0, 0.99, 1.0, 0.845, 0.99]
    r = row(recs(ten, [0.3] * 10))
    assert r.agrees is True and "above 0.9 at 9 of 10 tracked points (min 0.84)" in r.bnlab
    assert row(recs(ten[:7] + [0.8, 0.85, 0.7], [0.3] * 10)).agrees is False
    # BN's gradients align late in training
    assert row(recs([0.98, 1.0, 0.99], [0.3, 0.32, 0.8])).agrees is False
    # a point without a direction (None: every representation is 0) is left out, not counted as 0
    assert row(recs([0.98, None, 0.99], [0.3, 0.32, 0.31])).agrees is True


def test_fig6_build_mlp_structure():
    from torch import nn

    from bnlab.reproductions.daneshmand2020_fig6 import build_mlp

    m = build_mlp("bn", 32, 128, seed=0)
    linears = [x for x in m.modules() if isinstance(x, nn.Linear)]
    assert len(linears) == 33 and sum(isinstance(x, nn.BatchNorm1d) for x in m.modules()) == 32
    assert float(linears[0].bias.detach().abs().max()) == 0.0
    # the asymmetric init of "breaking BN": every weight in [0, 2/sqrt(fan_in)]
    w = [x for x in build_mlp("bn_asym", 2, 16, seed=0).modules() if isinstance(x, nn.Linear)][1].weight.detach()
    assert float(w.min()) >= 0.0 and float(w.max()) <= 2 / 16**0.5
    assert not any(isinstance(x, nn.BatchNorm1d) for x in build_mlp("vanilla", 2, 16, seed=0).modules())


def test_fig1_cells_tiny(tmp_path):
    exp = f1.EXPERIMENTS[0]
    recs = []
    for norm in ("bn", "none"):
        for depth in (1, 12):
            p = dict(depth=depth, width=32, norm=norm, lr=0.1, batch_size=32, n_train=400, n_eval=200, steps=5,
                     seed=0)
            m = f1.run_cell(p)
            if m.get("skipped"):
                pytest.skip(m["skip_reason"])
            json.dumps(m)
            recs.append(Record(p, m))
    by = {(r.params["norm"], r.params["depth"]): r.metrics for r in recs}
    # PyTorch's default init at depth 12, width 32, N = 32: without BN the last hidden layer has collapsed
    # (measured: r(H) = 1.00, rank_1/2 = 1, float32 numerical rank 7 — the tail sits just above the
    # float32 tolerance), with BN it has not (r = 4.85, rank_1/2 = 10, numerical rank 32)
    assert by[("none", 12)]["r_init"] < 1.05 and by[("none", 12)]["soft_rank_init"] == 1
    assert by[("bn", 12)]["soft_rank_init"] >= 4 and by[("bn", 12)]["rank_init"] > by[("none", 12)]["rank_init"]
    assert all(p.exists() for p in exp.plot(recs, tmp_path))
    assert len(exp.compare(recs)) == 2


def test_fig4_compare_and_plot_on_synthetic_records(tmp_path):
    exp = f4.EXPERIMENTS[0]

    def rec(kind, depth, final):
        curve = [[i, 2.3 + (final - 2.3) * i / 9] for i in range(10)]
        return Record(dict(kind=kind, depth=depth, seed=0), dict(loss_curve=curve))

    recs = [rec("vanilla", 32, 2.30), rec("pretrain25", 32, 1.6), rec("bn", 32, 1.0),
            rec("vanilla", 8, 0.9), rec("pretrain25", 8, 0.8)]
    rows = exp.compare(recs)
    # depth 8: vanilla not stuck, not judged (with its reason); depth 32; the slow-down with depth (pre-trained
    # 1.6 − 0.8 against vanilla 2.3 − 0.9); pre-trained 1.6 against BN 1.0 at depth 32 does not beat BN
    assert [r.agrees for r in rows] == [None, True, True, False]
    assert "not stuck" in rows[0].reason
    assert "vanilla 2.300" in rows[1].bnlab
    recs.append(rec("pretrain25", 16, 2.29))
    recs.append(rec("vanilla", 16, 2.30))
    assert exp.compare(recs)[1].agrees is False
    assert all(p.exists() for p in exp.plot(recs, tmp_path))


@pytest.mark.slow
def test_fig4_small_scale_agrees_at_depth_32(tmp_path):
    """At the small budget (500 SGD steps, seed 0) pre-training rescues the stuck depth-32 net (loss 1.34 vs
    2.30); at depth 16 neither trains (2.27 vs 2.28, a documented disagreement with Fig. 4/12 at this
    budget, docs/rank.md) and at depth 8 vanilla is not stuck (no sharp test)."""
    exp = f4.EXPERIMENTS[0]
    recs = [Record(p, exp.run_cell(p)) for p in exp.grid("small")]
    rows = {r.quantity.split(":")[0]: r for r in exp.compare(recs)}
    assert rows["depth 32"].agrees is True
    assert rows["depth 8"].agrees is None


def test_fig6_settings_are_read_off_the_grid():
    exp = f6.EXPERIMENTS[0]
    rows = {s.what: s for s in exp.settings}
    for scale in ("small", "paper"):
        cells = exp.grid(scale)
        assert rows["seeds"].at(scale) == str(len({c["seed"] for c in cells}))
        assert rows["training images"].at(scale) == str(cells[0]["n_train"])
        assert rows["SGD steps (batch 64, lr 0.01)"].at(scale) == str(cells[0]["steps"])
        track = rows["steps with r(H_L), alignment, accuracy (Figs. 6, 10)"].at(scale)
        assert track == ", ".join(map(str, cells[0]["track_steps"])) and cells[0]["track_steps"][-1] == cells[0]["steps"]
