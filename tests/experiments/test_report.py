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
from bnlab.experiments.spec import Comparison, Experiment

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)


class _Images(HTMLParser):
    def __init__(self):
        super().__init__()
        self.srcs, self.tags, self.links = [], [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag == "img":
            self.srcs.append(dict(attrs)["src"])
        if tag == "a" and dict(attrs).get("href", "").startswith("data:"):
            self.links.append(dict(attrs)["href"])


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
    # one image per figure: the PNG is shown, the SVG of the same figure is a download link
    assert len(parsed.srcs) == 1 and parsed.srcs[0].startswith("data:image/png")
    assert len(parsed.links) == 1 and parsed.links[0].startswith("data:image/svg+xml")
    kinds = set()
    for src in parsed.srcs + parsed.links:
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
        ".figures.json", "squares.png", "squares.svg"]  # the manifest lets a later report reuse them


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
  document.body.setAttribute("data-verdicts", document.querySelectorAll("section.experiment h3 .badge").length);
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
    return {k: int(v) for k, v in re.findall(r'data-(images|loaded|sections|verdicts)="(\d+)"', body.group(1))}


def _screenshot(page: Path, tmp_path: Path) -> Path:
    shot = tmp_path / "screenshot.png"
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={tmp_path / 'chromium-profile'}", "--window-size=1200,3000",
           "--virtual-time-budget=10000", f"--screenshot={shot}", page.resolve().as_uri()]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and shot.is_file(), out.stderr[-2000:]
    return shot


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (Debian package 'chromium')")
def test_report_renders_in_headless_chromium(report, tmp_path):
    html = report.index.read_text()
    # The check script goes into a copy beside index.html, so the page itself stays script-free.
    page = report.index.with_name("render-check.html")
    page.write_text(html.replace("</body>", _CHECK + "</body>"))
    counts = _render_counts(page, tmp_path)
    assert counts == {"images": 1, "loaded": 1, "sections": 3, "verdicts": 3}  # no section without a verdict
    # Negative control: the same check sees a figure that cannot load.
    broken = page.with_name("render-broken.html")
    broken.write_text(re.sub(r'src="data:image/png[^"]*"', 'src="figures/missing.png"', page.read_text(), count=1))
    assert _render_counts(broken, tmp_path) == {"images": 1, "loaded": 0, "sections": 3, "verdicts": 3}
    # The screenshot shows the page: the figure's pixels (its plotted line) and the coloured badges are
    # there, not a blank render.
    from PIL import Image

    img = Image.open(_screenshot(report.index, tmp_path)).convert("RGB")
    colours = img.getcolors(maxcolors=1 << 20) or []
    assert img.size == (1200, 3000) and len(colours) > 50
    red_badge = (0xCF, 0x22, 0x2E)  # --bad: the error verdict badge of the broken-grid section
    assert any(rgb == red_badge for _, rgb in colours)


def test_verdicts_badges_counts_and_json_from_known_disagreements(tmp_path, test_env):
    """Stored results with known agreements (tests/experiments/_verdict_helpers.py) get the verdicts
    they must: on the badges, in the summary counts and in report.json."""
    from tests.experiments import _verdict_helpers as vh

    rep = build_report(tmp_path / "out", results_dir=tmp_path / "res", experiments=vh.EXPERIMENTS, serial=True,
                       progress=False)
    assert {s.name: s.verdict for s in rep.sections} == vh.EXPECTED
    assert rep.ok and not rep.all_reproduced  # every cell ran, but not every claim is reproduced
    by_name = {s.name: s for s in rep.sections}
    assert by_name["bnlab-test-two-of-five"].verdict_reason == "2 of 5 checked rows agree"
    # distinct reasons, each once, on one line (the page and the terminal table show the verdict inline)
    assert by_name["bnlab-test-data-missing"].verdict_reason == f"{vh.SKIP_REASON}; {vh.SKIP_REASON_2}"
    assert by_name["bnlab-test-data-missing"].figures == []  # no placeholder figure for a skipped section
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    assert data["verdicts"] == {"reproduced": 1, "partly": 1, "not_reproduced": 1, "not_judged": 1, "skipped": 1,
                                "error": 1}
    assert by_name["bnlab-test-unjudged"].verdict_reason == (
        "none of 2 rows could be judged: too close to call (0); too close to call (1)")
    assert [s["verdict"] for s in data["sections"]] == list(vh.EXPECTED.values())
    assert data["all_reproduced"] is False
    html = rep.index.read_text()
    # the section badges: one per section heading, in the verdict's colour class
    badges = re.findall(r'<h3>[^<]*<span class="badge v-(\w+)">([\w ]+)</span></h3>', html)
    assert badges == [(v, v.replace("_", " ")) for v in vh.EXPECTED.values()]
    # the summary's counts and table
    assert '<span class="badge v-partly">partly</span> 1' in html
    assert html.count('<td class="num">2 of 5</td>') == 1 and "– (skipped)" in html
    assert html.count('<td class="num">0 of 0 (2 too close to call)</td>') == 1
    # the scale table and the checks are on the page
    assert "<td>width</td><td>384</td><td>128<br>" in html and "agrees when the numbers match" in html
    # a skipped section has no image; the five others have one each
    assert len(_parse(html).srcs) == 5


def test_strict_exit_code_follows_the_verdicts(tmp_path, test_env, capsys):
    from bnlab.cli import main
    from tests.experiments import _verdict_helpers as vh

    def report(*names, strict=True):
        argv = ["report", "--only", *[f"{vh.__name__}:{n}" for n in names], "--results-dir", str(tmp_path / "res"),
                "--out", str(tmp_path / "out"), "--serial", "--no-progress"] + (["--strict"] if strict else [])
        code = main(argv)
        capsys.readouterr()
        return code

    assert report("bnlab-test-all-agree", "bnlab-test-data-missing") == 0  # skipped does not count against
    assert report("bnlab-test-all-agree", "bnlab-test-two-of-five") == 1  # partly is not reproduced
    assert report("bnlab-test-none-agree") == 1 and report("bnlab-test-unjudged") == 1  # not_judged fails too
    assert report("bnlab-test-no-rows") == 1
    assert report("bnlab-test-none-agree", strict=False) == 0  # without --strict verdicts do not set the exit code
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), pytest.raises(SystemExit):
        main(["report", "--help"])
    assert "unless every reproduction that is not skipped has the verdict 'reproduced'" in " ".join(buf.getvalue().split())
    # bnlab reproduce prints the verdict and honours --strict the same way
    ref = f"{vh.__name__}:bnlab-test-two-of-five"
    common = [ref, "--results-dir", str(tmp_path / "res"), "--out", str(tmp_path / "figs"), "--serial", "--no-progress"]
    assert main(["reproduce", *common]) == 0
    assert "bnlab-test-two-of-five: partly — 2 of 5 checked rows agree" in capsys.readouterr().out
    assert main(["reproduce", *common, "--strict"]) == 1
    capsys.readouterr()


def test_verdict_rules():
    from bnlab.experiments.report import verdict

    rows = lambda *a: [{"agrees": x} for x in a]  # noqa: E731
    assert verdict("ok", rows(True, True, None)) == ("reproduced", "2 of 2 checked rows agree")
    assert verdict("ok", rows(True, False))[0] == "partly"
    assert verdict("ok", rows(False, None))[0] == "not_reproduced"
    assert verdict("ok", rows(None)) == ("not_judged", "none of 1 rows could be judged: no criterion")
    assert verdict("ok", [{"agrees": None, "reason": "too close"}] * 2) == (
        "not_judged", "none of 2 rows could be judged: too close")
    assert verdict("ok", [])[0] == "error"
    # a row too close to call could have disagreed: all judged rows agreeing is then only partly
    close = {"agrees": None, "reason": "too close to call on one seed: …", "too_close_to_call": True}
    assert verdict("ok", rows(True, True, None) + [close]) == (
        "partly", "2 of 2 checked rows agree, but 1 row too close to call")
    assert verdict("ok", rows(True, False) + [close]) == ("partly", "1 of 2 checked rows agree (1 more too close to call)")
    assert verdict("ok", rows(False) + [close]) == ("not_reproduced", "0 of 1 checked rows agree (1 more too close to call)")
    assert verdict("ok", [close, close]) == ("not_judged", "none of 2 rows could be judged: too close to call on one seed")
    with pytest.raises(ValueError, match="too_close_to_call=True needs agrees=None"):
        Comparison("q", "p", "b", True, too_close_to_call=True)
    # nothing judged and cells failed: the failure, not the rows, is the verdict
    assert verdict("partial", rows(None), failed_cells=2) == (
        "error", "no comparison row could be judged, and 2 cells failed")
    assert verdict("skipped", rows(True), skip_reason="no data") == ("skipped", "no data")
    assert verdict("error", [], errors=[{"what": "The sweep could not run."}]) == ("error", "The sweep could not run.")
    # rows that all agree but rest on part of the grid are only "partly"
    assert verdict("partial", rows(True), failed_cells=2) == ("partly", "1 of 1 checked rows agree, but 2 cells failed")
    assert verdict("partial", rows(True), errors=[{"what": "plot() raised."}])[0] == "partly"


def test_report_writes_a_claim_ledger_page_per_paper(report, tmp_path):
    from bnlab import claims

    out = report.index.parent
    html = report.index.read_text()
    data = json.loads((out / "report.json").read_text())
    led = data["claims"]
    assert led["counts"]["claims"] == len(claims.all_claims())
    for key in claims.PAPERS:
        page = out / f"claims-{key}.html"
        text = page.read_text()
        assert f'href="claims-{key}.html"' in html  # linked from the summary's counts table
        # every claim of the paper is a row, with its id as the anchor; nothing is fetched
        assert text.count('<tr id="') == len(claims.claims_of(key))
        assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text)
    # this report runs none of the papers' reproductions: their checks are "not run", tests "tested"
    rows = {c["id"]: c for p in led["papers"] for c in p["claims"]}
    assert rows["yang2019/fig3a"]["verdict"] == "not run"  # only reproduction checks, none ran here
    assert rows["yang2019/thm3.10"]["verdict"] == "tested"  # its reproduction did not run; its tests exist
    assert rows["lange/prop2"]["verdict"] == "tested"
    assert rows["fisher/small-terms"]["verdict"] == "not checked" and rows["fisher/small-terms"]["not_checked"]


_LEDGER_CHECK = """<script>window.addEventListener("load", function () {
  document.body.setAttribute("data-rows", document.querySelectorAll("table.ledger tr[id]").length);
  document.body.setAttribute("data-badges", document.querySelectorAll("table.ledger .badge").length);
});</script>"""


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (Debian package 'chromium')")
def test_claim_ledger_page_renders_in_headless_chromium(report, tmp_path):
    from bnlab import claims

    page = report.index.with_name("claims-lange.html")
    check = page.with_name("ledger-check.html")
    check.write_text(page.read_text().replace("</body>", _LEDGER_CHECK + "</body>"))
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-sync",
           "--disable-background-networking", "--disable-component-update",
           f"--user-data-dir={tmp_path / 'chromium-profile'}", "--virtual-time-budget=10000", "--dump-dom",
           check.resolve().as_uri()]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    body = re.search(r"<body([^>]*)>", out.stdout).group(1)
    got = {k: int(v) for k, v in re.findall(r'data-(rows|badges)="(\d+)"', body)}
    n = len(claims.claims_of("lange"))
    assert got["rows"] == n and got["badges"] >= n  # every claim has its verdict badge
    from PIL import Image

    img = Image.open(_screenshot(page, tmp_path)).convert("RGB")
    colours = img.getcolors(maxcolors=1 << 20) or []
    assert len(colours) > 50
    assert any(rgb == (0x09, 0x69, 0xDA) for _, rgb in colours)  # the blue "tested" badges are drawn
