"""The SQLite results store: schema, round trip, the never-overwrite-done rule, the single-writer lock."""
import json
import sqlite3

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bnlab.experiments.store import STATUSES, ResultsStore, canonical_json, cell_key, grid_hash

CELLS = [{"B": b, "seed": s, "phi": "relu"} for b in (2, 4) for s in (0, 1)]


def _store(tmp_path, **kw):
    s = ResultsStore(tmp_path / "s.sqlite", **kw)
    s.initialize("exp", "small", CELLS, module="mod", versions={"numpy": "x"})
    return s


def test_schema_wal_and_version(tmp_path):
    with _store(tmp_path):
        pass
    conn = sqlite3.connect(tmp_path / "s.sqlite")
    cols = {r[1] for r in conn.execute("PRAGMA table_info(cells)")}
    assert cols == {"key", "idx", "params", "status", "metrics", "error", "attempts", "submitted", "started",
                    "finished", "duration", "worker", "host", "versions"}
    sweep_cols = {r[1] for r in conn.execute("PRAGMA table_info(sweep)")}
    assert {"experiment", "scale", "grid_hash", "created", "versions", "module"} <= sweep_cols
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 1
    # The CHECK constraint rejects unknown statuses at the database level too.
    with pytest.raises(sqlite3.IntegrityError):
        conn.execute("UPDATE cells SET status = 'bogus'")


def test_roundtrip(tmp_path):
    with _store(tmp_path) as s:
        keys = [cell_key(c) for c in CELLS]
        assert s.counts() == {"pending": 4, "running": 0, "done": 0, "failed": 0}
        s.mark_submitted(keys[:3])
        metrics = {"x": 1.5, "nan": float("nan"), "v": [1, 2, 3], "nested": {"a": None}}
        assert s.record_done(keys[0], metrics, started="t0", finished="t1", duration=0.25, worker="w0",
                             host="h", versions={"numpy": "2"})
        assert s.record_failed(keys[1], "Traceback...\nValueError: boom", duration=0.1)
        assert s.counts() == {"pending": 1, "running": 1, "done": 1, "failed": 1}
        info = s.sweep_info()
        assert (info["experiment"], info["scale"], info["module"], info["n_cells"]) == ("exp", "small", "mod", 4)
        assert info["grid_hash"] == grid_hash(keys)
    with ResultsStore(tmp_path / "s.sqlite", readonly=True) as r:
        done = r.cells(status="done")
        assert len(done) == 1 and done[0].params == CELLS[0]
        m = done[0].metrics
        assert m["x"] == 1.5 and m["nan"] != m["nan"] and m["v"] == [1, 2, 3] and m["nested"] == {"a": None}
        assert (done[0].duration, done[0].worker, done[0].host, done[0].attempts) == (0.25, "w0", "h", 1)
        assert done[0].versions == {"numpy": "2"}
        failed = r.cells(status="failed")[0]
        assert failed.error.endswith("ValueError: boom") and failed.metrics is None
        recs = r.records()
        assert len(recs) == 1 and recs[0].params == CELLS[0] and recs[0].metrics["x"] == 1.5
        with pytest.raises(ValueError, match="read-only"):
            r.record_done(keys[2], {})
        with pytest.raises(ValueError, match="status must be one of"):
            r.cells(status="finished")


def test_done_is_never_overwritten(tmp_path):
    with _store(tmp_path) as s:
        k = cell_key(CELLS[0])
        assert s.record_done(k, {"v": 1})
        assert not s.record_done(k, {"v": 2})
        assert not s.record_failed(k, "late failure")
        s.mark_submitted([k])  # a done cell is not submitted again
        s.requeue_running()
        s.requeue_failed()
        row = s.cells(keys=[k])[0]
        assert (row.status, row.metrics, row.attempts) == ("done", {"v": 1}, 0)


def test_requeue_running_and_failed(tmp_path):
    with _store(tmp_path) as s:
        keys = [cell_key(c) for c in CELLS]
        s.mark_submitted(keys)
        s.record_failed(keys[0], "e")
        assert s.requeue_running() == 3
        assert s.counts()["pending"] == 3
        assert s.requeue_failed([keys[0]]) == 1
        assert s.counts() == {"pending": 4, "running": 0, "done": 0, "failed": 0}


def test_grid_growth_keeps_results_and_mismatch_is_refused(tmp_path):
    with _store(tmp_path) as s:
        s.record_done(cell_key(CELLS[0]), {"v": 1})
    more = CELLS + [{"B": 8, "seed": 0, "phi": "relu"}]
    with ResultsStore(tmp_path / "s.sqlite") as s:
        keys = s.initialize("exp", "small", list(reversed(more)))
        assert len(keys) == 5 and s.counts() == {"pending": 4, "running": 0, "done": 1, "failed": 0}
        assert s.cells()[0].params == more[-1]  # grid order follows the newest grid
        with pytest.raises(ValueError, match="holds sweep 'exp' at scale 'small'"):
            s.initialize("other", "small", CELLS)
        with pytest.raises(ValueError, match="identical parameters"):
            s.initialize("exp", "small", [CELLS[0], dict(CELLS[0])])


def test_single_writer_lock(tmp_path):
    with _store(tmp_path):
        with pytest.raises(ValueError, match="being written by another running sweep"):
            ResultsStore(tmp_path / "s.sqlite")
        with ResultsStore(tmp_path / "s.sqlite", readonly=True) as r:  # readers are welcome
            assert r.counts()["pending"] == 4
    with ResultsStore(tmp_path / "s.sqlite"):  # released on close
        pass


@pytest.mark.timeout(60)
def test_a_fifo_planted_at_the_lock_neither_hangs_nor_is_taken_for_a_lock(tmp_path):
    """Opening a FIFO for reading blocks until a writer comes: before, ``sweep status`` (the reader's
    driver probe), ``sweep run`` and ``reproduce`` hung on a FIFO at ``<store>.lock``.  Now a reader sees no
    driver and a writer refuses the file; each open would block without ``O_NONBLOCK`` (the timeout fails
    the test then)."""
    import os

    with _store(tmp_path):
        pass
    lock = tmp_path / "s.sqlite.lock"
    lock.unlink()
    os.mkfifo(lock)
    with ResultsStore(tmp_path / "s.sqlite", readonly=True) as r:
        assert not r.writer_alive() and r.counts()["pending"] == 4
    with pytest.raises(ValueError, match="lock file .* is not a regular file; remove it"):
        ResultsStore(tmp_path / "s.sqlite")
    with pytest.raises(ValueError, match="not a regular file"):  # the same for a store not yet created
        os.mkfifo(tmp_path / "new.sqlite.lock")
        ResultsStore(tmp_path / "new.sqlite")


def test_a_done_cell_without_metrics_is_damage(tmp_path):
    """``record_done`` always writes a JSON object, so a finished cell whose metrics are NULL was edited or
    planted: before, status counted it done, resume reused it and the report's compare() met a KeyError
    traceback.  Now reading it is the damaged-store error, and salvage leaves it out as unreadable."""
    import sqlite3

    from bnlab.experiments.store import salvage_store

    with _store(tmp_path) as s:
        keys = [c.key for c in s.cells()]
        s.record_done(keys[0], {"v": 0})
        s.record_done(keys[1], {"v": 1})
    conn = sqlite3.connect(tmp_path / "s.sqlite")
    with conn:
        conn.execute("UPDATE cells SET metrics = NULL WHERE key = ?", (keys[1],))
    conn.close()
    with ResultsStore(tmp_path / "s.sqlite", readonly=True) as r:
        with pytest.raises(ValueError, match="damaged results store: .* it is done but its metrics are missing"):
            r.records()
    got = salvage_store(tmp_path / "s.sqlite", tmp_path / "new.sqlite")
    assert (got["recovered"], got["unreadable"]) == (1, 1)
    with ResultsStore(tmp_path / "new.sqlite", readonly=True) as r:
        assert [rec.metrics for rec in r.records()] == [{"v": 0}]


def test_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        ResultsStore(tmp_path / "missing.sqlite", readonly=True)
    (tmp_path / "junk.sqlite").write_text("not a database")
    with pytest.raises(ValueError, match="not a bnlab results store"):
        ResultsStore(tmp_path / "junk.sqlite", readonly=True)
    import numpy as np

    with pytest.raises(ValueError, match="JSON-serializable"):
        cell_key({"B": np.int64(2)})
    with pytest.raises(ValueError, match="finite"):
        cell_key({"eps": float("nan")})
    with pytest.raises(ValueError, match="must be a dict"):
        cell_key([1, 2])
    assert set(STATUSES) == {"pending", "running", "done", "failed"}


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3),
    max_leaves=8,
)


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.text(max_size=8), json_values, min_size=1, max_size=6), st.randoms())
def test_cell_key_is_order_independent_and_value_sensitive(params, rnd):
    items = list(params.items())
    rnd.shuffle(items)
    assert cell_key(dict(items)) == cell_key(params)
    # The key is a function of the canonical JSON: any change of a value that changes the JSON changes the key
    # (up to SHA-256 collisions, probability ~2^-128 for 32 hex digits).
    k = next(iter(params))
    changed = dict(params, **{k: ["changed", params[k]]})
    assert canonical_json(changed) != canonical_json(params)
    assert cell_key(changed) != cell_key(params)
    assert json.loads(canonical_json(params)) == params


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.integers(0, 2)),
        st.tuples(st.just("done"), st.integers(0, 2), st.integers(0, 9)),
        st.tuples(st.just("fail"), st.integers(0, 2)),
        st.tuples(st.just("requeue_running")),
        st.tuples(st.just("requeue_failed")),
    ),
    max_size=25,
)


@settings(max_examples=40, deadline=None)
@given(_OPS)
def test_store_transitions_match_a_reference_model(ops):
    """Any interleaving of driver events leaves the store where a plain-Python state machine says it should.

    In particular the first committed result of a cell is final: later results, failures and requeues never
    change it (the store's guarantee that a finished cell is committed once and never recomputed).
    """
    import tempfile

    cells = [{"i": i, "seed": i} for i in range(3)]
    keys = [cell_key(c) for c in cells]
    model = {k: {"status": "pending", "metrics": None, "attempts": 0} for k in keys}
    with tempfile.TemporaryDirectory() as tmp, ResultsStore(f"{tmp}/m.sqlite") as s:
        s.initialize("exp", "small", cells)
        for op in ops:
            if op[0] == "submit":
                k = keys[op[1]]
                s.mark_submitted([k])
                if model[k]["status"] == "pending":
                    model[k].update(status="running", attempts=model[k]["attempts"] + 1)
            elif op[0] == "done":
                k = keys[op[1]]
                expected = model[k]["status"] != "done"
                assert s.record_done(k, {"v": op[2]}) == expected
                if expected:
                    model[k].update(status="done", metrics={"v": op[2]})
            elif op[0] == "fail":
                k = keys[op[1]]
                expected = model[k]["status"] != "done"
                assert s.record_failed(k, "boom") == expected
                if expected:
                    model[k].update(status="failed", metrics=None)
            else:
                src = "running" if op[0] == "requeue_running" else "failed"
                n = s.requeue_running() if src == "running" else s.requeue_failed()
                assert n == sum(m["status"] == src for m in model.values())
                for m in model.values():
                    if m["status"] == src:
                        m["status"] = "pending"
        got = {r.key: {"status": r.status, "metrics": r.metrics, "attempts": r.attempts} for r in s.cells()}
    assert got == model
