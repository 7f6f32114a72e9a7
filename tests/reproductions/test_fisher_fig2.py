"""Fisher paper Fig. 2 reproduction: grid, the boundary definition, plot and comparison plumbing."""
import json

import pytest

from bnlab.experiments.spec import Record
from bnlab.reproductions import fisher_fig2 as fig2

E = fig2.EXPERIMENTS[0]


def test_grid():
    assert E.name == "fisher-fig2"
    for scale in ("small", "paper"):
        cells = E.grid(scale)
        json.dumps(cells)
        assert len(cells) >= 3 and all("seed" in c and len(c["etas"]) >= 13 for c in cells)
    assert len(E.grid("paper")) >= 10  # the paper scale keeps its 10 γ rows


def test_divergence_boundary_definition():
    etas = [0.01, 0.1, 1.0, 10.0]
    assert fig2.divergence_boundary(etas, [False, False, True, True]) == pytest.approx(10 ** -0.5)
    assert fig2.divergence_boundary(etas, [False] * 4) is None
    assert fig2.divergence_boundary(etas, [True] * 4) is None
    # a stray stable cell above an explosion: the boundary follows the largest stable η
    assert fig2.divergence_boundary(etas, [False, True, False, True]) == pytest.approx(10 ** 0.5)


def test_plot_and_compare_with_stand_in_records(tmp_path):
    recs = []
    for c in E.grid("small"):
        etas = c["etas"]
        b = 0.3 / c["gamma"] ** 2
        ex = [e > b for e in etas]
        recs.append(Record(c, dict(skipped=False, etas=etas, test_loss=[None if x else 0.3 for x in ex],
                                   exploded_any=ex, boundary=fig2.divergence_boundary(etas, ex),
                                   boundary_no_learning=fig2.divergence_boundary(etas, ex),
                                   eta_star_paper=b, eta_star_measured_eval=b, eta_star_measured_train=b * 3)))
    assert E.plot(recs, tmp_path)[0].exists()
    rows = {r.quantity: r for r in E.compare(recs)}
    assert rows["η* (as printed) / measured explosion boundary, per γ (within a factor 2?)"].agrees is True
    assert rows["η* (corrected, train) / measured explosion boundary, per γ (within a factor 2?)"].agrees is False


def test_settings_are_read_off_the_grid():
    rows = {s.what: s for s in E.settings}
    for scale in ("small", "paper"):
        cells = E.grid(scale)
        assert rows["network"].at(scale) == cells[0]["arch"]
        assert rows["steps (batch 64)"].at(scale) == str(cells[0]["steps"])
        assert rows["seeds per (γ, η)"].at(scale) == str(len(cells[0]["seeds"]))
        assert rows["η grid"].at(scale).startswith(f"{len(cells[0]['etas'])} log-spaced")
    assert rows["γ rows"].at("small") == ", ".join(f"{c['gamma']:g}" for c in E.grid("small"))
    assert rows["γ rows"].at("paper").startswith(f"{len(E.grid('paper'))} log-spaced")
