"""A cached report reuses figures whose records, plot code and files are unchanged, and redraws any other."""
import dataclasses
import json
import os

import pytest

from bnlab.experiments import build_report
from bnlab.experiments.report import FIGURE_MANIFEST


@pytest.fixture
def counted(helpers, test_env):
    """The test sweep whose plot counts its calls."""
    calls = []

    def plot(records, outdir):
        calls.append(len(records))
        return helpers.plot(records, outdir)

    return dataclasses.replace(helpers.SWEEP, plot=plot), calls


def _build(exp, tmp_path):
    rep = build_report(tmp_path / "out", results_dir=tmp_path / "res", experiments=[exp], serial=True,
                       progress=False)
    return rep.sections[0]


def test_unchanged_figures_are_reused_and_a_tampered_one_redrawn(counted, tmp_path):
    exp, calls = counted
    first = _build(exp, tmp_path)
    figdir = tmp_path / "out" / "figures" / exp.name
    assert calls == [6] and not first.figures_reused and (figdir / FIGURE_MANIFEST).is_file()
    png = figdir / "squares.png"
    drawn = png.read_bytes()

    again = _build(exp, tmp_path)  # every cell cached, figures untouched: no plot call
    assert calls == [6] and again.figures_reused and again.figures == first.figures
    assert again.verdict == first.verdict and again.comparisons == first.comparisons
    assert "data:image/png;base64," in (tmp_path / "out" / "index.html").read_text()

    # a planted/modified figure file (same size, one byte changed) is never trusted: redrawn
    planted = bytearray(drawn)
    planted[len(planted) // 2] ^= 0xFF
    png.write_bytes(bytes(planted))
    third = _build(exp, tmp_path)
    assert calls == [6, 6] and not third.figures_reused and png.read_bytes() != bytes(planted)

    # a figure replaced by a link (even to identical bytes) is redrawn
    copy = tmp_path / "elsewhere.png"
    copy.write_bytes(png.read_bytes())
    png.unlink()
    os.symlink(copy, png)
    assert not _build(exp, tmp_path).figures_reused and calls == [6, 6, 6]

    # a missing figure is redrawn
    (figdir / "squares.svg").unlink()
    assert not _build(exp, tmp_path).figures_reused and calls == [6, 6, 6, 6]
    assert (figdir / "squares.svg").is_file()


def test_changed_records_or_manifest_redraw(counted, tmp_path, monkeypatch):
    exp, calls = counted
    _build(exp, tmp_path)
    figdir = tmp_path / "out" / "figures" / exp.name
    # one more cell: the records' digest changes, the figures are redrawn with it
    monkeypatch.setenv("BNLAB_TEST_CELLS", "7")
    sec = _build(exp, tmp_path)
    assert not sec.figures_reused and calls == [6, 7]
    # a hand-edited manifest (another digest, or not JSON) vouches for nothing
    manifest = figdir / FIGURE_MANIFEST
    data = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**data, "digest": "0" * 64}))
    assert not _build(exp, tmp_path).figures_reused and calls == [6, 7, 7]
    manifest.write_text("{not json")
    assert not _build(exp, tmp_path).figures_reused and calls == [6, 7, 7, 7]
    # a manifest naming a file outside the folder is refused
    data = json.loads(manifest.read_text())
    data["figures"][0]["name"] = "../../elsewhere.png"
    manifest.write_text(json.dumps(data))
    assert not _build(exp, tmp_path).figures_reused and calls == [6, 7, 7, 7, 7]
    assert _build(exp, tmp_path).figures_reused and calls == [6, 7, 7, 7, 7]


def test_a_failed_plot_leaves_no_manifest(counted, helpers, tmp_path):
    exp, calls = counted
    _build(exp, tmp_path)
    manifest = tmp_path / "out" / "figures" / exp.name / FIGURE_MANIFEST
    assert manifest.is_file()
    # another plot function (same records) is another digest: it runs, and raises
    sec = _build(dataclasses.replace(exp, plot=helpers.plot_raises), tmp_path)
    assert sec.errors and not sec.figures_reused and not manifest.exists()


# --- the figure key: stable across processes for partial plots, and covering the code the plot runs ---

_partial_calls: list[str] = []


def _counting_partial_plot(records, outdir, *, tag, helpers):
    _partial_calls.append(tag)
    return helpers.plot(records, outdir)


def _as_in_a_new_process(fn):
    """The same function at another address, as a new process (the next `bnlab report`) would have it."""
    import types

    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__qualname__, copy.__module__, copy.__kwdefaults__ = fn.__qualname__, fn.__module__, fn.__kwdefaults__
    assert repr(copy) != repr(fn)  # the address differs
    return copy


def test_a_partial_plot_is_reused_and_another_binding_redrawn(helpers, test_env, tmp_path):
    """Issue 25: a functools.partial has no __qualname__, and its repr names its function's memory
    address, so the key built from it differed in every process and the nine partial-plot
    reproductions were redrawn on every cached report."""
    import functools

    _partial_calls.clear()
    plot = _as_in_a_new_process(_counting_partial_plot)
    exp = dataclasses.replace(helpers.SWEEP, plot=functools.partial(plot, tag="a", helpers=helpers))
    assert not _build(exp, tmp_path).figures_reused and _partial_calls == ["a"]
    # the next process: a new partial of the function at another address, the same binding: reused
    plot = _as_in_a_new_process(_counting_partial_plot)
    exp = dataclasses.replace(exp, plot=functools.partial(plot, tag="a", helpers=helpers))
    assert _build(exp, tmp_path).figures_reused and _partial_calls == ["a"]
    # another bound argument draws another figure: redrawn
    exp = dataclasses.replace(exp, plot=functools.partial(plot, tag="b", helpers=helpers))
    assert not _build(exp, tmp_path).figures_reused and _partial_calls == ["a", "b"]


def test_a_plot_bound_to_an_undescribable_object_is_always_redrawn(helpers, test_env, tmp_path):
    """An argument with no stable description (its repr names an address) cannot key a figure: redraw,
    and leave no manifest that a later run could match."""
    import functools

    _partial_calls.clear()
    exp = dataclasses.replace(helpers.SWEEP, plot=functools.partial(_counting_partial_plot, tag=object(),
                                                                    helpers=helpers))
    first = _build(exp, tmp_path)
    assert first.figures and not first.figures_reused
    assert not (tmp_path / "out" / "figures" / exp.name / FIGURE_MANIFEST).exists()
    assert not _build(exp, tmp_path).figures_reused and len(_partial_calls) == 2


def test_a_changed_record_redraws(counted, tmp_path):
    """Same cells, one metric changed in the store: another key, the figure is drawn again from it."""
    import sqlite3

    from bnlab.experiments.sweep import store_path

    exp, calls = counted
    _build(exp, tmp_path)
    assert _build(exp, tmp_path).figures_reused and calls == [6]
    path = store_path(exp.name, "small", tmp_path / "res")
    with sqlite3.connect(path) as db:
        key, metrics = db.execute("SELECT key, metrics FROM cells WHERE status = 'done' ORDER BY idx LIMIT 1").fetchone()
        changed = json.loads(metrics)
        changed["extra"] = 1.5
        db.execute("UPDATE cells SET metrics = ? WHERE key = ?", (json.dumps(changed), key))
    db.close()
    sec = _build(exp, tmp_path)
    assert not sec.figures_reused and calls == [6, 6]
    assert _build(exp, tmp_path).figures_reused and calls == [6, 6]


def test_a_change_in_a_module_the_plot_imports_lazily_redraws(helpers, test_env, tmp_path, monkeypatch):
    """The key covers the plot's module and every module of its package that it imports, transitively,
    at module level or inside a function (bnlab imports lazily): editing the helper a heatmap
    imports inside its body (bnlab.theory for its theory curve) redraws; an unchanged one is reused."""
    import importlib
    import sys

    pkg = tmp_path / "src" / "figpkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "curve.py").write_text("SLOPE = 1\n")
    (pkg / "plots.py").write_text(
        "CALLS = []\n"
        "def plot(records, outdir):\n"
        "    from .sub import curve  # lazy, relative: still part of the key\n"
        "    CALLS.append(curve.SLOPE)\n"
        "    import importlib\n"
        "    return importlib.import_module(HELPERS).plot(records, outdir)\n")
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    plots = importlib.import_module("figpkg.plots")
    try:
        plots.HELPERS = helpers.__name__
        exp = dataclasses.replace(helpers.SWEEP, plot=plots.plot)
        assert not _build(exp, tmp_path).figures_reused and plots.CALLS == [1]
        assert _build(exp, tmp_path).figures_reused and plots.CALLS == [1]
        (pkg / "sub" / "curve.py").write_text("SLOPE = 2\n")
        importlib.reload(sys.modules["figpkg.sub.curve"])
        assert not _build(exp, tmp_path).figures_reused and plots.CALLS == [1, 2]
        assert _build(exp, tmp_path).figures_reused and plots.CALLS == [1, 2]
    finally:
        for name in [n for n in sys.modules if n == "figpkg" or n.startswith("figpkg.")]:
            del sys.modules[name]


def test_imported_names_resolves_relative_and_lazy_imports():
    from bnlab.experiments.report import _imported_names

    src = (b"import a.b\nfrom . import c\nfrom ..d import e, f\n"
           b"def g():\n    from .h import i\n    import j\n")
    names = set(_imported_names(src, "p.q.mod", is_package=False))
    assert {"a.b", "p.q", "p.q.c", "p.d", "p.d.e", "p.d.f", "p.q.h", "p.q.h.i", "j"} <= names
    # in a package's __init__, "." is the package itself
    assert "p.q.c" in _imported_names(b"from .c import x\n", "p.q", is_package=True)
    # a relative import above the top level names nothing (it would fail to import)
    assert _imported_names(b"from .... import x\n", "p.mod", is_package=False) == []
