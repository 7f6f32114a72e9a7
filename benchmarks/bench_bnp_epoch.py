"""Lange et al. Table 1 the way the paper timed it: whole training epochs of SGD, BN and BNP through bnlab's trainer.

    python benchmarks/bench_bnp_epoch.py [--quick] [--network mnist|table1] [--batch-sizes 16 256 512]
        [--rounds 7] [--min-seconds 10] [--max-steps K] [--device cpu|cuda] [--threads 1] [--bnp-kwargs JSON] [--json]

``benchmarks/bench_bnp.py`` measures the median single *training step* on pre-generated batches —
the strict number the ≤ 10 % goal of bnlab issue #16 is checked against.  The paper's Table 1
(V100, 20-epoch averages: BN 16.08 / 10.81 / 10.67 s, BNP 16.69 / 10.70 / 10.57 s at B = 16 /
256 / 512) instead timed whole epochs of its training script.  This script is that measurement
for bnlab: one epoch as ``bnlab train --model fc --norm X --batch-size B --epochs 1`` runs it,
i.e. :func:`bnlab.optim.training.train_network`'s set-up (its network, learning rate, BNP
hyperparameters and SGD factory, rebuilt here from the same public functions and defaults so
that ``--bnp-kwargs`` can reach the preconditioner; ``tests/optim/test_bench_bnp_epoch.py``
checks that the numbers equal ``train_network``'s) and then :func:`bnlab.nets.train` unchanged.

Variants: ``sgd`` (``--norm none``: the vanilla network, plain SGD), ``bn`` (post-activation
BatchNorm1d) and ``bnp`` (the vanilla network with ``BNPreconditioner(**defaults | --bnp-kwargs)``
between ``backward()`` and ``step()``).  Networks: ``mnist`` (default) — the trainer's FC network,
784 → 100 → 100 → 100 → 10, on MNIST as ``bnlab.data`` loads it (60 000 train / 10 000 test;
``--dataset`` picks another bnlab dataset); ``table1`` — the network of Table 1 / Fig. 8, 3072 →
100 → 100 → 10 (``widths=(100, 100)``), on random CIFAR-10-shaped tensors (50 000 × 3 × 32 × 32
uniform in [0, 1], random labels; CIFAR-10 itself is not on this machine — the cost of an FC
epoch does not depend on the pixel values).

What is timed, per variant and round (one ``train()`` call = one epoch):

* **train loop** — inside the timed region: every step of the epoch as the trainer runs it
  (slicing the shuffled index, gathering the batch, forward, loss, zero_grad, backward, BNP's
  ``pre.step()`` hook, ``opt.step()``, storing the loss, the NaN check with its host sync every
  10 steps).  Timed from the end of step 0 to the end of the last step by a callback (so it covers
  steps 1 … n−1 and is scaled by n/(n−1)); the callback itself adds a ``StepInfo`` and a Python
  call per step (~1-2 µs, the same for every variant), and reads the clock only at those two steps.
* **eval** — one pass over the test set (``_evaluate``, batches of 1000, running statistics),
  timed by wrapping the trainer's ``_evaluate`` (behaviour unchanged).  The trainer evaluates
  once per epoch (``eval_every_epoch=True``); the printout also gives how many passes one run made
  in total (1 for a whole epoch: the run's final result reuses the epoch's pass; with
  ``--max-steps`` the run ends mid-epoch and takes one final pass instead).
* **epoch** = train loop + one eval pass: the cost of each epoch of a multi-epoch ``bnlab train``.
* *Outside* the timed region (reported as ``outside``, not in the epoch): loading the dataset
  (once per script run), building the network and the preconditioner, ``train()``'s set-up
  (conversion of the data to tensors with its finiteness check over the whole training set,
  optimizer construction, the label check), the epoch's one ``randperm`` and step 0 (first-call
  costs), and the run's end (history to a list).

With ``--max-steps K`` only the first K steps of the epoch run (``train(steps=K)``) and the loop
time is scaled to the full epoch (stated in the output).  Fairness on a shared machine: the
variants alternate — rounds of one epoch of each variant, in an order that rotates from round to
round; at least ``--rounds``, and more until each variant's timed loops add up to ``--min-seconds``
(short epochs need more rounds, see :func:`measure`) — and each number is the median over the
rounds.  The clock is the thread's CPU time with one thread on a CPU (default ``--threads 1``;
wall time preempted by other work would land unevenly on the variants, see ``_timing.device_clock``),
wall time on CUDA (synchronized at the two clock reads and around each
evaluation) or with more threads.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import device_clock, device_sync  # noqa: E402

import torch  # noqa: E402

from bnlab.nets import train  # noqa: E402
from bnlab.optim import BNPreconditioner  # noqa: E402
from bnlab.optim.training import build_network, default_learning_rate, train_network  # noqa: E402

#: variant -> ``bnlab train --norm``
NORMS = {"sgd": "none", "bn": "bn", "bnp": "bnp"}
VARIANTS = tuple(NORMS)
NETWORKS = ("mnist", "table1")
#: train_network's defaults (the trainer's configuration is taken from it, not restated)
_DEFAULTS = {k: p.default for k, p in inspect.signature(train_network).parameters.items()}
_TRAIN_MODULE = importlib.import_module("bnlab.nets.train")
#: Table 1's CIFAR-10-shaped data: image shape, training and test set sizes
_CIFAR_SHAPE, _CIFAR_TRAIN, _CIFAR_TEST = (3, 32, 32), 50_000, 10_000


class _LoopClock:
    """Training callback: the clock at the end of step 0 and at the end of the last step."""

    def __init__(self, steps: int, device):
        self.last, self.device = steps - 1, device
        self.first_t = self.last_t = None

    def __call__(self, info) -> None:
        if info.step == 0 or info.step == self.last:
            device_sync(self.device)
            t = device_clock(self.device)
            if info.step == 0:
                self.first_t = t
            if info.step == self.last:
                self.last_t = t


@contextlib.contextmanager
def _timed_evaluations(device, seconds: list):
    """Wrap the trainer's test pass so that each call's time is appended to ``seconds``."""
    original = _TRAIN_MODULE._evaluate

    def timed(*args, **kwargs):
        device_sync(device)
        t = device_clock(device)
        out = original(*args, **kwargs)
        device_sync(device)
        seconds.append(device_clock(device) - t)
        return out

    _TRAIN_MODULE._evaluate = timed
    try:
        yield
    finally:
        _TRAIN_MODULE._evaluate = original


def load_data(network: str, *, dataset: str = "mnist", train_size=None, test_size=None, seed: int = 0):
    """(train, test, widths): the data and hidden widths of ``network`` (one-time cost, not timed).

    ``mnist``: ``bnlab.data.load_dataset`` as ``train_network`` calls it (seeded subsets when sizes
    are given, as ``--train-size``); ``table1``: random CIFAR-10-shaped (x, y) pairs."""
    if network == "mnist":
        from bnlab.data import load_dataset

        tr, te = load_dataset(dataset, "train"), load_dataset(dataset, "test")
        if train_size is not None:
            tr = tr.subset(train_size, seed=seed)
        if test_size is not None:
            te = te.subset(test_size, seed=seed)
        return tr, te, tuple(_DEFAULTS["widths"])
    g = torch.Generator().manual_seed(seed)

    def pair(n):
        return torch.rand(n, *_CIFAR_SHAPE, generator=g), torch.randint(0, 10, (n,), generator=g)

    return pair(train_size or _CIFAR_TRAIN), pair(test_size or _CIFAR_TEST), (100, 100)


def _xy(data):
    return (data.x, data.y) if hasattr(data, "x") else data


def run_epoch(variant: str, train_data, test_data, *, batch_size: int, widths, steps: int | None = None,
              bnp_kwargs=None, device: str = "cpu"):
    """One ``train_network``-configured ``train()`` call: ``steps=None`` is one whole epoch (``epochs=1``).

    Returns ``(TrainResult, timings)`` with timings ``loop_s`` (steps 1 … n−1), ``steps``,
    ``eval_s`` (one entry per test pass) and ``total_s`` (the whole call)."""
    norm = NORMS[variant]
    x, y = _xy(train_data)
    num_classes = getattr(train_data, "num_classes", 10)
    seed = _DEFAULTS["seed"]
    net = build_network("fc", norm, tuple(x.shape[1:]), num_classes, widths=widths, seed=seed)
    lr = default_learning_rate("fc", norm, batch_size)
    hooks = []
    if norm == "bnp":
        net = net.to(device)
        kwargs = {k: _DEFAULTS[k] for k in ("rho", "eps1", "eps2")} | dict(bnp_kwargs or {})
        pre = BNPreconditioner(net, **kwargs)
        hooks.append(lambda _model: pre.step())

    def make_optimizer(params):
        return torch.optim.SGD(params, lr=lr, momentum=_DEFAULTS["momentum"])

    n_steps = len(y) // batch_size if steps is None else steps
    clock, evals = _LoopClock(n_steps, device), []
    length = {"epochs": 1.0} if steps is None else {"steps": steps}
    with _timed_evaluations(device, evals):
        device_sync(device)
        t0 = device_clock(device)
        res = train(net, train_data, optimizer=make_optimizer, batch_size=batch_size, test_data=test_data,
                    hooks=hooks, callbacks=[clock], eval_every_epoch=True, seed=seed, device=device, **length)
        device_sync(device)
        total = device_clock(device) - t0
    if res.diverged or res.steps != n_steps:
        raise RuntimeError(f"{variant} at batch {batch_size} stopped after {res.steps} of {n_steps} steps "
                           f"(diverged={res.diverged}): its time would not be an epoch's")
    return res, {"loop_s": clock.last_t - clock.first_t, "steps": n_steps, "eval_s": evals, "total_s": total}


def measure(batch_size: int, train_data, test_data, *, widths, rounds: int, min_seconds: float = 0.0,
            max_steps=None, bnp_kwargs=None, device="cpu", variants=VARIANTS):
    """Medians over the rounds of each variant's epoch, the variants alternating in rotating order.

    At least ``rounds`` rounds, and more (up to 200) until every variant's timed loops add up to
    ``min_seconds``: a short epoch is one mean over few steps, and a burst of memory traffic from
    other work on the machine slows whichever variant runs during it, so short epochs need more
    rounds for a stable median (Table 1's network at B = 512: BNP/SGD 1.03-1.20 over three 7-round
    runs, 1.13 with 21 rounds)."""
    n = len(_xy(train_data)[1])
    per_epoch = n // batch_size
    if per_epoch < 2:
        raise ValueError(f"batch_size={batch_size} is not allowed: the training set of {n} gives fewer than 2 steps")
    steps = None if max_steps is None or max_steps >= per_epoch else max(2, max_steps)
    for v in variants:  # warm-up: allocator, first-call overheads
        run_epoch(v, train_data, test_data, batch_size=batch_size, widths=widths, steps=2, bnp_kwargs=bnp_kwargs,
                  device=device)
    raw = {v: [] for v in variants}
    r = 0
    while r < rounds or (r < 200 and min(sum(t["loop_s"] for t in ts) for ts in raw.values()) < min_seconds):
        for v in variants[r % len(variants):] + variants[: r % len(variants)]:
            raw[v].append(run_epoch(v, train_data, test_data, batch_size=batch_size, widths=widths, steps=steps,
                                    bnp_kwargs=bnp_kwargs, device=device)[1])
        r += 1
    out = {}
    for v, ts in raw.items():
        n_timed = ts[0]["steps"] - 1
        loop = statistics.median(t["loop_s"] for t in ts) / n_timed * per_epoch
        eval_pass = statistics.median(e for t in ts for e in t["eval_s"])
        outside = statistics.median(t["total_s"] - t["loop_s"] - sum(t["eval_s"]) for t in ts)
        rounds_loop = [t["loop_s"] / n_timed * per_epoch for t in ts]
        out[v] = {"loop_s": loop, "eval_s": eval_pass, "epoch_s": loop + eval_pass, "step_ms": 1e3 * loop / per_epoch,
                  "evals_per_run": len(ts[0]["eval_s"]), "outside_s": outside,
                  "loop_s_rounds": rounds_loop, "loop_spread": (max(rounds_loop) - min(rounds_loop)) / loop}
    return {"batch_size": batch_size, "steps_per_epoch": per_epoch, "steps_timed": ts[0]["steps"], "rounds": r,
            "variants": out, "ratios": _ratios(out)}


def _ratios(t):
    pairs = [("bnp", "sgd"), ("bnp", "bn"), ("bn", "sgd")]
    return {f"{a}/{b}": {"epoch": t[a]["epoch_s"] / t[b]["epoch_s"], "loop": t[a]["loop_s"] / t[b]["loop_s"]}
            for a, b in pairs if a in t and b in t}


def _bnp_kwargs(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--bnp-kwargs={text!r} is not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"--bnp-kwargs={text!r} is not allowed: expected a JSON object")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed: expected an integer ≥ 1")
    return value


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 640 training / 200 test examples, batches 16 and 64, 2 rounds")
    parser.add_argument("--network", choices=NETWORKS, default="mnist",
                        help="mnist: the trainer's 784-100-100-100-10 net on MNIST; table1: 3072-100-100-10 "
                             "on random CIFAR-10-shaped tensors")
    parser.add_argument("--dataset", default="mnist", help="bnlab dataset of --network mnist (default mnist)")
    parser.add_argument("--batch-sizes", type=_positive, nargs="+", default=[16, 256, 512])
    parser.add_argument("--rounds", type=_positive, default=7, help="least number of rounds (default 7)")
    parser.add_argument("--min-seconds", type=float, default=10.0,
                        help="add rounds until each variant's timed loops add up to this (default 10; 0: --rounds)")
    parser.add_argument("--max-steps", type=_positive, default=None,
                        help="time only the first K (≥ 2) steps of each epoch and scale to the epoch")
    parser.add_argument("--train-size", type=_positive, default=None, help="train on this many examples")
    parser.add_argument("--test-size", type=_positive, default=None, help="test on this many examples")
    parser.add_argument("--bnp-kwargs", type=_bnp_kwargs, default={},
                        help="JSON object of extra BNPreconditioner arguments, e.g. '{\"gradient\": \"auto\"}'")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=_positive, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not 0.0 <= args.min_seconds < float("inf"):
        parser.error(f"--min-seconds={args.min_seconds!r} is not allowed: expected a finite number ≥ 0")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device={args.device!r} is not allowed: CUDA is not available on this machine")
    try:  # options the preconditioner does not know fail here, not after the data is loaded
        BNPreconditioner(torch.nn.Sequential(torch.nn.Linear(2, 2)), **args.bnp_kwargs)
    except (TypeError, ValueError) as exc:
        parser.error(f"--bnp-kwargs={json.dumps(args.bnp_kwargs)} is not allowed: {exc}")
    train_size, test_size, batch_sizes, rounds = args.train_size, args.test_size, args.batch_sizes, args.rounds
    if args.quick:
        train_size, test_size, batch_sizes, rounds, args.min_seconds = 640, 200, [16, 64], 2, 0.0
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        train_data, test_data, widths = load_data(args.network, dataset=args.dataset, train_size=train_size,
                                                  test_size=test_size)
        rows = [measure(b, train_data, test_data, widths=widths, rounds=rounds, min_seconds=args.min_seconds,
                        max_steps=args.max_steps,
                        bnp_kwargs=args.bnp_kwargs, device=args.device) for b in batch_sizes]
        clock = "wall" if args.device.startswith("cuda") or args.threads > 1 else "thread CPU time"
    finally:
        torch.set_num_threads(threads)
    x, y = _xy(train_data)
    meta = {"network": [int(torch.tensor(x.shape[1:]).prod())] + list(widths) + [10],
            "data": (f"{args.dataset} ({len(y)} train / {len(_xy(test_data)[1])} test)" if args.network == "mnist"
                     else f"random CIFAR-10-shaped ({len(y)} train / {len(_xy(test_data)[1])} test)"),
            "device": args.device, "threads": args.threads, "clock": clock, "min_rounds": rounds,
            "min_seconds": args.min_seconds,
            "max_steps": args.max_steps, "bnp_kwargs": args.bnp_kwargs, "torch": torch.__version__,
            "timed": "epoch = train loop (every step: indexing, forward, backward, hooks, opt.step, loss "
                     "bookkeeping and NaN checks) + one test pass; not timed: data loading, network/optimizer "
                     "construction, train() set-up, step 0, end of run"}
    if args.json:
        print(json.dumps({"meta": meta, "rows": rows}, indent=2))
        return 0
    print(f"Whole epochs through bnlab.nets.train: network {meta['network']}, {meta['data']}, device {args.device}, "
          f"threads {args.threads}, clock {clock}, medians over ≥ {rounds} rounds and ≥ {args.min_seconds:g} s per "
          f"variant, BNP kwargs {args.bnp_kwargs}, "
          f"torch {torch.__version__}")
    print(f"timed: {meta['timed']}")
    print(f"{'B':>5} {'steps':>11} {'rounds':>6} {'SGD s/ep':>9} {'BN s/ep':>8} {'BNP s/ep':>9} "
          f"{'BNP/SGD':>8} {'BNP/BN':>7} {'BN/SGD':>7}   loop only: {'BNP/SGD':>8} {'BNP/BN':>7} {'BN/SGD':>7}")
    for r in rows:
        t, q = r["variants"], r["ratios"]
        steps = (f"{r['steps_per_epoch']}" if r["steps_timed"] == r["steps_per_epoch"]
                 else f"{r['steps_timed']}/{r['steps_per_epoch']}")
        print(f"{r['batch_size']:>5} {steps:>11} {r['rounds']:>6} {t['sgd']['epoch_s']:>9.3f} "
              f"{t['bn']['epoch_s']:>8.3f} {t['bnp']['epoch_s']:>9.3f} {q['bnp/sgd']['epoch']:>8.3f} {q['bnp/bn']['epoch']:>7.3f} "
              f"{q['bn/sgd']['epoch']:>7.3f}   {'':>10} {q['bnp/sgd']['loop']:>8.3f} {q['bnp/bn']['loop']:>7.3f} "
              f"{q['bn/sgd']['loop']:>7.3f}")
    if any(r["steps_timed"] != r["steps_per_epoch"] for r in rows):
        print("steps a/b: only the first a steps of the b-step epoch were run (--max-steps); the loop time "
              "(steps 2 … a) is scaled to b steps")
    print("per variant: train loop s/epoch (ms/step) [spread of the rounds: (max - min)/median] + eval s/pass "
          "= epoch s;  test passes per run;  outside the timed region s/run")
    for r in rows:
        parts = "  ".join(f"{v} {t['loop_s']:.3f} ({t['step_ms']:.3f}) [{100 * t['loop_spread']:.0f}%] + "
                          f"{t['eval_s']:.4f} = {t['epoch_s']:.3f}; {t['evals_per_run']}; {t['outside_s']:.3f}"
                          for v, t in r["variants"].items())
        print(f"{r['batch_size']:>5}  {parts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
