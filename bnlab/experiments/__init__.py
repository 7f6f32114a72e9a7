"""The papers' figures as declared sweeps: Dask engine, resumable SQLite results store, HTML report.

Declare an :class:`Experiment` (grid × seeds, ``run_cell``, ``plot``,
``compare``) in a module of :mod:`bnlab.reproductions`; run it with
:func:`run_sweep` (or ``bnlab sweep run NAME``), continue it after an
interruption with :func:`resume_sweep`, inspect it with :func:`sweep_status`,
export it with :func:`export_sweep`, write the report of every
reproduction with :func:`build_report` (``bnlab report``), and estimate a run before
starting it with :func:`plan_experiments` (``--plan``; ``docs/paper-scale.md``).  See
``docs/experiments.md``.
"""
from __future__ import annotations

from bnlab.experiments.cells import Cell, cell_param, parse_cell
from bnlab.experiments.registry import get_experiment, list_experiments, register_experiment
from bnlab.experiments.report import build_report
from bnlab.experiments.plan import ExperimentPlan, Plan, format_plan, plan_experiment, plan_experiments
from bnlab.experiments.spec import (
    SCALES,
    Check,
    Comparison,
    Experiment,
    Record,
    Setting,
    TaskCost,
    cell_device,
    cell_tasks,
)
from bnlab.experiments.store import ResultsStore, cell_key, salvage_store
from bnlab.experiments.sweep import (
    SweepStatus,
    SweepSummary,
    export_sweep,
    resume_sweep,
    run_sweep,
    store_path,
    sweep_status,
)

__all__ = [
    "Experiment",
    "Cell",
    "cell_param",
    "parse_cell",
    "Record",
    "Comparison",
    "Check",
    "Setting",
    "SCALES",
    "cell_device",
    "cell_tasks",
    "TaskCost",
    "plan_experiment",
    "plan_experiments",
    "format_plan",
    "Plan",
    "ExperimentPlan",
    "run_sweep",
    "resume_sweep",
    "sweep_status",
    "export_sweep",
    "store_path",
    "SweepSummary",
    "SweepStatus",
    "ResultsStore",
    "salvage_store",
    "cell_key",
    "list_experiments",
    "get_experiment",
    "register_experiment",
    "build_report",
]
