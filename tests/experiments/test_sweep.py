"""The sweep engine in serial mode: results, reuse, failing cells, progress, status, export, bad input.

The independent route for "how often did a cell run" is the marker files the
test experiment writes per execution (tests/experiments/_helpers.py), not the store.
"""
import io
import json

import pandas as pd
import pytest

from bnlab.experiments import ResultsStore, export_sweep, resume_sweep, run_sweep, store_path, sweep_status
from bnlab.experiments.spec import Experiment


def test_serial_sweep_runs_every_cell_once_and_reuses(tmp_path, test_env, helpers):
    s = run_sweep(helpers.SWEEP, results_dir=tmp_path, serial=True, progress=False)
    assert (s.total, s.done, s.failed, s.pending, s.executed, s.reused) == (6, 6, 0, 0, 6, 0)
    assert s.store == store_path("bnlab-test-sweep", "small", tmp_path) and s.complete
    with ResultsStore(s.store, readonly=True) as st:
        rows = st.cells()
    assert [r.params["i"] for r in rows] == list(range(6))
    for r in rows:
        i = r.params["i"]
        # NumPy values were converted on the worker side to plain JSON.
        assert r.metrics["square"] == i * i and r.metrics["vector"] == [0, i, 2 * i]
        assert r.duration >= 0.01 and r.attempts == 1 and r.versions["python"] and r.host
    again = run_sweep(helpers.SWEEP, results_dir=tmp_path, serial=True, progress=False)
    assert (again.executed, again.reused, again.done) == (0, 6, 6)
    assert {i: len(p) for i, p in helpers.markers(test_env, "start").items()} == dict.fromkeys(range(6), 1)


def test_failing_cell_is_recorded_and_sweep_continues(tmp_path, test_env, helpers, monkeypatch):
    monkeypatch.setenv("BNLAB_TEST_FAIL", "1,4")
    s = run_sweep(helpers.SWEEP, results_dir=tmp_path, serial=True, progress=False)
    assert (s.done, s.failed, s.pending) == (4, 2, 0)
    st = sweep_status(s.store)
    assert st.counts == {"pending": 0, "running": 0, "done": 4, "failed": 2}
    assert sorted(f["params"]["i"] for f in st.failures) == [1, 4]
    assert all(f["error"] == f"ValueError: cell {f['params']['i']} fails on purpose" for f in st.failures)
    with ResultsStore(s.store, readonly=True) as r:
        tb = r.cells(status="failed")[0].error
    assert "Traceback" in tb and "run_cell" in tb  # the full traceback is kept
    # Not retried by default; retried on request, and then only the failed cells run.
    assert run_sweep(helpers.SWEEP, results_dir=tmp_path, serial=True, progress=False).executed == 0
    monkeypatch.setenv("BNLAB_TEST_FAIL", "")
    fixed = run_sweep(helpers.SWEEP, results_dir=tmp_path, serial=True, progress=False, retry_failed=True)
    assert (fixed.executed, fixed.done, fixed.failed) == (2, 6, 0)
    starts = helpers.markers(test_env, "start")
    assert {i: len(p) for i, p in starts.items()} == {0: 1, 1: 2, 2: 1, 3: 1, 4: 2, 5: 1}


def test_progress_shows_done_failed_remaining_and_eta(tmp_path, test_env, helpers, monkeypatch):
    monkeypatch.setenv("BNLAB_TEST_FAIL", "2")
    buf = io.StringIO()
    run_sweep(helpers.SWEEP, results_dir=tmp_path, serial=True, progress=buf)
    out = buf.getvalue()
    assert "bnlab-test-sweep [small]" in out
    assert "done=0 failed=0 remaining=6" in out  # the initial state
    assert "done=5 failed=1 remaining=0" in out  # the final state
    assert "cell " in out and "failed: ValueError: cell 2 fails on purpose" in out
    assert "6/6 [" in out and "<00:00" in out  # elapsed<ETA
    # A resumed sweep starts its bar at the cells already finished.
    monkeypatch.setenv("BNLAB_TEST_CELLS", "8")
    buf = io.StringIO()
    run_sweep(helpers.SWEEP, results_dir=tmp_path, serial=True, progress=buf)
    assert "done=5 failed=1 remaining=2" in buf.getvalue() and "done=7 failed=1 remaining=0" in buf.getvalue()


def test_interrupt_requeues_running_cells(tmp_path, test_env, helpers):
    calls = []

    def grid(scale):
        return [{"i": i, "seed": i} for i in range(5)]

    def run_cell(p):
        calls.append(p["i"])
        if p["i"] == 2:
            raise KeyboardInterrupt  # Ctrl-C while cell 2 runs
        return {"i": p["i"]}

    exp = Experiment(name="interrupt-test", paper="p", figure="f", title="t", claim="c", grid=grid,
                     run_cell=run_cell, plot=lambda r, o: [])
    buf = io.StringIO()
    with pytest.raises(KeyboardInterrupt):
        run_sweep(exp, results_dir=tmp_path, serial=True, progress=buf)
    assert "interrupted: 2 cells done are saved" in buf.getvalue() and "bnlab sweep resume" in buf.getvalue()
    path = store_path("interrupt-test", "small", tmp_path)
    assert sweep_status(path).counts == {"pending": 3, "running": 0, "done": 2, "failed": 0}
    calls.clear()
    exp2 = Experiment(name="interrupt-test", paper="p", figure="f", title="t", claim="c", grid=grid,
                      run_cell=lambda p: {"i": p["i"]}, plot=lambda r, o: [])
    s = run_sweep(exp2, results_dir=tmp_path, serial=True, progress=False)
    assert (s.executed, s.reused, s.done) == (3, 2, 5)


def test_resume_finds_the_experiment_from_the_store(tmp_path, test_env, helpers, monkeypatch):
    monkeypatch.setenv("BNLAB_TEST_CELLS", "3")
    s = run_sweep(helpers.SWEEP, results_dir=tmp_path, serial=True, progress=False)
    monkeypatch.setenv("BNLAB_TEST_CELLS", "5")  # the grid grew: resume runs only the new cells
    r = resume_sweep(s.store, serial=True, progress=False)
    assert (r.executed, r.reused, r.done) == (2, 3, 5)
    assert sweep_status(s.store).module == helpers.__name__


def test_export_csv_and_parquet(tmp_path, test_env, helpers, monkeypatch):
    monkeypatch.setenv("BNLAB_TEST_FAIL", "3")
    s = run_sweep(helpers.SWEEP, results_dir=tmp_path, serial=True, progress=False)
    csv = export_sweep(s.store, tmp_path / "out" / "cells.csv")
    pq = export_sweep(s.store, tmp_path / "cells.bin", format="parquet")
    for df in (pd.read_csv(csv), pd.read_parquet(pq)):
        assert len(df) == 6 and list(df["param.i"]) == list(range(6))
        assert set(df["status"]) == {"done", "failed"} and (df["experiment"] == "bnlab-test-sweep").all()
        done = df[df["status"] == "done"]
        assert list(done["metric.square"]) == [i * i for i in done["param.i"]]
        # Lists are JSON text; the failed cell has its error and no metrics.
        assert [json.loads(v) for v in done["metric.vector"]] == [[0, i, 2 * i] for i in done["param.i"]]
        bad = df[df["status"] == "failed"].iloc[0]
        assert "cell 3 fails on purpose" in bad["error"] and pd.isna(bad["metric.square"])
    with pytest.raises(ValueError, match="cannot tell the format"):
        export_sweep(s.store, tmp_path / "cells.txt")
    with pytest.raises(ValueError, match="format='xlsx' is not allowed"):
        export_sweep(s.store, tmp_path / "cells.csv", format="xlsx")


def test_bad_input_is_a_clear_value_error(tmp_path, test_env, helpers):
    with pytest.raises(ValueError, match="scale='huge' is not allowed"):
        run_sweep(helpers.SWEEP, "huge", results_dir=tmp_path, serial=True)
    with pytest.raises(ValueError, match="workers=0 is not allowed"):
        run_sweep(helpers.SWEEP, results_dir=tmp_path, workers=0)
    with pytest.raises(ValueError, match="unknown experiment 'nope'"):
        run_sweep("nope", results_dir=tmp_path, serial=True)
    with pytest.raises(ValueError, match="serial=True runs in this process"):
        run_sweep(helpers.SWEEP, results_dir=tmp_path, serial=True, scheduler="tcp://127.0.0.1:1")
    import numpy as np

    exp = Experiment(name="numpy-grid", paper="p", figure="f", title="t", claim="c",
                     grid=lambda s: [{"B": np.int64(4), "seed": 0}], run_cell=helpers.run_cell, plot=lambda r, o: [])
    with pytest.raises(ValueError, match="JSON-serializable"):
        run_sweep(exp, results_dir=tmp_path, serial=True)
    with pytest.raises(ValueError, match="holds no sweep|does not exist"):
        sweep_status(tmp_path / "none.sqlite")


def test_metrics_must_be_a_json_dict(tmp_path, helpers):
    exp = Experiment(name="bad-metrics", paper="p", figure="f", title="t", claim="c",
                     grid=lambda s: [{"seed": 0}, {"seed": 1}],
                     run_cell=lambda p: [1, 2] if p["seed"] == 0 else {"obj": object()}, plot=lambda r, o: [])
    s = run_sweep(exp, results_dir=tmp_path, serial=True, progress=False)
    assert s.failed == 2
    errors = [f["error"] for f in sweep_status(s.store).failures]
    assert any("must return a dict" in e for e in errors) and any("not JSON-serializable" in e for e in errors)


def test_interrupt_is_reported_before_the_local_cluster_is_torn_down(tmp_path, test_env, helpers, monkeypatch):
    """The store is requeued and the user told so before the local cluster's teardown starts: a teardown
    that takes long (a worker stuck in a cell) never holds back the message or leaves cells 'running'.
    The local cluster and the run are stand-ins; the old order (teardown inside the try) fails the
    asserts made at teardown."""
    import contextlib

    from bnlab.experiments import sweep

    seen = {}
    buf = io.StringIO()
    path = store_path(helpers.SWEEP.name, "small", tmp_path)

    @contextlib.contextmanager
    def fake_open_client(scheduler=None, workers=None, threads=None):
        try:
            yield Client()
        finally:  # the teardown: what the store and the user have been told by now
            with ResultsStore(path, readonly=True) as st:
                seen["counts"] = st.counts()
            seen["said"] = buf.getvalue()

    cancelled = []

    class Client:
        def cancel(self, futures):  # the futures in flight are cancelled after the store is put right
            with ResultsStore(path, readonly=True) as st:
                cancelled.append((list(futures), st.counts()["running"], "interrupted:" in buf.getvalue()))

    def interrupted_run(exp, tasks, st, bar, client, retries, stopped, checkpoints=(None, None)):
        st.mark_submitted([r.key for members, _ in tasks for r in members])  # cells in flight
        stopped.extend(["future-1", "future-2"])
        raise KeyboardInterrupt

    monkeypatch.setenv("BNLAB_TEST_CELLS", "4")
    monkeypatch.setattr(sweep, "open_client", fake_open_client)
    monkeypatch.setattr(sweep, "_run_dask", interrupted_run)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(helpers.SWEEP, results_dir=tmp_path, progress=buf)
    assert seen["counts"]["running"] == 0 and seen["counts"]["pending"] == 4
    assert "interrupted: 0 cells done are saved" in seen["said"]
    assert cancelled == [(["future-1", "future-2"], 0, True)]


def test_a_cancellation_that_hangs_is_given_up(monkeypatch):
    """Client.cancel has no timeout; a client whose cancel never returns holds the stop back only for the bound."""
    import threading

    from bnlab.experiments import sweep

    never = threading.Event()

    class Hung:
        def cancel(self, futures):
            never.wait(30)

    with pytest.warns(RuntimeWarning, match="did not finish within 0.2 s"):
        sweep._cancel_bounded(Hung(), ["f"], timeout=0.2)
    never.set()


def test_local_cluster_teardown_is_bounded(monkeypatch):
    """A client or cluster that does not close in time is given up with a warning naming it, not waited on;
    each is asked with the bound (stand-ins for distributed's objects, whose close raises TimeoutError)."""
    from bnlab.experiments import sweep

    asked = []

    class Stuck:
        def __init__(self, name):
            self.name = name

        def close(self, timeout=None):
            asked.append((self.name, timeout))
            if self.name == "cluster":
                raise TimeoutError("workers still busy")

    with pytest.warns(RuntimeWarning, match="local Dask cluster did not close within 2 s"):
        sweep._close_bounded(Stuck("client"), Stuck("cluster"), timeout=2.0)
    assert asked == [("client", 2.0), ("cluster", 2.0)]

    class Broken(Stuck):
        def close(self, timeout=None):
            raise ValueError("a bug")

    with pytest.raises(ValueError):  # anything but a timeout or a lost connection is not swallowed
        sweep._close_bounded(Broken("client"), Stuck("cluster"), timeout=2.0)
