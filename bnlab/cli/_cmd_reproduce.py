"""``bnlab reproduce``: list the paper reproductions, or run one and write its figures and table."""
from __future__ import annotations

import argparse
import dataclasses

from bnlab.cli._common import (add_data_dir_argument, apply_data_dir, check_cluster_arguments, check_output_dir,
                               print_json, print_table, yes_no)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("reproduce", help="list the paper reproductions or run one (sweep + figures + table)")
    p.add_argument("name", nargs="?", help="reproduction name (see --list) or package.module:NAME")
    p.add_argument("--list", action="store_true", help="list the registered reproductions")
    p.add_argument("--scale", default="small", choices=["small", "paper"], help="grid size (default small)")
    p.add_argument("--out", default="bnlab-figures", help="where figures go (<out>/figures/<name>/)")
    p.add_argument("--results-dir", default=None, help="results stores (default $BNLAB_RESULTS or bnlab-results)")
    p.add_argument("--scheduler", default=None, metavar="ADDRESS", help="an existing Dask cluster")
    p.add_argument("--workers", type=int, default=None, help="worker processes of the local cluster (default: cores)")
    p.add_argument("--serial", action="store_true", help="run the cells in this process (debugging)")
    p.add_argument("--no-retry-failed", action="store_true", help="keep cells recorded as failed instead of rerunning them")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_data_dir_argument(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from bnlab.experiments.registry import discovery_errors, list_experiments

    if args.list or args.name is None:
        exps = list_experiments()
        errors = discovery_errors()
        if args.json:
            print_json(
                {
                    "experiments": [
                        {"name": e.name, "paper": e.paper, "figure": e.figure, "title": e.title, "uses_gpu": e.uses_gpu}
                        for e in exps.values()
                    ],
                    "broken_modules": errors,
                }
            )
        else:
            print_table([(e.name, e.paper, e.figure, e.title) for e in exps.values()],
                        header=["name", "paper", "figure", "title"])
            for mod, tb in errors.items():
                print(f"\n{mod} failed to import: {tb.strip().splitlines()[-1]}")
        return 0

    from bnlab.experiments.report import reproduce

    check_output_dir("out", args.out)  # checked first: a cached run would otherwise never notice
    check_cluster_arguments(args)
    apply_data_dir(args)

    sec = reproduce(
        args.name,
        scale=args.scale,
        out=args.out,
        results_dir=args.results_dir,
        scheduler=args.scheduler,
        workers=args.workers,
        serial=args.serial,
        retry_failed=not args.no_retry_failed,
        progress=not args.no_progress,
    )
    if args.json:
        print_json(dataclasses.asdict(sec))
    else:
        print(f"{sec.name}: {sec.status} ({sec.done} of {sec.total} cells done, {sec.failed} failed)")
        for f in sec.figures:
            print(f"figure: {f}")
        if sec.comparisons:
            print_table([(c["quantity"], c["paper"], c["bnlab"], yes_no(c["agrees"])) for c in sec.comparisons],
                        header=["quantity", "paper", "bnlab", "agrees"])
        for e in sec.errors:
            print(f"\n{e['what']}\n{e['text']}")
    return 0 if sec.status == "ok" else 1
