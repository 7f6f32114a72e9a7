"""advise-validation: the advice's verdicts against training, on networks with known outcomes.

Each cell trains real networks on MNIST (skipped without it), so the expensive depth cell (two BN-MLPs, 200
steps at small scale) is marked slow; the others run in the default suite and must agree row for row.
"""
import pytest

from bnlab.experiments.spec import Check, Record, Setting
from bnlab.reproductions.advise_validation import CASES, CELLS, EXPERIMENTS, _grid, run_cell

EXP = EXPERIMENTS[0]


def _small(cell):
    (params,) = [p for p in _grid("small") if p["cell"] == cell]
    return params


def _mnist_or_skip():
    from bnlab.data import DatasetNotFoundError, load_dataset

    try:
        load_dataset("mnist", "train")
    except (DatasetNotFoundError, OSError) as exc:
        pytest.skip(f"MNIST not available: {exc}")


@pytest.mark.parametrize("cell", ["learning-rate", "batch-1",
                                  "rank", pytest.param("depth", marks=pytest.mark.slow)])
def test_predicted_matches_observed(cell):
    _mnist_or_skip()
    rows = run_cell(_small(cell))["rows"]
    assert [r["case"] for r in rows] == list(CELLS[cell])
    for r in rows:
        assert r["agrees"], r
    # the pair differs: one row of each cell trains, the other fails (so an always-"trains" advice would fail here)
    assert sorted(r["observed_trains"] for r in rows) == [False, True]


def test_declaration_plot_and_compare(tmp_path):
    assert EXP.name == "advise-validation" and {p["cell"] for p in EXP.grid("small")} == set(CELLS)
    assert len(EXP.grid("paper")) == 3 * len(CELLS)
    assert all(isinstance(s, Setting) and s.small and s.paper_scale for s in EXP.settings)
    assert [c.name for c in EXP.checks] == list(CASES) and all(isinstance(c, Check) for c in EXP.checks)
    row = dict(case="lr-below", predicted_trains=True, prediction="stable", observed_trains=False,
               observation="diverged", agrees=False, history=[1.0, 2.0, float("nan")])
    recs = [Record({"cell": "learning-rate", "seed": 0}, {"rows": [row]}),
            Record({"cell": "depth", "seed": 0}, {"skipped": True, "skip_reason": "no MNIST"})]
    rows = EXP.compare(recs)
    assert len(rows) == 1 and rows[0].agrees is False and rows[0].quantity.startswith("lr-below")
    paths = EXP.plot(recs, tmp_path)
    assert paths and all(p.exists() for p in paths)
