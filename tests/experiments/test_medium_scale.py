"""The ``medium`` scale: the small grids plus the restarts and investigations that do not fit the report's budget."""
from __future__ import annotations

import pytest

from bnlab.experiments import SCALES, Experiment, list_experiments
from bnlab.experiments.spec import Setting
from bnlab.experiments.store import cell_key


def _toy(grid, **kw) -> Experiment:
    return Experiment(name="toy", paper="p", figure="f", title="t", claim="c", grid=grid,
                      run_cell=lambda p: {}, plot=lambda r, o: [], **kw)


def test_scales_are_declared_in_order():
    assert SCALES == ("small", "medium", "paper")


def test_a_grid_without_a_medium_grid_runs_its_small_grid_at_medium():
    # a grid written for small and paper only reads anything but "small" as paper: without the
    # engine's mapping the medium scale would silently run the paper grid
    def grid(scale):
        return [{"n": 1, "seed": 0}] if scale == "small" else [{"n": 1000, "seed": 0}]

    exp = _toy(grid)
    assert exp.grid("medium") == exp.grid("small") == [{"n": 1, "seed": 0}]
    assert exp.grid("paper") == [{"n": 1000, "seed": 0}]


def test_a_declared_medium_grid_is_called_with_medium():
    seen = []

    def grid(scale):
        seen.append(scale)
        return [{"seed": s} for s in ([0, 1, 2] if scale == "medium" else [0])]

    exp = _toy(grid, medium_grid=True)
    assert len(exp.grid("medium")) == 3 and len(exp.grid("small")) == 1
    assert seen == ["medium", "small"]


def test_setting_at_medium_falls_back_to_small():
    s = Setting("seeds", "5", "1", "5")
    assert (s.at("small"), s.at("medium"), s.at("paper")) == ("1", "1", "5")
    s = Setting("seeds", "5", "1", "5", medium="3")
    assert (s.at("small"), s.at("medium"), s.at("paper")) == ("1", "3", "5")


@pytest.mark.parametrize("name", ["daneshmand2020-fig1", "daneshmand2020-fig5", "lange-fig5"])
def test_medium_restarts_contain_every_small_cell(name):
    # medium adds restarts: the small cells (and so the small run's rows) are all part of it
    exp = list_experiments()[name]
    small = {cell_key(p) for p in exp.grid("small")}
    medium = {cell_key(p) for p in exp.grid("medium")}
    assert small < medium
    seeds = {p["seed"] for p in exp.grid("medium")}
    assert len(seeds) == 3, seeds
    assert {p["seed"] for p in exp.grid("small")} == {0}


def test_lange_fc_keeps_its_restarts_at_small_scale():
    # its batch-6 interval rows disagree; without the restarts they would go unjudged and the verdict
    # would read "reproduced" because the disagreeing rows were dropped
    exp = list_experiments()["lange-fc"]
    small = exp.grid("small")
    assert {p["seed"] for p in small if p["batch_size"] == 6 and p["norm"] in ("bn", "bnp")} == {0, 1, 2}
    # medium adds only the methods drawn in the figure but in no row (LayerNorm)
    medium = exp.grid("medium")
    assert [p for p in medium if p["norm"] != "ln"] == small and {p["norm"] for p in medium} - {p["norm"] for p in small} == {"ln"}


def test_fig3a_medium_has_two_restarts_per_cell_and_small_one():
    exp = list_experiments()["yang2019-fig3a"]
    assert all(c["seeds"] == [0] for c in exp.grid("small"))
    assert all(c["seeds"] == [0, 1] for c in exp.grid("medium"))
    restarts = next(s for s in exp.settings if s.what == "restarts per cell")
    assert (restarts.at("small"), restarts.at("medium")) == ("1", "2")


def test_fig5d_medium_runs_the_papers_beta_past_twice_16xi():
    from bnlab.reproductions.trainability import theory_max_depth

    exp = list_experiments()["yang2019-fig5d"]
    small, medium = exp.grid("small"), exp.grid("medium")
    assert {c["beta"] for c in small} == {0.5} and {c["beta"] for c in medium} == {2.0}
    for c in medium:
        t = theory_max_depth("relu", c["bn_batch"], c["eps"], c["gamma"], c["beta"])
        # the grid can contradict the claim: a depth at most 16ξ/2 that must train and, where 16ξ is
        # finite, one beyond the window's 1.6·16ξ (the boundary check), and for ε ≤ 0.01 one at least
        # 2·16ξ that must fail (the "deeper than 2·16ξ fails" check)
        assert min(c["depths"]) <= t / 2
        if t != float("inf"):
            assert max(c["depths"]) >= 1.6 * t, (c["eps"], t)
            if c["eps"] <= 0.01:
                assert max(c["depths"]) >= 2 * t, (c["eps"], t)


def test_every_registered_grid_answers_medium():
    for name, exp in list_experiments().items():
        cells = exp.grid("medium")
        assert isinstance(cells, list) and cells, name


def test_cli_scale_choices_include_medium(capsys):
    from bnlab.cli import main

    with pytest.raises(SystemExit):
        main(["report", "--scale", "huge"])
    err = capsys.readouterr().err
    assert "medium" in err and "huge" in err


def test_the_cli_reads_the_scales_without_importing_the_engine():
    # the scale choices come from bnlab._vocabulary: building the parser must not import bnlab.experiments
    # (with it, Dask's distributed was imported before the command started, and `bnlab sweep run` no longer
    # exited on Ctrl-C: tests/experiments/test_sweep_dask.py timed out)
    import subprocess
    import sys

    code = ("import sys, bnlab.cli; bnlab.cli.build_parser(); "
            "print(sorted(m for m in sys.modules if m.startswith(('bnlab.experiments', 'distributed'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
