"""``bnlab sweep run|status|resume|export``: run an experiment's grid on Dask with a resumable results store."""
from __future__ import annotations

import argparse
import dataclasses
import sys

from bnlab.cli._common import (add_checkpoint_arguments, add_threads_argument, check_cluster_arguments, checkpoint_every,
                               print_json, print_table)
from bnlab._vocabulary import SCALES


def _add_location(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scale", default="small", choices=SCALES,
                   help="grid size: small (the default, ~10 min on 2 cores), medium (small plus more restarts and the investigations, ~1 h), paper (the papers' sizes, for GPUs)")
    p.add_argument(
        "--results-dir",
        default=None,
        help="directory of the results stores (default $BNLAB_RESULTS or bnlab-results)",
    )


def _add_cluster(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("where cells run")
    g.add_argument("--scheduler", default=None, metavar="ADDRESS",
                   help="connect to an existing Dask cluster (e.g. tcp://host:8786) instead of starting a local one")
    g.add_argument("--workers", type=int, default=None, help="worker processes of the local cluster (default: cores)")
    g.add_argument("--serial", action="store_true", help="run the cells in this process, one by one (debugging)")
    add_threads_argument(g, cells=True)
    add_checkpoint_arguments(g)
    g.add_argument("--retry-failed", action="store_true", help="run cells recorded as failed again")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sweep", help="run, inspect, resume and export experiment sweeps")
    ss = p.add_subparsers(dest="sweep_command", metavar="SUBCOMMAND")
    ss.required = True

    r = ss.add_parser("run", help="run (or continue) the sweep of an experiment")
    r.add_argument("name", help="experiment name (bnlab reproduce --list) or package.module:NAME")
    _add_location(r)
    r.add_argument("--store", default=None, help="store file (default <results-dir>/<name>-<scale>.sqlite)")
    _add_cluster(r)
    r.add_argument("--json", action="store_true", help="machine-readable output")
    r.set_defaults(func=run_run)

    s = ss.add_parser("status", help="cells done / failed / pending of a sweep")
    s.add_argument("target", help="a .sqlite store or an experiment name")
    _add_location(s)
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=run_status)

    u = ss.add_parser("resume", help="continue an interrupted sweep: finished cells are kept, the rest run")
    u.add_argument("target", help="a .sqlite store or an experiment name")
    _add_location(u)
    _add_cluster(u)
    u.add_argument("--json", action="store_true", help="machine-readable output")
    u.set_defaults(func=run_resume)

    e = ss.add_parser("export", help="write every cell of a sweep to CSV or Parquet")
    e.add_argument("target", help="a .sqlite store or an experiment name")
    _add_location(e)
    e.add_argument("--output", "-o", required=True, help="output file (.csv or .parquet)")
    e.add_argument("--format", choices=["csv", "parquet"], default=None, help="default: from the output suffix")
    e.add_argument("--json", action="store_true", help="machine-readable output")
    e.set_defaults(func=run_export)

    v = ss.add_parser("salvage", help="copy the readable finished cells of a damaged store into a new store")
    v.add_argument("store", help="the damaged .sqlite store (read only)")
    v.add_argument("new_store", help="the new .sqlite store to write (must not exist)")
    v.add_argument("--json", action="store_true", help="machine-readable output")
    v.set_defaults(func=run_salvage)


def _cluster_kwargs(args) -> dict:
    check_cluster_arguments(args)  # the same combinations as reproduce and report refuse
    return {
        "scheduler": args.scheduler,
        "workers": args.workers,
        "serial": args.serial,
        "threads": args.threads,
        "retry_failed": args.retry_failed,
        "checkpoint_every": checkpoint_every(args),
        "progress": not args.no_progress,
    }


def _print_summary(summary, as_json: bool) -> int:
    d = dataclasses.asdict(summary)
    d["store"] = str(summary.store)
    d["complete"] = summary.complete
    if as_json:
        print_json(d)
    else:
        print_table([(k, d[k]) for k in ("experiment", "scale", "store", "total", "done", "failed", "pending",
                                         "executed", "reused", "wall_time")], header=["", "value"])
        if summary.failed:
            print(f"\n{summary.failed} cell(s) failed: bnlab sweep status {summary.store}", file=sys.stderr)
    return 0


def run_run(args) -> int:
    from bnlab.experiments.sweep import run_sweep

    summary = run_sweep(args.name, args.scale, results_dir=args.results_dir, store=args.store, **_cluster_kwargs(args))
    return _print_summary(summary, args.json)


def run_resume(args) -> int:
    from bnlab.experiments.sweep import resolve_store, resume_sweep

    path = resolve_store(args.target, args.scale, args.results_dir)
    summary = resume_sweep(path, **_cluster_kwargs(args))
    return _print_summary(summary, args.json)


def run_status(args) -> int:
    from bnlab.experiments.sweep import resolve_store, sweep_status

    st = sweep_status(resolve_store(args.target, args.scale, args.results_dir))
    if args.json:
        d = dataclasses.asdict(st)
        d["store"] = str(st.store)
        print_json(d)
        return 0
    c = st.counts
    print_table(
        [
            ("experiment", st.experiment),
            ("scale", st.scale),
            ("store", st.store),
            ("cells", st.total),
            ("done", c["done"]),
            ("failed", c["failed"]),
            ("pending", c["pending"]),
            ("running", _running(st)),
            ("cell time (s)", st.cell_seconds),
            ("mean cell time (s)", st.mean_cell_seconds),
            ("updated", st.updated),
            ("checkpoints", _checkpoints(st)),
        ],
        header=["", "value"],
    )
    if st.failures:
        print("\nfailed cells:")
        print_table([(f["key"], f["params"], f["error"]) for f in st.failures], header=["key", "params", "error"])
    return 0


def _running(st) -> str:
    """Running cells, telling a live driver's from those a killed driver left behind."""
    n = st.counts["running"]
    d = st.driver or {}
    who = f"driver pid {d.get('pid')} on {d.get('host')} since {d.get('started')}" if d else "driver"
    if n == 0:
        return "0"
    if st.driver_alive:
        return f"{n} (running now: {who})"
    return f"{n} interrupted ({who} is gone; bnlab sweep resume {st.store} runs them again)"


def _checkpoints(st) -> str:
    """The tasks' checkpoints beside the store: how many, their size and the latest save."""
    files = st.checkpoints
    if not files:
        return "none"
    size = sum(f["bytes"] for f in files) / 1e6
    return (f"{len(files)} file(s), {size:.1f} MB, last saved {files[0]['saved']} (an interrupted task goes on "
            "from its file when the sweep is resumed)")


def run_export(args) -> int:
    from bnlab.experiments.sweep import export_sweep, resolve_store

    out = export_sweep(resolve_store(args.target, args.scale, args.results_dir), args.output, args.format)
    if args.json:
        print_json({"output": str(out)})
    else:
        print(out)
    return 0


def run_salvage(args) -> int:
    from bnlab.experiments.store import salvage_store

    res = salvage_store(args.store, args.new_store)
    if args.json:
        print_json(res)
    else:
        print(f"{res['recovered']} finished cells of {res['experiment']} [{res['scale']}] copied to {args.new_store} "
              f"({res['unreadable']} unreadable); continue with: bnlab sweep resume {args.new_store}")
    return 0
