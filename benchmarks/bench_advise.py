"""``bnlab advise`` on four networks at batch 64: CPU seconds per part (the issue's budget: 60 s each on 2 cores).

The networks: a 10-layer BN-MLP (Linear → BatchNorm1d → ReLU, width 256) and a user-written conv net
(``benchmarks/_advise_user_model.py``, loaded by ``module:factory`` as the command line does) on MNIST; a small
CNN (bnlab's ``BNPCNN``, Lange et al.'s 5-layer CNN) on MNIST and ResNet-20 (``bnlab.nets.resnet(20)``) on
random 3×32×32 inputs (CIFAR-10 is not shipped offline).  Cross-entropy, SGD lr 0.1, momentum 0.9.

Timing: one torch thread and the process's CPU time per part (``Advice.cpu_seconds``), because this machine is
shared: CPU time leaves out the other jobs' load, and with one thread it is also an upper bound on the wall time
of an idle 2-core machine (which can only be faster with its second core).  Wall time is printed beside it.
The first network also pays the one-off imports (scipy, the theory's routes).

``--lr-study`` instead measures where the learning-rate verdict's limit sits against training: 4-layer MLPs
(784-128×4-10, with and without BN, ½‖f − y‖² and cross-entropy, momentum 0.9, batch 64, MNIST) trained for
200 steps at η = η*·2^(k/2), k = −2 … 4, with η* the advice's limit (the free block for BN, the whole network
without); it prints the final loss over the initial one, or "DIV" (a loss above 1e4 or not finite).

Usage::

    python benchmarks/bench_advise.py [--only resnet20] [--json out.json] [--threads 1]
    python benchmarks/bench_advise.py --lr-study
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

BUDGET_S = 60.0
HERE = pathlib.Path(__file__).resolve().parent


def cases():
    import torch

    from bnlab.advice import load_model
    from bnlab.nets import BNPCNN, MLP, resnet

    gen = torch.Generator().manual_seed(0)
    cifar_like = (torch.randn(64, 3, 32, 32, generator=gen), torch.randint(0, 10, (64,), generator=gen))
    return {
        "bn-mlp": (lambda: MLP(784, [256] * 10, 10, norm="bn", seed=0), "mnist"),
        "small-cnn": (lambda: BNPCNN((1, 28, 28), 10, seed=0), "mnist"),
        "resnet20": (lambda: resnet(20, 10, seed=0), cifar_like),
        "user-module": (lambda: load_model(f"{HERE / '_advise_user_model.py'}:build"), "mnist"),
    }


def run_case(name: str, build, data, **kw) -> dict:
    from bnlab.advice import advise

    model = build()
    t, c = time.perf_counter(), time.process_time()
    advice = advise(model, data, loss="cross_entropy", lr=0.1, momentum=0.9, batch_size=64, **kw)
    wall, call = time.perf_counter() - t, time.process_time() - c
    cpu = dict(advice.cpu_seconds)
    # the whole call (the parts, plus loading the dataset and the checks before them) is what the budget is about
    return {"network": name, "parameters": advice.structure.num_params, "cpu_s": cpu,
            "cpu_total_s": call, "cpu_parts_s": sum(cpu.values()), "wall_total_s": wall, "wall_s": dict(advice.seconds),
            "verdicts": advice.verdicts(),
            "matvecs": None if advice.learning_rate is None else advice.learning_rate.matvecs}


def lr_study(steps: int = 200) -> list[dict]:
    import functools

    import torch

    from bnlab.advice import advise
    from bnlab.data import load_dataset, standardize
    from bnlab.nets import MLP, half_squared_error, train

    d = standardize(load_dataset("mnist", "train").subset(4000, seed=0))
    x, y = d.x.reshape(len(d), -1), d.y
    rows = []
    for norm in ("bn", "none"):
        for loss in ("mse", "cross_entropy"):
            lr = advise(MLP(784, [128] * 4, 10, norm=norm, seed=0), (x[:64], y[:64]), loss=loss, momentum=0.9,
                        tol=1e-3, skip=("gradients", "rank", "batch_size")).learning_rate
            fn = half_squared_error if loss == "mse" else torch.nn.functional.cross_entropy
            cells = {}
            for k in range(-2, 5):
                res = train(MLP(784, [128] * 4, 10, norm=norm, seed=0), (x, y), batch_size=64, steps=steps, seed=0,
                            optimizer=functools.partial(torch.optim.SGD, lr=lr.limit * 2 ** (k / 2), momentum=0.9),
                            loss_fn=fn, diverge_above=1e4)
                cells[f"{2 ** (k / 2):.2g}"] = "DIV" if res.diverged else round(res.final_train_loss / res.history[0], 3)
            rows.append({"norm": norm, "loss": loss, "eta_star_limit": lr.limit, "eta_star_whole": lr.eta_star,
                         "final/initial loss at η = factor × limit": cells})
            print(f"{norm:4s} {loss:13s} limit {lr.limit:.4g} (whole {lr.eta_star:.4g}): "
                  + "  ".join(f"{k}×: {v}" for k, v in cells.items()), flush=True)
    return rows


def main(argv=None) -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=None, help="one network: bn-mlp, small-cnn, resnet20, user-module")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    p.add_argument("--lr-study", action="store_true", help="where the η* verdict sits against training (slow)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.lr_study:
        rows = lr_study()
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(rows, indent=2))
        return 0
    rows = []
    for name, (build, data) in cases().items():
        if args.only and name != args.only:
            continue
        row = run_case(name, build, data)
        rows.append(row)
        parts = ", ".join(f"{k} {v:.1f}" for k, v in row["cpu_s"].items())
        ok = "within" if row["cpu_total_s"] <= BUDGET_S else "OVER"
        print(f"{name:12s} {row['parameters']:>9,} params  CPU {row['cpu_total_s']:5.1f} s for the call ({ok} "
              f"{BUDGET_S:.0f} s; wall {row['wall_total_s']:.1f} s)  per part: {parts}", flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0 if all(r["cpu_total_s"] <= BUDGET_S for r in rows) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    sys.exit(main())
