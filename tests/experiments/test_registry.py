"""Discovery of reproduction modules, programmatic registration, module:NAME references, broken modules."""
import sys
import textwrap

import pytest

from bnlab.experiments import build_report, get_experiment, list_experiments, register_experiment
from bnlab.experiments import registry
from bnlab.experiments.spec import Experiment


@pytest.fixture
def fake_reproductions(tmp_path, monkeypatch, helpers):
    """A stand-in reproductions package: one good module, one that fails to import, one private."""
    pkg = tmp_path / "fake_repros"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "good.py").write_text(textwrap.dedent(f"""
        from {helpers.__name__} import SWEEP
        EXPERIMENTS = [SWEEP]
    """))
    (pkg / "broken.py").write_text("import this_module_does_not_exist\n")
    (pkg / "_private.py").write_text("raise RuntimeError('private modules are not imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_REPRODUCTIONS", "fake_repros")
    registry.refresh()
    yield pkg
    registry.refresh()
    for name in [m for m in sys.modules if m.startswith("fake_repros")]:
        del sys.modules[name]


def test_discovery_keeps_good_modules_and_reports_broken(fake_reproductions, helpers):
    assert list(list_experiments()) == ["bnlab-test-sweep"]
    errors = registry.discovery_errors()
    assert list(errors) == ["fake_repros.broken"] and "this_module_does_not_exist" in errors["fake_repros.broken"]
    assert get_experiment("bnlab-test-sweep") is helpers.SWEEP


def test_report_shows_a_broken_module(fake_reproductions, tmp_path, test_env):
    rep = build_report(tmp_path / "out", results_dir=tmp_path / "res", serial=True, progress=False)
    assert [s.name for s in rep.sections] == ["bnlab-test-sweep"] and rep.sections[0].status == "ok"
    assert list(rep.broken_modules) == ["fake_repros.broken"]
    html = rep.index.read_text()
    assert "This reproduction module failed to import" in html and "this_module_does_not_exist" in html


def test_register_and_module_reference(helpers):
    exp = Experiment(name="registry-test", paper="p", figure="f", title="t", claim="c",
                     grid=lambda s: [], run_cell=helpers.run_cell, plot=lambda r, o: [])
    try:
        register_experiment(exp)
        assert get_experiment("registry-test") is exp and "registry-test" in list_experiments()
        with pytest.raises(ValueError, match="already registered"):
            register_experiment(exp)
        register_experiment(exp, replace=True)
    finally:
        registry.unregister_experiment("registry-test")
    assert "registry-test" not in list_experiments()
    assert get_experiment(f"{helpers.__name__}:bnlab-test-plotfail") is helpers.PLOT_FAILS
    assert registry.experiment_module(helpers.PLOT_FAILS) == helpers.__name__
    with pytest.raises(ValueError, match="unknown experiment 'no-such'"):
        get_experiment("no-such")
    with pytest.raises(ValueError, match="declares no experiment 'nope'"):
        get_experiment(f"{helpers.__name__}:nope")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'"):
        get_experiment("no_such_module_xyz:x")
    with pytest.raises(ValueError, match="non-empty string"):
        get_experiment("")


def test_the_real_reproductions_are_all_importable():
    """Every module in bnlab.reproductions imports and declares well-formed experiments."""
    registry.refresh()
    assert registry.discovery_errors() == {}
    for name, exp in list_experiments().items():
        assert name == exp.name and exp.claim and exp.paper and callable(exp.run_cell)
        assert "." in exp.run_cell.__module__ and exp.run_cell.__qualname__ == exp.run_cell.__name__, (
            f"{name}: run_cell must be a module-level function (picklable for Dask workers)")
