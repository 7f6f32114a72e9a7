"""The declaration contract's helpers: cell_device() and the engine's GPU resource request."""
import types

import pytest

from bnlab.experiments import cell_device
from bnlab.experiments.spec import SCALES, Experiment
from bnlab.experiments.sweep import _gpu_resources


def test_scales_and_backward_compatible_defaults(helpers):
    assert SCALES == ("small", "medium", "paper")
    exp = Experiment(name="n", paper="p", figure="f", title="t", claim="c", grid=helpers.grid,
                     run_cell=helpers.run_cell, plot=helpers.plot)
    assert exp.compare([]) == [] and exp.uses_gpu is False


def test_cell_device(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("BNLAB_DEVICE", "cuda:7")
    assert cell_device() == "cuda:7"
    monkeypatch.delenv("BNLAB_DEVICE")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cell_device() == "cpu"
    # With 2 GPUs, local worker "3" gets GPU 3 mod 2 = 1; outside a worker, GPU 0.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert cell_device() == "cuda:0"
    import distributed

    monkeypatch.setattr(distributed, "get_worker", lambda: types.SimpleNamespace(name=3))
    assert cell_device() == "cuda:1"
    monkeypatch.setattr(distributed, "get_worker", lambda: types.SimpleNamespace(name="gpu-node-a"))
    assert cell_device() == "cuda:0"


class _FakeClient:
    def __init__(self, resources):
        self._workers = {f"tcp://w{i}": {"resources": r} for i, r in enumerate(resources)}

    def scheduler_info(self, n_workers=5):
        return {"workers": self._workers}


def test_gpu_cells_ask_for_a_gpu_only_where_workers_have_one(helpers):
    gpu_exp = Experiment(name="g", paper="p", figure="f", title="t", claim="c", grid=helpers.grid,
                         run_cell=helpers.run_cell, plot=helpers.plot, uses_gpu=True)
    cpu_exp = Experiment(name="c", paper="p", figure="f", title="t", claim="c", grid=helpers.grid,
                         run_cell=helpers.run_cell, plot=helpers.plot)
    assert _gpu_resources(_FakeClient([{}, {"GPU": 1}]), gpu_exp) == {"GPU": 1}
    assert _gpu_resources(_FakeClient([{}, {}]), gpu_exp) is None  # would otherwise wait forever
    assert _gpu_resources(_FakeClient([{"GPU": 1}]), cpu_exp) is None


def echo_device(params):
    return {"device": params.get("device"), "keys": sorted(params)}


def test_gpu_experiments_get_a_device_outside_their_identity(tmp_path, monkeypatch):
    from bnlab.experiments import ResultsStore, cell_key, run_sweep

    monkeypatch.setenv("BNLAB_DEVICE", "cuda:5")  # what cell_device() would pick on a GPU machine
    grid = lambda scale: [{"seed": 0}, {"seed": 1, "device": "cpu"}]  # noqa: E731
    for uses_gpu, expected in ((True, ["cuda:5", "cpu"]), (False, [None, "cpu"])):
        exp = Experiment(name=f"dev-{uses_gpu}", paper="p", figure="f", title="t", claim="c", grid=grid,
                         run_cell=echo_device, plot=lambda r, o: [], uses_gpu=uses_gpu)
        s = run_sweep(exp, results_dir=tmp_path, serial=True, progress=False)
        with ResultsStore(s.store, readonly=True) as st:
            rows = st.cells()
        assert [r.metrics["device"] for r in rows] == expected
        assert [r.key for r in rows] == [cell_key(c) for c in grid("small")]  # stored params unchanged
        assert rows[0].params == {"seed": 0}
        assert rows[0].versions.get("device") == (expected[0] if uses_gpu else None)
