"""``bnlab claims``: the claim ledger — every checkable claim of the four papers and where bnlab checks it."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from bnlab.cli._common import print_json, print_table


def add_parser(sub: argparse._SubParsersAction) -> None:
    from bnlab.claims import PAPERS, STATUSES, VERDICTS

    p = sub.add_parser("claims", help="list the papers' claims, what checks each and how strongly (the claim ledger)")
    p.add_argument("--paper", choices=list(PAPERS), default=None, help="one paper (default: all four)")
    p.add_argument("--status", choices=list(STATUSES), default=None,
                   help="checked (a test or a reproduction check exists) or not_checked (with the reason)")
    p.add_argument("--report", default=None, metavar="DIR",
                   help="a `bnlab report` output folder: add each claim's verdict from that run")
    p.add_argument("--verdict", choices=list(VERDICTS), default=None,
                   help="only claims with this verdict in --report's run")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def _report_rows(folder: str) -> dict[str, dict]:
    """``{claim id: row}`` from the ``claims`` part of ``<folder>/report.json``."""
    path = Path(folder) / "report.json"
    if not path.is_file():
        raise ValueError(f"--report {folder!r} is not allowed: {path} does not exist (run `bnlab report --out "
                         f"{folder}` first)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        papers = data["claims"]["papers"]
        return {c["id"]: c for p in papers for c in p["claims"]}
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--report {folder!r} is not allowed: {path} holds no claim ledger ({exc})") from None


def run(args: argparse.Namespace) -> int:
    from bnlab.claims import select, summarize

    if args.verdict and not args.report:
        raise ValueError("--verdict needs --report DIR (verdicts come from a report's run)")
    claims = [c.to_dict() for c in select(args.paper, args.status)]
    if args.report:
        judged = _report_rows(args.report)
        for c in claims:
            row = judged.get(c["id"])
            c["verdict"] = row["verdict"] if row else "not run"
            c["links"] = row["links"] if row else []
        if args.verdict:
            claims = [c for c in claims if c["verdict"] == args.verdict]
    counts = summarize(claims) if claims else {"claims": 0}
    if args.json:
        print_json({"counts": counts, "claims": claims})
        return 0
    rows = []
    for c in claims:
        checked_by = list(c["checks"]) + [t.split("::", 1)[1] for t in c["tests"]]
        what = "; ".join(checked_by) if checked_by else "not checked: " + c["not_checked"]
        row = [c["id"], c["where"], c["kind"], c["strength"] or "-", what]
        if args.report:
            row.append(c["verdict"])
        rows.append(row)
    header = ["claim", "where", "kind", "strength", "checked by"] + (["verdict"] if args.report else [])
    print_table(rows, header=header)
    extra = "" if not args.report else ", " + ", ".join(f"{counts.get(v, 0)} {v}" for v in
                                                         ("agrees", "partly", "disagrees", "not judged", "tested",
                                                          "not run") if counts.get(v))
    print(f"\n{counts['claims']} claims: {counts.get('checked', 0)} checked, {counts.get('not_checked', 0)} not "
          f"checked{extra}")
    return 0
