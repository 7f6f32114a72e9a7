"""Intra-op thread counts side by side on small and large torch work: what bnlab's chooser
(``bnlab._threads``) is calibrated by.

Each case runs with 1 thread, with all the cores this process may use (``--threads``, default
all), and with the chooser deciding from the work's size (torch at all the cores, the entry point's
``small_work_threads`` lowering it), interleaved round by round so that a change of the machine's
load hits every variant; printed: the median wall time and CPU time (this process, all its
threads) per round, and the ratios against 1 thread.  CPU time above wall time × threads doing
useful work is threads waiting at joins (spinning).

Cases:

* ``matmul m``: m×m times m×m products (2·m³ FLOPs each), a loop of ≈ 2e8 FLOPs per round: where
  a second thread starts to pay (:data:`bnlab._threads.SMALL_WORK_FLOPS`);
* ``train B=1``: ``bnlab train --norm bnp --batch-size 1``'s network (Lange et al.'s FC net,
  784-100-100-100-10, BNP preconditioner) for 50 steps on random MNIST-shaped data, through
  :func:`bnlab.nets.train`;
* ``train B=256``: the same at batch 256 (the other side of the threshold);
* ``ensemble 4``: :func:`bnlab.nets.train_ensemble` of 4 BN-MLPs of width 32, depths 5–20, B = 8,
  40 steps; ``ensemble 20``: 20 BN-MLPs of width 384, depths 5–100 by 5, B = 8, 5 steps
  (issue 27's Fig. 3a column);
* ``chain d``: :func:`bnlab.rank.run_chain` at width d, batch 32, depth 200 (d = 32) or 40 (d = 512).

Usage::

    python benchmarks/bench_threads.py [--quick] [--rounds 5] [--threads N] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from bnlab import _threads


def _matmul_case(m: int):
    a, b = torch.randn(m, m), torch.randn(m, m)
    reps = max(1, int(2e8 // (2 * m**3)))

    def run():
        for _ in range(reps):
            torch.mm(a, b)
    return run, 2.0 * m**3


def _train_case(batch: int, steps: int):
    from bnlab.nets import train
    from bnlab.optim import BNPreconditioner
    from bnlab.optim.training import build_network

    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(max(2048, batch * 4), 1, 28, 28, generator=g), torch.randint(0, 10, (max(2048, batch * 4),),
                                                                                   generator=g)

    def run():
        net = build_network("fc", "none", (1, 28, 28), 10, seed=0)
        pre = BNPreconditioner(net)
        train(net, (x, y), optimizer=lambda p: torch.optim.SGD(p, lr=0.01), batch_size=batch, steps=steps,
              hooks=[lambda _m: pre.step()])
    flops = _threads.training_flops_per_op(build_network("fc", "none", (1, 28, 28), 10), batch, (x, y))
    return run, flops


def _ensemble_case(depths, width: int, steps: int):
    from bnlab.nets import BNMLP, train_ensemble

    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(1024, 784, generator=g), torch.randint(0, 10, (1024,), generator=g)

    def models():
        return [BNMLP(784, 10, depth=d, width=width, seed=i) for i, d in enumerate(depths)]

    def run():
        train_ensemble(models(), (x, y), lr=0.01, batch_size=8, steps=steps)
    return run, _threads.training_flops_per_op(models(), 8, (x, y))


def _chain_case(width: int, depth: int):
    from bnlab.rank import run_chain

    def run():
        run_chain(width, 32, depth, seed=0)
    return run, 2.0 * 32 * width * width


def _print_row(r: dict, many: int) -> None:
    w, c, q = r["wall_s"], r["cpu_s"], r["wall_over_1_thread"]
    print(f"{r['case']:14} {r['flops_per_op']:>9.3g} {r['chooser_threads']:>6} {w['1']:>8.3f} "
          f"{w[str(many)]:>8.3f} {w['chooser']:>9.3f} {q[str(many)]:>6.2f} {q['chooser']:>9.2f} "
          f"{c['1']:>7.3f} {c[str(many)]:>7.3f}", flush=True)


def _measure(cases: dict, counts: dict, rounds: int, show=None) -> list[dict]:
    """``counts``: variant name -> (torch threads, pinned?).  Interleaved rounds, medians; ``show(row)``
    as each case is done."""
    rows = []
    for name, (run, flops) in cases.items():
        wall = {v: [] for v in counts}
        cpu = {v: [] for v in counts}
        chosen = {}
        for variant, (threads, pinned) in counts.items():  # one untimed call each (imports, allocator)
            _threads.pin_threads(threads if pinned else None)
            torch.set_num_threads(threads)
            run()
        for _ in range(rounds):
            for variant, (threads, pinned) in counts.items():
                _threads.pin_threads(threads if pinned else None)
                torch.set_num_threads(threads)
                t, c = time.perf_counter(), time.process_time()
                with _threads.small_work_threads(flops) as n:  # as the entry points do (a no-op when pinned)
                    run()
                wall[variant].append(time.perf_counter() - t)
                cpu[variant].append(time.process_time() - c)
                chosen[variant] = n
        _threads.pin_threads(None)
        med = {v: statistics.median(wall[v]) for v in counts}
        med_cpu = {v: statistics.median(cpu[v]) for v in counts}
        base = med["1"]
        rows.append({"case": name, "flops_per_op": flops, "chooser_threads": chosen["chooser"],
                     "wall_s": med, "cpu_s": med_cpu, "wall_over_1_thread": {v: med[v] / base for v in counts}})
        if show is not None:
            show(rows[-1])
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one round (a smoke test)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="the many-thread variant (default: all cores)")
    ap.add_argument("--cases", nargs="+", default=None, help="only the cases whose name starts with one of these")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    many = args.threads or _threads.available_cores()
    rounds = 1 if args.quick else args.rounds
    if args.quick:
        cases = {"matmul 32": _matmul_case(32), "train B=1": _train_case(1, 5), "chain 32": _chain_case(32, 10)}
    else:
        cases = {f"matmul {m}": _matmul_case(m) for m in (32, 64, 128, 192, 256, 384, 512)}
        cases.update({"train B=1": _train_case(1, 50), "train B=256": _train_case(256, 10),
                      "ensemble 4": _ensemble_case([5, 10, 15, 20], 32, 40),
                      "ensemble 20": _ensemble_case(list(range(5, 101, 5)), 384, 5),
                      "chain 32": _chain_case(32, 200), "chain 512": _chain_case(512, 40)})
    if args.cases:
        cases = {k: v for k, v in cases.items() if any(k.startswith(c) for c in args.cases)}
    counts = {"1": (1, True), str(many): (many, True), "chooser": (many, False)}
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    if not args.json:
        print(f"threads side by side: 1, {many} and the chooser (SMALL_WORK_FLOPS = "
              f"{_threads.SMALL_WORK_FLOPS:.3g}); {rounds} interleaved rounds, medians; load average {load}")
        print(f"{'case':14} {'FLOPs/op':>9} {'chosen':>6} {'1 thr s':>8} {f'{many} thr s':>8} {'chooser s':>9} "
              f"{f'{many}/1':>6} {'chooser/1':>9} {'CPU 1':>7} {f'CPU {many}':>7}", flush=True)
    old = torch.get_num_threads()
    try:
        rows = _measure(cases, counts, rounds, show=None if args.json else (lambda r: _print_row(r, many)))
    finally:
        _threads.pin_threads(None)
        torch.set_num_threads(old)
    out = {"meta": {"cores": _threads.available_cores(), "many": many, "rounds": rounds, "load_1min": load,
                    "load_1min_after": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
                    "small_work_flops": _threads.SMALL_WORK_FLOPS, "torch": torch.__version__},
           "rows": rows}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"load average after: {out['meta']['load_1min_after']}")
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
