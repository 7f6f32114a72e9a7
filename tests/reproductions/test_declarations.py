"""Every reproduction states its scale and its checks as data, so no report section lacks them."""
import pytest

from bnlab.experiments.registry import discovery_errors, list_experiments
from bnlab.experiments.spec import SCALES, Check, Setting
from bnlab.reproductions.trainability import expand_cells

EXPS = {n: e for n, e in list_experiments().items() if n.startswith("yang2019-")}


def test_every_reproduction_module_imports():
    assert not {m: e for m, e in discovery_errors().items() if "reproductions" in m}
    assert len(EXPS) == 15  # yang2019-fig5c-sigma4 (issue 23 item 6) is the 15th


@pytest.mark.parametrize("name", sorted(EXPS))
def test_scale_table_and_checks_are_declared(name):
    e = EXPS[name]
    assert e.settings and all(isinstance(s, Setting) for s in e.settings)
    for s in e.settings:
        assert s.what and s.paper and s.small and s.paper_scale, s
        assert s.at("small") == s.small and s.at("paper") == s.paper_scale
        assert s.at("medium") == (s.small if s.medium is None else s.medium)
    assert e.checks and all(isinstance(c, Check) and c.name and c.meaning for c in e.checks)
    assert set(SCALES) == {"small", "medium", "paper"}


@pytest.mark.parametrize("name", sorted(EXPS))
def test_scale_tables_of_trainability_grids_are_read_off_the_grid(name):
    # Figs. 3–5: the depths in the table are the grid's depths (describe_grid), so they cannot drift
    e = EXPS[name]
    row = next((s for s in e.settings if s.what in ("depth grid", "depths")), None)
    if row is None or not name[len("yang2019-"):].startswith(("fig3", "fig4", "fig5")):
        pytest.skip("no depth grid in this reproduction's table")
    for scale in SCALES:
        # small-scale grids of Figs. 3, 5 hold one ensemble cell per column (depths × seeds)
        depths = sorted({c["depth"] for c in expand_cells(e.grid(scale))})
        assert row.at(scale) == ", ".join(map(str, depths))
