"""How many intra-op threads torch gets for a piece of work (issue 27 item 6).

Work whose operators are small — batch-1 training, small ensembles, the rank chain at d = 32 —
does not gain from intra-op threads: every operator pays the threads' fork/join, and on a busy
machine a thread that the scheduler has taken away stalls the others at every join (measured on
this project's 2-core machine under load: ``bnlab train --norm bnp --batch-size 1 --train-size
500`` took 61 s with 2 threads and 2.9 s with ``OMP_NUM_THREADS=1``).  Large operators do gain,
where the other threads get cores.  So the entry points that run such work take their thread count
from :func:`choose_threads` — by the size of their largest product, and for large work by the cores
that other work leaves free — through :func:`small_work_threads` (a context manager that sets and
restores ``torch.set_num_threads``) or the decorator :func:`sized_by`.

A count the user fixed (``--threads``, :func:`pin_threads`) is never overridden.  The chooser
only lowers the count torch has (never raises it), so a process limited by its environment — a
Dask worker running with its share of the cores — stays within it.

Shared by every torch part, like :mod:`bnlab._validation` (docs/architecture.md); torch is
imported lazily, so the sweep workers' import stays light.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import math
import os
from typing import Any, Callable, Iterator

#: Floating-point operations of a work's largest matrix product below which it runs on one intra-op
#: thread.  Calibrated with ``benchmarks/bench_threads.py --cases matmul`` (square products, 1 and 2
#: threads side by side) on this project's 2-core machine, run at real-time priority so that the
#: machine's other load did not take the second core (docs/experiments.md, "Threads"): a second
#: thread lost up to 2e6 FLOPs per product (2 threads / 1 thread = 1.07–2.1 at 2.2e5–1.8e6), gained
#: 4–36 % between 3e6 and 1.4e7 (varying from run to run) and 1.8× from 3.4e7 on.  Below 1e7 the gain is
#: too small to risk a join with a descheduled thread; batch-1 training (1.6e5), a 4-network ensemble of
#: width 32 (1.6e6) and the rank chain at d = 32 (6.6e4) are far below it.
SMALL_WORK_FLOPS = 1.0e7

#: The largest thread count accepted anywhere (``--threads``, ``threads=``): beyond any machine's
#: cores, so that a typo (``--threads 1000000``) is an error, not a million idle threads.
MAX_THREADS = 4096

_pinned: int | None = None


def check_threads(threads: Any) -> int:
    """``threads`` as an int from 1 to :data:`MAX_THREADS`, or a ValueError naming the argument."""
    from bnlab._validation import check_int

    return check_int("threads", threads, minimum=1, maximum=MAX_THREADS)


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity mask; ``os.cpu_count()`` elsewhere)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def pin_threads(threads: int | None, *, apply: bool = True) -> None:
    """Fix torch's intra-op thread count of this process to ``threads`` (the user's ``--threads``):
    the chooser leaves it alone from now on.  ``None`` unpins (the chooser decides again) and leaves
    the count as it is.  ``apply=False`` records the pin only (a Dask worker whose environment
    already gives torch that count when it is imported: no torch import for NumPy-only cells).

    ``threads`` is an integer from 1 to :data:`MAX_THREADS` (ValueError naming it otherwise)."""
    global _pinned
    if threads is not None:
        threads = check_threads(threads)
    if threads is not None and apply:
        import torch

        torch.set_num_threads(int(threads))
    _pinned = None if threads is None else int(threads)


@contextlib.contextmanager
def pinned(threads: int | None) -> Iterator[None]:
    """:func:`pin_threads` for the body only (torch's count and the pin restored after); ``None``
    changes nothing."""
    global _pinned
    if threads is None:
        yield
        return
    threads = check_threads(threads)
    import torch

    before, before_pin = torch.get_num_threads(), _pinned
    pin_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
        _pinned = before_pin


def pinned_threads() -> int | None:
    """The count :func:`pin_threads` fixed, or None."""
    return _pinned


def busy_cores() -> int | None:
    """Threads that the machine runs or could run right now besides the caller: the runnable count of
    ``/proc/loadavg`` minus one (a snapshot); None where it cannot be read (not Linux)."""
    try:
        with open("/proc/loadavg", encoding="ascii") as f:
            runnable = int(f.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0, runnable - 1)


def choose_threads(flops_per_op: float | None, current: int | None = None, busy: int | None = None) -> int:
    """Intra-op threads for work whose largest product does ``flops_per_op`` floating-point operations.

    * below :data:`SMALL_WORK_FLOPS`: 1;
    * else ``current`` (default: torch's count now), but no more than the cores other work leaves
      free: available cores − ``busy`` (default :func:`busy_cores`, a snapshot), at least 1.  On this
      project's 2-core machine under load (load average 28–38) a second thread lost at every size up
      to 2.7e8 FLOPs per product, 1.6–200× in wall time (its joins wait for a descheduled thread).

    An unknown size (None, NaN) keeps ``current``.  Never more than ``current``."""
    if current is None:
        import torch

        current = torch.get_num_threads()
    if flops_per_op is None or not math.isfinite(flops_per_op):
        return current
    if flops_per_op < SMALL_WORK_FLOPS:
        return 1
    if busy is None:
        busy = busy_cores()
    if busy is None:
        return current
    return max(1, min(current, available_cores() - busy))


@contextlib.contextmanager
def small_work_threads(flops_per_op: float | None) -> Iterator[int]:
    """Run the body with :func:`choose_threads` intra-op threads, restored afterwards; yields the count.

    Nothing changes where the count is pinned (:func:`pin_threads`) or the chooser keeps it.  The
    count is process-wide (torch has one): another Python thread's torch work in this window runs
    with it too — slower or faster, never different in its results beyond BLAS rounding."""
    import torch

    before = torch.get_num_threads()
    chosen = before if _pinned is not None else choose_threads(flops_per_op, before)
    if chosen == before:
        yield before
        return
    torch.set_num_threads(chosen)
    try:
        yield chosen
    finally:
        torch.set_num_threads(before)


def sized_by(flops_per_op: Callable[[dict], float | None]) -> Callable:
    """Decorator: run the function inside :func:`small_work_threads` with the size that
    ``flops_per_op(arguments)`` estimates from its bound arguments (defaults applied).

    An estimate that fails (the arguments are bad: the function itself reports that) counts as an
    unknown size; the function runs unchanged."""

    def decorate(fn: Callable) -> Callable:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            try:
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                size = flops_per_op(bound.arguments)
            except Exception:  # noqa: BLE001 - the function validates its own arguments
                size = None
            with small_work_threads(size):
                return fn(*args, **kwargs)

        return wrapper

    return decorate


def sized_for_training(models_argument: str) -> Callable:
    """:func:`sized_by` a training entry point's arguments ``models_argument`` (a model or a list of
    them), ``batch_size`` and ``train_data`` (:func:`training_flops_per_op`)."""
    return sized_by(lambda args: training_flops_per_op(args[models_argument], args["batch_size"], args["train_data"]))


def training_flops_per_op(models: Any, batch_size: Any, train_data: Any) -> float | None:
    """FLOPs of the largest matrix product of one training step's forward pass: 2·B·(the largest
    weight matrix's numel — a Linear's in·out, a BN-MLP's raw weight — or a convolution kernel's
    numel times the input's spatial size, an upper bound for its layers), summed over ``models``
    when it is a list (an ensemble runs its networks' layers as one batched product).  None where
    it cannot tell (no weight matrix)."""
    nets = list(models) if isinstance(models, (list, tuple)) else [models]
    x = getattr(train_data, "x", None)
    if x is None and isinstance(train_data, (list, tuple)) and train_data:
        x = train_data[0]
    shape = tuple(getattr(x, "shape", ()))
    spatial = math.prod(shape[2:]) if len(shape) > 2 else 1
    total = 0.0
    for net in nets:
        largest = 0.0
        for p in net.parameters():  # 1-d parameters (biases, BN's γ and β) do no products
            if p.dim() == 2:
                largest = max(largest, float(p.numel()))
            elif p.dim() > 2:
                largest = max(largest, float(p.numel() * spatial))
        total += largest
    if total == 0.0:
        return None
    return 2.0 * int(batch_size) * total
