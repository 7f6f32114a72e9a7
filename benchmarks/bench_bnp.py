"""Lange et al. Table 1 on this machine: training time per epoch of BN vs BNP, and BNP's overhead over SGD.

    python benchmarks/bench_bnp.py [--quick] [--device cpu|cuda] [--threads 1] [--json]

The network is the paper's Table 1 / Fig. 8 fully connected net (input 3072 = a CIFAR-10 image,
two hidden layers of 100, 10 outputs, ReLU, cross-entropy, SGD); ``--input 784 --depth 3`` is the
MNIST network of Figs. 3-4.  Three variants train side by side
on the same pre-generated random batches, interleaved step by step (so drifting load on a shared
machine hits all of them alike) and summarized by the median time of a single training step:

* ``sgd``  — the vanilla network, plain SGD (the baseline of the ≤ 10 % overhead goal);
* ``bn``   — the post-activation BN network (BatchNorm1d on each hidden layer's output), SGD;
* ``bnp``  — the vanilla network, SGD with ``BNPreconditioner`` (hooks + ``step()``);
* ``floor`` — the vanilla network, SGD plus the least memory traffic any implementation of
  Algorithm 2 must add: a forward pre-hook that reads each layer input once (``x.sum(0)``, one
  pass; the statistics need at least that) and, after ``backward()``, one in-place scaling of each
  weight gradient by a column vector (one read-modify-write pass over G_w; Eq. 15 needs at least
  that, plus a rank-1 correction and a matrix-vector product).  ``floor/sgd`` is the overhead no
  rewrite of BNP as hooks + a ``.grad`` transform in eager PyTorch can go below.

A step is zero_grad + forward + backward (+ ``pre.step()``) + ``opt.step()``; time per epoch is the
step time × ⌈50 000 / B⌉ (one CIFAR-10 epoch).  Printed ratios: bnp/sgd (goal ≤ 1.10) and bnp/bn
(goal ≤ 1.00), and BNP's two parts measured alone: the forward hooks' statistics (4·n_in·N
elementwise operations per layer) and ``pre.step()`` (Eq. 15 on every layer).  The paper's Table 1 (V100 GPU, 20-epoch average) has BN 16.08 / 10.81 / 10.67 s and
BNP 16.69 / 10.70 / 10.57 s at B = 16 / 256 / 512, dominated by input-pipeline time we do not have.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from bnlab.optim import BNPreconditioner  # noqa: E402

TRAIN_SIZE = 50_000
#: BNP variants and their ``gradient`` mode (see bnlab.optim.BNPreconditioner).
_GRADIENT = {"bnp": "transform", "bnp_fused": "fused", "bnp_auto": "auto"}
VARIANTS = ("sgd", "bn", "bnp", "bnp_fused", "bnp_auto", "floor")


class _Floor:
    """The ``floor`` variant's stand-in for a preconditioner (see the module docstring)."""

    def __init__(self, model: nn.Module):
        self.linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        self.scales = [torch.ones(m.in_features, device=m.weight.device) for m in self.linears]
        for m in self.linears:
            m.register_forward_pre_hook(self._read_input)

    @staticmethod
    def _read_input(module, args):
        args[0].detach().sum(0)  # one read of the layer input, the result discarded

    def step(self):
        for m, v in zip(self.linears, self.scales):
            m.weight.grad.mul_(v)


def build(variant: str, n_in: int, hidden: int, depth: int, device: str):
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    width = n_in
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        if variant == "bn":
            layers.append(nn.BatchNorm1d(hidden))  # post-activation BN (Lange et al. Eq. 2)
        width = hidden
    layers.append(nn.Linear(width, 10))
    model = nn.Sequential(*layers).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if variant.startswith("bnp"):
        pre = BNPreconditioner(model, gradient=_GRADIENT[variant])
    else:
        pre = _Floor(model) if variant == "floor" else None
    return model, opt, pre


def make_step(model, opt, pre):
    loss_fn = nn.functional.cross_entropy

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        if pre is not None:
            pre.step()
        opt.step()

    return step


def _clock(device) -> float:
    """Seconds: this thread's CPU time on a CPU device, wall time on a GPU.

    On an oversubscribed machine the scheduler takes the CPU away for a time slice (~3 ms here)
    every few milliseconds; wall time then puts a preemption into a fraction of the steps that
    grows with the step's length, and once that fraction passes one half the median jumps by a
    whole slice (BNP/SGD read 3.9 at B = 256 on the MNIST net in one run, 1.4 in the next).  The
    thread's CPU time leaves the preemptions out; it is used only with one thread (``--threads 1``,
    the default), which then does all the work.
    """
    if str(device).startswith("cuda") or torch.get_num_threads() > 1:
        return time.perf_counter()
    return time.thread_time()


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def measure(batch: int, *, n_in: int, hidden: int, depth: int, steps: int, rounds: int, device: str,
            variants=VARIANTS):
    """Median seconds (see :func:`_clock`) per training step of each variant, interleaved step by step.

    On a shared machine a preemption lands in one step of one variant; the median over the
    ``rounds × steps`` single steps of each variant drops it, where a mean over a block of steps
    would keep it (block-of-steps timing swung BNP/SGD by up to 0.25 between runs here).
    """
    g = torch.Generator().manual_seed(batch)
    n_batches = 8
    xs = [torch.randn(batch, n_in, generator=g).to(device) for _ in range(n_batches)]
    ys = [torch.randint(0, 10, (batch,), generator=g).to(device) for _ in range(n_batches)]
    steppers = {}
    for v in variants:
        step = make_step(*build(v, n_in, hidden, depth, device))
        for i in range(3):  # warm-up (allocator, first-call overheads)
            step(xs[i % n_batches], ys[i % n_batches])
        steppers[v] = step
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(rounds):
        for i in range(steps):
            for v in variants:
                _sync(device)
                t = _clock(device)
                steppers[v](xs[i % n_batches], ys[i % n_batches])
                _sync(device)
                times[v].append(_clock(device) - t)
    return {v: statistics.median(ts) for v, ts in times.items()}


def breakdown(batch: int, *, n_in: int, hidden: int, depth: int, device: str, repeat: int) -> dict:
    """Milliseconds of BNP's two parts in one step: the forward hooks' statistics and ``pre.step()``."""
    model, opt, pre = build("bnp", n_in, hidden, depth, device)
    g = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, n_in, generator=g).to(device)
    y = torch.randint(0, 10, (batch,), generator=g).to(device)

    def timed(fn):
        _sync(device)
        t = _clock(device)
        fn()
        _sync(device)
        return _clock(device) - t

    def paired(fn_a, fn_b, between=lambda: None):
        # The two alternate call by call (load drifts hit both alike); milliseconds, medians.
        a, b = [], []
        for _ in range(repeat):
            a.append(timed(fn_a))
            between()
            b.append(timed(fn_b))
            between()
        return 1e3 * statistics.median(a), 1e3 * statistics.median(b)

    def plain_forward():
        with pre.paused():
            model(x)

    def clear():
        for s in pre._layers.values():
            s.clear_pending()  # one forward's statistics each time, as in a training step

    fwd_plain, fwd_hooked = paired(plain_forward, lambda: model(x), clear)
    for s in pre._layers.values():
        s.clear_pending()
    nn.functional.cross_entropy(model(x), y).backward()
    pending = {n: (s.samples, s.rows, s.s1, s.s2) for n, s in pre._layers.items()}
    grads = [p.grad.clone() for p in model.parameters()]

    def one_step():
        for n, s in pre._layers.items():
            s.samples, s.rows, s.s1, s.s2 = pending[n]
        for p, g0 in zip(model.parameters(), grads):
            p.grad.copy_(g0)  # fresh gradients each time (repeated transforms would reach denormals)
        pre.step()

    def copies_only():
        for p, g0 in zip(model.parameters(), grads):
            p.grad.copy_(g0)

    with_step, copies = paired(one_step, copies_only)
    return {"hooks": fwd_hooked - fwd_plain, "step": with_step - copies}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small network and few steps (smoke test)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 256, 512])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--input", type=int, default=3072,
                        help="input features (3072: Table 1's CIFAR-10 net; 784: the MNIST net of Figs. 3-4)")
    parser.add_argument("--depth", type=int, default=2, help="hidden layers of 100 (2: Table 1; 3: Figs. 3-4)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.quick:
        n_in, hidden, depth, rounds, batch_sizes = 64, 16, 2, 2, [4, 32]
    else:
        n_in, hidden, depth, rounds, batch_sizes = args.input, 100, args.depth, args.rounds, args.batch_sizes
    rows = []
    for b in batch_sizes:
        steps = 3 if args.quick else max(10, min(200, 20_000 // b))
        t = measure(b, n_in=n_in, hidden=hidden, depth=depth, steps=steps, rounds=rounds, device=args.device)
        per_epoch = math.ceil(TRAIN_SIZE / b)
        rows.append({
            "batch_size": b,
            "step_s": t,
            "epoch_s": {v: s * per_epoch for v, s in t.items()},
            "bnp_over_sgd": t["bnp"] / t["sgd"],
            "bnp_over_bn": t["bnp"] / t["bn"],
            "floor_over_sgd": t["floor"] / t["sgd"],
            "bnp_parts_ms": breakdown(b, n_in=n_in, hidden=hidden, depth=depth, device=args.device,
                                      repeat=3 if args.quick else 100),
        })
    meta = {"device": args.device, "threads": args.threads,
            "clock": "wall" if args.device.startswith("cuda") or args.threads > 1 else "thread CPU time", "network": [n_in] + [hidden] * depth + [10],
            "torch": torch.__version__}
    if args.json:
        print(json.dumps({"meta": meta, "rows": rows}, indent=2))
        return 0
    print(f"BNP benchmark: network {meta['network']}, device {args.device}, threads {args.threads}, "
          f"torch {torch.__version__}")
    print(f"{'B':>5} {'SGD s/epoch':>12} {'BN s/epoch':>11} {'BNP s/epoch':>12} {'BNP/SGD':>8} {'BNP/BN':>7} "
          f"{'floor/SGD':>9} {'SGD ms/step':>12} {'hooks ms':>9} {'pre.step ms':>12}")
    for r in rows:
        e = r["epoch_s"]
        print(f"{r['batch_size']:>5} {e['sgd']:>12.3f} {e['bn']:>11.3f} {e['bnp']:>12.3f} "
              f"{r['bnp_over_sgd']:>8.3f} {r['bnp_over_bn']:>7.3f} {r['floor_over_sgd']:>9.3f} "
              f"{1e3 * r['step_s']['sgd']:>12.3f} "
              f"{r['bnp_parts_ms']['hooks']:>9.3f} {r['bnp_parts_ms']['step']:>12.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
