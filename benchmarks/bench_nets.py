"""Time per training step of bnlab.nets MLPs with every normalization, side by side.

    python benchmarks/bench_nets.py [--width 1024] [--depth 4] [--batch 128] [--steps 30] [--repeat 3]
                                    [--threads 1] [--dtype float32] [--quick]

For one MLP shape (784 inputs, ``depth`` hidden layers of ``width``, 10 outputs, ReLU, pre-activation
placement) it measures the median wall time of one SGD training step (forward, cross-entropy,
backward, step) for each normalization of ``bnlab.nets.NORMALIZATIONS`` and prints:

* ``× none`` — the step time over that of the same MLP without normalization;
* ``× matmul`` — the step time over the time of the matrix products alone that a step needs
  (forward h = a Wᵀ per layer, backward dA = dH W and dW = dHᵀ A per layer), timed with ``torch.mm``
  on the same shapes: the machine's matmul floor for this network;
* for the whole loop, ``train()`` (the library's loop: data indexing, the hooks/callbacks machinery,
  the divergence checks) against the bare loop of the first table, for ``norm="bn"``.

``--step-modes eager,compile`` adds ``train(step_mode=...)`` side by side for ``norm="bn"``: the
median time of one step of the library's loop (from callback to callback, after 3 warm-up steps, so
the compilation is not counted), and the compiled/eager ratio.

``--checkpoint-ab`` times instead ``train()`` of the BN MLP with SGD (momentum 0.9) saving a checkpoint at
every check (``checkpoint_every=0``, every 10 steps: the most often it can) against the same run keeping
none, rounds alternating (medians of ``--repeat``): the cost per save (their difference over the number of
saves, the fingerprint's one hash of the data and the initial model included) beside one step's time, and
the file's size.

The configurations are timed interleaved (each repeat runs all of them in turn), so a change of load
on a shared machine affects all alike; use ``--repeat`` ≥ 5 there.  Nothing is asserted;
``tests/nets/test_bench_nets.py`` runs ``--quick`` as a smoke test.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _timing, the benchmarks' shared helpers

from bnlab.nets import MLP, NORMALIZATIONS, train  # noqa: E402

IN, OUT = 784, 10


def _norm_kwargs(name: str, batch: int) -> dict:
    if name == "ghost_bn":
        return {"ghost_batch_size": max(2, batch // 4)}
    if name == "gn":
        return {"num_groups": 32}
    return {}


def _interleaved_medians(runners: dict, steps: int, repeat: int) -> dict:
    """Median seconds per step of each runner, the runners interleaved within every repeat so that a
    change of machine load (the benchmark shares its cores) hits all of them alike."""
    for run in runners.values():
        run(2)  # warm-up (allocations, first-call dispatch)
    times = {k: [] for k in runners}
    for _ in range(repeat):
        for k, run in runners.items():
            t = time.perf_counter()
            run(steps)
            times[k].append((time.perf_counter() - t) / steps)
    return {k: statistics.median(v) for k, v in times.items()}


def _step_runner(norm: str, width: int, depth: int, batch: int, dtype):
    model = MLP(IN, [width] * depth, OUT, norm=norm, norm_kwargs=_norm_kwargs(norm, batch), dtype=dtype)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, IN, generator=g, dtype=dtype)
    y = torch.randint(0, OUT, (batch,), generator=g)

    def run(k):
        for _ in range(k):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

    return run


def _matmul_runner(width: int, depth: int, batch: int, dtype):
    """The matrix products of one training step, alone: forward per layer, dA and dW per layer."""
    g = torch.Generator().manual_seed(1)
    dims = [IN] + [width] * depth + [OUT]
    ws = [torch.randn(o, i, generator=g, dtype=dtype) for i, o in zip(dims[:-1], dims[1:])]
    acts = [torch.randn(batch, i, generator=g, dtype=dtype) for i in dims[:-1]]
    grads = [torch.randn(batch, o, generator=g, dtype=dtype) for o in dims[1:]]

    def run(k):
        for _ in range(k):
            for a, w in zip(acts, ws):
                torch.mm(a, w.T)
            for layer, (a, w, dh) in enumerate(zip(acts, ws, grads)):
                torch.mm(dh.T, a)
                if layer > 0:  # no gradient for the input
                    torch.mm(dh, w)

    return run


def _train_loop_runner(width: int, depth: int, batch: int, steps: int, dtype):
    g = torch.Generator().manual_seed(2)
    n = batch * steps
    x = torch.randn(n, IN, generator=g, dtype=dtype)
    y = torch.randint(0, OUT, (n,), generator=g)
    model = MLP(IN, [width] * depth, OUT, norm="bn", dtype=dtype)
    sgd = functools.partial(torch.optim.SGD, lr=1e-3)

    def run(k):
        train(model, (x, y), optimizer=sgd, batch_size=batch, steps=k)

    return run


def _train_step_mode_times(width: int, depth: int, batch: int, steps: int, dtype, modes) -> dict:
    """Median seconds per step of ``train(step_mode=mode)`` (BN MLP, SGD), callback to callback after 3
    warm-up steps (the compiled step is compiled in the first two)."""
    warm = 3
    g = torch.Generator().manual_seed(3)
    n = batch * (steps + warm)
    x = torch.randn(n, IN, generator=g, dtype=dtype)
    y = torch.randint(0, OUT, (n,), generator=g)
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    out = {}
    for mode in modes:
        stamps = []
        train(MLP(IN, [width] * depth, OUT, norm="bn", dtype=dtype), (x, y), optimizer=functools.partial(torch.optim.SGD, lr=1e-3),
              batch_size=batch, steps=steps + warm, step_mode=mode, callbacks=[lambda info: stamps.append(clock())])
        out[mode] = statistics.median(b - a for a, b in zip(stamps[warm - 1:], stamps[warm:]))
    return out


def checkpoint_ab(width: int, depth: int, batch: int, steps: int, repeat: int, threads: int, dtype: str) -> dict:
    """Seconds of one ``train()`` run saving at every check against one keeping no checkpoint (medians over
    ``repeat`` alternating rounds), the saves made and the file's size; restores threads."""
    import tempfile

    from _timing import measured_checkpoint_writes

    tdtype = {"float32": torch.float32, "float64": torch.float64}[dtype]
    steps = max(steps, 20)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(batch * steps, IN, generator=g, dtype=tdtype)
    y = torch.randint(0, OUT, (batch * steps,), generator=g)
    def one(keep: bool) -> float:
        model = MLP(IN, [width] * depth, OUT, norm="bn", dtype=tdtype)
        sgd = functools.partial(torch.optim.SGD, lr=1e-3, momentum=0.9)
        with tempfile.TemporaryDirectory() as folder:
            extra = {"checkpoint": Path(folder) / "run.pt", "checkpoint_every": 0.0} if keep else {}
            t = time.perf_counter()
            train(model, (x, y), optimizer=sgd, batch_size=batch, steps=steps, check_every=10, **extra)
            return time.perf_counter() - t

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with measured_checkpoint_writes() as (sizes, saves):
            one(False)  # warm-up
            without, with_saves = [], []
            for _ in range(repeat):
                without.append(one(False))
                saves.clear()
                with_saves.append(one(True))
    finally:
        torch.set_num_threads(old)
    t0, t1 = statistics.median(without), statistics.median(with_saves)
    return {"steps": steps, "saves": len(saves), "without_s": t0, "with_s": t1, "ratio": t1 / t0,
            "per_save_s": (t1 - t0) / max(len(saves), 1), "per_step_s": t0 / steps,
            "file_mb": (sizes[-1] / 1e6) if sizes else 0.0,
            "shape": dict(width=width, depth=depth, batch=batch, threads=threads, dtype=dtype)}


def bench(width: int = 1024, depth: int = 4, batch: int = 128, steps: int = 30, repeat: int = 3, threads: int = 1,
          dtype: str = "float32", step_modes: tuple = ()) -> dict:
    """Seconds per step for every normalization, the matmul floor and the train() loop (and per
    ``step_modes``, train(step_mode=...)); restores threads."""
    tdtype = {"float32": torch.float32, "float64": torch.float64}[dtype]
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        runners = {name: _step_runner(name, width, depth, batch, tdtype) for name in NORMALIZATIONS}
        runners["matmul"] = _matmul_runner(width, depth, batch, tdtype)
        runners["train_loop_bn"] = _train_loop_runner(width, depth, batch, steps, tdtype)
        t = _interleaved_medians(runners, steps, repeat)
        modes = _train_step_mode_times(width, depth, batch, steps, tdtype, step_modes) if step_modes else {}
    finally:
        torch.set_num_threads(old)
    return {"per_norm": {name: t[name] for name in NORMALIZATIONS}, "matmul": t["matmul"],
            "train_loop_bn": t["train_loop_bn"], "train_step_modes": modes,
            "shape": dict(width=width, depth=depth, batch=batch, threads=threads, dtype=dtype)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--quick", action="store_true", help="tiny sizes, one repeat (smoke test)")
    p.add_argument("--step-modes", default="", help="e.g. eager,compile: train(step_mode=...) side by side")
    p.add_argument("--checkpoint-ab", action="store_true",
                   help="train() saving a checkpoint at every check against keeping none")
    a = p.parse_args(argv)
    if a.quick:
        a.width, a.depth, a.batch, a.steps, a.repeat = 64, 2, 16, 3, 1
    if a.checkpoint_ab:
        r = checkpoint_ab(a.width, a.depth, a.batch, a.steps, a.repeat, a.threads, a.dtype)
        s = r["shape"]
        print(f"train(), MLP 784 → {s['depth']}×{s['width']} → 10 with BN, batch {s['batch']}, {s['dtype']}, SGD with "
              f"momentum, {s['threads']} thread(s); {r['steps']} steps, medians of {a.repeat} alternating rounds")
        print(f"without checkpoints  {r['without_s']:.3f} s")
        print(f"saving at every check {r['with_s']:.3f} s  ({r['ratio']:.2f}×; {r['saves']} saves of "
              f"{r['file_mb']:.1f} MB)")
        print(f"per save {1e3 * r['per_save_s']:.1f} ms against {1e3 * r['per_step_s']:.1f} ms per step")
        return
    modes = tuple(m.strip() for m in a.step_modes.split(",") if m.strip())
    r = bench(a.width, a.depth, a.batch, a.steps, a.repeat, a.threads, a.dtype, modes)
    s = r["shape"]
    print(f"MLP 784 → {s['depth']}×{s['width']} → 10, batch {s['batch']}, {s['dtype']}, {s['threads']} thread(s); "
          f"median of {a.repeat} × {a.steps} steps")
    none = r["per_norm"]["none"]
    print(f"{'norm':<10} {'ms/step':>9} {'× none':>8} {'× matmul':>9}")
    for name, t in r["per_norm"].items():
        print(f"{name:<10} {1e3 * t:9.3f} {t / none:8.2f} {t / r['matmul']:9.2f}")
    print(f"{'matmuls':<10} {1e3 * r['matmul']:9.3f} {r['matmul'] / none:8.2f} {1.0:9.2f}")
    bare = r["per_norm"]["bn"]
    print(f"train() loop, norm='bn': {1e3 * r['train_loop_bn']:.3f} ms/step = {r['train_loop_bn'] / bare:.2f} × "
          "the bare loop")
    base = r["train_step_modes"].get("eager")
    for mode, t in r["train_step_modes"].items():
        ratio = f" = {base / t:.2f}× faster than eager" if base and mode != "eager" else ""
        print(f"train(step_mode={mode!r}), norm='bn': {1e3 * t:.3f} ms/step{ratio}")


if __name__ == "__main__":
    main()
