"""Benchmark: batched ensemble training (bnlab.nets.train_ensemble) against one-at-a-time training.

The grid is a column of a trainability figure (Yang et al. 2019, Figs. 3, 5): M BN-MLPs of width 128
on MNIST-shaped inputs (784 features, 10 classes), trained with SGD at batch size B for a fixed
number of steps, once one after the other with ``bnlab.nets.train_classifier`` and once together
with ``train_ensemble``, in the same process, side by side.  Two grids: networks that differ only
in seed and learning rate (equal depth), and networks of different depths (the depth-sorted prefix
stacking, no padding).  Then a row of the Fisher paper's learning-rate phase diagram (Fig. 2,
``fisher-fig2``): the paper's FC BN network (``bnlab.fisher.build_model``, torch's BatchNorm1d, so the
vmap stack) at 13 learning rates 10^(k/4) × 2 seeds, momentum SGD (μ = 0.9) on ½‖f − onehot(y)‖², a
loss above 1e6 counting as an explosion — one at a time with ``bnlab.nets.train`` + torch.optim.SGD
against one ``train_ensemble`` (which drops exploded networks at the next check, as ``train`` stops
them).  Prints the wall and CPU times and their ratios.

    OMP_NUM_THREADS=2 python benchmarks/bench_ensemble.py [--quick] [--threads 2] [--json]

Random inputs (no dataset needed): the cost does not depend on the pixel values.
"""
from __future__ import annotations

import argparse
import functools
import json
import time

import torch


def _data(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 784, generator=g), torch.randint(0, 10, (n,), generator=g)


def _models(depths, width, seeds):
    from bnlab.nets import BNMLP

    return [BNMLP(784, 10, depth=d, width=width, seed=s) for d, s in zip(depths, seeds)]


def _one_at_a_time(depths, width, seeds, lrs, data, test, batch, steps):
    from bnlab.nets import train_classifier

    t = time.perf_counter()
    for m, s, lr in zip(_models(depths, width, seeds), seeds, lrs):
        train_classifier(m, data, test, optimizer=functools.partial(torch.optim.SGD, lr=lr), batch_size=batch,
                         steps=steps, seed=s)
    return time.perf_counter() - t


def _together(depths, width, seeds, lrs, data, test, batch, steps):
    from bnlab.nets import train_ensemble

    t = time.perf_counter()
    train_ensemble(_models(depths, width, seeds), data, test_data=test, lr=lrs, batch_size=batch, steps=steps,
                   seeds=seeds)
    return time.perf_counter() - t


def _phase_row(width, steps, n_etas, data, test, threads):
    """Fisher Fig. 2 row: (wall, CPU) seconds one at a time and as one ensemble."""
    from bnlab.fisher import build_model
    from bnlab.nets import half_squared_error, train, train_ensemble

    arch = f"fc:784-{width}-{width}-{width}-10"
    nets = [(10.0 ** (k / 4), s) for k in range(-n_etas + 1, 1) for s in (0, 1)]  # η ≤ 1: half of them explode
    common = dict(batch_size=64, steps=steps, test_data=test, diverge_above=1e6, test_bn_mode="train")
    times = []
    t, c = time.perf_counter(), time.process_time()
    for eta, s in nets:
        train(build_model(arch, seed=s), data, optimizer=functools.partial(torch.optim.SGD, lr=eta, momentum=0.9),
              loss_fn=half_squared_error, seed=0, **common)
    times.append((time.perf_counter() - t, time.process_time() - c))
    t, c = time.perf_counter(), time.process_time()
    train_ensemble([build_model(arch, seed=s) for _, s in nets], data, lr=[e for e, _ in nets], momentum=0.9,
                   loss="mse", seeds=0, **common)
    times.append((time.perf_counter() - t, time.process_time() - c))
    (a, ac), (b, bc) = times
    return {"grid": f"Fisher Fig. 2 row: {len(nets)} nets ({n_etas} η × 2 seeds), width {width}", "width": width,
            "batch": 64, "steps": steps, "one_at_a_time_s": round(a, 3), "ensemble_s": round(b, 3),
            "speedup": round(a / b, 2), "one_at_a_time_cpu_s": round(ac, 3), "ensemble_cpu_s": round(bc, 3),
            "speedup_cpu": round(ac / bc, 2), "threads": threads}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test, seconds)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2: the target machine)")
    ap.add_argument("--json", action="store_true", help="print the table as JSON")
    ap.add_argument("--phase-only", action="store_true", help="only the Fisher Fig. 2 rows")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.quick:
        width, steps, batch, n_nets, deep = 32, 10, 16, 4, [2, 3, 4, 6]
    else:
        # one Fig. 3a column (B = 8, depths 4…64) and 8 seeds × lr of one depth, 100 steps each
        width, steps, batch, n_nets, deep = 128, 100, 8, 8, [4, 8, 12, 16, 24, 32, 48, 64]
    data, test = _data(4096), _data(1000, seed=1)
    grids = {
        f"{n_nets} seeds × lr, depth 16" if not args.quick else f"{n_nets} seeds × lr, depth 3": (
            [16 if not args.quick else 3] * n_nets, list(range(n_nets)), [10 ** (-3 + 2 * i / n_nets) for i in range(n_nets)]),
        f"depths {deep[0]}…{deep[-1]} ({len(deep)} nets)": (deep, list(range(len(deep))), [0.1] * len(deep)),
    }
    rows = []
    for name, (depths, seeds, lrs) in ({} if args.phase_only else grids).items():
        a = _one_at_a_time(depths, width, seeds, lrs, data, test, batch, steps)
        b = _together(depths, width, seeds, lrs, data, test, batch, steps)
        rows.append({"grid": name, "width": width, "batch": batch, "steps": steps, "one_at_a_time_s": round(a, 3),
                     "ensemble_s": round(b, 3), "speedup": round(a / b, 2)})
    phase = [(32, 5, 4)] if args.quick else [(128, 100, 13), (512, 100, 13)]
    for w, st, ne in phase:
        rows.append(_phase_row(w, st, ne, data, test, args.threads))
    variance = _variance_rows(3 if args.quick else 200)
    if args.json:
        print(json.dumps({"rows": rows, "variance": variance}, indent=1))
    else:
        print(f"threads={args.threads}")
        print(f"{'grid':60s} {'one-at-a-time s':>16s} {'ensemble s':>11s} {'ratio':>6s}   (CPU s: one / ens / ratio)")
        for r in rows:
            cpu = (f"   {r['one_at_a_time_cpu_s']:.2f} / {r['ensemble_cpu_s']:.2f} / {r['speedup_cpu']:.2f}×"
                   if "speedup_cpu" in r else "")
            print(f"{r['grid']:60s} {r['one_at_a_time_s']:16.2f} {r['ensemble_s']:11.2f} {r['speedup']:6.2f}×{cpu}")
        print("\nBN variance of the float32 stack, forward + backward (torch.var against the ensemble's two-pass):")
        print(f"{'(nets, groups, B, width)':26s} {'torch.var µs':>13s} {'two-pass µs':>12s} {'ratio':>6s}")
        for r in variance:
            print(f"{str(tuple(r['shape'])):26s} {r['torch_var_us']:13.0f} {r['two_pass_us']:12.0f} {r['speedup']:6.2f}×")
    return {"rows": rows, "variance": variance}


def _variance_rows(repeats: int) -> list[dict]:
    """CPU time of one BN variance (forward and backward) of a float32 stack, torch.var against
    ``bnlab.nets.ensemble._sample_variance``, at the shapes of Fig. 3a's B = 8 and 128 columns and Fig. 3b's
    ghost batches of 4."""
    from bnlab.nets.ensemble import _sample_variance

    def torch_var(h):
        return h.var(dim=2, unbiased=False, keepdim=True)

    rows = []
    for shape in [(8, 1, 8, 128), (8, 1, 128, 128), (6, 32, 4, 128)]:
        h = torch.randn(shape).requires_grad_()
        times = {}
        for name, fn in [("torch_var_us", torch_var), ("two_pass_us", _sample_variance)]:
            t = time.process_time()
            for _ in range(repeats):
                fn(h).sum().backward()
            times[name] = (time.process_time() - t) / repeats * 1e6
        rows.append({"shape": list(shape), **times, "speedup": round(times["torch_var_us"] / times["two_pass_us"], 2)})
    return rows


if __name__ == "__main__":
    main()
