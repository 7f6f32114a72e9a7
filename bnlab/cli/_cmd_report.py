"""``bnlab report``: one self-contained HTML page with every reproduction's claim, figure, table and verdict."""
from __future__ import annotations

import argparse
import dataclasses
import sys

from bnlab.cli._common import (add_checkpoint_arguments, add_data_dir_argument, add_threads_argument, apply_data_dir,
                               check_cluster_arguments, check_output_dir, checkpoint_every, print_json, print_table)
from bnlab._vocabulary import SCALES


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """Where the cells run and which stores are reused: the options ``report`` and ``reproduce`` share."""
    p.add_argument("--scale", default="small", choices=SCALES,
                   help="grid size: small (the default, ~10 min on 2 cores), medium (small plus more restarts and the investigations, ~1 h), paper (the papers' sizes, for GPUs)")
    p.add_argument("--results-dir", default=None, help="results stores to reuse (default $BNLAB_RESULTS or bnlab-results)")
    p.add_argument("--scheduler", default=None, metavar="ADDRESS", help="an existing Dask cluster")
    p.add_argument("--workers", type=int, default=None, help="worker processes of the local cluster (default: cores)")
    p.add_argument("--serial", action="store_true", help="run the cells in this process (debugging)")
    add_threads_argument(p, cells=True)
    add_checkpoint_arguments(p)
    p.add_argument("--no-retry-failed", action="store_true", help="keep cells recorded as failed instead of rerunning them")
    p.add_argument("--no-progress", action="store_true", help="no progress bars or messages")
    add_data_dir_argument(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    g = p.add_argument_group("plan (nothing long runs)")
    g.add_argument("--plan", action="store_true",
                   help="pilot a few steps of each kind of task on this device and print the cells, the estimated "
                   "time per reproduction and in total, and the memory per task; then stop")
    g.add_argument("--plan-budget", type=float, default=60.0, metavar="SECONDS",
                   help="seconds the pilots of one reproduction should take (default 60; a reproduction whose "
                   "pilots run past 2x this + 60 s is stopped and reported with a lower bound)")
    g.add_argument("--device", default=None,
                   help="device of the plan's pilots for GPU reproductions (default: the engine's choice, "
                   "cuda:0 when CUDA is present)")


def run_plan(args: argparse.Namespace, names) -> int:
    """``--plan``: pilot the reproductions ``names`` and print the estimate (the table, or JSON)."""
    from bnlab._validation import check_real
    from bnlab.experiments.plan import MAX_BUDGET_S, format_plan, plan_experiments

    check_cluster_arguments(args)
    check_real("--plan-budget", args.plan_budget, minimum=0.0, strict_minimum=True, maximum=MAX_BUDGET_S)
    apply_data_dir(args)
    plan = plan_experiments(names, args.scale, device=args.device, workers=args.workers, budget=args.plan_budget,
                            progress=not args.no_progress and not args.json)
    if args.json:
        print_json(plan.to_dict())
    else:
        print(format_plan(plan))
    return 0


def run_options(args: argparse.Namespace) -> dict:
    """The keyword arguments of ``build_report``/``reproduce`` that :func:`add_run_arguments` parsed."""
    return dict(scale=args.scale, results_dir=args.results_dir, scheduler=args.scheduler, workers=args.workers,
                serial=args.serial, retry_failed=not args.no_retry_failed, progress=not args.no_progress,
                threads=args.threads, checkpoint_every=checkpoint_every(args))


#: The output folder of ``report`` and ``reproduce`` (one folder: reproduce's figures are the report's).
DEFAULT_OUT = "bnlab-report"
#: The summary table's width in columns: it fits a terminal (the "why" column wraps).
SUMMARY_WIDTH = 100


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report", help="run (or reuse) every reproduction and write the HTML report with verdicts",
        description="Run (or reuse from the results stores) every registered reproduction of the four papers, "
        "draw its figures, compare it with the paper and write one self-contained HTML page, <out>/index.html, "
        "with each reproduction's claim, figures, table and verdict (reproduced, partly, not_reproduced, "
        "not_judged, skipped, error), plus report.json. Finished cells are never recomputed, and figures whose "
        "records, plotting code and files are unchanged are reused, not redrawn.",
    )
    p.add_argument("--out", default=DEFAULT_OUT, help="output directory: index.html, report.json, figures/<name>/")
    p.add_argument("--only", nargs="+", default=None, metavar="NAME", help="only these reproductions")
    add_run_arguments(p)
    p.add_argument("--strict", action="store_true",
                   help="exit 1 unless every reproduction that is not skipped has the verdict 'reproduced' "
                   "(partly, not_reproduced, not_judged and error all fail, and are named on stderr; without "
                   "--strict the exit status is 0 whatever the verdicts)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from bnlab.experiments.report import build_report

    if args.plan:
        from bnlab.experiments.registry import list_experiments

        return run_plan(args, args.only or list(list_experiments()))
    check_output_dir("out", args.out)  # checked first: a cached run would otherwise never notice
    if args.results_dir is not None:
        check_output_dir("results_dir", args.results_dir)
    check_cluster_arguments(args)
    apply_data_dir(args)
    rep = build_report(args.out, only=args.only, **run_options(args))
    if args.json:
        print_json(
            {
                "index": str(rep.index),
                "scale": rep.scale,
                "ok": rep.ok,
                "all_reproduced": rep.all_reproduced,
                "verdicts": rep.verdict_counts,
                "seconds": rep.seconds,
                "sections": [dataclasses.asdict(s) for s in rep.sections],
                "broken_modules": rep.broken_modules,
            }
        )
    else:
        print_table([(s.name, s.verdict, s.status, f"{s.done}/{s.failed}/{s.total}", s.verdict_reason)
                     for s in rep.sections]
                    + [(m, "error", "-", "-", "module failed to import") for m in rep.broken_modules],
                    header=["reproduction", "verdict", "cells", "done/fail/all", "why"], max_width=SUMMARY_WIDTH)
        counts = ", ".join(f"{n} {v}" for v, n in rep.verdict_counts.items() if n)
        reused = sum(s.figures_reused for s in rep.sections)
        print(f"\nverdicts: {counts}\nfigures: {reused} of {len(rep.sections)} reproductions' reused unchanged"
              f"\nreport: {rep.index} ({rep.seconds:.1f} s)")
    if args.strict and not rep.all_reproduced:
        failing = rep.not_reproduced
        print(f"bnlab report: --strict: {len(failing)} not reproduced: "
              + ", ".join(f"{name} ({v})" for name, v in failing.items()), file=sys.stderr)
        return 1
    return 0
