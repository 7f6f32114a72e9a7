"""A sweep's task interrupted mid-way goes on from its checkpoint when the sweep is resumed (issue 27).

Route of the check: the same one-task sweep (four BN-MLPs trained as one ensemble, float64) run straight
through, and run with an interruption right after the task's first checkpoint save — Ctrl-C in a serial
run, the worker process ending (``os._exit``, as the system kills a worker) on a Dask cluster — then
resumed.  The resumed task must run only the steps after the save and give the straight run's metrics:
the same float64 operations on the same operands in one process, so 1e-10 relative (the tolerance
argument of tests/nets/test_ensemble_checkpoint.py); across processes on one machine the same.
"""
from __future__ import annotations

import os

import pytest

from bnlab.experiments import ResultsStore
from bnlab.experiments.sweep import checkpoint_folder, run_sweep, sweep_status

from ._helpers import markers


def _metrics(store) -> dict[int, dict]:
    with ResultsStore(store, readonly=True) as st:
        return {r.params["i"]: r.metrics for r in st.cells()}


def _same(a: dict, b: dict) -> None:
    for i in a:
        assert a[i]["weights"] == pytest.approx(b[i]["weights"], rel=1e-10)
        assert a[i]["last_loss"] == pytest.approx(b[i]["last_loss"], rel=2e-7)


def test_an_interrupted_task_resumes_from_its_checkpoint(tmp_path, test_env, helpers, monkeypatch):
    monkeypatch.setenv("BNLAB_TEST_STEPS", "60")
    straight = run_sweep(helpers.ENSEMBLE, results_dir=tmp_path / "a", serial=True, progress=False)
    ref = _metrics(straight.store)
    assert all(m["steps_run"] == 60 and m["first_step"] == 0 for m in ref.values())

    import bnlab.nets._checkpoint as ck

    real = ck.write

    def interrupt(path, payload, *kind):
        real(path, payload, *kind)
        raise KeyboardInterrupt

    monkeypatch.setattr(ck, "write", interrupt)
    store = tmp_path / "b" / "run.sqlite"
    with pytest.raises(KeyboardInterrupt):
        run_sweep(helpers.ENSEMBLE, store=store, serial=True, progress=False, checkpoint_every=0)
    folder = checkpoint_folder(store)
    kept = list(folder.iterdir())
    assert [p.suffix for p in kept] == [".pt"]  # one task, one trainer call: one file, no temporary left
    assert folder.stat().st_mode & 0o077 == 0  # the worker made it private
    # sweep status lists it (a link or a killed save's temporary file beside it is not a checkpoint)
    (folder / "planted.pt").symlink_to(kept[0])
    (folder / f".{kept[0].stem}.pt.123.tmp.pt").write_bytes(b"partial")
    listed = sweep_status(store).checkpoints
    assert [(c["file"], c["bytes"]) for c in listed] == [(kept[0].name, kept[0].stat().st_size)]
    (folder / "planted.pt").unlink()
    (folder / f".{kept[0].stem}.pt.123.tmp.pt").unlink()
    monkeypatch.setattr(ck, "write", real)
    done = run_sweep(helpers.ENSEMBLE, store=store, serial=True, progress=False, checkpoint_every=0)
    assert (done.done, done.executed) == (4, 4)
    resumed = _metrics(store)
    # the first save is at the first check (step 10): the resumed task ran steps 10 … 59 only
    assert all(m["steps_run"] == 50 and m["first_step"] == 10 for m in resumed.values())
    _same(ref, resumed)
    assert not folder.exists()  # removed once its task finished and nothing else is kept there
    assert sweep_status(store).checkpoints == []


def test_a_task_training_networks_one_by_one_resumes_each_from_its_checkpoint(tmp_path, test_env, helpers,
                                                                             monkeypatch):
    # bnlab.nets.train, one call per cell: Ctrl-C right after the second network's first save; on resume the
    # first network resumes at its saved end (no step again), the second from step 10, the last two from 0
    monkeypatch.setenv("BNLAB_TEST_STEPS", "30")
    ref = _metrics(run_sweep(helpers.SINGLE, results_dir=tmp_path / "a", serial=True, progress=False).store)
    assert all(m["steps_run"] == 30 for m in ref.values())

    import bnlab.nets._checkpoint as ck

    real, writes = ck.write, []

    def interrupt(path, payload, *kind):
        real(path, payload, *kind)
        writes.append((path.name, payload["done"]))
        if path.name.endswith("-1.pt"):
            raise KeyboardInterrupt

    monkeypatch.setattr(ck, "write", interrupt)
    store = tmp_path / "b" / "run.sqlite"
    with pytest.raises(KeyboardInterrupt):
        run_sweep(helpers.SINGLE, store=store, serial=True, progress=False, checkpoint_every=0)
    assert [d for _, d in writes] == [10, 20, 30, 10]  # the first run's checks, its final state, then the second's
    monkeypatch.setattr(ck, "write", real)
    done = run_sweep(helpers.SINGLE, store=store, serial=True, progress=False, checkpoint_every=1e9)
    assert (done.done, done.executed) == (4, 4)
    resumed = _metrics(store)
    assert [resumed[i]["steps_run"] for i in range(4)] == [0, 20, 30, 30]
    _same(ref, resumed)
    assert not checkpoint_folder(store).exists()


def test_without_checkpoints_an_interrupted_task_starts_over(tmp_path, test_env, helpers, monkeypatch):
    monkeypatch.setenv("BNLAB_TEST_STEPS", "30")
    import bnlab.nets.ensemble as ens

    real_check = ens._EnsembleRun.check
    calls = []

    def stop_at_second_check(self):
        calls.append(self.done)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_check(self)

    monkeypatch.setattr(ens._EnsembleRun, "check", stop_at_second_check)
    store = tmp_path / "run.sqlite"
    with pytest.raises(KeyboardInterrupt):
        run_sweep(helpers.ENSEMBLE, store=store, serial=True, progress=False, checkpoint_every=None)
    monkeypatch.setattr(ens._EnsembleRun, "check", real_check)
    assert not checkpoint_folder(store).exists()
    run_sweep(helpers.ENSEMBLE, store=store, serial=True, progress=False, checkpoint_every=None)
    assert all(m["steps_run"] == 30 and m["first_step"] == 0 for m in _metrics(store).values())


def test_a_planted_checkpoint_folder_is_refused(tmp_path, helpers):
    store = tmp_path / "run.sqlite"
    folder = tmp_path / "run.sqlite.checkpoints"
    target = tmp_path / "elsewhere"
    target.mkdir()
    os.symlink(target, folder)
    with pytest.raises(ValueError, match=r"checkpoint folder .*symbolic link"):
        run_sweep(helpers.ENSEMBLE, store=store, serial=True, progress=False)
    os.unlink(folder)
    folder.write_text("")
    with pytest.raises(ValueError, match=r"checkpoint folder .*not a folder"):
        run_sweep(helpers.ENSEMBLE, store=store, serial=True, progress=False)
    with pytest.raises(ValueError, match="checkpoint_every"):
        run_sweep(helpers.ENSEMBLE, store=tmp_path / "other.sqlite", serial=True, progress=False, checkpoint_every=-1)


def test_a_killed_dask_worker_s_task_resumes_from_its_checkpoint(tmp_path, test_env, helpers, monkeypatch):
    # the worker process ends right after the task's first save; the nanny starts a new one, the scheduler
    # runs the task again, and it goes on from the save
    monkeypatch.setenv("BNLAB_TEST_STEPS", "60")
    straight = run_sweep(helpers.ENSEMBLE, results_dir=tmp_path / "a", serial=True, progress=False)
    monkeypatch.setenv("BNLAB_TEST_EXIT_AFTER_SAVE", "1")
    s = run_sweep(helpers.ENSEMBLE, results_dir=tmp_path / "b", workers=1, progress=False, checkpoint_every=0)
    assert test_env.joinpath("exited").exists()
    assert (s.done, s.failed) == (4, 0)
    resumed = _metrics(s.store)
    assert all(m["first_step"] == 10 and m["steps_run"] == 50 for m in resumed.values())
    _same(_metrics(straight.store), resumed)
    assert len(markers(test_env, "group")[0]) == 2  # the straight run's execution and the resumed one


@pytest.mark.parametrize("flags, expected", [([], 300.0), (["--checkpoint-every", "30"], 30.0),
                                             (["--no-checkpoints"], None)])
def test_the_cli_passes_the_checkpoint_interval_to_the_engine(monkeypatch, tmp_path, flags, expected):
    # sweep run/resume, report and reproduce take the same options and hand them to run_sweep / build_report /
    # reproduce as checkpoint_every
    import bnlab.experiments.report as report
    import bnlab.experiments.sweep as sweep
    from bnlab.cli import main

    seen = {}

    def fake(name):
        def run(*args, **kwargs):
            seen[name] = kwargs.get("checkpoint_every", "missing")
            raise ValueError("stop here")
        return run

    monkeypatch.setattr(sweep, "run_sweep", fake("sweep"))
    monkeypatch.setattr(report, "build_report", fake("report"))
    monkeypatch.setattr(report, "reproduce", fake("reproduce"))
    for argv in (["sweep", "run", "yang2019-theory"], ["report", "--out", str(tmp_path / "r")],
                 ["reproduce", "yang2019-theory", "--out", str(tmp_path / "r")]):
        with pytest.raises(SystemExit):
            main([*argv, *flags, "--results-dir", str(tmp_path)])
    assert seen == {"sweep": expected, "report": expected, "reproduce": expected}
