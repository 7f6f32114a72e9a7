"""Test reproductions with known agreements, for the verdicts of the report (importable as ``module:NAME``).

Each runs the cheap cells of :mod:`tests.experiments._helpers` and returns comparison rows whose
``agrees`` values are fixed, so the verdict each must get is known in advance:

==========================  =====================  ================
experiment                  rows agreeing          verdict
==========================  =====================  ================
bnlab-test-all-agree        2 of 2 (+ 1 unjudged)  reproduced
bnlab-test-two-of-five      2 of 5 (as Fig. 5c)    partly
bnlab-test-none-agree       0 of 2                 not_reproduced
bnlab-test-unjudged         0 of 0 (only None)     not_judged
bnlab-test-no-rows          (no row at all)        error
bnlab-test-data-missing     (every cell skipped)   skipped
==========================  =====================  ================
"""
from __future__ import annotations

from bnlab.experiments.spec import Check, Comparison, Experiment, Setting
from tests.experiments import _helpers

EXPECTED = {
    "bnlab-test-all-agree": "reproduced",
    "bnlab-test-two-of-five": "partly",
    "bnlab-test-none-agree": "not_reproduced",
    "bnlab-test-unjudged": "not_judged",
    "bnlab-test-no-rows": "error",
    "bnlab-test-data-missing": "skipped",
}
SKIP_REASON = "dataset X not present: bnlab data download x"
# a second reason on the odd cells: a skipped section with two distinct reasons, as lange-fig6's two
# panels (CIFAR-10 and CIFAR-100) have
SKIP_REASON_2 = "dataset Y not present: bnlab data download y"


def _rows(*agrees):
    return lambda records: [Comparison(f"row {i}", "paper", "bnlab", a) for i, a in enumerate(agrees)]


def skipping_cell(params: dict) -> dict:
    return {"skipped": True, "skip_reason": SKIP_REASON_2 if params["i"] % 2 else SKIP_REASON}


def plot_must_not_run(records, outdir):
    raise AssertionError("plot() was called for a reproduction whose cells were all skipped")


def _exp(name: str, **kw) -> Experiment:
    base = dict(name=name, paper="Verdict et al. 2025", figure=f"Fig. {len(name)}", title=name, claim="c",
                grid=_helpers.grid, run_cell=_helpers.run_cell, plot=_helpers.plot,
                settings=[Setting("width", paper="384", small="128", paper_scale="384", why="2 CPU cores")],
                checks=[Check("row", "agrees when the numbers match")])
    base.update(kw)
    return Experiment(**base)


EXPERIMENTS = [
    _exp("bnlab-test-all-agree", compare=_rows(True, True, None)),
    _exp("bnlab-test-two-of-five", compare=_rows(True, False, True, False, False)),
    _exp("bnlab-test-none-agree", compare=_rows(False, False)),
    _exp("bnlab-test-unjudged", compare=lambda records: [
        Comparison(f"row {i}", "paper", "bnlab", None, reason=f"too close to call ({i})", too_close_to_call=True)
        for i in range(2)]),
    _exp("bnlab-test-no-rows", compare=lambda records: []),
    _exp("bnlab-test-data-missing", run_cell=skipping_cell, plot=plot_must_not_run, compare=_rows(True)),
]
