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


#: A report's ``report.json`` is a few hundred kB; anything far larger is not one (and is not read whole).
MAX_REPORT_BYTES = 64 << 20


def _report_rows(folder: str) -> dict[str, dict]:
    """``{claim id: row}`` from the ``claims`` part of ``<folder>/report.json``, every row checked: the file
    may have been planted or edited, and its verdicts are printed and counted as they stand."""
    from bnlab.claims import VERDICTS

    path = Path(folder) / "report.json"
    if not path.is_file():
        raise ValueError(f"--report {folder!r} is not allowed: {path} does not exist (run `bnlab report --out "
                         f"{folder}` first)")
    if path.stat().st_size > MAX_REPORT_BYTES:
        raise ValueError(f"--report {folder!r} is not allowed: {path} is larger than a report's "
                         f"({path.stat().st_size} bytes > {MAX_REPORT_BYTES})")

    def no_constant(name):  # NaN and ±Infinity are no verdicts (json.loads would accept them)
        raise ValueError(f"{name} is not JSON")

    try:
        data = json.loads(path.read_text(encoding="utf-8"), parse_constant=no_constant)
        rows = [c for p in data["claims"]["papers"] for c in p["claims"]]
        for c in rows:
            if not (isinstance(c, dict) and isinstance(c["id"], str) and c["verdict"] in VERDICTS
                    and isinstance(c["links"], list) and all(isinstance(x, dict) for x in c["links"])):
                raise ValueError(f"a claim row {str(c)[:200]!r} is not a claim's verdict (verdicts: {VERDICTS})")
        return {c["id"]: c for c in rows}
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        why = f"no key {exc}" if isinstance(exc, KeyError) else str(exc)[:300]
        raise ValueError(f"--report {folder!r} is not allowed: {path} holds no claim ledger ({why})") from None


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
