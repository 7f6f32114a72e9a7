"""Lange et al. Table 1 on this machine: training time per epoch of BN vs BNP, and BNP's overhead over SGD.

    python benchmarks/bench_bnp.py [--quick] [--device cpu|cuda] [--threads 1] [--rounds 7] [--json]
                                   [--no-native] [--no-compiled]

The network is the paper's Table 1 / Fig. 8 fully connected net (input 3072 = a CIFAR-10 image,
two hidden layers of 100, 10 outputs, ReLU, cross-entropy, SGD); ``--input 784 --depth 3`` is the
MNIST network of Figs. 3-4.  The variants train side by side on the same pre-generated random
batches, interleaved step by step (so drifting load on a shared machine hits all of them alike)
and are summarized by the median time of a single training step:

* ``sgd``  — the vanilla network, plain SGD (the baseline of the ≤ 10 % overhead goal);
* ``bn``   — the post-activation BN network (BatchNorm1d on each hidden layer's output), SGD;
* ``bnp``  — the vanilla network, SGD with ``BNPreconditioner(model)``: the default route the route
  chooser picks for the device (autograd forms G_w, ``step()`` rewrites it with Eq. 15): the eager
  route on CPU, the compiled route captured in a CUDA graph on CUDA (with Triton);
* ``bnp_eager`` (CUDA only; on CPU it is ``bnp``) — ``compiled=False``: the eager ``_foreach`` route;
* ``bnp_uncaptured`` (CUDA only) — ``cuda_graph=False``: the compiled route without the CUDA graph
  (one compiled call per step: guards and one launch per fused kernel);
* ``bnp_compiled`` (CPU only; on CUDA it is ``bnp``) — ``compiled=True``: the hooks keep the layer
  inputs and ``step()`` is one call of the ``torch.compile``-d functional core (inductor's C++
  backend on CPU; compiles on the first step of each batch size, left out of ``--quick`` and by
  ``--no-compiled``);
* ``bnp_fused`` — ``gradient="fused"``: autograd skips the weight gradient, ``step()`` forms the
  preconditioned one as δᵀĤ (no pass over G_w, one N × n_in pass over the input);
* ``bnp_auto`` — ``gradient="auto"``: fused where N ≤ n_out, transform elsewhere;
* ``bnp_native`` — ``native=True``: the hooks only keep each layer's input and ``pre.step()`` does
  Algorithm 2 steps 1-5 of all three layers in one call of a compiled kernel (one read of each
  input, one pass over each G_w; ``bnlab.optim._native``; built on first use, ~20 s once; left out
  of ``--quick`` and by ``--no-native``);
* ``floor`` — the vanilla network, SGD plus the least memory traffic the *transform* route must
  add: a forward pre-hook that reads each layer input once (``x.sum(0)``) and one in-place scaling
  of each weight gradient after ``backward()``.  ``floor/sgd`` is the overhead no hooks + ``.grad``
  rewrite in eager PyTorch can go below (the fused route can, by saving autograd's product).

**Operators per step** (``ops_per_step``): the aten operators one training step dispatches, counted
with a ``TorchDispatchMode`` (the proxy for kernel launches the issue uses: SGD 59, BN 75, BNP 85 on
Table 1's net at B = 16).  ``torch.compile`` runs uncompiled under a dispatch mode, so the compiled
route's one call is counted apart: outside the mode, under the profiler, as the kernels it runs
(inductor's ``cpp_fused_*`` / ``triton_*`` kernels) plus the aten operators it calls.  On CUDA also
``launches_per_step``: the kernels (and copies) the profiler sees on the device in one step.

A step is zero_grad + forward + backward (+ ``pre.step()``) + ``opt.step()``; time per epoch is the
step time × ⌈50 000 / B⌉ (one CIFAR-10 epoch).  Each phase is timed too (medians over the steps):
``fwd`` (zero_grad + forward, BNP's hooks included), ``bwd``, ``pre`` (``pre.step()``), ``opt``.
Printed ratios: BNP/SGD (goal ≤ 1.10) and BNP/BN (goal ≤ 1.00) for each BNP variant, and the
SGD step against the time of its matrix products alone (``gemm ms``: the same forward, weight-
and input-gradient products timed by themselves), i.e. how far the step is from the machine's
matmul throughput.  The paper's Table 1 (V100 GPU, 20-epoch average) has BN 16.08 / 10.81 /
10.67 s and BNP 16.69 / 10.70 / 10.57 s at B = 16 / 256 / 512, dominated by input-pipeline time we
do not have.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # noqa: E402

from bnlab.optim import BNPreconditioner  # noqa: E402
from bnlab.optim import _compiled  # noqa: E402
from _timing import LAUNCH_CALLS, device_clock, device_sync, worst_check  # noqa: E402

TRAIN_SIZE = 50_000
#: BNP variants and their BNPreconditioner arguments (see bnlab.optim.BNPreconditioner).
_BNP_KWARGS = {"bnp": {}, "bnp_eager": {"compiled": False}, "bnp_compiled": {"compiled": True},
               "bnp_uncaptured": {"cuda_graph": False}, "bnp_fused": {"gradient": "fused"},
               "bnp_auto": {"gradient": "auto"}, "bnp_native": {"native": True}}
VARIANTS = ("sgd", "bn", "bnp", "bnp_eager", "bnp_uncaptured", "bnp_compiled", "bnp_fused", "bnp_auto", "bnp_native",
            "floor")
_BNP = ("bnp", "bnp_eager", "bnp_uncaptured", "bnp_compiled", "bnp_fused", "bnp_auto", "bnp_native")
PHASES = ("fwd", "bwd", "pre", "opt")


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


class OpCounter(TorchDispatchMode):
    """Counts the aten operators dispatched while it is active."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _region_ops(prof) -> int:
    """Kernels (inductor's ``cpp_fused_*`` / ``triton_*``) and top-level aten operators of one
    compiled call, from its profile."""
    n = 0
    for e in prof.events():
        name = e.name
        if "cpp_fused" in name or name.startswith("triton_"):
            n += 1
        elif name.startswith("aten::"):
            parent = e.cpu_parent
            while parent is not None and not parent.name.startswith("aten::"):
                parent = parent.cpu_parent
            n += parent is None
    return n


@contextmanager
def _counting_compiled_calls(counter: OpCounter):
    """Run the compiled route's call outside the dispatch mode (under which torch.compile would fall
    back to eager) and add what it runs to ``counter``."""
    real = _compiled.dense_steps_

    def counted(*args):
        with _disable_current_modes():
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                out = real(*args)
        counter.count += _region_ops(prof)
        return out

    _compiled.dense_steps_ = counted
    try:
        yield
    finally:
        _compiled.dense_steps_ = real


def ops_per_step(step, x, y) -> int:
    """Aten operators one training step dispatches (a compiled call counted as its kernels + operators)."""
    counter = OpCounter()
    with _counting_compiled_calls(counter), counter:
        step(x, y)
    return counter.count


def launches_per_step(step, x, y) -> tuple[int, int] | tuple[None, None]:
    """``(kernels, launch calls)`` of one training step: the kernels (and copies/fills) the profiler sees
    on the CUDA device, and the host calls that launched them (a replayed CUDA graph is one call for all
    of its kernels).  ``(None, None)`` if the profiler fails (the timings do not depend on it)."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    try:
        with torch.profiler.profile(activities=activities) as prof:
            step(x, y)
        events = prof.events()
    except Exception as exc:  # noqa: BLE001 - a profiler refusing (CUPTI) must not cost the timings
        print(f"bench_bnp: the profiler failed ({type(exc).__name__}: {exc}); no launch counts", file=sys.stderr)
        return None, None
    kernels = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    calls = sum(1 for e in events if e.device_type != torch.autograd.DeviceType.CUDA and e.name in LAUNCH_CALLS)
    return kernels, calls


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
        pre = BNPreconditioner(model, **_BNP_KWARGS[variant])
    else:
        pre = _Floor(model) if variant == "floor" else None
    return model, opt, pre


def make_step(model, opt, pre, device="cpu"):
    """One training step; returns the seconds of its phases (see ``_timing.device_clock``)."""
    loss_fn = nn.functional.cross_entropy

    def step(x, y):
        device_sync(device)
        t0 = device_clock(device)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        device_sync(device)
        t1 = device_clock(device)
        loss.backward()
        device_sync(device)
        t2 = device_clock(device)
        if pre is not None:
            pre.step()
        device_sync(device)
        t3 = device_clock(device)
        opt.step()
        device_sync(device)
        t4 = device_clock(device)
        return t1 - t0, t2 - t1, t3 - t2, t4 - t3

    return step


def make_plain_step(model, opt, pre):
    """One training step as a training loop runs it: no synchronization inside (on a GPU the host
    queues the next work while the device runs the last)."""
    loss_fn = nn.functional.cross_entropy

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        if pre is not None:
            pre.step()
        opt.step()

    return step


#: steps per timed block of the pipelined measurement
PIPELINE_BLOCK = 20


def measure(batch: int, *, n_in: int, hidden: int, depth: int, steps: int, rounds: int, device: str,
            variants=VARIANTS):
    """Median seconds per training step of each variant and of each phase, interleaved step by step.

    On a shared machine a preemption lands in one step of one variant; the median over the
    ``rounds × steps`` single steps of each variant drops it, where a mean over a block of steps
    would keep it (block-of-steps timing swung BNP/SGD by up to 0.25 between runs here).
    """
    g = torch.Generator().manual_seed(batch)
    n_batches = 8
    xs = [torch.randn(batch, n_in, generator=g).to(device) for _ in range(n_batches)]
    ys = [torch.randint(0, 10, (batch,), generator=g).to(device) for _ in range(n_batches)]
    steppers, plain, ops, launches, calls = {}, {}, {}, {}, {}
    for v in variants:
        parts = build(v, n_in, hidden, depth, device)
        step = make_step(*parts, device=device)
        plain[v] = make_plain_step(*parts)
        for i in range(3):  # warm-up (allocator, first-call overheads, compilation)
            step(xs[i % n_batches], ys[i % n_batches])
        ops[v] = ops_per_step(step, xs[3], ys[3])
        if str(device).startswith("cuda"):
            launches[v], calls[v] = launches_per_step(step, xs[4], ys[4])
        steppers[v] = step
    times: dict[str, list[tuple]] = {v: [] for v in variants}
    for _ in range(rounds):
        for i in range(steps):
            for v in variants:
                times[v].append(steppers[v](xs[i % n_batches], ys[i % n_batches]))
    # pipelined: blocks of PIPELINE_BLOCK plain steps between two synchronizations, interleaved block by
    # block; the median block's time per step is what an epoch costs (Table 1 times epochs)
    blocks: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(max(rounds, 3) * max(1, steps // PIPELINE_BLOCK)):
        for v in variants:
            device_sync(device)
            t0 = device_clock(device)
            for i in range(PIPELINE_BLOCK):
                plain[v](xs[(r + i) % n_batches], ys[(r + i) % n_batches])
            device_sync(device)
            blocks[v].append((device_clock(device) - t0) / PIPELINE_BLOCK)
    out = {}
    for v, ts in times.items():
        out[v] = {"step": statistics.median(sum(t) for t in ts), "ops": ops[v], "launches": launches.get(v),
                  "launch_calls": calls.get(v), "pipelined": statistics.median(blocks[v])}
        out[v].update({p: statistics.median(t[k] for t in ts) for k, p in enumerate(PHASES)})
    return out


def gemm_time(batch: int, *, n_in: int, hidden: int, depth: int, device: str, repeat: int) -> float:
    """Median seconds of the SGD step's matrix products alone: per layer the forward x Wᵀ + b and
    the weight gradient δᵀx, and for every layer but the first the input gradient δW."""
    widths = [n_in] + [hidden] * depth + [10]
    g = torch.Generator().manual_seed(0)
    mats = []
    for a, b in zip(widths[:-1], widths[1:]):
        mats.append((torch.randn(batch, a, generator=g).to(device), torch.randn(b, a, generator=g).to(device),
                     torch.randn(b, generator=g).to(device), torch.randn(batch, b, generator=g).to(device)))

    def products():
        for i, (x, w, bias, d) in enumerate(mats):
            torch.addmm(bias, x, w.t())
            torch.mm(d.t(), x)
            if i > 0:
                torch.mm(d, w)

    ts = []
    for k in range(repeat + 3):
        device_sync(device)
        t = device_clock(device)
        products()
        device_sync(device)
        if k >= 3:
            ts.append(device_clock(device) - t)
    return statistics.median(ts)


def run(batch_sizes, *, n_in, hidden, depth, rounds, device, quick=False, native=True, compiled=True):
    rows = []
    cuda = str(device).startswith("cuda")
    for b in batch_sizes:
        steps = 3 if quick else max(10, min(200, 20_000 // b))
        # BN cannot train on one sample (the batch variance is zero; BatchNorm1d raises): at B = 1 the
        # comparison is with SGD alone, BNP's case (Lange et al. §5).  bnp is the eager route on CPU and
        # the compiled one (captured) on CUDA, so the other of the two is measured beside it, and on
        # CUDA the compiled route without its graph.
        variants = tuple(v for v in VARIANTS if (native or v != "bnp_native") and (b > 1 or v != "bn")
                         and (v not in ("bnp_eager", "bnp_uncaptured") or cuda)
                         and (v != "bnp_compiled" or (compiled and not cuda)))
        t = measure(b, n_in=n_in, hidden=hidden, depth=depth, steps=steps, rounds=rounds, device=device,
                    variants=variants)
        gemm = gemm_time(b, n_in=n_in, hidden=hidden, depth=depth, device=device, repeat=3 if quick else 50)
        sizes = [a * c for a, c in zip([n_in] + [hidden] * depth, [hidden] * depth + [10])]
        flops = 2 * b * (2 * sum(sizes) + sum(sizes[1:]))  # the products gemm_time runs
        per_epoch = math.ceil(TRAIN_SIZE / b)
        step = {v: t[v]["step"] for v in t}
        piped = {v: t[v]["pipelined"] for v in t}
        rows.append({
            "batch_size": b,
            "ops_per_step": {v: t[v]["ops"] for v in t},
            **({"launches_per_step": {v: t[v]["launches"] for v in t},
                "launch_calls_per_step": {v: t[v]["launch_calls"] for v in t}} if cuda else {}),
            "step_s": step,
            "phase_s": {v: {p: t[v][p] for p in PHASES} for v in t},
            "epoch_s": {v: s * per_epoch for v, s in step.items()},
            "pipelined_step_s": piped,
            "pipelined_ratios": {
                **{f"{v}/sgd": piped[v] / piped["sgd"] for v in ("bn", *_BNP, "floor") if v in piped},
                **{f"{v}/bn": piped[v] / piped["bn"] for v in _BNP if v in piped and "bn" in piped},
            },
            "ratios": {
                **{f"{v}/sgd": step[v] / step["sgd"] for v in ("bn", *_BNP, "floor") if v in step},
                **{f"{v}/bn": step[v] / step["bn"] for v in _BNP if v in step and "bn" in step},
            },
            "gemm_s": gemm,
            "gemm_gflops": flops / gemm / 1e9,
            "sgd_over_gemm": step["sgd"] / gemm,
        })
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small network and few steps (smoke test)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 256, 512])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--input", type=int, default=3072,
                        help="input features (3072: Table 1's CIFAR-10 net; 784: the MNIST net of Figs. 3-4)")
    parser.add_argument("--depth", type=int, default=2, help="hidden layers (2: Table 1; 3: Figs. 3-4)")
    parser.add_argument("--hidden", type=int, default=100, help="width of the hidden layers (100: the paper's)")
    parser.add_argument("--no-native", action="store_true", help="leave out the bnp_native variant")
    parser.add_argument("--no-compiled", action="store_true",
                        help="leave out the bnp_compiled variant on CPU (it compiles for each batch size)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.quick:
        n_in, hidden, depth, rounds, batch_sizes = 64, 16, 2, 2, [1, 4, 32]
    else:
        n_in, hidden, depth, rounds, batch_sizes = args.input, args.hidden, args.depth, args.rounds, args.batch_sizes
    compiled = not (args.quick or args.no_compiled)
    if compiled:  # the CPU kernels of the compiled route show up in the profile (the operator count)
        import torch._inductor.config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True
    rows = run(batch_sizes, n_in=n_in, hidden=hidden, depth=depth, rounds=rounds, device=args.device,
               quick=args.quick, native=not (args.quick or args.no_native), compiled=compiled)
    meta = {"device": args.device, "threads": args.threads,
            "clock": "wall" if args.device.startswith("cuda") or args.threads > 1 else "thread CPU time",
            "network": [n_in] + [hidden] * depth + [10], "torch": torch.__version__}
    summary = {
        # the default route (BNPreconditioner(model): eager on CPU, compiled and captured on CUDA), per batch size
        "bnp_over_sgd": {str(r["batch_size"]): r["ratios"]["bnp/sgd"] for r in rows},
        "bnp_over_bn": {str(r["batch_size"]): r["ratios"]["bnp/bn"] for r in rows if "bnp/bn" in r["ratios"]},
        # the same without synchronizations inside a step (what an epoch costs; on CPU about the same)
        "bnp_over_sgd_pipelined": {str(r["batch_size"]): r["pipelined_ratios"]["bnp/sgd"] for r in rows},
        "bnp_over_bn_pipelined": {str(r["batch_size"]): r["pipelined_ratios"]["bnp/bn"] for r in rows
                                  if "bnp/bn" in r["pipelined_ratios"]},
        # operators per step at the first batch size (per batch size in each row)
        "ops_per_step": rows[0]["ops_per_step"],
        "ops_batch_size": rows[0]["batch_size"],
        # the compiled (and captured) dense step's checks of each new program against the uncompiled
        # core (bnlab.optim._compiled): the worst ratio to the tolerance, ≤ 1 agrees; None: none made
        "compiled_check_worst": worst_check(_compiled._STATE.get("checks", [])),
    }
    if args.json:
        print(json.dumps({"meta": meta, **summary, "rows": rows}, indent=2))
        return 0
    print(f"BNP benchmark: network {meta['network']}, device {args.device}, threads {args.threads}, "
          f"clock {meta['clock']}, torch {torch.__version__}")
    print(f"{'B':>5} {'SGD s/ep':>9} {'BN s/ep':>8} {'BNP s/ep':>9} {'auto s/ep':>10} "
          f"{'BNP/SGD':>8} {'fused/SGD':>9} {'auto/SGD':>8} {'BNP/BN':>7} {'auto/BN':>7} {'BN/SGD':>7} "
          f"{'floor/SGD':>9} {'SGD ms':>7} {'gemm ms':>8} {'GFLOP/s':>8}")
    nan = float("nan")
    for r in rows:
        e, q = dict(r["epoch_s"]), dict(r["ratios"])
        e.setdefault("bn", nan)
        for key in ("bnp/bn", "bnp_auto/bn", "bn/sgd"):
            q.setdefault(key, nan)
        print(f"{r['batch_size']:>5} {e['sgd']:>9.3f} {e['bn']:>8.3f} {e['bnp']:>9.3f} {e['bnp_auto']:>10.3f} "
              f"{q['bnp/sgd']:>8.3f} {q['bnp_fused/sgd']:>9.3f} {q['bnp_auto/sgd']:>8.3f} {q['bnp/bn']:>7.3f} "
              f"{q['bnp_auto/bn']:>7.3f} {q['bn/sgd']:>7.3f} {q['floor/sgd']:>9.3f} "
              f"{1e3 * r['step_s']['sgd']:>7.3f} {1e3 * r['gemm_s']:>8.3f} {r['gemm_gflops']:>8.1f}")
    for r in rows:
        q = r["ratios"]
        if "bnp_native/sgd" in q:
            print(f"{r['batch_size']:>5}  native=True: BNP/SGD {q['bnp_native/sgd']:.3f}  "
                  f"BNP/BN {q.get('bnp_native/bn', float('nan')):.3f}")
    for r in rows:
        q = r["ratios"]
        for other in ("bnp_eager", "bnp_uncaptured", "bnp_compiled"):
            if other in r["step_s"]:
                print(f"{r['batch_size']:>5}  {other}: BNP/SGD {q[other + '/sgd']:.3f}  "
                      f"BNP/BN {q.get(other + '/bn', float('nan')):.3f}")
    print(f"pipelined (blocks of {PIPELINE_BLOCK} steps, no synchronization inside a step), ratios of the "
          "time per step:")
    for r in rows:
        q = r["pipelined_ratios"]
        print(f"{r['batch_size']:>5}  SGD {1e3 * r['pipelined_step_s']['sgd']:.3f} ms  "
              + "  ".join(f"{k} {v:.3f}" for k, v in q.items()))
    if summary["compiled_check_worst"] is not None:
        print(f"compiled dense step checked against the uncompiled core: worst {summary['compiled_check_worst']} "
              "of the tolerance (≤ 1 agrees)")
    print("aten operators dispatched per step (a compiled call counted as its kernels + operators)"
          + (", and [kernels on the GPU / host launch calls]" if args.device.startswith("cuda") else "") + ":")
    for r in rows:
        ops = r["ops_per_step"]
        launches = r.get("launches_per_step", {})
        calls = r.get("launch_calls_per_step", {})
        parts = "  ".join(f"{v} {n}" + (f" [{launches[v]} / {calls.get(v)}]" if v in launches else "")
                          + (f" ({n / ops['sgd']:.2f}x)" if v != "sgd" else "") for v, n in ops.items())
        print(f"{r['batch_size']:>5}  {parts}")
    print("phases, ms per step (fwd = zero_grad + forward with hooks, bwd, pre = pre.step(), opt):")
    for r in rows:
        parts = "  ".join(
            f"{v} " + "/".join(f"{1e3 * r['phase_s'][v][p]:.3f}" for p in PHASES) for v in r["phase_s"])
        print(f"{r['batch_size']:>5}  {parts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
