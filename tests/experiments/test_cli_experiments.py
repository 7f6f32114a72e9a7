"""``bnlab sweep|reproduce|report`` parse, call the library and print (JSON checked against the store)."""
import json

import pandas as pd
import pytest

from bnlab.cli import main
from bnlab.experiments import ResultsStore


def _json(capsys, argv, code=0):
    assert main(argv) == code
    return json.loads(capsys.readouterr().out)


def test_sweep_commands(tmp_path, test_env, helper_ref, capsys, monkeypatch):
    monkeypatch.setenv("BNLAB_TEST_FAIL", "2")
    res = str(tmp_path / "res")
    out = _json(capsys, ["sweep", "run", helper_ref, "--results-dir", res, "--serial", "--no-progress", "--json"])
    assert (out["total"], out["done"], out["failed"], out["complete"]) == (6, 5, 1, True)
    store = out["store"]
    with ResultsStore(store, readonly=True) as st:
        assert st.counts() == {"pending": 0, "running": 0, "done": 5, "failed": 1}
    status = _json(capsys, ["sweep", "status", "bnlab-test-sweep", "--results-dir", res, "--json"])
    assert status["counts"]["failed"] == 1 and status["failures"][0]["params"]["i"] == 2
    assert main(["sweep", "status", store]) == 0
    assert "ValueError: cell 2 fails on purpose" in capsys.readouterr().out
    monkeypatch.setenv("BNLAB_TEST_FAIL", "")
    again = _json(capsys, ["sweep", "resume", store, "--serial", "--retry-failed", "--no-progress", "--json"])
    assert (again["executed"], again["reused"], again["done"]) == (1, 5, 6)
    exp = _json(capsys, ["sweep", "export", store, "--output", str(tmp_path / "c.parquet"), "--json"])
    assert len(pd.read_parquet(exp["output"])) == 6


def test_cli_bad_input_exits_2(tmp_path, test_env, capsys):
    with pytest.raises(SystemExit) as e:
        main(["sweep", "run", "no-such-experiment", "--results-dir", str(tmp_path), "--serial"])
    assert e.value.code == 2 and "unknown experiment 'no-such-experiment'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["sweep", "status", str(tmp_path / "missing.sqlite")])
    assert e.value.code == 2 and "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["sweep", "run", "x", "--workers", "0"])
    assert e.value.code == 2


def test_reproduce_and_report_commands(tmp_path, test_env, helper_ref, capsys, helpers):
    listing = _json(capsys, ["reproduce", "--list", "--json"])
    assert set(listing) == {"experiments", "broken_modules"}
    res, out = str(tmp_path / "res"), tmp_path / "figs"
    sec = _json(capsys, ["reproduce", helper_ref, "--results-dir", res, "--out", str(out), "--serial",
                         "--no-progress", "--json"])
    assert sec["status"] == "ok" and sec["done"] == 6 and {c["quantity"] for c in sec["comparisons"]} >= {"sum of squares"}
    assert all((out / "figures" / "bnlab-test-sweep" / n).is_file() for n in ("squares.png", "squares.svg"))
    plotfail = f"{helpers.__name__}:bnlab-test-plotfail"
    rep = _json(capsys, ["report", "--only", helper_ref, plotfail, "--results-dir", res, "--out",
                         str(tmp_path / "rep"), "--serial", "--no-progress", "--json"])
    assert [s["status"] for s in rep["sections"]] == ["ok", "failed"] and not rep["ok"]
    assert [s["reused"] for s in rep["sections"]] == [6, 0]
    assert (tmp_path / "rep" / "index.html").is_file()
    assert main(["report", "--only", helper_ref, plotfail, "--results-dir", res, "--out", str(tmp_path / "rep"),
                 "--serial", "--no-progress", "--strict"]) == 1
