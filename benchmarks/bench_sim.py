"""Achieved FLOP/s of the finite-width simulator as a fraction of plain torch.bmm on the same shapes.

For each configuration the simulator (:func:`bnlab.sim.simulate`, forward +
autograd backward + all per-layer measurements + weight generation) is timed
against a loop of bare ``torch.bmm`` calls with exactly the matmul shapes of
the explicit network's forward and backward passes, in the same process and
with the same ``torch.set_num_threads``.  Counted FLOPs are those of these
matmuls: forward 2·rows·d_in·N per layer and network, backward (input
gradient) the same for layers 2..L (the first layer needs no input gradient);
rows = k·B.  The ratio printed is (network FLOPs / simulator time) / (bmm
FLOP/s) = t_bmm / t_sim, for both ways of realizing the weights:

* ``explicit``: every N×N weight matrix is drawn (the simulator really runs
  those matmuls, plus the draws and the BN/φ/measurement work around them);
* ``conditional`` (the default ``weight_sampling="auto"`` for Gaussian weights
  when rows ≤ N/4): each layer is sampled from its conditional Gaussian law
  (:mod:`bnlab.sim.conditional`) — the same joint law of every measured
  quantity, computed with O(rows²·N) work, so the ratio can exceed 1: it then
  says how much faster than the bare matmuls of the explicit network the whole
  simulation runs.

Another count (columns ``train``) adds the weight-gradient products ∂L/∂W^l = a^lᵀ δ^l
(2·rows·d_in·N FLOPs per layer and network) to the reference loop: the simulator reports
‖∂L/∂W^l‖² for every layer (computed exactly from the B×B Gram matrices ⟨a aᵀ, δδᵀ⟩ rather
than from the N×N matrix), and an autograd network whose weights require grad runs these
products; forward + input gradient + weight gradient is the usual "model FLOPs" count of a
training step (3× the forward).  Both counts are printed; the ``explicit`` and
``conditional`` columns use the smaller one.

A second, literal reading of "achieved FLOP/s as a fraction of torch.matmul on the same
shapes" is also printed (columns ``all-mm``): every matrix product the simulator runs is
recorded (a ``TorchDispatchMode`` over one run: the layers' products and the measurements' B×B
Gram matrices, for either weight sampling), the same products are replayed bare, and the ratio
is t_replay / t_sim — the share of the simulator's time that runs at matmul speed; the rest is
random number generation, QR/Cholesky, batch normalization, φ and bookkeeping.

The time of drawing the N² Gaussian weights per layer and network with
torch's CPU generator (~3–8 ns per number, single-threaded per generator) is
also reported as a share of the explicit simulation: at small B it, not the
matmul, bounds the explicit simulator, since a matmul uses each weight only
4·rows times.

Usage::

    python benchmarks/bench_sim.py [--threads 2] [--width 1000] [--depth 8] [--networks 8] [--device cpu]
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bnlab.sim import simulate
from bnlab.sim.init import _draw


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


# matrix products, and the overload replayed for each (products written into a slice with out=,
# as the blocked Gram and triangular products do, are replayed allocating their result)
_MATMULS = {op: op for op in (torch.ops.aten.bmm.default, torch.ops.aten.mm.default, torch.ops.aten.baddbmm.default,
                              torch.ops.aten.addmm.default)}
_MATMULS.update({torch.ops.aten.bmm.out: torch.ops.aten.bmm.default, torch.ops.aten.mm.out: torch.ops.aten.mm.default,
                 torch.ops.aten.baddbmm.out: torch.ops.aten.baddbmm.default,
                 torch.ops.aten.baddbmm_.default: torch.ops.aten.baddbmm.default})


class _RecordMatmuls(TorchDispatchMode):
    """Records (op, argument shapes, dtype) of every matrix product dispatched in this thread."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _MATMULS:
            self.calls.append((_MATMULS[func], [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)],
                               next(a.dtype for a in args if isinstance(a, torch.Tensor))))
        return func(*args, **(kwargs or {}))


def _replay(calls, device):
    """A function running the recorded products on fresh operands of the same shapes."""
    operands = [(func, [torch.randn(sh, dtype=dtype, device=device) for sh in shapes]) for func, shapes, dtype in calls]

    def run():
        for func, ts in operands:
            func(*ts)
    return run


def bench(width, depth, networks, batch_size, num_batches, dtype, device, repeats):
    dt = {"float32": torch.float32, "float64": torch.float64}[dtype]
    rows = batch_size * num_batches
    flops = 2.0 * rows * width * width * networks * (depth + (depth - 1))

    def sim(weight_sampling):
        return lambda: simulate("relu", batch_size, width, depth, networks, num_batches=num_batches, dtype=dtype,
                                device=device, seed=0, max_memory_bytes=8 << 30, weight_sampling=weight_sampling)

    a = torch.randn(networks, rows, width, dtype=dt, device=device)
    w = torch.randn(networks, width, width, dtype=dt, device=device)

    def run_bmm():
        for _ in range(depth):
            torch.bmm(a, w)
        wt = w.transpose(1, 2)
        for _ in range(depth - 1):
            torch.bmm(a, wt)

    at = a.transpose(1, 2)

    def run_bmm_train():  # + the weight gradients a^lᵀ δ^l, (d, rows) × (rows, N) per layer
        run_bmm()
        for _ in range(depth):
            torch.bmm(at, a)

    gens = [torch.Generator(device=device).manual_seed(i) for i in range(networks)]

    def run_rng():
        for _ in range(depth):
            _draw("gaussian", networks, width, width, 1.0, gens, dt, device)

    replays = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: the chunks run in this thread, where the recorder sees them
    try:
        for ws in ("explicit", "conditional"):
            with _RecordMatmuls() as rec:
                sim(ws)()
            replays[ws] = _replay(rec.calls, device)
    finally:
        torch.set_num_threads(threads)
    sim("explicit")()  # warm up (thread pools, allocator)
    sim("conditional")()
    # interleave the timed runs so that a load change on a shared machine hits all of them
    t_exp = t_cond = t_bmm = t_bmm_train = t_rng = t_mm_exp = t_mm_cond = float("inf")
    for _ in range(repeats):
        t_bmm = min(t_bmm, _best(run_bmm, 1))
        t_bmm_train = min(t_bmm_train, _best(run_bmm_train, 1))
        t_mm_exp = min(t_mm_exp, _best(replays["explicit"], 1))
        t_mm_cond = min(t_mm_cond, _best(replays["conditional"], 1))
        t_exp = min(t_exp, _best(sim("explicit"), 1))
        t_cond = min(t_cond, _best(sim("conditional"), 1))
        t_rng = min(t_rng, _best(run_rng, 1))
    return dict(t_exp=t_exp, t_cond=t_cond, t_bmm=t_bmm, t_rng=t_rng, gflops_bmm=flops / t_bmm / 1e9,
                ratio_explicit=t_bmm / t_exp, ratio_conditional=t_bmm / t_cond, rng_share=t_rng / t_exp,
                train_explicit=t_bmm_train / t_exp, train_conditional=t_bmm_train / t_cond,
                all_mm_explicit=t_mm_exp / t_exp, all_mm_conditional=t_mm_cond / t_cond,
                speedup=t_exp / t_cond)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--width", type=int, default=1000)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--networks", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, device {args.device}, width {args.width}, "
          f"depth {args.depth}, {args.networks} networks")
    print("ratio = (explicit network's matmul FLOPs / simulator time) / (bmm FLOP/s) = t_bmm / t_sim;")
    print("train = the same with the weight-gradient products a^lᵀδ^l added to the count and to the bmm loop")
    print("all-mm = (all matmul FLOPs the simulator runs / its time) / (the same matmuls' FLOP/s) = t_mm / t_sim")
    header = (f"{'dtype':8} {'B':>4} {'k':>3} {'rows':>5} {'bmm GF/s':>9} {'explicit':>9} {'train':>6} {'all-mm':>7} "
              f"{'RNG share':>9} {'conditional':>11} {'train':>6} {'all-mm':>7} {'cond speedup':>12}")
    print(header)
    print("-" * len(header))
    for dtype in ("float32", "float64"):
        for b, k in ((32, 1), (32, 4), (128, 1), (256, 1), (64, 8)):
            r = bench(args.width, args.depth, args.networks, b, k, dtype, args.device, args.repeats)
            print(f"{dtype:8} {b:>4} {k:>3} {b * k:>5} {r['gflops_bmm']:>9.1f} {r['ratio_explicit']:>9.2f} "
                  f"{r['train_explicit']:>6.2f} {r['all_mm_explicit']:>7.2f} {r['rng_share']:>9.2f} "
                  f"{r['ratio_conditional']:>11.2f} {r['train_conditional']:>6.2f} {r['all_mm_conditional']:>7.2f} "
                  f"{r['speedup']:>11.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
