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
