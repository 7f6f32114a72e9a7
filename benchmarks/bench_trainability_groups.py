"""Benchmark: a Fig. 5 panel's columns trained one at a time against all of them as one ensemble.

At ``small`` scale a trainability cell is a column (every depth of one x) and a Fig. 5 panel's columns,
which differ only in γ, β or ε, train together (``bnlab.reproductions.trainability.ensemble_group``).
This script runs the small Fig. 5a setting — tanh BN-MLPs of width 128, depths 5, 10, 20, 40, 60, B = 32,
SGD at η = 3e-3·B, γ ∈ {0.5, 1, 2} — on random MNIST-shaped inputs (784 features, 10 classes; the cost
does not depend on the pixel values), side by side in one process: ``train_ensemble`` once per column,
then once over every column.  Interleaved rounds, the median of each side's CPU time (one torch thread:
CPU time leaves out other jobs' preemptions, ``_timing.cpu_time``), and their ratio.  For scale it also
prints the panel's multiply-add rate against the machine's own ``torch.bmm`` at the shape of a hidden
layer's product.

    python benchmarks/bench_trainability_groups.py [--quick] [--steps 150] [--rounds 3] [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import bmm_gflops  # noqa: E402


def _models(gammas, depths, width, seed=0):
    from bnlab.nets import BNMLP

    return [[BNMLP(784, 10, depth=d, width=width, phi="tanh", gamma=g, beta=0.0, eps=1e-3, seed=seed)
             for d in depths] for g in gammas]


def _train(models, data, *, lr, batch, steps):
    from bnlab.nets import train_ensemble

    return train_ensemble(models, data, lr=lr, batch_size=batch, steps=steps, seeds=0)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test, seconds)")
    ap.add_argument("--steps", type=int, default=None, help="SGD steps per run (default 150, --quick 4)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3, --quick 1)")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args(argv)
    steps = args.steps if args.steps is not None else (4 if args.quick else 150)
    rounds = args.rounds if args.rounds is not None else (1 if args.quick else 3)
    for name, v in (("steps", steps), ("rounds", rounds)):
        if v < 1:
            raise SystemExit(f"--{name}={v} is not allowed: expected an integer ≥ 1")
    torch.set_num_threads(1)
    width, batch = (16, 8) if args.quick else (128, 32)
    depths = [2, 3] if args.quick else [5, 10, 20, 40, 60]
    gammas = [0.5, 1.0, 2.0]
    n = 256 if args.quick else 10_000
    gen = torch.Generator().manual_seed(0)
    data = (torch.rand(n, 784, generator=gen), torch.randint(0, 10, (n,), generator=gen))
    lr = 3e-3 * batch

    times = {"one column at a time": [], "one ensemble": []}
    for _ in range(rounds):
        columns = _models(gammas, depths, width)
        t = time.process_time()
        for col in columns:
            _train(col, data, lr=lr, batch=batch, steps=steps)
        times["one column at a time"].append(time.process_time() - t)
        panel = [m for col in _models(gammas, depths, width) for m in col]
        t = time.process_time()
        _train(panel, data, lr=lr, batch=batch, steps=steps)
        times["one ensemble"].append(time.process_time() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    # floating-point operations per step: forward + backward ≈ 3 × batch × the networks' weights multiply-adds
    weights = len(gammas) * sum(784 * width + d * width * width + 10 * width for d in depths)
    rate = 3.0 * batch * weights * 2 * steps / med["one ensemble"] / 1e9
    bmm = bmm_gflops(len(gammas) * len(depths), batch, width)
    out = {"setting": dict(width=width, batch=batch, depths=depths, gammas=gammas, steps=steps, rounds=rounds,
                           threads=1),
           "cpu_s": med, "samples_s": times,
           "separate_over_ensemble": med["one column at a time"] / med["one ensemble"],
           "ensemble_gflops": rate, "bmm_gflops": bmm, "ensemble_over_bmm": rate / bmm}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"Fig. 5a small setting: width {width}, B = {batch}, depths {depths}, γ {gammas}, {steps} steps, "
              f"{rounds} round(s), one thread (CPU seconds, median)")
        for k, v in med.items():
            print(f"  {k:22s} {v:8.2f} s")
        print(f"  one column at a time / one ensemble: {out['separate_over_ensemble']:.2f}×")
        print(f"  the ensemble's arithmetic: {rate:.1f} GFLOP/s; torch.bmm at a hidden layer's shape: "
              f"{bmm:.1f} GFLOP/s (ratio {out['ensemble_over_bmm']:.2f})")
    return out


if __name__ == "__main__":
    main()
