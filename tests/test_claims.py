"""The claim ledger (bnlab.claims): complete, linked to what exists, and judged by a report's rows.

``test_the_ledger_is_sound`` is the guard of issue 23: it fails when a listed test node id or a
reproduction check does not exist, and when a reproduction declares a check no claim links.  The
validator itself is fed broken ledgers so each of its rules can fail.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bnlab import claims
from bnlab.claims.core import Claim, claim_verdicts, summarize, validate
from bnlab.experiments.registry import list_experiments
from bnlab.experiments.spec import check_for

ROOT = Path(__file__).resolve().parents[1]


def test_the_ledger_is_sound():
    problems = claims.validate_against_registry(ROOT)
    assert not problems, "\n".join(problems)


def test_the_ledger_is_complete_enough():
    every = claims.all_claims()
    assert len(every) >= 120
    counts = {k: summarize(c.to_dict() for c in claims.claims_of(k)) for k in claims.PAPERS}
    assert set(counts) == {"yang2019", "daneshmand2020", "fisher", "lange"}
    for key, n in counts.items():
        assert n["claims"] >= 20 and n["checked"] + n["not_checked"] == n["claims"], key
    for c in every:
        assert c.status in claims.STATUSES
        assert (c.status == "checked") == bool(c.strength) == (not c.not_checked)


def _ledger_counts(paper: str | None) -> list[int]:
    """One row of docs/claims.md's count table, computed from the ledger as the command above it does."""
    c = [x.to_dict() for x in (claims.all_claims() if paper is None else claims.claims_of(paper))]
    return [len(c), sum(x["status"] == "checked" for x in c), sum(bool(x["tests"]) for x in c),
            sum(bool(x["checks"]) for x in c), sum(x["status"] == "not_checked" for x in c),
            *[sum(x["strength"] == s for x in c) for s in claims.STRENGTHS]]


def test_the_counts_on_the_docs_pages_are_the_ledgers():
    """docs/claims.md's table and the README's claim count are numbers of the ledger as it is now (a claim
    added without them fails here, not on the page)."""
    rows = {}
    for line in (ROOT / "docs" / "claims.md").read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 10 and cells[1].isdigit():
            rows[cells[0]] = [int(c) for c in cells[1:]]
    names = {"Yang et al. 2019": "yang2019", "Daneshmand et al. 2020": "daneshmand2020",
             "the Fisher paper": "fisher", "Lange et al.": "lange", "all": None}
    assert set(rows) == set(names), sorted(rows)
    for label, paper in names.items():
        assert rows[label] == _ledger_counts(paper), label
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert f"four papers ({len(claims.all_claims())}: theorems" in readme


def test_every_reproduction_declares_checks_and_limitations():
    bare = {n: (bool(e.checks), bool(e.limitations)) for n, e in list_experiments().items()
            if not n.startswith("bnlab-test") and not (e.checks and e.limitations)}
    assert not bare


def _ledger(**kw):
    base = dict(id="p/c1", where="§1", statement="s", kind="formula")
    return [Claim(**{**base, **kw})]


@pytest.mark.parametrize("claim, needle", [
    (dict(tests=["tests/test_claims.py::test_no_such_test"], strength="exact formula"), "defines no test"),
    (dict(tests=["tests/no_such_file.py::test_x"], strength="exact formula"), "does not exist"),
    (dict(tests=["test_x"], strength="exact formula"), "is not a node id"),
    (dict(checks=["exp-a: no such check"], strength="simulation"), "declares no check"),
    (dict(checks=["exp-z: c"], strength="simulation"), "no reproduction 'exp-z'"),
    (dict(checks=["no colon"], strength="simulation"), "is not allowed"),
    (dict(checks=["exp-a: c"]), "needs a strength"),
    (dict(checks=["exp-a: c"], strength="simulation", not_checked="x"), "cannot also give"),
    (dict(), "must say why"),
    (dict(not_checked="why", strength="simulation"), "has no strength"),
    (dict(kind="theorem", not_checked="why"), "kind 'theorem'"),
])
def test_validate_catches(claim, needle):
    problems = validate(_ledger(**claim), {"exp-a": ["c"]}, ROOT)
    assert any(needle in p for p in problems), problems


def test_validate_catches_an_unlinked_check_and_a_duplicate_id():
    ok = _ledger(checks=["exp-a: c"], strength="simulation")
    assert validate(ok, {"exp-a": ["c"]}, ROOT) == []
    assert any("'d' is in no claim" in p for p in validate(ok, {"exp-a": ["c", "d"]}, ROOT))
    assert any("used twice" in p for p in validate(ok + ok, {"exp-a": ["c"]}, ROOT))
    test_ok = _ledger(tests=["tests/test_claims.py::test_validate_catches"], strength="exact formula")
    assert validate(test_ok, {}, ROOT) == []


def test_check_names_match_rows_by_prefix_with_an_ellipsis_and_the_longest_wins():
    names = ["γ = …: exponent", "BN", "BN without mean subtraction", "η* (…) / measured explosion boundary"]
    assert check_for("γ = 0.1: exponent of mean rank", names) == "γ = …: exponent"
    assert check_for("BN without mean subtraction vs BN", names) == "BN without mean subtraction"
    assert check_for("BN: training accuracy", names) == "BN"
    assert check_for("η* (as printed) / measured explosion boundary, per γ", names).startswith("η*")
    assert check_for("η* (as printed) / no-learning boundary", names) is None
    assert check_for("vanilla: rank", names) is None


def _sections(rows, verdict="partly"):
    return {"exp-a": {"verdict": verdict, "checks": [{"name": "c"}, {"name": "d"}], "comparisons": rows}}


@pytest.mark.parametrize("agrees, want", [([True, True], "agrees"), ([True, False], "partly"),
                                          ([False, False], "disagrees"), ([None, None], "not judged")])
def test_claim_verdicts_follow_the_rows_of_the_linked_check(agrees, want):
    rows = [{"quantity": f"c {i}", "agrees": a, "reason": "grid too short" if a is None else ""}
            for i, a in enumerate(agrees)] + [{"quantity": "d 1", "agrees": False}]
    (out,) = claim_verdicts(_ledger(checks=["exp-a: c"], strength="simulation"), _sections(rows), check_for)
    assert out["verdict"] == want and len(out["links"][0]["rows"]) == 2
    if want == "not judged":
        assert out["links"][0]["why"] == "grid too short"


def test_a_row_too_close_to_call_keeps_a_claim_from_agrees():
    # the report's rule (bnlab.experiments.report.verdict): a row the seeds run cannot decide was checked and could
    # have disagreed, so the agreeing rows beside it make "partly", not "agrees"
    close = {"quantity": "c 2", "agrees": None, "reason": "too close to call on one seed", "too_close_to_call": True}
    rows = [{"quantity": "c 1", "agrees": True}, close]
    (out,) = claim_verdicts(_ledger(checks=["exp-a: c"], strength="simulation"), _sections(rows), check_for)
    assert out["verdict"] == "partly" and out["links"][0]["why"] == "1 of 1 rows agree, 1 too close to call"
    (out,) = claim_verdicts(_ledger(checks=["exp-a: c"], strength="simulation"), _sections([close]), check_for)
    assert out["verdict"] == "not judged" and out["links"][0]["why"] == "too close to call on one seed"
    # a claim with one agreeing link and one whose only row is too close to call
    two = _ledger(checks=["exp-a: c", "exp-a: d"], strength="simulation")
    rows = [{"quantity": "c 1", "agrees": True}, dict(close, quantity="d 1")]
    assert claim_verdicts(two, _sections(rows), check_for)[0]["verdict"] == "partly"
    # a disagreement beside a row too close to call stays a disagreement (nothing is claimed that was not seen)
    rows = [{"quantity": "c 1", "agrees": False}, close]
    (out,) = claim_verdicts(_ledger(checks=["exp-a: c"], strength="simulation"), _sections(rows), check_for)
    assert out["verdict"] == "disagrees" and out["links"][0]["why"] == "0 of 1 rows agree, 1 too close to call"


def test_claim_verdicts_without_rows():
    tested = _ledger(tests=["tests/test_claims.py::test_validate_catches"], strength="exact formula")
    assert claim_verdicts(tested, {}, check_for)[0]["verdict"] == "tested"
    linked = _ledger(checks=["exp-a: c"], strength="simulation")
    assert claim_verdicts(linked, {}, check_for)[0]["verdict"] == "not run"
    assert claim_verdicts(linked, _sections([], verdict="skipped"), check_for)[0]["verdict"] == "not run"
    none = _ledger(not_checked="needs ImageNet")
    assert claim_verdicts(none, {}, check_for)[0]["verdict"] == "not checked"
    both = _ledger(checks=["exp-a: c"], tests=["tests/test_claims.py::test_validate_catches"], strength="simulation")
    (out,) = claim_verdicts(both, _sections([{"quantity": "c", "agrees": True}]), check_for)
    assert out["verdict"] == "agrees" and out["tested"]


def test_select_and_bad_input():
    assert all(c.paper == "lange" and c.status == "not_checked" for c in claims.select("lange", "not_checked"))
    with pytest.raises(ValueError, match="paper"):
        claims.select("smith2021")
    with pytest.raises(ValueError, match="status"):
        claims.select(status="maybe")
    assert claims.paper_of_experiment("lange-fig8") == "lange" and claims.paper_of_experiment("other") is None


class _Out:
    def __init__(self, code, capsys):
        got = capsys.readouterr()
        self.returncode, self.stdout, self.stderr = code, got.out, got.err


def test_cli_lists_filters_and_reads_a_report(tmp_path, capsys):
    from bnlab.cli import main

    def _cli(*args):
        try:
            code = main(["claims", *args])
        except SystemExit as exc:  # argparse and usage errors exit 2
            code = exc.code
        return _Out(code, capsys)

    out = _cli("--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["counts"]["claims"] == len(claims.all_claims()) >= 120
    out = _cli("--paper", "fisher", "--status", "not_checked")
    assert out.returncode == 0 and "fisher/small-terms" in out.stdout and "fisher/claim31-fc" not in out.stdout
    assert _cli("--paper", "nobody").returncode == 2
    bad = _cli("--verdict", "agrees")
    assert bad.returncode == 2 and "--report" in bad.stderr
    assert _cli("--report", str(tmp_path)).returncode == 2  # no report.json there
    # a report's ledger: the verdicts come from it
    rows = [dict(c.to_dict(), verdict="agrees" if c.checks else "tested", links=[]) for c in claims.all_claims()]
    (tmp_path / "report.json").write_text(json.dumps({"claims": {"papers": [{"claims": rows}]}}))
    out = _cli("--report", str(tmp_path), "--verdict", "agrees", "--json")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)["claims"]
    assert got and all(c["verdict"] == "agrees" and c["checks"] for c in got)


@pytest.mark.parametrize("text, why", [
    ('{"claims": {"papers": [{"claims": [{"id": "yang2019/eq8"}]}]}}', "no key 'verdict'"),
    ('{"claims": {"papers": [{"claims": [{"id": "yang2019/eq8", "verdict": "agrees"}]}]}}', "no key 'links'"),
    ('{"claims": {"papers": [{"claims": [{"id": "yang2019/eq8", "verdict": NaN, "links": []}]}]}}', "NaN is not JSON"),
    ('{"claims": {"papers": [{"claims": [{"id": "yang2019/eq8", "verdict": ["x"], "links": []}]}]}}',
     "is not a claim's verdict"),
    ('{"claims": {"papers": [{"claims": [{"id": "yang2019/eq8", "verdict": "\\u001b[31mno", "links": []}]}]}}',
     "is not a claim's verdict"),
    ('{"claims": {"papers": [{"claims": [{"id": 7, "verdict": "agrees", "links": []}]}]}}', "is not a claim's"),
    ("[" * 100_000 + "]" * 100_000, "recursion"),
])
def test_cli_refuses_a_planted_report(tmp_path, capsys, text, why):
    """A report.json that is not a report's ledger is a clean error (exit 2) saying why: before, a row
    without a verdict or links was a KeyError traceback, deep nesting a RecursionError, and a NaN or an
    escape sequence was printed and counted as a verdict."""
    from bnlab.cli import main

    (tmp_path / "report.json").write_text(text)
    try:
        code = main(["claims", "--report", str(tmp_path)])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and "holds no claim ledger" in err and why in err and "Traceback" not in err
