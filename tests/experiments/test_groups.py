"""Cells trained together (Experiment.group / run_group): one task per group, one stored result per cell.

The test experiment (``_helpers.GROUPED``) groups cells i ≡ r (mod 3) at ``paper`` scale; its
``run_group`` runs every member through ``run_cell`` and leaves a ``group-<first i>`` marker per
execution, so the tests count how often each group ran independently of what the store says.
"""
from __future__ import annotations

import pytest

from bnlab.experiments import ResultsStore, cell_key, run_sweep
from bnlab.experiments.spec import Experiment, cell_tasks

from ._helpers import markers


def _rows(path):
    with ResultsStore(path, readonly=True) as st:
        return {r.params["i"]: r for r in st.cells()}


def test_cell_tasks_group_by_name_in_first_seen_order(helpers):
    cells = helpers.grid("paper")  # 12 cells
    assert cell_tasks(helpers.GROUPED, cells, "paper") == [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8, 11]]
    assert cell_tasks(helpers.GROUPED, cells, "small") == [[i] for i in range(12)]
    assert cell_tasks(helpers.SWEEP, cells, "paper") == [[i] for i in range(12)]


def test_group_and_run_group_come_together(helpers):
    with pytest.raises(ValueError, match="both group and run_group"):
        Experiment(name="x", paper="p", figure="f", title="t", claim="c", grid=helpers.grid,
                   run_cell=helpers.run_cell, plot=helpers.plot, group=helpers.group_of)


def test_a_grouped_sweep_stores_every_cell_once_and_runs_each_group_once(tmp_path, test_env, helpers):
    s = run_sweep(helpers.GROUPED, "paper", results_dir=tmp_path, serial=True, progress=False)
    assert (s.total, s.done, s.executed, s.failed) == (12, 12, 12, 0)
    rows = _rows(s.store)
    assert sorted(rows) == list(range(12))
    for i, r in rows.items():
        # the group's metrics are the cell's own (run_cell's), plus the size of the group it trained in
        alone = helpers.run_cell(dict(r.params))
        assert r.metrics["square"] == alone["square"] and r.metrics["noise"] == pytest.approx(alone["noise"], abs=0)
        assert r.metrics["group_size"] == 4
        assert r.key == cell_key(r.params)
    assert {i: len(p) for i, p in markers(test_env, "group").items()} == {0: 1, 1: 1, 2: 1}
    # each cell records an equal share of its group's time, so the durations add up to the time spent
    by_group = {}
    for i, r in rows.items():
        by_group.setdefault(i % 3, set()).add(round(r.duration, 9))
    assert all(len(v) == 1 for v in by_group.values())


def test_a_resumed_group_trains_only_its_unfinished_cells(tmp_path, test_env, helpers, monkeypatch):
    # cell 4 fails: its whole group (1, 4, 7, 10) is recorded failed with the traceback, the others are done
    monkeypatch.setenv("BNLAB_TEST_FAIL", "4")
    s = run_sweep(helpers.GROUPED, "paper", results_dir=tmp_path, serial=True, progress=False)
    rows = _rows(s.store)
    assert {i for i, r in rows.items() if r.status == "failed"} == {1, 4, 7, 10}
    assert "cell 4 fails on purpose" in rows[7].error
    # one cell of the failed group is then finished by hand: a retry trains the other three only
    with ResultsStore(s.store) as st:
        st.record_done(rows[1].key, {"i": 1, "square": 1, "noise": 0.0, "vector": [0, 1, 2], "group_size": 0})
    monkeypatch.setenv("BNLAB_TEST_FAIL", "")
    before = markers(test_env, "start")
    again = run_sweep(helpers.GROUPED, "paper", results_dir=tmp_path, serial=True, progress=False, retry_failed=True)
    assert (again.done, again.executed) == (12, 3)
    after = markers(test_env, "start")
    ran = {i for i in after if len(after[i]) > len(before.get(i, []))}
    assert ran == {4, 7, 10}
    rows = _rows(s.store)
    assert all(rows[i].metrics["group_size"] == 3 for i in (4, 7, 10))
    assert rows[1].metrics["group_size"] == 0  # kept, not recomputed


def test_a_group_that_returns_the_wrong_number_of_results_fails_every_cell(tmp_path, test_env, helpers):
    exp = Experiment(name="bnlab-test-badgroup", paper="p", figure="f", title="t", claim="c", grid=helpers.grid,
                     run_cell=helpers.run_cell, plot=helpers.plot, group=helpers.group_of, run_group=_one_result)
    s = run_sweep(exp, "paper", results_dir=tmp_path, serial=True, progress=False)
    assert (s.done, s.failed) == (0, 12)
    assert all("must return a list of 4 metrics dicts" in r.error for r in _rows(s.store).values())


def _one_result(cells):
    return [{"i": cells[0]["i"]}]


def test_groups_run_on_a_dask_cluster(tmp_path, test_env, helpers):
    s = run_sweep(helpers.GROUPED, "paper", results_dir=tmp_path, workers=2, progress=False)
    assert (s.done, s.executed) == (12, 12)
    assert {i: len(p) for i, p in markers(test_env, "group").items()} == {0: 1, 1: 1, 2: 1}
    rows = _rows(s.store)
    assert all(r.metrics["group_size"] == 4 and r.worker for r in rows.values())


def test_gpu_groups_go_to_the_workers_that_declare_a_gpu(tmp_path, test_env, helpers, monkeypatch):
    # The layout of docs/paper-scale.md for a cluster of GPU workers: one single-threaded worker per GPU,
    # each declaring a GPU resource.  Here two CPU workers declare one each (BNLAB_DEVICE stands for the
    # device cell_device() would give): every group runs as one task on one of them, both get work, and
    # each cell is told its device.
    from distributed import Client, LocalCluster

    monkeypatch.setenv("BNLAB_DEVICE", "cuda:7")
    monkeypatch.setenv("BNLAB_TEST_SLEEP", "0.3")  # each group takes > 1 s: both workers get one
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, resources={"GPU": 1},
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        s = run_sweep(helpers.GROUPED_GPU, "paper", results_dir=tmp_path, client=client, progress=False)
    assert (s.done, s.executed) == (12, 12)
    rows = _rows(s.store)
    assert all(r.metrics["device"] == "cuda:7" and r.versions["device"] == "cuda:7" for r in rows.values())
    by_group = {}
    for i, r in rows.items():
        by_group.setdefault(i % 3, set()).add(r.worker)
    assert all(len(w) == 1 for w in by_group.values())  # a group is one task on one worker
    assert len(set().union(*by_group.values())) == 2
