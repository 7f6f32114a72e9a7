"""``build_report`` with a cluster runs the next reproductions' sweeps while a section is plotted and judged
(``report._sections``): the page must be the one the serial route writes, every cell must run once — a failed
one too, although the default ``retry_failed`` would run it again — and the sections stay in order.

How often each cell ran is counted from the marker files the test experiments write per execution
(tests/experiments/_helpers.py), independently of the stores."""
from __future__ import annotations

from collections import Counter

import pytest

from bnlab.experiments.report import build_report


def _starts(markers) -> Counter:
    return Counter(int(p.name.split("-")[1]) for p in markers.glob("start-*"))


def _page(report):
    return [(s.name, s.verdict, s.done, s.failed, [(c["quantity"], c["bnlab"], c["agrees"]) for c in s.comparisons])
            for s in report.sections]


@pytest.fixture
def three(helpers):
    third = helpers._experiment("bnlab-test-third", figure="Fig. 3")
    return [helpers.SWEEP, helpers.PLOT_FAILS, third]


def test_pipelined_sections_equal_serial_and_run_each_cell_once(tmp_path, test_env, monkeypatch, three):
    from distributed import Client, LocalCluster

    monkeypatch.setenv("BNLAB_TEST_FAIL", "2")  # cell 2 of every experiment raises
    serial = build_report(tmp_path / "serial", experiments=three, results_dir=tmp_path / "rs", serial=True,
                          progress=False)
    for p in test_env.glob("*"):
        p.unlink()
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        piped = build_report(tmp_path / "piped", experiments=three, results_dir=tmp_path / "rp", client=client,
                             progress=False)
    assert [s.name for s in piped.sections] == [e.name for e in three]
    assert _page(piped) == _page(serial)
    assert [s.verdict for s in piped.sections] == ["partly", "partly", "partly"]  # cell 2 failed; plot failed
    # every cell of the three sweeps ran exactly once (the failed cell 2 too: not again by its section)
    assert _starts(test_env) == Counter({i: 3 for i in range(6)})
    assert all(s.reused == 0 for s in piped.sections)


def test_pipelined_report_reuses_a_finished_run(tmp_path, test_env, three):
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        first = build_report(tmp_path / "a", experiments=three, results_dir=tmp_path / "r", client=client,
                             progress=False)
        again = build_report(tmp_path / "b", experiments=three, results_dir=tmp_path / "r", client=client,
                             progress=False)
    assert _starts(test_env) == Counter({i: 3 for i in range(6)})  # nothing ran twice
    assert _page(again) == _page(first)
    assert [s.reused for s in again.sections] == [6, 6, 6]
