"""The report's section plumbing: a section's grid and keys computed once, its store opened once, the
experiment looked up once (bnlab.experiments.report._run_section)."""
from __future__ import annotations

import dataclasses

import pytest

from bnlab.experiments import build_report
from bnlab.experiments import registry as registry_module
from bnlab.experiments import report as report_module
from bnlab.experiments import sweep as sweep_module
from bnlab.experiments.store import ResultsStore


@pytest.fixture
def counted(helpers, monkeypatch):
    """The engine's test sweep with its grid calls, store opens and experiment lookups counted."""
    calls = {"grid": 0, "open": 0, "lookup": 0}
    base = helpers.EXPERIMENTS[0]

    def grid(scale):
        calls["grid"] += 1
        return base.grid(scale)

    real_init = ResultsStore.__init__

    def init(self, *args, **kwargs):
        calls["open"] += 1
        real_init(self, *args, **kwargs)

    def lookup(real):
        def wrapped(*args, **kwargs):
            calls["lookup"] += 1
            return real(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(ResultsStore, "__init__", init)
    for module in (report_module, sweep_module):
        monkeypatch.setattr(module, "get_experiment", lookup(module.get_experiment))
    exp = dataclasses.replace(base, grid=grid)
    registry_module.register_experiment(exp, replace=True)
    yield exp, calls
    registry_module.unregister_experiment(exp.name)


def test_a_section_computes_its_grid_once_and_opens_its_store_once(counted, test_env, tmp_path):
    exp, calls = counted
    kwargs = dict(results_dir=tmp_path / "res", only=[exp.name], serial=True, progress=False, retry_failed=False)
    first = build_report(tmp_path / "out", **kwargs)
    assert first.sections[0].total == len(exp.grid("small")) and first.sections[0].done > 0
    calls.update(grid=0, open=0, lookup=0)
    build_report(tmp_path / "out1", **kwargs)  # every cell has an outcome: nothing runs
    assert calls == {"grid": 1, "open": 1, "lookup": 1}
    # a fresh store: the sweep opens it once for writing and hands back the final rows
    calls.update(grid=0, open=0, lookup=0)
    fresh = build_report(tmp_path / "out2", **dict(kwargs, results_dir=tmp_path / "res2"))
    assert calls == {"grid": 1, "open": 1, "lookup": 1}
    assert [(s.total, s.done, s.failed, s.reused) for s in fresh.sections] == \
        [(s.total, s.done, s.failed, 0) for s in first.sections]
