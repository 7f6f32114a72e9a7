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
* ``conditional`` (the default ``weight_sampling="auto"`` on a CPU for Gaussian
  weights when rows ≤ N/4): each layer is sampled from its conditional Gaussian law
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

On a GPU (``--device cuda``): 64 networks by default (the goal of issue 27 item 4 is
≥ 0.5 of bmm at width ≥ 1000 with ≥ 64 networks), wall time with ``torch.cuda.synchronize``
around every timed call, the simulator's memory bound (``max_memory_bytes``) and the
replay's operand budget set from the device's free memory.  The replay allocates fresh
operands for every recorded product, in groups whose operands fit the budget (all at once
would need 134 GiB at width 4096 × 64 networks), timing only the products.

``ops/layer`` counts the aten operators the simulator dispatches per layer (a
``TorchDispatchMode``; on a GPU nearly every one is a kernel launch of ≈ 5–10 µs of host time,
longer than most of the simulator's kernels at width ~1000), for each route.

``--json`` prints every row and ``sim_over_bmm``: route -> t_bmm / t_sim of the largest
configuration run (most bmm FLOPs), for "explicit", "conditional" and "auto" (the route
``weight_sampling="auto"`` picks on this device for that shape, named by ``auto_route``).

Usage::

    python benchmarks/bench_sim.py [--threads 2] [--width 1000] [--depth 8] [--networks 8] [--device cpu]
        [--quick] [--json] [--replay-budget-gb G]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bnlab.sim import simulate
from bnlab.sim.init import _draw

#: (batch size B, batches k) of the full run; rows = k·B
CONFIGS = ((32, 1), (32, 4), (128, 1), (256, 1), (64, 8))


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _best(fn, repeats: int, device="cpu") -> float:
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return best


def _free_bytes(device) -> int:
    """Memory a benchmark may fill: the device's free memory on a GPU (cached blocks released
    first), a quarter of the physical memory on a CPU."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        return int(torch.cuda.mem_get_info(dev)[0])
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return 4 << 30


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


class _CountOps(TorchDispatchMode):
    """Counts the aten operators dispatched in this thread (a proxy for kernel launches on a GPU)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def ops_per_layer(batch_size, num_batches, networks, device, weight_sampling, dtype="float32") -> float:
    """Dispatched aten operators per layer of one simulation: (ops at depth 8 − ops at depth 4) / 4, at
    width 64 (the count does not depend on the width), in this thread (one torch thread)."""
    counts = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        simulate("relu", batch_size, 64, 2, networks, num_batches=num_batches, device=device, dtype=dtype,
                 seed=0, weight_sampling=weight_sampling, max_memory_bytes=8 << 30)  # caches made once
        for depth in (4, 8):
            with _CountOps() as c:
                simulate("relu", batch_size, 64, depth, networks, num_batches=num_batches, device=device,
                         dtype=dtype, seed=0, weight_sampling=weight_sampling, max_memory_bytes=8 << 30)
            counts.append(c.count)
    finally:
        torch.set_num_threads(threads)
    return (counts[1] - counts[0]) / 4


def _call_bytes(shapes, dtype) -> int:
    """Operands and result of one recorded product (the result is (…, n, p) of the last two operands)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    result = math.prod(shapes[-2][:-1]) * shapes[-1][-1]
    return (sum(math.prod(sh) for sh in shapes) + result) * itemsize


def _replay_groups(calls, budget_bytes: int) -> list[list]:
    """Consecutive runs of ``calls`` whose operands and results fit ``budget_bytes`` together (a
    product larger than the budget alone is a group of its own)."""
    groups, group, used = [], [], 0
    for call in calls:
        size = _call_bytes(call[1], call[2])
        if group and used + size > budget_bytes:
            groups.append(group)
            group, used = [], 0
        group.append(call)
        used += size
    if group:
        groups.append(group)
    return groups


def _replay(calls, device, budget_bytes: int | None = None):
    """A function that runs the recorded products bare on fresh operands of the same shapes and
    returns the seconds spent in the products.

    Every product gets operands of its own, as in the simulation (no operand stays in a cache
    for the next product).  They are allocated in groups of at most ``budget_bytes`` (default:
    the free memory, see :func:`_free_bytes`, halved); only the products are timed, each group
    between two synchronizations.  A single group is allocated once and reused by every call of
    the returned function; several are allocated anew on every call.
    """
    budget = _free_bytes(device) // 2 if budget_bytes is None else budget_bytes
    groups = _replay_groups(calls, budget)

    def operands(group):
        return [(func, [torch.randn(sh, dtype=dtype, device=device) for sh in shapes]) for func, shapes, dtype in group]

    kept = operands(groups[0]) if len(groups) == 1 else None

    def run() -> float:
        total = 0.0
        for group in groups:
            ops = kept if kept is not None else operands(group)
            _sync(device)
            t = time.perf_counter()
            for func, ts in ops:
                func(*ts)
            _sync(device)
            total += time.perf_counter() - t
            del ops
        return total

    run.groups = len(groups)
    return run


def bench(width, depth, networks, batch_size, num_batches, dtype, device, repeats, *, max_memory_bytes=None,
          replay_budget_bytes=None):
    dt = {"float32": torch.float32, "float64": torch.float64}[dtype]
    rows = batch_size * num_batches
    flops = 2.0 * rows * width * width * networks * (depth + (depth - 1))
    def sim(weight_sampling):
        return lambda: simulate("relu", batch_size, width, depth, networks, num_batches=num_batches, dtype=dtype,
                                device=device, seed=0, max_memory_bytes=max_memory_bytes,
                                weight_sampling=weight_sampling)

    a = torch.randn(networks, rows, width, dtype=dt, device=device)
    w = torch.randn(networks, width, width, dtype=dt, device=device)
    if max_memory_bytes is None:  # the simulator's chunk bound: 8 GiB on a CPU, half the GPU memory left free
        max_memory_bytes = 8 << 30 if torch.device(device).type == "cpu" else int(0.5 * _free_bytes(device))

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

    def run_rng():  # per layer and network, as the CPU route draws them
        for _ in range(depth):
            _draw("gaussian", networks, width, width, 1.0, gens, dt, device)

    replays = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: the chunks run in this thread, where the recorder sees them
    try:
        for ws in ("explicit", "conditional"):
            with _RecordMatmuls() as rec:
                sim(ws)()
            replays[ws] = rec.calls
    finally:
        torch.set_num_threads(threads)
    auto_route = sim("auto")().config["weight_sampling"]  # also warms up that route (thread pools, allocator)
    sim("conditional" if auto_route == "explicit" else "explicit")()
    del a, w, at  # the replay's operands get the memory
    replays = {ws: _replay(calls, device, replay_budget_bytes) for ws, calls in replays.items()}
    for replay in replays.values():
        replay()  # warm up (first use of each product's shape)
    a = torch.randn(networks, rows, width, dtype=dt, device=device)
    w = torch.randn(networks, width, width, dtype=dt, device=device)
    at = a.transpose(1, 2)
    # interleave the timed runs so that a load change on a shared machine hits all of them
    t_exp = t_cond = t_bmm = t_bmm_train = t_rng = t_mm_exp = t_mm_cond = float("inf")
    for _ in range(repeats):
        t_bmm = min(t_bmm, _best(run_bmm, 1, device))
        t_bmm_train = min(t_bmm_train, _best(run_bmm_train, 1, device))
        t_mm_exp = min(t_mm_exp, replays["explicit"]())
        t_mm_cond = min(t_mm_cond, replays["conditional"]())
        t_exp = min(t_exp, _best(sim("explicit"), 1, device))
        t_cond = min(t_cond, _best(sim("conditional"), 1, device))
        t_rng = min(t_rng, _best(run_rng, 1, device))
    ratio = {"explicit": t_bmm / t_exp, "conditional": t_bmm / t_cond}
    return dict(t_exp=t_exp, t_cond=t_cond, t_bmm=t_bmm, t_rng=t_rng, gflops_bmm=flops / t_bmm / 1e9, flops=flops,
                ratio_explicit=ratio["explicit"], ratio_conditional=ratio["conditional"],
                auto_route=auto_route, ratio_auto=ratio[auto_route], rng_share=t_rng / t_exp,
                train_explicit=t_bmm_train / t_exp, train_conditional=t_bmm_train / t_cond,
                all_mm_explicit=t_mm_exp / t_exp, all_mm_conditional=t_mm_cond / t_cond,
                replay_groups=max(r.groups for r in replays.values()), speedup=t_exp / t_cond,
                ops_per_layer={ws: ops_per_layer(batch_size, num_batches, networks, device, ws, dtype)
                               for ws in ("explicit", "conditional")})


def sim_over_bmm(rows: list[dict]) -> dict:
    """route -> t_bmm / t_sim of the largest configuration (most bmm FLOPs) among ``rows``; "auto"
    is the route the simulator picks by default there, named by the extra key ``auto_route``."""
    big = max(rows, key=lambda r: r["flops"])
    out = {"explicit": big["ratio_explicit"], "conditional": big["ratio_conditional"], "auto": big["ratio_auto"]}
    return {**out, "auto_route": big["auto_route"],
            "config": {key: big[key] for key in ("dtype", "batch_size", "num_batches", "rows", "width", "depth",
                                                  "networks")}}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--width", type=int, default=None, help="default 1000 (--quick: 64 on a CPU, 1024 on a GPU)")
    p.add_argument("--depth", type=int, default=None, help="default 8 (--quick: 3 on a CPU)")
    p.add_argument("--networks", type=int, default=None, help="default 8 on a CPU, 64 on a GPU (--quick: 2 on a CPU)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=None, help="default 3 (--quick: 1)")
    p.add_argument("--quick", action="store_true",
                   help="a smoke test: one small float64 configuration on a CPU; on a GPU width 1024, 64 networks, "
                        "float32, rows 32 and 256")
    p.add_argument("--replay-budget-gb", type=float, default=None,
                   help="memory for the replayed products' operands at once (default: half the free memory)")
    p.add_argument("--json", action="store_true", help="print the rows and sim_over_bmm as JSON")
    args = p.parse_args(argv)
    if args.threads < 1:
        p.error(f"--threads={args.threads} is not allowed: expected an integer >= 1")
    gpu = torch.device(args.device).type != "cpu"
    if args.quick:
        width, depth, networks = (1024, 8, 64) if gpu else (64, 3, 2)
        dtypes, configs, repeats = (("float32",), ((32, 1), (64, 4)), 1) if gpu else (("float64",), ((4, 2),), 1)
    else:
        width, depth, networks = 1000, 8, 64 if gpu else 8
        dtypes, configs, repeats = ("float32", "float64"), CONFIGS, 3
    width = args.width or width
    depth = args.depth or depth
    networks = args.networks or networks
    repeats = args.repeats or repeats
    budget = None if args.replay_budget_gb is None else int(args.replay_budget_gb * 2**30)
    torch.set_num_threads(args.threads)
    rows = []
    if not args.json:
        print(f"torch {torch.__version__}, {args.threads} threads, device {args.device}, width {width}, "
              f"depth {depth}, {networks} networks")
        print("ratio = (explicit network's matmul FLOPs / simulator time) / (bmm FLOP/s) = t_bmm / t_sim;")
        print("train = the same with the weight-gradient products a^lᵀδ^l added to the count and to the bmm loop")
        print("all-mm = (all matmul FLOPs the simulator runs / its time) / (the same matmuls' FLOP/s) = t_mm / t_sim")
        header = (f"{'dtype':8} {'B':>4} {'k':>3} {'rows':>5} {'bmm GF/s':>9} {'explicit':>9} {'train':>6} "
                  f"{'all-mm':>7} {'RNG share':>9} {'conditional':>11} {'train':>6} {'all-mm':>7} "
                  f"{'cond speedup':>12} {'auto':>11} {'ops/layer e/c':>13}")
        print(header)
        print("-" * len(header))
    for dtype in dtypes:
        for b, k in configs:
            r = bench(width, depth, networks, b, k, dtype, args.device, repeats, replay_budget_bytes=budget)
            r.update(dtype=dtype, batch_size=b, num_batches=k, rows=b * k, width=width, depth=depth, networks=networks)
            rows.append(r)
            if not args.json:
                print(f"{dtype:8} {b:>4} {k:>3} {b * k:>5} {r['gflops_bmm']:>9.1f} {r['ratio_explicit']:>9.2f} "
                      f"{r['train_explicit']:>6.2f} {r['all_mm_explicit']:>7.2f} {r['rng_share']:>9.2f} "
                      f"{r['ratio_conditional']:>11.2f} {r['train_conditional']:>6.2f} "
                      f"{r['all_mm_conditional']:>7.2f} {r['speedup']:>11.1f}x {r['auto_route']:>11} "
                      f"{r['ops_per_layer']['explicit']:>6.0f}/{r['ops_per_layer']['conditional']:<6.0f}", flush=True)
    out = {"meta": {"device": args.device, "threads": args.threads, "torch": torch.__version__, "clock": "wall",
                    "quick": args.quick},
           "rows": rows, "sim_over_bmm": sim_over_bmm(rows)}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        s = out["sim_over_bmm"]
        print(f"largest configuration ({s['config']}): simulator / bmm = explicit {s['explicit']:.2f}, "
              f"conditional {s['conditional']:.2f}, auto ({s['auto_route']}) {s['auto']:.2f}")
    return out


if __name__ == "__main__":
    main()
