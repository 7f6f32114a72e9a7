"""A small trainability sweep for the plan tests: BN-MLP columns on sklearn's digits, grouped at ``paper``.

Importable by Dask workers and by the plan's child process.  ``BNLAB_TEST_PLAN_STEPS`` sets the training
steps of every cell (default 300) and ``BNLAB_TEST_PLAN_BATCHES`` the BN batch of each column (default
"8,32"), so a test can make the grid longer or more varied without another experiment.
"""
from __future__ import annotations

import os

from bnlab.experiments.spec import Experiment
from bnlab.reproductions.trainability import (column_group, run_trainability_cell, run_trainability_group,
                                              trainability_cost, trainability_shorten)


def grid(scale: str) -> list[dict]:
    steps = int(os.environ.get("BNLAB_TEST_PLAN_STEPS", "300"))
    batches = [int(b) for b in os.environ.get("BNLAB_TEST_PLAN_BATCHES", "8,32").split(",")]
    return [dict(dataset="digits", phi="relu", gamma=1.0, beta=0.0, eps=1e-3, depth=d, width=32, bn_batch=b,
                 batch_size=b, optimizer="sgd", lr=1e-2 * b, n_train=1400, n_test=397, seed=0, steps=steps)
            for b in batches for d in (2, 4, 8)]


COLUMNS = Experiment(name="bnlab-test-plan-columns", paper="p", figure="f", title="digits columns", claim="c",
                     grid=grid, run_cell=run_trainability_cell, plot=lambda records, outdir: [],
                     group=column_group, run_group=run_trainability_group, cost=trainability_cost,
                     shorten=trainability_shorten)
EXPERIMENTS = [COLUMNS]
