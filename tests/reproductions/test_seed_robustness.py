"""Verdicts that rest on one seed must not rest on a lucky one (slow).

Each reproduction listed here is ``reproduced`` at ``small`` scale on one seed per cell (or a fixed set of
seeds).  Its small grid is run twice, with its own seeds and with every seed moved by one, and each judged row
must read the same both times.  ``lange-cnn-min-batch`` is why (docs/optim.md): on one seed its Batch Renorm
row agreed on one CPU and not on another, and five seeds showed the agreement was seed 0's alone; it now
judges the means of three seeds; run through this check with seed 0 alone, both of its rows agree with seeds 0
and both disagree with seeds 1 (measured).  Measured 2026-11-28 on the 2-core AVX-512 machine: every row of the
reproductions below reads the same under the shift (3 min 13 s for the list, one thread).
"""
from __future__ import annotations

import re

import pytest
import torch

from bnlab.experiments.registry import get_experiment
from bnlab.experiments.spec import Record, cell_tasks

ONE_SEED_REPRODUCED = [
    "daneshmand2020-fig1", "daneshmand2020-fig2", "daneshmand2020-fig3a", "daneshmand2020-fig5",
    "daneshmand2020-fig89", "daneshmand2020-lemma3", "yang2019-fig1ab", "yang2019-fig3b", "yang2019-fig4",
    "yang2019-fig5b", "yang2019-width", "lange-fig5", "fisher-lambda-measured", "advise-validation",
]


def _shifted(params: dict, shift: int) -> dict:
    p = dict(params)
    if isinstance(p.get("seeds"), list):
        p["seeds"] = [s + shift for s in p["seeds"]]
    elif "seed" in p:
        p["seed"] = p["seed"] + shift
    return p


def _judged_rows(exp, shift: int) -> dict[str, bool]:
    cells = [_shifted(dict(c, device="cpu") if exp.uses_gpu else dict(c), shift) for c in exp.grid("small")]
    records = []
    for task in cell_tasks(exp, cells, "small"):
        group = [cells[i] for i in task]
        metrics = exp.run_group(group) if len(group) > 1 else [exp.run_cell(group[0])]
        records += [Record(p, m) for p, m in zip(group, metrics)]
    if all(r.metrics.get("skipped") for r in records):
        pytest.skip(f"{exp.name}: every cell skipped ({records[0].metrics.get('skip_reason')})")
    # a row that names its seed ("(seed 0)") is the same row under the shift
    return {re.sub(r"\(seed \d+\)", "(seed)", r.quantity): r.agrees for r in exp.compare(records)
            if r.agrees is not None}


@pytest.mark.slow
@pytest.mark.parametrize("name", ONE_SEED_REPRODUCED)
def test_a_one_seed_verdict_reads_the_same_with_the_next_seed(name):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        exp = get_experiment(name)
        own, shifted = _judged_rows(exp, 0), _judged_rows(exp, 1)
    finally:
        torch.set_num_threads(threads)
    assert own and own.keys() == shifted.keys()
    assert all(own.values()), {q: a for q, a in own.items() if not a}  # still reproduced with its own seeds
    assert own == shifted, {q: (own[q], shifted[q]) for q in own if own[q] != shifted[q]}
