"""The HTML report: structure, embedded figures, failures shown not fatal, reuse of stores, Chromium render."""
import base64
import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from bnlab.experiments import build_report
from bnlab.experiments.spec import Experiment

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)


class _Images(HTMLParser):
    def __init__(self):
        super().__init__()
        self.srcs, self.tags = [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag == "img":
            self.srcs.append(dict(attrs)["src"])


def _parse(html):
    p = _Images()
    p.feed(html)
    return p


@pytest.fixture
def report(tmp_path, test_env, helpers, monkeypatch):
    monkeypatch.setenv("BNLAB_TEST_FAIL", "3")

    def bad_grid(scale):
        raise RuntimeError("grid is broken on purpose")

    broken = Experiment(name="bnlab-test-badgrid", paper="Other et al. 2020", figure="Tab. 1", title="t",
                        claim="c", grid=bad_grid, run_cell=helpers.run_cell, plot=helpers.plot)
    rep = build_report(tmp_path / "out", results_dir=tmp_path / "res", experiments=helpers.EXPERIMENTS + [broken],
                       serial=True, progress=False)
    return rep


def test_report_structure_and_failures(report, tmp_path):
    html = report.index.read_text()
    status = {s.name: s.status for s in report.sections}
    assert status == {"bnlab-test-sweep": "partial", "bnlab-test-plotfail": "failed", "bnlab-test-badgrid": "error"}
    assert not report.ok
    # Claims are escaped text, the errors of every kind are on the page.
    assert "&lt;b&gt;(escaped)&lt;/b&gt;" in html and "<b>(escaped)</b>" not in html
    assert "ValueError: cell 3 fails on purpose" in html
    assert "RuntimeError: this plot is broken on purpose" in html
    assert "RuntimeError: grid is broken on purpose" in html
    assert html.count('class="comparison"') == 2 and "<td>sum of squares</td><td>46</td><td>46</td>" in html
    for paper in ("Test et al. 2024", "Other et al. 2020"):
        assert f"<h2>{paper}</h2>" in html
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [s["status"] for s in data["sections"]] == ["partial", "failed", "error"]


def test_report_is_self_contained_with_embedded_figures(report):
    html = report.index.read_text()
    parsed = _parse(html)
    assert len(parsed.srcs) == 2
    kinds = set()
    for src in parsed.srcs:
        m = re.fullmatch(r"data:(image/png|image/svg\+xml);base64,([A-Za-z0-9+/=]+)", src)
        assert m, src[:60]
        raw = base64.b64decode(m.group(2))
        kinds.add(m.group(1))
        assert raw.startswith(b"\x89PNG\r\n\x1a\n") if m.group(1) == "image/png" else b"<svg" in raw
    assert kinds == {"image/png", "image/svg+xml"}
    # Nothing is fetched: no external stylesheet/script/font, no http(s) resource anywhere in attributes or CSS.
    assert not [t for t, a in parsed.tags if t in ("link", "script", "iframe")]
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html) and "url(" not in html
    # The figure files also stay beside the page.
    assert sorted(p.name for p in (report.index.parent / "figures" / "bnlab-test-sweep").iterdir()) == [
        "squares.png", "squares.svg"]


def test_report_reuses_the_stores(tmp_path, test_env, helpers, monkeypatch, report):
    starts = sum(len(v) for v in helpers.markers(test_env, "start").values())
    # An unreachable scheduler proves no cluster is even contacted when every cell is in the store.
    again = build_report(tmp_path / "out2", results_dir=tmp_path / "res", experiments=helpers.EXPERIMENTS,
                         scheduler="tcp://127.0.0.1:9", retry_failed=False, progress=False)
    assert [s.status for s in again.sections] == ["partial", "failed"]
    assert [s.reused for s in again.sections] == [5, 5]
    assert sum(len(v) for v in helpers.markers(test_env, "start").values()) == starts
    # After a fix, the default (retry_failed=True) reruns only the failed cell.
    monkeypatch.setenv("BNLAB_TEST_FAIL", "")
    fixed = build_report(tmp_path / "out3", results_dir=tmp_path / "res", experiments=helpers.EXPERIMENTS[:1],
                         serial=True, progress=False)
    assert fixed.ok and fixed.sections[0].done == 6
    assert sum(len(v) for v in helpers.markers(test_env, "start").values()) == starts + 1


_CHECK = """<script>window.addEventListener("load", function () {
  var imgs = Array.from(document.images);
  document.body.setAttribute("data-images", imgs.length);
  document.body.setAttribute("data-loaded", imgs.filter(function (i) { return i.complete && i.naturalWidth > 0; }).length);
  document.body.setAttribute("data-sections", document.querySelectorAll("section.experiment").length);
});</script>"""


def _render_counts(page: Path, tmp_path: Path) -> dict:
    """Load ``page`` in headless Chromium and return the counts the injected script wrote on <body>."""
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={tmp_path / 'chromium-profile'}", "--virtual-time-budget=10000", "--dump-dom",
           page.resolve().as_uri()]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    body = re.search(r"<body([^>]*)>", out.stdout)
    assert body, out.stdout[:500]
    return {k: int(v) for k, v in re.findall(r'data-(images|loaded|sections)="(\d+)"', body.group(1))}


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (Debian package 'chromium')")
def test_report_renders_in_headless_chromium(report, tmp_path):
    html = report.index.read_text()
    # The check script goes into a copy beside index.html, so the page itself stays script-free.
    page = report.index.with_name("render-check.html")
    page.write_text(html.replace("</body>", _CHECK + "</body>"))
    counts = _render_counts(page, tmp_path)
    assert counts == {"images": 2, "loaded": 2, "sections": 3}
    # Negative control: the same check sees a figure that cannot load.
    broken = page.with_name("render-broken.html")
    broken.write_text(re.sub(r'src="data:image/png[^"]*"', 'src="figures/missing.png"', page.read_text(), count=1))
    assert _render_counts(broken, tmp_path) == {"images": 2, "loaded": 1, "sections": 3}


def _skipping_cell(params):
    return {"skipped": True, "skip_reason": "dataset X not present: bnlab data download x"}


def _plot_skipped(records, outdir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(3, 2))
    ax.text(0.5, 0.5, records[0].metrics["skip_reason"], ha="center")
    path = Path(outdir) / "skipped.png"
    fig.savefig(path)
    plt.close(fig)
    return [path]


def test_all_skipped_cells_give_a_skipped_section_with_the_reason(tmp_path, helpers):
    # A reproduction whose cells legitimately cannot run here (data absent) is neither ok nor failed.
    exp = Experiment(name="bnlab-test-skipped", paper="Test et al. 2024", figure="Fig. 9", title="t", claim="c",
                     grid=lambda scale: [{"seed": 0}, {"seed": 1}], run_cell=_skipping_cell, plot=_plot_skipped)
    rep = build_report(tmp_path / "out", results_dir=tmp_path / "res", experiments=[exp], serial=True,
                       progress=False)
    (sec,) = rep.sections
    assert sec.status == "skipped" and rep.ok
    html = rep.index.read_text()
    assert "2 of 2 cells were skipped." in html and "dataset X not present: bnlab data download x" in html
