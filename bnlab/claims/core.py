"""The claim ledger's data model: one :class:`Claim` per checkable statement of a paper, and the rules
that tie a claim to what checks it in bnlab.

A claim is *checked* when it names at least one pytest node id (``tests``) or one reproduction check
(``checks``, written ``"<reproduction>: <check name>"`` with the name of one of the reproduction's
:class:`~bnlab.experiments.spec.Check`\\ s); it is *not checked* otherwise, and then says why
(``not_checked``).  A checked claim states how strongly (:data:`STRENGTHS`).  Adding a claim is one
``Claim(...)`` entry in the paper's module; linking a test is one string in its ``tests``.

:func:`validate` (run by ``tests/test_claims.py``) fails when a listed test or check does not exist and
when a reproduction declares a check that no claim links; :func:`claim_verdicts` turns a report's
sections into a verdict per claim (the report's ledger pages and ``bnlab claims --report``).
"""
from __future__ import annotations

import ast
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

__all__ = ["Claim", "Paper", "KINDS", "STRENGTHS", "STATUSES", "VERDICTS", "validate", "claim_verdicts",
           "check_link", "summarize"]

#: What kind of statement a claim is.
KINDS = ("formula", "figure", "table", "algorithm", "headline")

#: How strongly bnlab checks a claim, weakest last: a closed form or exact identity tested against an
#: independent route; a simulation (Monte Carlo, finite networks) of the quantity the claim is about;
#: a reduced experiment that stands in for the paper's (smaller data, nets, budgets, another data set);
#: the paper's own experiment at its size.
STRENGTHS = ("exact formula", "simulation", "small-scale stand-in", "paper scale")

#: A claim is checked (a test or a reproduction check exists) or not checked (with the reason).
STATUSES = ("checked", "not_checked")

#: The verdict of a claim in one report run (see :func:`claim_verdicts`).
VERDICTS = ("agrees", "partly", "disagrees", "not judged", "tested", "not run", "not checked")


@dataclass(frozen=True)
class Paper:
    """One of the four papers: its key (the prefix of its reproductions' names) and citation."""

    key: str  # "yang2019", "daneshmand2020", "fisher", "lange"
    title: str
    short: str  # for headings: "Yang et al. 2019"


@dataclass(frozen=True)
class Claim:
    """One claim of a paper and where bnlab checks it.

    Attributes
    ----------
    id:
        Unique in the ledger, ``"<paper key>/<short id>"`` (e.g. ``"yang2019/thm3.10"``).
    where:
        The paper's location: section, equation, theorem, figure panel (``"§3.1.2, Thm 3.10, Eq. 19"``).
    statement:
        The claim in one line, as the paper states it.
    kind:
        One of :data:`KINDS`.
    tests:
        pytest node ids that check it (``"tests/theory/test_backward.py::test_relu_rate…"``).
    checks:
        Reproduction checks that judge it, ``"<reproduction>: <check name>"``.
    strength:
        One of :data:`STRENGTHS` when checked (the strongest of its checks), else ``""``.
    not_checked:
        Why nothing checks it (``"needs ImageNet"``), only when it has no tests and no checks.
    note:
        What a reader must know beside the verdict: an erratum, a contradiction measured here, what
        the stand-in changes.
    """

    id: str
    where: str
    statement: str
    kind: str
    tests: tuple[str, ...] = ()
    checks: tuple[str, ...] = ()
    strength: str = ""
    not_checked: str = ""
    note: str = ""

    def __post_init__(self):
        # lists are accepted in the data modules; stored as tuples so a Claim stays hashable
        object.__setattr__(self, "tests", tuple(self.tests))
        object.__setattr__(self, "checks", tuple(self.checks))

    @property
    def paper(self) -> str:
        return self.id.split("/", 1)[0]

    @property
    def status(self) -> str:
        return "checked" if (self.tests or self.checks) else "not_checked"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "paper": self.paper, "status": self.status}


def check_link(link: str) -> tuple[str, str]:
    """``"yang2019-fig3a: max trainable depth at"`` → ``("yang2019-fig3a", "max trainable depth at")``."""
    name, sep, check = link.partition(":")
    if not sep or not name.strip() or not check.strip():
        raise ValueError(f"check link {link!r} is not allowed: write '<reproduction>: <check name>'")
    return name.strip(), check.strip()


# --------------------------------------------------------------------------------------------- validation
def _test_functions(path: Path) -> set[str]:
    """``{"test_f", "TestC::test_m"}``: the test functions a test file defines (parsed, not imported)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.add(node.name)
        elif isinstance(node, ast.ClassDef):
            out.update(f"{node.name}::{f.name}" for f in node.body
                       if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)))
    return out


def validate(claims: Sequence[Claim], checks_by_experiment: Mapping[str, Iterable[str]],
             repo_root: str | Path | None = None) -> list[str]:
    """Every problem of the ledger, as readable lines (empty when it is sound).

    ``checks_by_experiment`` maps each registered reproduction to the names of its declared checks.
    ``repo_root`` (the folder holding ``tests/``) enables the test node id check; without it test
    ids are only checked for their form.  Problems: duplicate ids, an unknown kind or strength, a
    checked claim without a strength or with a not-checked reason, an unchecked one without a reason,
    a test node id whose file or function does not exist, a check link to an unknown reproduction or
    check, and a reproduction check that no claim links.
    """
    problems: list[str] = []
    seen: set[str] = set()
    linked: set[tuple[str, str]] = set()
    files: dict[Path, set[str] | None] = {}
    root = Path(repo_root) if repo_root is not None else None
    known = {k: set(v) for k, v in checks_by_experiment.items()}
    for c in claims:
        where = f"claim {c.id!r}"
        if c.id in seen:
            problems.append(f"{where}: the id is used twice")
        seen.add(c.id)
        if "/" not in c.id:
            problems.append(f"{where}: the id must be '<paper>/<short id>'")
        if c.kind not in KINDS:
            problems.append(f"{where}: kind {c.kind!r} is not one of {KINDS}")
        if not c.where.strip() or not c.statement.strip():
            problems.append(f"{where}: location and statement must not be empty")
        if c.status == "checked":
            if c.strength not in STRENGTHS:
                problems.append(f"{where}: a checked claim needs a strength from {STRENGTHS}, got {c.strength!r}")
            if c.not_checked:
                problems.append(f"{where}: it is checked, so it cannot also give a not-checked reason")
        else:
            if not c.not_checked.strip():
                problems.append(f"{where}: nothing checks it, so it must say why (not_checked)")
            if c.strength:
                problems.append(f"{where}: nothing checks it, so it has no strength")
        for node in c.tests:
            file, sep, func = node.partition("::")
            if not sep or not file.startswith("tests/") or not file.endswith(".py") or not func:
                problems.append(f"{where}: test {node!r} is not a node id 'tests/…/test_x.py::test_name'")
                continue
            if root is None:
                continue
            path = root / file
            if path not in files:
                files[path] = _test_functions(path) if path.is_file() else None
            defined = files[path]
            if defined is None:
                problems.append(f"{where}: test file {file} does not exist")
            elif func.split("[", 1)[0] not in defined:
                problems.append(f"{where}: {file} defines no test {func.split('[', 1)[0]!r}")
        for link in c.checks:
            try:
                exp, check = check_link(link)
            except ValueError as exc:
                problems.append(f"{where}: {exc}")
                continue
            if exp not in known:
                problems.append(f"{where}: no reproduction {exp!r} is registered")
            elif check not in known[exp]:
                problems.append(f"{where}: {exp} declares no check {check!r} (it declares {sorted(known[exp])})")
            else:
                linked.add((exp, check))
    for exp, names in sorted(known.items()):
        for name in sorted(names):
            if (exp, name) not in linked:
                problems.append(f"reproduction check {exp}: {name!r} is in no claim of the ledger")
    return problems


# --------------------------------------------------------------------------------------------- verdicts
@dataclass
class LinkResult:
    """What one ``"<reproduction>: <check>"`` link of a claim says in a report run."""

    link: str
    verdict: str  # agrees | partly | disagrees | not judged | not run
    rows: list[dict] = field(default_factory=list)  # the matched comparison rows
    why: str = ""


def _link_result(link: str, sections: Mapping[str, Mapping[str, Any]], match) -> LinkResult:
    exp, check = check_link(link)
    sec = sections.get(exp)
    if sec is None:
        return LinkResult(link, "not run", why=f"{exp} is not in this report")
    if sec.get("verdict") == "skipped":
        return LinkResult(link, "not run", why=f"{exp} was skipped: {sec.get('verdict_reason', '')}")
    names = [c["name"] for c in sec.get("checks", [])]
    rows = [r for r in sec.get("comparisons", []) if match(r["quantity"], names) == check]
    judged = [r for r in rows if r.get("agrees") is not None]
    if not rows:
        why = "no row of this check in the run" + (f" ({sec.get('verdict_reason')})" if sec.get("verdict") == "error"
                                                    else "")
        return LinkResult(link, "not judged", rows, why)
    if not judged:
        reasons = sorted({r.get("reason") or "no reason given" for r in rows})
        return LinkResult(link, "not judged", rows, "; ".join(reasons))
    ok = sum(bool(r["agrees"]) for r in judged)
    verdict = "agrees" if ok == len(judged) else "disagrees" if ok == 0 else "partly"
    close = sum(bool(r.get("too_close_to_call")) for r in rows)
    why = f"{ok} of {len(judged)} rows agree" + (f", {close} too close to call" if close else "")
    if close and verdict == "agrees":  # a row too close to call could have disagreed (report.verdict's rule)
        verdict = "partly"
    return LinkResult(link, verdict, rows, why)


def claim_verdicts(claims: Sequence[Claim], sections: Mapping[str, Mapping[str, Any]], match) -> list[dict]:
    """One dict per claim: the claim (:meth:`Claim.to_dict`), ``verdict`` and the per-link results.

    ``sections`` maps a reproduction's name to its report section as a dict (``comparisons``,
    ``checks``, ``verdict``); ``match(quantity, check_names)`` names the check a row belongs to
    (:func:`bnlab.experiments.spec.check_for`).  A claim's verdict comes from its reproduction checks'
    rows — every judged row agrees: ``agrees`` (``partly`` where a row is too close to call, as in the
    report's verdicts); some: ``partly``; none: ``disagrees``; rows without a criterion only: ``not judged``,
    with their reasons — else ``tested`` (tests only), ``not run`` (its
    reproductions are not in the report) or ``not checked``.
    """
    out = []
    for c in claims:
        links = [_link_result(link, sections, match) for link in c.checks]
        judged = [r for r in links if r.verdict in ("agrees", "partly", "disagrees")]
        if judged:
            kinds = {r.verdict for r in judged}
            verdict = "agrees" if kinds == {"agrees"} else "disagrees" if kinds == {"disagrees"} else "partly"
            if verdict == "agrees" and any(row.get("too_close_to_call") for r in links for row in r.rows):
                verdict = "partly"  # a link's rows too close to call: checked, not settled
        elif any(r.verdict == "not judged" for r in links):
            verdict = "not judged"
        elif c.tests:
            verdict = "tested"
        elif links:
            verdict = "not run"
        else:
            verdict = "not checked"
        out.append({**c.to_dict(), "verdict": verdict, "tested": bool(c.tests),
                    "links": [asdict(r) for r in links]})
    return out


def summarize(rows: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Counts of a ledger (claims or :func:`claim_verdicts` rows): total, per status, per verdict."""
    rows = list(rows)
    counts = {"claims": len(rows)}
    for s in STATUSES:
        counts[s] = sum(r["status"] == s for r in rows)
    if rows and "verdict" in rows[0]:
        for v in VERDICTS:
            counts[v] = sum(r["verdict"] == v for r in rows)
    return counts
