"""Run a reproduction's whole small grid in this process, plot it and return its comparison rows."""
from __future__ import annotations

from bnlab.experiments.spec import Record


def small_scale_rows(exp, outdir):
    records = [Record(p, exp.run_cell(p)) for p in exp.grid("small")]
    paths = exp.plot(records, outdir)
    assert paths and all(p.exists() for p in paths)
    return exp.compare(records)
