"""The claim ledger: every checkable claim of the four papers, and where bnlab checks it.

One module per paper (:mod:`~bnlab.claims.yang2019`, :mod:`~bnlab.claims.daneshmand2020`,
:mod:`~bnlab.claims.fisher`, :mod:`~bnlab.claims.lange`) lists its claims as data
(:class:`~bnlab.claims.core.Claim`): the paper's location, the statement in one line, its kind, the tests and
reproduction checks that check it (or why nothing does) and how strongly.  ``bnlab claims`` prints the
ledger, the report shows it per paper with each claim's verdict from the run, and
``tests/test_claims.py`` keeps it honest (:func:`validate`).  docs/claims.md says how to add a claim or
link a test.
"""
from __future__ import annotations

from typing import Sequence

from bnlab._validation import check_choice
from bnlab.claims import daneshmand2020, fisher, lange, yang2019
from bnlab.claims.core import (KINDS, STATUSES, STRENGTHS, VERDICTS, Claim, Paper, check_link, claim_verdicts,
                               summarize, validate)

__all__ = ["Claim", "Paper", "KINDS", "STRENGTHS", "STATUSES", "VERDICTS", "PAPERS", "all_claims", "claims_of",
           "paper_of_experiment", "validate", "validate_against_registry", "claim_verdicts", "check_link",
           "summarize", "select"]

_MODULES = (yang2019, daneshmand2020, fisher, lange)

#: The four papers by key, in the order the report shows them.
PAPERS: dict[str, Paper] = {m.PAPER.key: m.PAPER for m in _MODULES}


def all_claims() -> list[Claim]:
    """Every claim of the ledger, paper by paper in :data:`PAPERS` order."""
    return [c for m in _MODULES for c in m.CLAIMS]


def claims_of(paper: str) -> list[Claim]:
    """The claims of one paper (a key of :data:`PAPERS`)."""
    check_choice("paper", paper, tuple(PAPERS))
    return [c for c in all_claims() if c.paper == paper]


def select(paper: str | None = None, status: str | None = None) -> list[Claim]:
    """The claims of ``paper`` (all papers when None) with ``status`` (``checked``/``not_checked``, or all)."""
    claims = claims_of(paper) if paper is not None else all_claims()
    if status is not None:
        check_choice("status", status, STATUSES)
        claims = [c for c in claims if c.status == status]
    return claims


def paper_of_experiment(name: str) -> str | None:
    """The paper key a reproduction belongs to, read off its name's prefix (``"lange-fig8"`` → ``"lange"``)."""
    for key in PAPERS:
        if name.startswith(key + "-"):
            return key
    return None


def validate_against_registry(repo_root=None, claims: Sequence[Claim] | None = None) -> list[str]:
    """:func:`validate` the ledger against the registered reproductions (and the tests under ``repo_root``)."""
    from bnlab.experiments.registry import list_experiments

    checks = {name: [c.name for c in exp.checks] for name, exp in list_experiments().items()}
    return validate(all_claims() if claims is None else claims, checks, repo_root)
