"""The timing helpers the benchmark scripts share (imported as a sibling: the scripts put this folder on
``sys.path``)."""
from __future__ import annotations

import contextlib
import math
import os
import statistics
import time
from typing import Callable, Iterator


def median_time(fn: Callable[[], object], repeat: int = 5, *, warmup: bool = False) -> float:
    """Median wall time of ``repeat`` calls of ``fn`` in seconds; ``warmup`` first makes one untimed call
    (imports, caches), so the median measures the steady state."""
    if warmup:
        fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def cpu_time(fn: Callable[[], object], repeat: int) -> float:
    """Median CPU time of this process over ``repeat`` calls of ``fn`` (one untimed call first).

    For single-threaded, CPU-bound work on a shared machine: CPU time is what each side of a ratio
    costs, where wall time would add the other jobs' load to whichever side ran at the busier moment."""
    fn()
    times = []
    for _ in range(repeat):
        t = time.process_time()
        fn()
        times.append(time.process_time() - t)
    return statistics.median(times)


def device_clock(device) -> float:
    """Seconds: this thread's CPU time on a CPU device with one torch thread, wall time on a GPU or
    with more threads.

    On an oversubscribed machine the scheduler takes the CPU away for a time slice (~3 ms here)
    every few milliseconds; wall time then puts a preemption into a fraction of the timed steps
    that grows with the step's length, and once that fraction passes one half the median jumps by a
    whole slice (BNP/SGD read 3.9 at B = 256 on the MNIST net in one run, 1.4 in the next).  The
    thread's CPU time leaves the preemptions out; it is used only with one thread, which then does
    all the work.  Pair every reading with :func:`device_sync` on a GPU.
    """
    import torch

    if str(device).startswith("cuda") or torch.get_num_threads() > 1:
        return time.perf_counter()
    return time.thread_time()


def device_sync(device) -> None:
    """Wait for the device's queued work (a no-op on CPU), so that a clock reading covers it."""
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize()


#: host calls that put work on a GPU, as the profiler names them: a kernel launch, or one launch of a
#: whole CUDA graph (bench_ensemble's and bench_bnp's launch counts)
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaGraphLaunch",
                "cuGraphLaunch")


def worst_check(checks: list[dict]):
    """The worst ratio to the tolerance of a compiled route's checks against its eager code (the
    ``checks`` records of ``bnlab.nets._ensemble_step.StepRunner`` or ``bnlab.optim._compiled``; ≤ 1
    agrees), JSON-safe: None when no check ran, ``"inf"`` when a mask, a count or a non-finite entry
    differed.  Not rounded: a ratio just above 1 must not print as 1."""
    if not checks:
        return None
    worst = max(c["worst"] for c in checks)
    return worst if math.isfinite(worst) else "inf"


def bmm_gflops(k: int, batch: int, width: int, repeat: int = 50) -> float:
    """The machine's own ``torch.bmm`` rate (GFLOP/s of CPU time, float32) at the shape of a stacked hidden
    layer: k networks, ``batch`` rows, ``width`` × ``width`` weights — the reference a training step's
    arithmetic rate is printed against."""
    import torch

    a, w = torch.randn(k, batch, width), torch.randn(k, width, width)
    for _ in range(5):
        torch.bmm(a, w)
    t = time.process_time()
    for _ in range(repeat):
        torch.bmm(a, w)
    return 2.0 * k * batch * width * width * repeat / max(time.process_time() - t, 1e-9) / 1e9


@contextlib.contextmanager
def measured_checkpoint_writes() -> Iterator[tuple[list[int], list[int]]]:
    """Within it, every checkpoint ``bnlab.nets`` writes (either trainer's) is recorded: yields the lists
    ``(sizes, steps)`` — each file's size in bytes and the step it was saved at — which the caller may clear."""
    import bnlab.nets._checkpoint as ck

    sizes: list[int] = []
    steps: list[int] = []
    real = ck.write

    def write(path, payload, *kind):
        real(path, payload, *kind)
        sizes.append(os.path.getsize(path))
        steps.append(payload["done"])

    ck.write = write
    try:
        yield sizes, steps
    finally:
        ck.write = real
