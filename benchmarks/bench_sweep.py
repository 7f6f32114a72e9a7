"""Overhead of the sweep engine per cell: SQLite commit + bookkeeping (serial) and + Dask round trip.

The same trivial cells (a few microseconds of work each) run three ways:

1. a plain Python loop calling ``run_cell`` (the floor);
2. ``run_sweep(serial=True)``: + per-cell store transactions, timing, versions, progress bookkeeping;
3. ``client.map`` + ``as_completed`` on the same cluster, no store (Dask's own cost);
4. ``run_sweep(client=...)`` on a ``LocalCluster`` (started beforehand, its start-up timed separately):
   + pickling, scheduling, the worker round trip and ``as_completed``.

Printed: seconds, per-cell time and overhead in ms, and ratios to the loop.  A real cell
(training a network, seconds to minutes) dwarfs these overheads; the numbers say from which
cell duration on the engine costs less than e.g. 1 %.

    python benchmarks/bench_sweep.py [--cells 300] [--workers 2]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from bnlab.experiments import Experiment, run_sweep
from bnlab.experiments.sweep import open_client


def grid(scale: str) -> list[dict]:
    return [{"i": i, "seed": i} for i in range(_N_CELLS)]


def run_cell(params: dict) -> dict:
    return {"i": params["i"], "square": params["i"] ** 2}


_N_CELLS = 300
EXP = Experiment(name="bench-trivial", paper="-", figure="-", title="trivial cells", claim="-", grid=grid,
                 run_cell=run_cell, plot=lambda r, o: [])


def main() -> None:
    global _N_CELLS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", type=int, default=300)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    _N_CELLS = args.cells
    n = args.cells
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        for p in grid("small"):
            run_cell(p)
        loop = time.perf_counter() - t

        t = time.perf_counter()
        s = run_sweep(EXP, results_dir=Path(tmp) / "serial", serial=True, progress=False)
        serial = time.perf_counter() - t
        assert s.done == n

        t = time.perf_counter()
        again = run_sweep(EXP, results_dir=Path(tmp) / "serial", serial=True, progress=False)
        reuse = time.perf_counter() - t
        assert again.executed == 0

        t = time.perf_counter()
        with open_client(workers=args.workers) as client:
            startup = time.perf_counter() - t
            client.submit(run_cell, {"i": 0}).result()  # warm the workers' imports
            from distributed import as_completed

            t = time.perf_counter()
            futs = client.map(run_cell, grid("small"), pure=False)
            plain = [r for _, r in as_completed(futs, with_results=True)]
            plain_dask = time.perf_counter() - t
            assert len(plain) == n
            del futs
            t = time.perf_counter()
            d = run_sweep(EXP, results_dir=Path(tmp) / "dask", client=client, progress=False)
            dask_time = time.perf_counter() - t
        assert d.done == n

    print(f"{n} trivial cells; LocalCluster of {args.workers} workers (start-up {startup:.2f} s, not included)")
    print(f"{'route':34s} {'seconds':>9s} {'ms/cell':>9s} {'overhead ms/cell':>17s} {'ratio to loop':>14s}")
    for name, sec in [("plain loop", loop), ("run_sweep serial (SQLite)", serial),
                      ("plain Dask map + as_completed", plain_dask),
                      ("run_sweep on Dask LocalCluster", dask_time), ("re-run, all cells reused", reuse)]:
        print(f"{name:34s} {sec:9.3f} {1e3 * sec / n:9.3f} {1e3 * (sec - loop) / n:17.3f} {sec / loop:14.1f}")
    per_cell = (dask_time - loop) / n
    print(f"\nengine overhead on Dask: {1e3 * per_cell:.2f} ms per cell ({1e3 * (dask_time - plain_dask) / n:.2f} ms "
          f"beyond plain Dask), i.e. < 1 % of cells longer than {100 * per_cell:.2f} s")


if __name__ == "__main__":
    main()
