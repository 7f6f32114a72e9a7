"""A small trainability sweep for the plan tests: BN-MLP columns on sklearn's digits, grouped at ``paper``.

Importable by Dask workers and by the plan's child process.  ``BNLAB_TEST_PLAN_STEPS`` sets the training
steps of every cell (default 300) and ``BNLAB_TEST_PLAN_BATCHES`` the BN batch of each column (default
"8,32"), so a test can make the grid longer or more varied without another experiment.

``COSTED`` is the engine's test sweep (``tests/experiments/_helpers.py``) with cost and shorten hooks:
100 steps per cell that each sleep ``BNLAB_TEST_STEP_SLEEP`` seconds (default 0), cells 0–2 twice the
work per step of cells 3–5 — for a pilot stopped while it runs a task cut to a few steps.
"""
from __future__ import annotations

import os
import time

from bnlab.experiments.spec import Experiment, TaskCost
from bnlab.reproductions.trainability import (ensemble_group, run_trainability_cell, run_trainability_group,
                                              trainability_cost, trainability_shorten)


def grid(scale: str) -> list[dict]:
    steps = int(os.environ.get("BNLAB_TEST_PLAN_STEPS", "300"))
    batches = [int(b) for b in os.environ.get("BNLAB_TEST_PLAN_BATCHES", "8,32").split(",")]
    return [dict(dataset="digits", phi="relu", gamma=1.0, beta=0.0, eps=1e-3, depth=d, width=32, bn_batch=b,
                 batch_size=b, optimizer="sgd", lr=1e-2 * b, n_train=1400, n_test=397, seed=0, steps=steps)
            for b in batches for d in (2, 4, 8)]


COLUMNS = Experiment(name="bnlab-test-plan-columns", paper="p", figure="f", title="digits columns", claim="c",
                     grid=grid, run_cell=run_trainability_cell, plot=lambda records, outdir: [],
                     group=ensemble_group, run_group=run_trainability_group, cost=trainability_cost,
                     shorten=trainability_shorten)


def _costed_grid(scale: str) -> list[dict]:
    from ._helpers import grid as sweep_grid

    step_sleep = float(os.environ.get("BNLAB_TEST_STEP_SLEEP", "0"))
    return [dict(c, steps=100, step_sleep=step_sleep) for c in sweep_grid(scale)]


def _costed_cell(params: dict) -> dict:
    from ._helpers import run_cell

    time.sleep(params["steps"] * params["step_sleep"])
    return run_cell(params)


def _costed_cost(cells: list[dict]) -> TaskCost:
    return TaskCost("sleep", steps=cells[0]["steps"], step_work=2.0 if cells[0]["i"] < 3 else 1.0)


COSTED = Experiment(name="bnlab-test-plan-costed", paper="p", figure="f", title="sleeps", claim="c",
                    grid=_costed_grid, run_cell=_costed_cell, plot=lambda records, outdir: [], cost=_costed_cost,
                    shorten=lambda cells, k: [dict(c, steps=k) for c in cells])


def _routed_grid(scale: str) -> list[dict]:
    # one long task (auto compiles it on a CPU) and one short one (auto keeps it eager)
    from bnlab.nets._ensemble_step import AUTO_COMPILE_STEPS

    return [dict(i=0, steps=AUTO_COMPILE_STEPS), dict(i=1, steps=100)]


def _routed_cell(params: dict) -> dict:
    """Records the route ``train_ensemble(step_mode="auto")`` would take for this (possibly cut) cell."""
    import torch

    from bnlab.nets._ensemble_step import resolve_step_mode

    route = resolve_step_mode("auto", torch.device("cpu"), params["steps"])
    with open(os.environ["BNLAB_TEST_ROUTE_LOG"], "a", encoding="utf-8") as f:
        f.write(f"{params['i']} {params['steps']} {route}\n")
    # a compiled route's set-up: cold the first time in this process, then from a graph cache
    cold = float(os.environ.get("BNLAB_TEST_COLD_COMPILE", "0"))
    if route == "compile" and params["i"] not in _COMPILED:
        _COMPILED.add(params["i"])
        time.sleep(cold)
    return {"route": route}


_COMPILED: set = set()


ROUTED = Experiment(name="bnlab-test-plan-routed", paper="p", figure="f", title="routes", claim="c",
                    grid=_routed_grid, run_cell=_routed_cell, plot=lambda records, outdir: [],
                    cost=lambda cells: TaskCost(f"task{cells[0]['i']}", steps=cells[0]["steps"], step_work=1.0),
                    shorten=lambda cells, k: [dict(c, steps=k) for c in cells])


_RUNS: list = []


def _jittery_cell(params: dict) -> dict:
    """A run whose set-up varies by more than its steps take (a GPU's tracing, cache and capture beside
    millisecond steps): 0.6 s and 0.2 s in turn, then ``steps`` steps of 2 ms, the steady ones timed and
    noted as a trainer does (bnlab._run_length)."""
    from bnlab._run_length import STEADY_FROM, note_steady_steps, timing_steps

    _RUNS.append(params["steps"])
    time.sleep(0.6 if len(_RUNS) % 2 else 0.2)
    t0 = 0.0
    for s in range(params["steps"]):
        if s == STEADY_FROM:
            t0 = time.perf_counter()
        time.sleep(0.002)
    if timing_steps() and params["steps"] > STEADY_FROM:
        seconds = time.perf_counter() - t0
        _NOTED.append((params["steps"] - STEADY_FROM, seconds))
        note_steady_steps(params["steps"] - STEADY_FROM, seconds)
    return {"ok": True}


_NOTED: list = []  # what _jittery_cell told the pilot, for the test to compare with


JITTERY = Experiment(name="bnlab-test-plan-jittery", paper="p", figure="f", title="jitter", claim="c",
                     grid=lambda scale: [dict(i=0, steps=100_000)], run_cell=_jittery_cell,
                     plot=lambda records, outdir: [],
                     cost=lambda cells: TaskCost("jittery", steps=cells[0]["steps"], step_work=1.0),
                     shorten=lambda cells, k: [dict(c, steps=k) for c in cells])
EXPERIMENTS = [COLUMNS, COSTED, ROUTED, JITTERY]
