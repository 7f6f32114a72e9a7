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

Then the step routes (``train_ensemble(step_mode=...)``) side by side on one ensemble of BN-MLPs: per
route the time of one step (median over rounds, same process, interleaved rounds), the operators each
step runs, and on CUDA the kernels per step, the host's launch calls per step and the fraction of the
step the GPU is busy.  Operators per step: for ``eager`` the aten operators dispatched (counted by a
``TorchDispatchMode``, views included; the issue's "68 per layer per step"), and for every route the
operators the step *runs*, counted by ``torch.profiler`` — top-level aten calls, plus, inside a compiled
step, each aten call and each fused Inductor kernel of the compiled graph (a dispatch mode cannot count
a compiled step: Dynamo runs the function uncompiled while one is active).  The CUDA setting is the
issue's: 20 BN-MLPs of width 384, depths 5, 10, …, 100, B = 8, 784 inputs.

    OMP_NUM_THREADS=2 python benchmarks/bench_ensemble.py [--quick] [--threads 2] [--json]
    python benchmarks/bench_ensemble.py --quick --routes-only --routes eager,compile   # before/after, ~1.5 min
    python benchmarks/bench_ensemble.py --routes-only [--routes eager,compile] [--device cuda]
    python benchmarks/bench_ensemble.py --step-ab [--rounds 9]   # eager CPU step: e082aac against now, ~1 min
    python benchmarks/bench_ensemble.py --bn-ab [--rounds 9]     # eager CPU step: native BN kernel against ATen
    python benchmarks/bench_ensemble.py --layout-ab [--rounds 9] # vmap stack: gradients' layout against row-major
    python benchmarks/bench_ensemble.py --checkpoint-ab [--rounds 5]  # a run saving at every check against none

Random inputs (no dataset needed): the cost does not depend on the pixel values.  The JSON has ``rows``,
``variance`` and, from the route section, ``step_ms`` (route -> ms per step), ``ops_per_step`` (route ->
operators per step, as above: dispatched for eager, run for the compiled routes), ``profiled_ops_per_step``
(route -> operators run, every route counted alike), ``gpu_busy_fraction`` (of the fastest route run; None
on the CPU), ``kernels_per_step`` / ``launch_calls_per_step`` / ``gpu_busy`` per route (CUDA only) and
``routes_setting``.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import (LAUNCH_CALLS, bmm_gflops, device_clock, device_sync, measured_checkpoint_writes,  # noqa: E402
                     worst_check)


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
    ap.add_argument("--routes-only", action="store_true", help="only the step routes (implied by --device cuda)")
    ap.add_argument("--device", default="cpu", help="device of the step routes (cpu or cuda)")
    ap.add_argument("--routes", default=None,
                    help="comma-separated step routes to time, side by side (default: every route the "
                         "device has; with --quick on the CPU only eager, as compiling takes a minute or more "
                         "there even at --quick's sizes: --quick --routes eager,compile for both)")
    ap.add_argument("--rounds", type=int, default=None, help="timing rounds per route (default 7, --quick 3)")
    ap.add_argument("--step-ab", action="store_true",
                    help="only the eager CPU step of a Yang et al. trainability column, before (e082aac, kept in "
                         "_ensemble_step_before.py) against now, one thread, side by side")
    ap.add_argument("--bn-ab", action="store_true",
                    help="only the eager CPU step of a Yang et al. trainability column with BN by the native kernel "
                         "(bnlab.nets._native_bn) against BN by ATen operators, one thread, side by side, with the "
                         "operators each dispatches per step")
    ap.add_argument("--compile-reuse", action="store_true",
                    help="only the compiled route's set-up: a cold compilation (fresh Inductor cache), then runs "
                         "of 2, 12 and 112 steps of the same networks, whose graph the cache serves (no shape of "
                         "the step depends on the run's length); one thread, CPU seconds")
    ap.add_argument("--layout-ab", action="store_true",
                    help="only the vmap stack's eager step with its parameters laid out as their gradients come "
                         "back against stack_module_state's row-major stack, side by side: fisher-fig2's cell (11 "
                         "FC BN nets 784-512-512-512-10, B = 64, momentum SGD, ½‖f − y‖²), one thread, ~1 min")
    ap.add_argument("--buffer-reuse-ab", action="store_true",
                    help="only the compiled CPU step with bnlab's Inductor options (buffer reuse off, "
                         "bnlab._inductor) against Inductor's default (reuse on), side by side: 3 float32 BN-MLPs "
                         "of depths 4, 8, 16, width 128, 784 inputs, B = 32; one thread, wall ms per steady step")
    ap.add_argument("--checkpoint-ab", action="store_true",
                    help="only train_ensemble with a checkpoint saved at every check (checkpoint_every=0, the most "
                         "often it saves) against a run keeping none, side by side: a Yang et al. Fig. 3 column "
                         "(width 128, depths 4…64, B = 8, SGD), one thread; wall ms per run, per save, MB per save")
    args = ap.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _main(args)
    finally:
        torch.set_num_threads(threads)


def _compile_reuse() -> list[dict]:
    """CPU seconds of ``train_ensemble(step_mode="compile")`` on two small BN-MLPs (depths 2, 3, width 16,
    B = 8): the first run compiles cold (Inductor's cache pointed at an empty folder), the later runs of
    other lengths reuse its graph from the cache.  What a plan's pilots (a task cut to k₁ and k₂ steps)
    and a grid's same-shaped tasks pay for compilation."""
    import os
    import tempfile

    from bnlab.nets import BNMLP, train_ensemble

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(512, 32, generator=gen), torch.randint(0, 10, (512,), generator=gen)
    rows = []
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # read when Inductor looks its cache up: a cold start
        try:
            for label, steps in (("cold", 2), ("cached", 2), ("cached", 12), ("cached", 112)):
                models = [BNMLP(32, 10, depth=d, width=16, seed=i) for i, d in enumerate((2, 3))]
                c = time.process_time()
                train_ensemble(models, (x, y), lr=0.01, batch_size=8, steps=steps, step_mode="compile")
                rows.append({"run": label, "steps": steps, "cpu_s": round(time.process_time() - c, 2)})
        finally:
            if before is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = before
    return rows


def _buffer_reuse_ab(quick: bool = False) -> list[dict]:
    """Wall ms per steady compiled step with each set of Inductor options, each in a fresh Inductor
    cache: the trainer's own timing of its steps after the third (``bnlab._run_length``, as a plan's
    pilot reads it), the least of 3 runs; the first run's compilation in CPU seconds."""
    import os
    import tempfile

    import bnlab._inductor as inductor_options
    from bnlab._run_length import standing_for, steady_steps
    from bnlab.nets import BNMLP, train_ensemble

    torch.set_num_threads(1)
    features, width, depths, batch, steps = (32, 16, (2, 3), 8, 20) if quick else (784, 128, (4, 8, 16), 32, 300)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(4096, features, generator=gen), torch.randint(0, 10, (4096,), generator=gen)

    def run():
        models = [BNMLP(features, 10, depth=d, width=width, seed=i) for i, d in enumerate(depths)]
        c = time.process_time()
        with standing_for(steps):
            train_ensemble(models, (x, y), lr=0.01, batch_size=batch, steps=steps, step_mode="compile")
            n, seconds = steady_steps()[-1]
        return time.process_time() - c, seconds / n * 1e3

    rows = []
    kept, before = inductor_options.COMPILE_OPTIONS, os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    try:
        reuse = {k: v for k, v in kept.items() if k != "allow_buffer_reuse"}  # bnlab's, but Inductor's default reuse
        for label, options in (("bnlab (allow_buffer_reuse=False)", dict(kept)), ("Inductor default reuse", reuse)):
            inductor_options.COMPILE_OPTIONS = options
            with tempfile.TemporaryDirectory() as cache:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
                runs = [run() for _ in range(3)]
            rows.append({"options": label, "first_run_cpu_s": round(runs[0][0], 1),
                         "step_ms": round(min(ms for _, ms in runs), 3),
                         "runs_ms": [round(ms, 3) for _, ms in runs]})
    finally:
        inductor_options.COMPILE_OPTIONS = kept
        if before is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = before
    rows[0]["ratio_to_default"] = round(rows[0]["step_ms"] / rows[1]["step_ms"], 3)
    return rows


def _main(args) -> dict:
    if args.buffer_reuse_ab:
        rows = _buffer_reuse_ab(args.quick)
        if args.json:
            print(json.dumps({"buffer_reuse_ab": rows}, indent=1))
        else:
            print("compiled step on the CPU, one thread: bnlab's Inductor options against Inductor's default")
            for r in rows:
                print(f"  {r['options']:34s} {r['step_ms']:8.3f} ms/step  (runs {r['runs_ms']}; first run, compiling: "
                      f"{r['first_run_cpu_s']} CPU s)")
            print(f"  ratio bnlab / default: {rows[0]['ratio_to_default']}")
        return {"buffer_reuse_ab": rows}
    if args.compile_reuse:
        rows = _compile_reuse()
        if args.json:
            print(json.dumps({"compile_reuse": rows}, indent=1))
        else:
            print("compiled route, 2 BN-MLPs (depths 2, 3, width 16, B = 8), one thread: CPU seconds per run")
            for r in rows:
                print(f"  {r['run']:7s} {r['steps']:4d} steps  {r['cpu_s']:7.2f} s")
        return {"compile_reuse": rows}
    for key, run, show in (("bn_ab", _bn_ab, _print_bn_ab), ("step_ab", _step_ab, _print_step_ab),
                           ("layout_ab", _layout_ab, _print_layout_ab),
                           ("checkpoint_ab", _checkpoint_ab, _print_checkpoint_ab)):
        if getattr(args, key):  # an A/B of the eager step, one thread, alternating rounds
            torch.set_num_threads(1)  # thread CPU time (device_clock) is the step's cost only on one thread
            rows = run(args.quick, args.rounds or (3 if args.quick else 9))
            if args.json:
                print(json.dumps({key: rows}, indent=1))
            else:
                show(rows)
            return {key: rows}
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    routes_only = args.routes_only or device.type == "cuda"
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
    for name, (depths, seeds, lrs) in ({} if args.phase_only or routes_only else grids).items():
        a = _one_at_a_time(depths, width, seeds, lrs, data, test, batch, steps)
        b = _together(depths, width, seeds, lrs, data, test, batch, steps)
        rows.append({"grid": name, "width": width, "batch": batch, "steps": steps, "one_at_a_time_s": round(a, 3),
                     "ensemble_s": round(b, 3), "speedup": round(a / b, 2)})
    phase = [(32, 5, 4)] if args.quick else [(128, 100, 13), (512, 100, 13)]
    for w, st, ne in ([] if routes_only else phase):
        rows.append(_phase_row(w, st, ne, data, test, args.threads))
    variance = [] if args.phase_only or routes_only else _variance_rows(3 if args.quick else 200)
    route_names = _route_names(args.routes, device, args.quick)
    routes = {} if args.phase_only else _route_section(device, route_names, args.quick,
                                                       args.rounds or (3 if args.quick else 7))
    out = {"rows": rows, "variance": variance, **routes}
    if args.json:
        print(json.dumps(out, indent=1))
        return out
    print(f"threads={args.threads}")
    if rows:
        print(f"{'grid':60s} {'one-at-a-time s':>16s} {'ensemble s':>11s} {'ratio':>6s}   (CPU s: one / ens / ratio)")
    for r in rows:
        cpu = (f"   {r['one_at_a_time_cpu_s']:.2f} / {r['ensemble_cpu_s']:.2f} / {r['speedup_cpu']:.2f}×"
               if "speedup_cpu" in r else "")
        print(f"{r['grid']:60s} {r['one_at_a_time_s']:16.2f} {r['ensemble_s']:11.2f} {r['speedup']:6.2f}×{cpu}")
    if variance:
        print("\nBN variance of the float32 stack, forward + backward (torch.var against the ensemble's two-pass):")
        print(f"{'(nets, groups, B, width)':26s} {'torch.var µs':>13s} {'two-pass µs':>12s} {'ratio':>6s}")
    for r in variance:
        print(f"{str(tuple(r['shape'])):26s} {r['torch_var_us']:13.0f} {r['two_pass_us']:12.0f} {r['speedup']:6.2f}×")
    if routes:
        _print_routes(routes)
    return out


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


# --------------------------------------------------------------------------- step routes
_ALL_ROUTES = {"cpu": ("eager", "compile"), "cuda": ("eager", "compile", "cuda_graph")}


def _route_names(text, device, quick) -> list[str]:
    allowed = _ALL_ROUTES[device.type]
    if text is None:
        # --quick on the CPU is the smoke test of the default suite (and of gpu_check.py --quick): no compile
        return ["eager"] if quick and device.type == "cpu" else list(allowed)
    names = [r.strip() for r in text.split(",") if r.strip()]
    bad = [r for r in names if r not in allowed]
    if bad or not names:
        raise SystemExit(f"--routes {text!r}: expected some of {', '.join(allowed)} on {device.type}")
    return names


def _route_setting(device, quick) -> dict:
    if device.type == "cuda":
        # the issue's setting: one Fig. 3a column at the paper's width (20 BN-MLPs, depths 5…100, B = 8)
        depths = [5, 10] if quick else list(range(5, 101, 5))
        return {"depths": depths, "width": 64 if quick else 384, "batch": 8, "in_features": 784, "dtype": "float32"}
    # the issue's CPU count (4 BN-MLPs of depths 5…20, width 32, B = 8); --quick: shallower
    return {"depths": [2, 3] if quick else [5, 10, 15, 20], "width": 16 if quick else 32, "batch": 8,
            "in_features": 784, "dtype": "float32"}


def _new_run(setting, route, device, steps):
    """An ``_EnsembleRun`` of the setting's BN-MLPs (SGD, cross-entropy, one data order per network),
    built as ``train_ensemble`` builds it, to time and count single steps."""
    from bnlab.nets import BNMLP
    from bnlab.nets._ensemble_step import StepConfig
    from bnlab.nets.ensemble import _BNMLPStack, _EnsembleRun

    depths, width, batch = setting["depths"], setting["width"], setting["batch"]
    x, y = _data(4096)
    x, y = x[:, : setting["in_features"]].to(device), y.to(device)
    models = [BNMLP(setting["in_features"], 10, depth=d, width=width, seed=i).to(device) for i, d in enumerate(depths)]
    stack = _BNMLPStack(models, device)
    m = len(models)
    cfg = StepConfig(loss="cross_entropy", optimizer="sgd", momentum=0.0, weight_decay=0.0, rmsprop_alpha=0.99,
                     rmsprop_eps=1e-8, diverge_above=None, shared_order=False, num_networks=m)
    return _EnsembleRun(stack, cfg, route, x, y, lrs=[1e-3 * batch] * m, seeds=list(range(m)), batch_size=batch,
                        steps=steps, check_every=10)


class _DispatchCount(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _profile_steps(run, n, device) -> dict:
    """Operators run (top-level aten calls; inside a compiled graph its aten calls and fused kernels),
    and on CUDA the device kernels, the host's launch calls and the kernels' busy time, per step."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    device_sync(device)
    with profile(activities=activities) as prof:
        for _ in range(n):
            run.step()
        device_sync(device)
    ops = kernels = launches = 0
    intervals = []
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            # busy: kernels and copies alike; kernels: not the window's index copy or a memset
            kernels += not e.name.startswith(("Memcpy", "Memset"))
            intervals.append((e.time_range.start, e.time_range.end))
            continue
        parent = e.cpu_parent
        if e.name in LAUNCH_CALLS:
            launches += 1
        elif parent is not None and parent.name.startswith("## Call CompiledFxGraph"):
            ops += 1  # an aten call or a fused kernel of the compiled step
        elif e.name.startswith("aten::") and not _has_aten_or_graph_ancestor(e):
            ops += 1
    busy = 0.0
    end = float("-inf")
    for a, b in sorted(intervals):  # the union of the kernels' intervals (µs)
        if b > end:
            busy += b - max(a, end)
            end = b
    out = {"ops": ops / n}
    if device.type == "cuda":
        out.update(kernels=kernels / n, launches=launches / n, busy_ms=busy / 1e3 / n)
    return out


def _has_aten_or_graph_ancestor(e) -> bool:
    p = e.cpu_parent
    while p is not None:
        if p.name.startswith("aten::") or p.name.startswith("## Call CompiledFxGraph"):
            return True
        p = p.cpu_parent
    return False


def _route_section(device, routes, quick, rounds) -> dict:
    """Each route's step time (median of ``rounds`` rounds of ``per_round`` steps, rounds interleaved
    across routes so a drifting load hits every route alike), operators and, on CUDA, kernels and GPU
    busy fraction."""
    if not routes:
        return {}
    if "compile" in routes and device.type == "cpu":
        # Inductor's C++ kernels appear in the profiler only when compiled with a RECORD_FUNCTION each
        # (a flag test when no profiler runs); its Triton kernels on CUDA are the profiler's kernel events
        import torch._inductor.config as inductor_config

        with inductor_config.patch({"cpp.enable_kernel_profile": True}):
            return _route_section_timed(device, routes, quick, rounds)
    return _route_section_timed(device, routes, quick, rounds)


def _route_section_timed(device, routes, quick, rounds) -> dict:
    setting = _route_setting(device, quick)
    per_round, warm, counted = (5, 3, 3) if quick else (10, 3, 5)
    steps = warm + rounds * per_round + 2 * counted + 4
    runs, setup_s = {}, {}
    for r in routes:
        t = time.perf_counter()
        runs[r] = _new_run(setting, r, device, steps)
        for _ in range(warm):  # compiles / captures here
            runs[r].step()
        device_sync(device)
        setup_s[r] = time.perf_counter() - t
    times = collections.defaultdict(list)
    for _ in range(rounds):
        for r in routes:
            device_sync(device)
            t = device_clock(device)
            for _ in range(per_round):
                runs[r].step()
            device_sync(device)
            times[r].append((device_clock(device) - t) / per_round)
    step_ms = {r: 1e3 * statistics.median(times[r]) for r in routes}
    dispatched = {}
    if "eager" in runs:
        with _DispatchCount() as counter:
            for _ in range(counted):
                runs["eager"].step()
        dispatched["eager"] = counter.count / counted
    prof = {r: _profile_steps(runs[r], counted, device) for r in routes}
    profiled = {r: prof[r]["ops"] for r in routes}
    ops = {r: dispatched.get(r, profiled[r]) for r in routes}
    out = {"routes_setting": {**setting, "nets": len(setting["depths"]), "device": str(device),
                              "threads": torch.get_num_threads(), "steps_per_round": per_round, "rounds": rounds},
           "step_ms": {r: round(v, 4) for r, v in step_ms.items()},
           "setup_s": {r: round(v, 2) for r, v in setup_s.items()},
           "ops_per_step": {r: round(v, 1) for r, v in ops.items()},
           "profiled_ops_per_step": {r: round(v, 1) for r, v in profiled.items()},
           "route_used": {r: runs[r].runner.route for r in routes},
           # the compiled and captured routes' checks of their first calls against the eager step (in
           # setup_s): the worst ratio to the tolerance (≤ 1 agrees; bnlab.nets._ensemble_step.step_disagreement)
           "route_check_worst": {r: worst_check(runs[r].runner.checks) for r in routes},
           "gpu_busy_fraction": None}
    if device.type == "cuda":
        out["kernels_per_step"] = {r: round(prof[r]["kernels"], 1) for r in routes}
        out["launch_calls_per_step"] = {r: round(prof[r]["launches"], 1) for r in routes}
        out["gpu_busy"] = {r: round(min(1.0, prof[r]["busy_ms"] / step_ms[r]), 3) for r in routes}
        fastest = min(routes, key=lambda r: step_ms[r])
        out["gpu_busy_fraction"] = out["gpu_busy"][fastest]
    return out


def _print_routes(res: dict) -> None:
    st = res["routes_setting"]
    print(f"\nstep routes: {st['nets']} BN-MLPs, width {st['width']}, depths {st['depths'][0]}…{st['depths'][-1]}, "
          f"B = {st['batch']}, {st['in_features']} inputs, {st['dtype']}, {st['device']}, {st['threads']} threads")
    routes = list(res["step_ms"])
    base = res["step_ms"].get("eager")
    cuda = "kernels_per_step" in res
    head = f"{'route':12s} {'ms/step':>9s} {'eager/route':>12s} {'ops/step':>9s} {'run ops/step':>13s} {'setup s':>8s}"
    print(head + (f" {'kernels':>8s} {'launches':>9s} {'GPU busy':>9s}" if cuda else ""))
    for r in routes:
        ratio = f"{base / res['step_ms'][r]:12.2f}" if base else f"{'':12s}"
        line = (f"{r:12s} {res['step_ms'][r]:9.3f} {ratio} {res['ops_per_step'][r]:9.0f} "
                f"{res['profiled_ops_per_step'][r]:13.0f} {res['setup_s'][r]:8.1f}")
        if cuda:
            line += (f" {res['kernels_per_step'][r]:8.0f} {res['launch_calls_per_step'][r]:9.0f} "
                     f"{res['gpu_busy'][r]:9.0%}")
        if res["route_used"][r] != r:
            line += f"   (ran as {res['route_used'][r]})"
        worst = res["route_check_worst"][r]
        if worst is not None:
            line += f"   (checked against eager: {float(worst):.2g} of the tolerance)"
        print(line)
    if "eager" in res["ops_per_step"]:
        print("ops/step: eager = aten operators dispatched (TorchDispatchMode); compiled = operators the compiled "
              "step runs (profiler).\nrun ops/step: every route counted by the profiler alike "
              f"(eager ops/layer/step: {res['ops_per_step']['eager'] / max(st['depths']):.1f} dispatched)")


# --------------------------------------------------------------------------- eager step, before/after
def _alternating_ms(runs: dict, contexts: dict, warm: int, rounds: int, per_round: int) -> dict[str, float]:
    """Median CPU ms per step of each run (``name -> _EnsembleRun``), the rounds alternating between them so a
    drifting load hits all alike; ``per_round`` steps per round, the first ``warm`` rounds untimed.  Each
    run's steps are taken inside ``contexts[name]()`` where given (the route a run is timed on)."""
    times = collections.defaultdict(list)
    for i in range(warm + rounds):
        for name, run in runs.items():
            with contexts.get(name, contextlib.nullcontext)():
                t = device_clock("cpu")
                for _ in range(per_round):
                    run.step()
                if i >= warm:
                    times[name].append((device_clock("cpu") - t) / per_round)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def _one_step_diff(fresh: dict, contexts: dict) -> float:
    """One step of each of two fresh runs from the same start (``contexts`` as in :func:`_alternating_ms`), then
    the largest difference of their parameters, first against second, relative to the second's largest entry.
    One step only: deep nets amplify a rounding difference by orders of magnitude per step (Yang et al.'s
    gradient explosion), so later states say nothing."""
    for name, run in fresh.items():
        with contexts.get(name, contextlib.nullcontext)():
            run.step()
    first, second = fresh.values()
    return max(((a - b).abs().max() / b.abs().max()).item()
               for a, b in zip(first.stack.params(), second.stack.params()))


def _step_ab(quick: bool, rounds: int) -> list[dict]:
    """Per-step CPU time of the eager step (one thread), the code of e082aac against the current, on a
    Yang et al. (2019) Fig. 3 column: BN-MLPs of width 128, depths 4…48 as one ensemble, 784 inputs,
    ReLU, ε = 1e-3, B = 8 and 128, RMSProp (Fig. 3c's lr 8e-4) and SGD (Fig. 3a's lr 8e-3).  Rounds
    alternate between the two, so a drifting load hits both alike; medians.  Both start from the same
    networks and draw the same batches, so their parameters after a step agree to float32
    rounding (printed: after one step, the largest difference relative to the tensor's largest entry).
    SGD's is ~1e-6 (measured); RMSProp's first step moves each weight by ~lr·g/(√(1−α)·|g| + ε), which
    turns a gradient entry at the level of its own rounding noise (a sum that cancels, of terms that grow
    with depth in these nets) into an update up to 10·lr of either sign, so its difference is up to
    ~10·lr / max|w| (1e-3–1e-1 here, measured), as any change of summation order can."""
    from bnlab.nets import BNMLP
    from bnlab.nets._ensemble_step import StepConfig
    from bnlab.nets.ensemble import _BNMLPStack, _EnsembleRun

    import _ensemble_step_before as before

    depths = [2, 3, 5] if quick else [4, 8, 16, 24, 32, 48]
    width = 16 if quick else 128
    per_round, warm = (2, 1) if quick else (4, 2)
    x, y = _data(2048)
    rows = []
    for batch in (8, 128):
        for opt, lr in (("rmsprop", 8e-4), ("sgd", 8e-3)):
            steps = (warm + rounds) * per_round
            cfg = StepConfig(loss="cross_entropy", optimizer=opt, momentum=0.0, weight_decay=0.0, rmsprop_alpha=0.99,
                             rmsprop_eps=1e-8, diverge_above=None, shared_order=True, num_networks=len(depths),
                             host_reads=True)

            def new(stack_cls):
                models = [BNMLP(784, 10, depth=d, width=width, eps=1e-3, phi="relu", seed=0) for d in depths]
                return _EnsembleRun(stack_cls(models, torch.device("cpu")), cfg, "eager", x, y, lrs=[lr] * len(depths),
                                    seeds=[0] * len(depths), batch_size=batch, steps=steps, check_every=10)

            swap = {"before": before.before_update}
            ms = _alternating_ms({"before": new(before.BeforeStack), "after": new(_BNMLPStack)}, swap, warm, rounds,
                                 per_round)
            diff = _one_step_diff({"before": new(before.BeforeStack), "after": new(_BNMLPStack)}, swap)
            rows.append({"batch": batch, "optimizer": opt, "depths": depths, "width": width, "steps": steps,
                         "before_ms": round(ms["before"], 2), "after_ms": round(ms["after"], 2),
                         "speedup": round(ms["before"] / ms["after"], 2), "max_param_diff": diff})
    return rows


def _layout_ab(quick: bool, rounds: int) -> list[dict]:
    """CPU ms per eager step (one thread) of a vmap stack — fisher-fig2's cell: 11 of the Fisher paper's FC BN
    nets (``bnlab.fisher.build_model``, torch's BatchNorm1d) at 11 learning rates, B = 64, momentum SGD (μ = 0.9),
    ½‖f − onehot(y)‖² — with the parameters in their gradients' layout (``_VmapStack.adopt_gradient_layout``,
    "after") against the row-major stack of ``stack_module_state`` ("before"; the method made a no-op).
    Alternating rounds, medians.  The same networks and batches: the parameters after a step agree to the
    rounding of a different summation order (printed: the largest difference relative to the tensor's
    largest entry).  ``matmul_fraction``: the step's matmul arithmetic (forward 2·B·Σ in·out per net, backward
    twice that) at the machine's own bmm rate (``bmm_gflops`` at B × 512 × 512), over the step's time."""
    from bnlab.fisher import build_model
    from bnlab.nets._ensemble_step import StepConfig
    from bnlab.nets.ensemble import _EnsembleRun, _VmapStack

    width, nets = (64, 3) if quick else (512, 11)
    sizes = [784, width, width, width, 10]
    arch = "fc:" + "-".join(map(str, sizes))
    per_round, warm = (2, 1) if quick else (4, 2)
    x, y = _data(2048)
    etas = [10.0 ** (-k / 4) for k in range(nets)]
    cfg = StepConfig(loss="mse", optimizer="sgd", momentum=0.9, weight_decay=0.0, rmsprop_alpha=0.99, rmsprop_eps=1e-8,
                     diverge_above=None, shared_order=True, num_networks=nets, host_reads=True)
    steps = (warm + rounds) * per_round

    def new(layout: bool):
        stack = _VmapStack([build_model(arch, seed=s) for s in range(nets)], torch.device("cpu"))
        stack._data_ndim = x.ndim  # one batch (B, 784) for every network, as train_ensemble sets it
        if not layout:
            stack.adopt_gradient_layout = lambda x: None
        return _EnsembleRun(stack, cfg, "eager", x, y, lrs=etas, seeds=[0] * nets, batch_size=64, steps=steps,
                            check_every=10)

    ms = _alternating_ms({"before": new(False), "after": new(True)}, {}, warm, rounds, per_round)
    diff = _one_step_diff({"before": new(False), "after": new(True)}, {})
    flops = 3 * 2 * nets * 64 * sum(a * b for a, b in zip(sizes, sizes[1:]))
    rate = bmm_gflops(nets, 64, width) * 1e9
    return [{"arch": arch, "networks": nets, "batch": 64, "steps": steps,
             "before_ms": round(ms["before"], 2), "after_ms": round(ms["after"], 2),
             "speedup": round(ms["before"] / ms["after"], 2), "max_param_diff": diff,
             "matmul_fraction_before": round(flops / rate / (ms["before"] / 1e3), 3),
             "matmul_fraction_after": round(flops / rate / (ms["after"] / 1e3), 3)}]


def _print_layout_ab(rows: list[dict]) -> None:
    r = rows[0]
    print(f"eager CPU step of the vmap stack, one thread: {r['networks']} nets {r['arch']}, B = {r['batch']}, momentum "
          "SGD; before = stack_module_state's row-major parameters, after = the gradients' layout; CPU ms per step, "
          "medians of alternating rounds")
    print(f"  before {r['before_ms']:8.2f} ms   after {r['after_ms']:8.2f} ms   before/after {r['speedup']:.2f}×   "
          f"param diff after one step {r['max_param_diff']:.1e}")
    print(f"  the step's matmuls at this machine's bmm rate: {r['matmul_fraction_before']:.0%} of the step before, "
          f"{r['matmul_fraction_after']:.0%} after")


def _print_step_ab(rows: list[dict]) -> None:
    r0 = rows[0]
    print(f"eager CPU step, one thread: BN-MLPs width {r0['width']}, depths {r0['depths']} as one ensemble, 784 inputs; "
          "before = e082aac (benchmarks/_ensemble_step_before.py), CPU ms per step, medians of alternating rounds")
    print(f"{'B':>4s} {'optimizer':>9s} {'before ms':>10s} {'after ms':>9s} {'before/after':>13s} {'param diff':>11s}")
    for r in rows:
        print(f"{r['batch']:4d} {r['optimizer']:>9s} {r['before_ms']:10.2f} {r['after_ms']:9.2f} {r['speedup']:12.2f}× "
              f"{r['max_param_diff']:11.1e}")


@contextlib.contextmanager
def _bn_route(name: str):
    """BN of the eager float32 step by the native kernel (``"native"``) or by ATen operators (``"aten"``,
    as on a machine without a C compiler)."""
    from bnlab.nets import _native_bn

    saved = dict(_native_bn._STATE)
    if name == "aten":
        _native_bn._STATE["kernel"] = None
    try:
        yield
    finally:
        _native_bn._STATE.clear()
        _native_bn._STATE.update(saved)


def _checkpoint_ab(quick: bool, rounds: int) -> list[dict]:
    """Wall seconds of one ``train_ensemble`` run that saves a checkpoint at every check (every 10 steps,
    ``checkpoint_every=0``: the most often it can) against the same run keeping none, rounds alternating
    (medians); the cost per save is their difference over the number of saves, beside one step's time.
    The first save also hashes the data and the initial models (the fingerprint), once per run."""
    import tempfile

    from bnlab.nets import BNMLP, train_ensemble

    depths = [2, 3, 5] if quick else [4, 8, 12, 16, 24, 32, 48, 64]
    width, steps, check_every = (16, 40, 10) if quick else (128, 200, 10)
    x, y = _data(4096)

    def one(keep: bool) -> float:
        models = [BNMLP(784, 10, depth=d, width=width, eps=1e-3, phi="relu", seed=i) for i, d in enumerate(depths)]
        with tempfile.TemporaryDirectory() as folder:
            extra = {"checkpoint": Path(folder) / "run.pt", "checkpoint_every": 0.0} if keep else {}
            t = time.perf_counter()
            train_ensemble(models, (x, y), lr=8e-3, batch_size=8, steps=steps, check_every=check_every,
                           step_mode="eager", **extra)
            return time.perf_counter() - t

    with measured_checkpoint_writes() as (sizes, saves):
        one(False), one(True)  # warm-up (the native kernel's build, allocator)
        times = {"none": [], "every_check": []}
        for _ in range(rounds):
            times["none"].append(one(False))
            sizes.clear(), saves.clear()
            times["every_check"].append(one(True))
    none, keep = statistics.median(times["none"]), statistics.median(times["every_check"])
    n_saves = len(saves)
    return [{"depths": depths, "width": width, "steps": steps, "check_every": check_every, "saves": n_saves,
             "none_s": round(none, 3), "every_check_s": round(keep, 3), "ratio": round(keep / none, 3),
             "ms_per_save": round((keep - none) / max(n_saves, 1) * 1e3, 2),
             "ms_per_step": round(none / steps * 1e3, 2), "mb_per_save": round(statistics.median(sizes) / 1e6, 2)}]


def _print_checkpoint_ab(rows: list[dict]) -> None:
    r = rows[0]
    print(f"train_ensemble, one thread: BN-MLPs width {r['width']}, depths {r['depths']}, B = 8, {r['steps']} SGD "
          f"steps; a checkpoint at every check ({r['saves']} saves) against none; wall s per run, medians")
    print(f"  none {r['none_s']:.3f} s   every check {r['every_check_s']:.3f} s   ratio {r['ratio']:.3f}×")
    print(f"  per save {r['ms_per_save']:.1f} ms ({r['mb_per_save']:.1f} MB) against {r['ms_per_step']:.1f} ms per step")


def _bn_ab(quick: bool, rounds: int) -> list[dict]:
    """Per-step CPU time (one thread) and dispatched operators per step of the eager step with BN by the
    native kernel against BN by ATen operators, on a Yang et al. (2019) Fig. 3 column (width 128,
    depths 4…64 as one ensemble, 784 inputs, ReLU, ε = 1e-3), SGD (Fig. 3a's lr) and RMSProp (Fig. 3c's)
    at B = 8 and 128.  Rounds alternate, so a drifting load hits both alike; medians.  The parameters
    after one step from the same start are compared (largest difference relative to the tensor's
    largest entry): the forward floats are the same, the backward's reductions may round differently.  At
    B = 128 these depth-64 nets explode their gradients (Yang et al.'s λ_G) and the first layers' step is
    larger than the weights: there both float32 routes are equally far from the float64 step (measured:
    first layer 22 native, 28 ATen, against a step of 36), so the printed difference is of order one."""
    from bnlab.nets import BNMLP, _native_bn
    from bnlab.nets._ensemble_step import StepConfig
    from bnlab.nets.ensemble import _BNMLPStack, _EnsembleRun

    if _native_bn.kernel() is None:
        raise SystemExit("--bn-ab: the native BN kernel could not be built here (see the warning)")
    depths = [2, 3, 5] if quick else [4, 8, 12, 16, 24, 32, 48, 64]
    width = 16 if quick else 128
    per_round, warm = (2, 1) if quick else (4, 2)
    x, y = _data(2048)
    rows = []
    for batch in (8, 128):
        for opt, lr in (("sgd", 8e-3), ("rmsprop", 8e-4)):
            steps = (warm + rounds) * per_round + 2
            cfg = StepConfig(loss="cross_entropy", optimizer=opt, momentum=0.0, weight_decay=0.0, rmsprop_alpha=0.99,
                             rmsprop_eps=1e-8, diverge_above=None, shared_order=True, num_networks=len(depths),
                             host_reads=True)

            def new():
                models = [BNMLP(784, 10, depth=d, width=width, eps=1e-3, phi="relu", seed=0) for d in depths]
                return _EnsembleRun(_BNMLPStack(models, torch.device("cpu")), cfg, "eager", x, y,
                                    lrs=[lr] * len(depths), seeds=[0] * len(depths), batch_size=batch, steps=steps,
                                    check_every=10)

            runs = {"native": new(), "aten": new()}
            routes = {name: functools.partial(_bn_route, name) for name in runs}
            ms = _alternating_ms(runs, routes, warm, rounds, per_round)
            ops = {}
            for name in runs:
                with _bn_route(name), _DispatchCount() as count:
                    runs[name].step()
                ops[name] = count.count
            diff = _one_step_diff({"native": new(), "aten": new()}, routes)
            # the step's products: forward + backward ≈ 3 × batch × the networks' weights, 2 flops each
            weights = sum(784 * width + d * width * width + 10 * width for d in depths)
            rate = 3.0 * batch * weights * 2 / (ms["native"] / 1e3) / 1e9
            bmm = bmm_gflops(len(depths), batch, width)
            rows.append({"batch": batch, "optimizer": opt, "depths": depths, "width": width,
                         "aten_ms": round(ms["aten"], 2), "native_ms": round(ms["native"], 2),
                         "speedup": round(ms["aten"] / ms["native"], 2), "aten_ops_per_step": ops["aten"],
                         "native_ops_per_step": ops["native"], "max_param_diff": diff,
                         "native_gflops": round(rate, 2), "bmm_gflops": round(bmm, 2),
                         "native_over_bmm": round(rate / bmm, 3)})
    return rows


def _print_bn_ab(rows: list[dict]) -> None:
    r0 = rows[0]
    print(f"eager CPU step, one thread: BN-MLPs width {r0['width']}, depths {r0['depths']} as one ensemble, 784 inputs; "
          "BN by ATen operators against the native kernel; CPU ms per step, medians of alternating rounds; "
          "dispatched operators per step")
    print(f"{'B':>4s} {'optimizer':>9s} {'ATen ms':>8s} {'native ms':>10s} {'ATen/native':>12s} "
          f"{'ATen ops':>9s} {'native ops':>11s} {'param diff':>11s} {'native/bmm':>11s}")
    for r in rows:
        print(f"{r['batch']:4d} {r['optimizer']:>9s} {r['aten_ms']:8.2f} {r['native_ms']:10.2f} {r['speedup']:11.2f}× "
              f"{r['aten_ops_per_step']:9d} {r['native_ops_per_step']:11d} {r['max_param_diff']:11.1e} "
              f"{r['native_over_bmm']:11.3f}")
    print("native/bmm: the native step's products (3 × B × weights multiply-adds) per second, over torch.bmm at a "
          "hidden layer's stacked shape on this machine")


if __name__ == "__main__":
    main()
