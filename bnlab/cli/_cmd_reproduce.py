"""``bnlab reproduce``: list the paper reproductions, or run one and write its figures and table."""
from __future__ import annotations

import argparse
import dataclasses

from bnlab.cli._cmd_report import DEFAULT_OUT, add_run_arguments, run_options, run_plan
from bnlab.cli._common import (apply_data_dir, check_cluster_arguments, check_output_dir, print_json, print_table,
                               yes_no)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "reproduce", help="list the paper reproductions or run one (sweep + figures + table)",
        description="Without a name (or with --list): the registered reproductions. With one: run (or reuse) its "
        "sweep, draw its figures into <out>/figures/<name>/ -- the folder `bnlab report` uses, so a later report "
        "reuses them -- and print its comparison with the paper and its verdict.",
    )
    p.add_argument("name", nargs="?", help="reproduction name (see --list) or package.module:NAME")
    p.add_argument("--list", action="store_true", help="list the registered reproductions")
    p.add_argument("--out", default=DEFAULT_OUT, help="output directory, as bnlab report's: figures go to "
                   "<out>/figures/<name>/")
    add_run_arguments(p)
    p.add_argument("--strict", action="store_true",
                   help="exit 1 unless the verdict is 'reproduced' or 'skipped' (without it, exit 1 only when "
                   "cells, the figure or the table failed)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from bnlab.experiments.registry import discovery_errors, list_experiments

    if args.list and args.name is not None:
        raise ValueError(f"--list is not allowed with a name ({args.name!r}): --list lists every reproduction, a name "
                         "runs one; give one of them")
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

    if args.plan:
        return run_plan(args, [args.name])
    from bnlab.experiments.report import reproduce

    check_output_dir("out", args.out)  # checked first: a cached run would otherwise never notice
    if args.results_dir is not None:
        check_output_dir("results_dir", args.results_dir)
    check_cluster_arguments(args)
    apply_data_dir(args)
    sec = reproduce(args.name, out=args.out, **run_options(args))
    if args.json:
        print_json(dataclasses.asdict(sec))
    else:
        print(f"{sec.name}: {sec.verdict.replace('_', ' ')} — {sec.verdict_reason} "
              f"(cells: {sec.done} of {sec.total} done, {sec.failed} failed)")
        for f in sec.figures:
            print(f"figure: {f}")
        if sec.comparisons:
            print_table([(c["quantity"], c["paper"], c["bnlab"], yes_no(c["agrees"])) for c in sec.comparisons],
                        header=["quantity", "paper", "bnlab", "agrees"])
        for e in sec.errors:
            print(f"\n{e['what']}\n{e['text']}")
    if sec.status not in ("ok", "skipped"):
        return 1  # the run itself failed (cells, plot or table): see the errors above
    return 1 if (args.strict and sec.verdict not in ("reproduced", "skipped")) else 0
