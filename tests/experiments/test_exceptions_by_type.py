"""Exceptions are recognised by their type, not their name: a worker that keeps dying (Dask's
``KilledWorker``) and a data set that is not on the machine (``DatasetNotFoundError``)."""
from __future__ import annotations

import pytest

from bnlab.experiments import ResultsStore, run_sweep


def test_a_cell_whose_worker_keeps_dying_is_failed_with_the_hint(tmp_path, test_env, helpers, monkeypatch):
    import dask
    import distributed  # noqa: F401  (its defaults loaded first: leaving the config.set below then restores
    # only the one key, instead of dropping the whole "distributed" section it would otherwise have created)

    from bnlab.experiments.sweep import _KILLED_HINT, open_client

    monkeypatch.setenv("BNLAB_TEST_CELLS", "2")
    monkeypatch.setenv("BNLAB_TEST_EXIT", "1")
    with dask.config.set({"distributed.scheduler.allowed-failures": 0}), open_client(workers=1) as client:
        s = run_sweep(helpers.SWEEP, results_dir=tmp_path, client=client, progress=False)
    assert (s.done, s.failed) == (1, 1)
    with ResultsStore(s.store, readonly=True) as st:
        failed = st.cells(status="failed")
    assert failed[0].params["i"] == 1
    assert failed[0].error.startswith("KilledWorker") and _KILLED_HINT in failed[0].error


def test_a_missing_data_set_skips_the_cell_and_other_errors_propagate(monkeypatch):
    from bnlab.data import DatasetNotFoundError
    from bnlab.reproductions import trainability

    cell = dict(dataset="cifar10", depth=2, seed=0, width=8, bn_batch=4, batch_size=4, lr=0.1, n_train=8,
                n_test=8, steps=1)

    def raising(exc):
        def load(*args, **kwargs):
            raise exc
        return load

    monkeypatch.setattr(trainability, "load_dataset_subset", raising(DatasetNotFoundError("not in /nowhere")))
    out = trainability.run_trainability_cell(cell)
    assert out["skipped"] is True and out["skip_reason"] == trainability.CIFAR_MISSING

    # another class that happens to carry the same name is not the data set's error: it propagates
    impostor = type("DatasetNotFoundError", (FileNotFoundError,), {})
    monkeypatch.setattr(trainability, "load_dataset_subset", raising(impostor("a file is missing")))
    with pytest.raises(FileNotFoundError, match="a file is missing"):
        trainability.run_trainability_cell(cell)
