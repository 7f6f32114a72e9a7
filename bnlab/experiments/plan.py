"""A plan before a run: what a sweep will cost on this machine, from a short pilot of each kind of task.

``bnlab reproduce NAME --scale paper --plan`` and ``bnlab report --scale paper --plan`` call
:func:`plan_experiments`.  For each experiment it forms the tasks the engine would run (cells, or
groups of cells trained together: :func:`~bnlab.experiments.spec.cell_tasks`), asks the experiment
what each task costs (:attr:`Experiment.cost <bnlab.experiments.spec.Experiment.cost>`: a kind, a
step count, the relative work of a step and of the rest), and pilots one task of every kind on the
present device:

1. the task cut to ``k₁`` steps (:attr:`Experiment.shorten`) runs once to warm up (imports, data
   loading, CUDA context, kernels chosen on first use; the first pilot of an experiment only), then
   again: ``t₁`` (when the warm-up alone used up the budget, it is ``t₁``: an overestimate);
2. cut to ``k₂ > k₁`` steps: ``t₂``; the seconds per step are ``(t₂ − t₁)/(k₂ − k₁)`` and the rest of
   the task (building the networks, the test pass) ``t₁ − k₁·step``.  When ``t₂ − t₁`` is small beside
   ``t₁`` (noise), ``k₂`` grows until the steps take at least a quarter of the run, within the budget;
   where the trainer timed its own steady steps in the cut of ``k₂`` (``train_ensemble`` does, within a
   pilot: :func:`bnlab._run_length.note_steady_steps`), that time per step is used instead and the cut is
   not lengthened: on a GPU the set-up of each run varies by more than its millisecond steps take, and
   the difference of two cuts measured that variation (``Pilot.step_source`` says which was used);
3. every task of that kind is extrapolated from the pilot in proportion to its cost:
   ``rest · fixed_work/fixed_work_pilot + steps · step · step_work/step_work_pilot``.

An experiment without ``cost``/``shorten`` is piloted by running its first and last task whole; every
task is estimated at their mean.  Memory is the pilot's peak: ``torch.cuda.max_memory_allocated`` on a
GPU, the growth of the process's resident set (sampled every 5 ms) on a CPU.  Time with several
workers is the longest-processing-time-first schedule of the task estimates.

Pilots run in this process (:func:`plan_experiment`) or, for the command line, in one child process
per run of experiments (``isolate=True``): a pilot that runs past its hard limit is stopped, and its
experiment is reported with a lower bound instead of an estimate.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import IO, Any, Iterable, Sequence

from bnlab._run_length import COMPILED_ROUTES, STEADY_FROM, standing_for, steady_steps
from bnlab._validation import check_choice, check_int, check_real
from bnlab.experiments.registry import experiment_module, get_experiment
from bnlab.experiments.spec import SCALES, Experiment, TaskCost, cell_tasks

__all__ = ["Pilot", "ExperimentPlan", "Plan", "plan_experiment", "plan_experiments", "format_plan",
           "lpt_makespan", "DEFAULT_PILOT_STEPS"]

#: steps of the first and second pilot run of a task (k₁, k₂)
DEFAULT_PILOT_STEPS = (2, 12)
#: The longest pilot budget of one reproduction, seconds (a week): a plan is minutes before a run, and the
#: pilots' deadlines must stay within what a clock and ``select`` can take (1e10 s overflowed ``time_t``).
MAX_BUDGET_S = 7 * 86400.0


@dataclass(frozen=True)
class Pilot:
    """One piloted task: the runs it took and what they say about the task's kind."""

    kind: str
    task: int  # index of the piloted task among the experiment's tasks
    cells: int  # cells in the piloted task
    steps: list[int]  # steps of each timed run (the warm-up excluded); [] when the whole task ran
    seconds: list[float]  # wall time of each timed run
    warmup_seconds: float | None  # the first run (one-time costs included)
    step_seconds: float | None  # per step; None when the task ran whole
    fixed_seconds: float  # the rest of the task (or the whole task when it ran whole)
    peak_bytes: int | None
    skipped: str | None = None  # the cells' own skip reason (data not present)
    error: str | None = None  # the last line of an exception
    #: where ``step_seconds`` comes from: "difference" of two cuts, or the trainer's "timed steps"
    step_source: str | None = None


@dataclass
class ExperimentPlan:
    """The estimate of one experiment at one scale on one device."""

    experiment: str
    scale: str
    device: str
    cells: int
    tasks: int
    largest_task: int  # cells in the largest task (a group trained together)
    seconds: float | None = None  # estimated time of every task one after the other
    wall_seconds: float | None = None  # with ``workers`` parallel workers (LPT schedule)
    workers: int = 1
    lower_bound: bool = False  # a pilot ran past its limit: the seconds are at least this much
    peak_bytes: int | None = None  # largest pilot peak (per task)
    memory_source: str = ""
    skipped: str | None = None
    error: str | None = None
    plan_seconds: float = 0.0  # how long the pilots took
    pilots: list[Pilot] = field(default_factory=list)
    task_seconds: list[float] = field(default_factory=list)


@dataclass
class Plan:
    """The plan of several experiments (a report): one :class:`ExperimentPlan` each, and the total."""

    scale: str
    device: str
    experiments: list[ExperimentPlan]
    plan_seconds: float

    @property
    def seconds(self) -> float | None:
        """Every experiment one after the other, each on its own workers (as ``bnlab report`` runs them)."""
        vals = [e.wall_seconds for e in self.experiments if e.skipped is None]
        return None if any(v is None for v in vals) else float(sum(vals))

    @property
    def lower_bound(self) -> bool:
        return any(e.lower_bound for e in self.experiments)

    def to_dict(self) -> dict:
        return {"scale": self.scale, "device": self.device, "seconds": self.seconds, "lower_bound": self.lower_bound,
                "plan_seconds": self.plan_seconds, "experiments": [asdict(e) for e in self.experiments]}


# --------------------------------------------------------------------------- measuring one run
def _check_device(device: Any) -> str | None:
    """``None``, ``"cpu"``, ``"cuda"`` or ``"cuda:<i>"`` of a GPU that exists here (a ValueError otherwise)."""
    import re

    if device is None:
        return None
    if not isinstance(device, str) or not re.fullmatch(r"cpu|cuda(:\d{1,3})?", device.strip()):
        raise ValueError(f"device={device!r} is not allowed: expected 'cpu', 'cuda' or 'cuda:<index>'")
    device = device.strip()
    if device.startswith("cuda"):
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(device.split(":")[1]) if ":" in device else 0
        if index >= count:
            raise ValueError(f"device={device!r} is not allowed: this machine has {count} CUDA device(s)")
    return device


def _device_of(exp: Experiment, device: str | None) -> str:
    """The device the engine would give this experiment's cells: ``device`` (or :func:`cell_device`) for a
    ``uses_gpu`` experiment, the CPU otherwise."""
    if not exp.uses_gpu:
        return "cpu"
    if device is not None:
        return device
    from bnlab.experiments.spec import cell_device

    return cell_device()


class _PeakRSS:
    """The resident set's growth above its size at the start, sampled every 5 ms by a thread (Linux)."""

    def __init__(self):
        self._stop = threading.Event()
        self.base = self.peak = self._rss()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _rss() -> int:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):  # not Linux: no estimate
            return 0

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._rss())

    def __enter__(self) -> "_PeakRSS":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def grown(self) -> int | None:
        return self.peak - self.base if self.base else None


def _release_memory() -> None:
    """Give freed heap back to the system, so the next pilot's resident-set growth is its own (glibc)."""
    import ctypes
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


_CLOCKS = {"wall": time.perf_counter, "process": time.process_time}


def _run_task(exp: Experiment, cells: list[dict], grouped: bool, device: str, limit_threads: bool,
              clock: str = "wall") -> dict:
    """Run one task as the engine would (``run_group`` or ``run_cell``), timed, with its peak memory."""
    from bnlab.experiments._worker import execute_task

    cells = [dict(c) for c in cells]
    if exp.uses_gpu:
        for c in cells:
            c.setdefault("device", device)
    cuda = device.startswith("cuda")
    if cuda:
        import torch

        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    else:
        _release_memory()
    with _PeakRSS() as rss:
        now = _CLOCKS[clock]
        t0 = now()
        outcomes = execute_task(exp.run_cell, exp.run_group if grouped else None, cells, limit_threads,
                                exp.uses_gpu, exp.cell, exp.name)
        if cuda:
            torch.cuda.synchronize(device)
        seconds = now() - t0
    peak = (torch.cuda.max_memory_allocated(device) - base) if cuda else rss.grown
    error = next((o["error"] for o in outcomes if not o["ok"]), None)
    skipped = None
    if error is None:
        reasons = [str(o["metrics"].get("skip_reason", "skipped")) for o in outcomes if o["metrics"].get("skipped")]
        if reasons and len(reasons) == len(outcomes):
            skipped = reasons[0]
    return {"seconds": seconds, "peak": peak, "error": error, "skipped": skipped}


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "error"


# --------------------------------------------------------------------------- the pilot of one kind
def _pilot(exp: Experiment, cells: list[dict], grouped: bool, task: int, cost: TaskCost, device: str,
           steps: tuple[int, int], deadline: float, limit_threads: bool, clock: str, notify=None,
           warm_up: bool = True) -> Pilot:
    kind = cost.kind
    k1, k2 = steps
    full = max(1, int(cost.steps))
    if exp.shorten is None or full <= k2:
        # nothing to cut (or the task is hardly longer than a pilot): run it whole, once
        if notify is not None:
            notify({"progress": "whole_task", "task": task})  # a parent that stops us knows a task took longer
        r = _run_task(exp, cells, grouped, device, limit_threads, clock)
        return Pilot(kind, task, len(cells), [], [r["seconds"]], None, None, r["seconds"], r["peak"],
                     r["skipped"], None if r["error"] is None else _last_line(r["error"]))

    def run(k: int) -> dict:
        if notify is not None:
            notify({"progress": "cut_task", "task": task, "steps": k})
        # the cut task runs the step route of the whole task (train_ensemble's "auto" chooses by the run's
        # length: compiled/captured for long runs, eager for a few steps), so the pilots time what the run
        # will do, its compilation included in the fixed part
        with standing_for(full) as routes:
            r = _run_task(exp, exp.shorten([dict(c) for c in cells], k), grouped, device, limit_threads, clock)
            steady = steady_steps()
        return dict(r, compiled=bool(routes & COMPILED_ROUTES), steady=steady)

    # the first pilot of an experiment warms up (imports, data read from disk, CUDA context); later ones
    # reuse what it loaded, as a worker's later tasks do
    warm = run(k1) if warm_up else None
    if warm is not None and (warm["error"] is not None or warm["skipped"] is not None):
        return Pilot(kind, task, len(cells), [], [], warm["seconds"], None, warm["seconds"], warm["peak"],
                     warm["skipped"], None if warm["error"] is None else _last_line(warm["error"]))
    # past the budget already: the warm-up stands in for the first timed run (its one-time costs then count
    # as the task's own: an overestimate, where a second run of minutes would be too slow to afford)
    first = warm if warm is not None and time.monotonic() > deadline else run(k1)
    if first["error"] is not None or first["skipped"] is not None:
        return Pilot(kind, task, len(cells), [], [], None, None, first["seconds"], first["peak"], first["skipped"],
                     None if first["error"] is None else _last_line(first["error"]))
    runs = [(k1, first)]
    second = run(k2)
    runs.append((k2, second))
    t1, t2 = first["seconds"], second["seconds"]
    # the trainer's own timing of its steps, where it gives one, is taken over the difference of the two
    # cuts: that difference also holds how much the set-up varies between runs, which on a GPU (seconds of
    # tracing, graph cache and capture beside millisecond steps) is larger than the steps themselves
    timed = _timed_step(second["steady"], k2)
    # else the steps must stand out of the noise of the rest of the run: at least a quarter of it
    while timed is None and t2 - t1 < 0.25 * t1 and k2 < full:
        per_step = max(t2 - t1, 0.02 * t1) / (k2 - k1)
        wanted = k1 + math.ceil(0.5 * t1 / per_step)
        left = deadline - time.monotonic()
        affordable = k1 + int(max(left - t1, 0.0) / per_step)
        k_next = min(full, wanted, max(affordable, k2))
        if k_next <= k2:
            break
        k2 = k_next
        second = run(k2)
        runs.append((k2, second))
        t2 = second["seconds"]
    step = timed if timed is not None else max(t2 - t1, 0.0) / (k2 - k1)
    fixed = max(t1 - k1 * step, 0.0)
    if warm is not None and first is not warm and warm.get("compiled"):
        # a compiled route: the warm-up compiled cold, the timed runs (the same shapes: no shape of the step
        # depends on the run's length) were served by Inductor's graph cache, seconds instead of tens of
        # seconds (CPU) or minutes (a Yang column on an H200).  The whole run's tasks of other shapes
        # compile cold, so the warm-up's excess counts in each task's fixed part (with the imports and the
        # data read it also holds: an overestimate by seconds per task)
        fixed += max(warm["seconds"] - first["seconds"], 0.0)
    peaks = [r["peak"] for _, r in runs if r["peak"] is not None] + (
        [warm["peak"]] if warm is not None and warm["peak"] is not None else [])
    errors = [r["error"] for _, r in runs if r["error"] is not None]
    return Pilot(kind, task, len(cells), [k for k, _ in runs], [r["seconds"] for _, r in runs],
                 None if warm is None else warm["seconds"], step,
                 fixed, max(peaks) if peaks else None, None, _last_line(errors[0]) if errors else None,
                 "timed steps" if timed is not None else "difference")


#: steady steps a cut must have timed for its own timing to be used (fewer: too few to average jitter)
_MIN_TIMED_STEPS = 5


def _timed_step(steady: list[tuple[int, float]], k: int) -> float | None:
    """Seconds per step of the task from the trainer's own timing of a cut of ``k`` steps
    (:func:`bnlab._run_length.note_steady_steps`), or ``None`` when it did not time enough of them.

    A task may train several ensembles one after another, each a step of the task per step of its own:
    the task's step is the sum of their seconds per step.  Only calls that ran the cut's steady steps
    count (a call of another length is not a step of this task)."""
    per_call = [seconds / n for n, seconds in steady if n == k - STEADY_FROM and n >= _MIN_TIMED_STEPS]
    return sum(per_call) if per_call else None


def lpt_makespan(durations: Sequence[float], workers: int) -> float:
    """Wall time of ``durations`` on ``workers`` workers, longest first to the least loaded worker (LPT;
    within 4/3 of the optimum, Graham 1969) — how a Dask cluster's queue roughly fills its workers."""
    import heapq

    workers = max(1, int(workers))
    loads = [0.0] * workers
    for d in sorted(durations, reverse=True):
        heapq.heapreplace(loads, loads[0] + d)
    return max(loads) if durations else 0.0


def _costs(exp: Experiment, cells: list[dict], tasks: list[list[int]]) -> list[TaskCost]:
    if exp.cost is None:
        return [TaskCost("task") for _ in tasks]
    out = []
    for t in tasks:
        c = exp.cost([dict(cells[i]) for i in t])
        if not isinstance(c, TaskCost):
            raise ValueError(f"{exp.name}.cost returned {c!r}, which is not a TaskCost")
        out.append(c)
    return out


def plan_experiment(
    experiment: str | Experiment,
    scale: str = "paper",
    *,
    device: str | None = None,
    workers: int | None = None,
    budget: float = 60.0,
    pilot_steps: tuple[int, int] = DEFAULT_PILOT_STEPS,
    limit_threads: bool = False,
    clock: str = "wall",
    _notify=None,
) -> ExperimentPlan:
    """Pilot ``experiment`` at ``scale`` in this process and estimate its sweep (see the module docstring).

    Parameters
    ----------
    experiment, scale:
        What to plan (a name, ``"module:NAME"`` or an :class:`Experiment`) and at which scale.
    device:
        The device a ``uses_gpu`` experiment's pilot runs on (default: the engine's choice,
        :func:`~bnlab.experiments.spec.cell_device`); other experiments run on the CPU, as in a sweep.
    workers:
        Parallel workers of the wall-time estimate (default: the GPUs when the device is CUDA, else the
        available cores — a local cluster's default).
    budget:
        Seconds the pilots of this experiment should take at most (a soft limit: a pilot run that
        started finishes; no new one starts after it).
    pilot_steps:
        ``(k₁, k₂)``, the steps of the first two pilot runs.
    limit_threads:
        Run with one torch/BLAS thread, as a Dask worker does (the command line's child process does).
    clock:
        ``"wall"`` (default: what a run will take) or ``"process"`` (this process's CPU time, all threads:
        on a CPU shared with other jobs it leaves their load out; compare it with a run timed the same way).
    """
    exp = get_experiment(experiment)
    check_choice("scale", scale, SCALES)
    budget = check_real("budget", budget, minimum=0.0, strict_minimum=True, maximum=MAX_BUDGET_S)
    k1 = check_int("pilot_steps[0]", pilot_steps[0], minimum=1)
    k2 = check_int("pilot_steps[1]", pilot_steps[1], minimum=k1 + 1)
    clock = check_choice("clock", clock, tuple(_CLOCKS))
    dev = _device_of(exp, _check_device(device))
    if workers is None:
        workers = _default_workers(dev)
    workers = check_int("workers", workers, minimum=1, maximum=4096)
    t_start = time.monotonic()
    deadline = t_start + budget
    cells = exp.grid(scale)
    tasks = cell_tasks(exp, cells, scale)
    grouped = [exp.group is not None and exp.group(dict(cells[t[0]]), scale) is not None for t in tasks]
    plan = ExperimentPlan(exp.name, scale, dev, len(cells), len(tasks), max((len(t) for t in tasks), default=0),
                          workers=workers, memory_source="torch.cuda.max_memory_allocated" if dev.startswith("cuda")
                          else "resident set growth")
    if not tasks:
        plan.seconds = plan.wall_seconds = 0.0
        return plan
    try:
        costs = _costs(exp, cells, tasks)
    except Exception as exc:  # a broken cost hook is this experiment's error, not the plan's
        plan.error = f"cost: {type(exc).__name__}: {exc}"
        return plan
    by_kind: dict[str, list[int]] = {}
    for j, c in enumerate(costs):
        by_kind.setdefault(c.kind, []).append(j)
    estimates: list[float | None] = [None] * len(tasks)
    for kind, members in by_kind.items():
        if exp.cost is None:
            chosen = sorted({members[0], members[-1]})  # no cost model: the first and the last task
        else:
            # the longest task of the kind (most steps, then most work), where extrapolation must err least;
            # and where the work per step spans more than 1.5x, the task at the other end of that span as well
            # (a line through both separates a fixed per-step overhead from the part that grows with work)
            longest = max(members, key=lambda j: (costs[j].steps, costs[j].steps * costs[j].step_work))
            w = costs[longest].step_work
            ends = [max(members, key=lambda j: costs[j].step_work), min(members, key=lambda j: costs[j].step_work)]
            other = max(ends, key=lambda j: max(costs[j].step_work / w, w / costs[j].step_work) if w > 0 else 0.0)
            span = costs[other].step_work / w if w > 0 else 1.0
            chosen = [longest] + ([other] if other != longest and max(span, 1 / span) > 1.5 else [])
        pilots = []
        for j in chosen:
            if time.monotonic() > deadline and pilots:
                break  # past the budget: one pilot per kind is enough
            pilots.append(_pilot(exp, [cells[i] for i in tasks[j]], grouped[j], j, costs[j], dev, (k1, k2),
                                 deadline, limit_threads, clock, _notify, warm_up=not (plan.pilots or pilots)))
        plan.pilots.extend(pilots)
        bad = [p for p in pilots if p.error is not None]
        if bad:
            plan.error = f"pilot of task {bad[0].task} ({kind}): {bad[0].error}"
            continue
        if any(p.skipped is not None for p in pilots):
            plan.skipped = next(p.skipped for p in pilots if p.skipped is not None)
            for j in members:
                estimates[j] = 0.0
            continue
        for j in members:
            estimates[j] = _extrapolate(pilots, costs, j)
    peaks = [p.peak_bytes for p in plan.pilots if p.peak_bytes is not None]
    plan.peak_bytes = max(peaks) if peaks else None
    plan.plan_seconds = time.monotonic() - t_start
    if plan.skipped is not None and all(e == 0.0 for e in estimates):
        plan.seconds = plan.wall_seconds = 0.0
        return plan
    if plan.error is None and all(e is not None for e in estimates):
        plan.task_seconds = [float(e) for e in estimates]
        plan.seconds = float(sum(plan.task_seconds))
        plan.wall_seconds = lpt_makespan(plan.task_seconds, workers)
    return plan


def _extrapolate(pilots: list[Pilot], costs: list[TaskCost], j: int) -> float:
    """Task ``j``'s seconds from the pilots of its kind.

    One stepped pilot: its step and rest scaled by the work ratios.  Two stepped pilots of different work
    per step: the line through them, ``seconds per step = a + b·step_work`` (and likewise for the rest) —
    a per-step overhead ``a`` that does not grow with the work (kernel launches on a GPU, Python on a CPU)
    beside the part that does.  Pilots that ran whole: the mean of their times scaled by the total work.
    """
    c = costs[j]
    stepped = [p for p in pilots if p.step_seconds is not None]
    if len(stepped) == 2 and costs[stepped[0].task].step_work != costs[stepped[1].task].step_work:
        return _line(stepped, costs, "step_work", "step_seconds", c.step_work) * c.steps + \
            _line(stepped, costs, "fixed_work", "fixed_seconds", c.fixed_work)
    vals = []
    for p in stepped[:1] or pilots:
        cp = costs[p.task]
        if p.step_seconds is None:  # the pilot ran whole: scale its time by the total work
            work_p = cp.fixed_work + cp.steps * cp.step_work
            work = c.fixed_work + c.steps * c.step_work
            vals.append(p.fixed_seconds * (work / work_p if work_p > 0 else 1.0))
            continue
        fixed = p.fixed_seconds * (c.fixed_work / cp.fixed_work if cp.fixed_work > 0 else 1.0)
        per_step = p.step_seconds * (c.step_work / cp.step_work if cp.step_work > 0 else 1.0)
        vals.append(fixed + c.steps * per_step)
    return float(sum(vals) / len(vals))


def _line(pilots: list[Pilot], costs: list[TaskCost], work_attr: str, sec_attr: str, work: float) -> float:
    """Seconds at ``work`` on the line through two pilots' (work, seconds); a slope or intercept below zero
    (noise can tilt a line through two points) is taken as zero."""
    (w1, s1), (w2, s2) = sorted((getattr(costs[p.task], work_attr), getattr(p, sec_attr)) for p in pilots)
    if w2 == w1:
        return (s1 + s2) / 2
    b = max((s2 - s1) / (w2 - w1), 0.0)
    a = max(s1 - b * w1, 0.0)
    return a + b * work


def _default_workers(device: str) -> int:
    if device.startswith("cuda"):
        import torch

        return max(1, torch.cuda.device_count())
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


# --------------------------------------------------------------------------- many experiments, isolated
def plan_experiments(
    experiments: Iterable[str | Experiment],
    scale: str = "paper",
    *,
    device: str | None = None,
    workers: int | None = None,
    budget: float = 60.0,
    pilot_steps: tuple[int, int] = DEFAULT_PILOT_STEPS,
    isolate: bool = True,
    hard_limit: float | None = None,
    total_budget: float | None = None,
    clock: str = "wall",
    progress: bool | IO = False,
) -> Plan:
    """Plan several experiments (a report's); see :func:`plan_experiment` for the arguments.

    ``isolate=True`` runs the pilots in a child process with one torch thread (as a Dask worker): an
    experiment whose pilots run past ``hard_limit`` seconds (default ``2·budget + 60``) is stopped there
    and reported with a lower bound — stopped in a whole task, each task is taken to take at least as long as
    it ran; stopped in a task cut to k steps, that task and (past the warm-up) every task of its kind with at
    least its work (:class:`~bnlab.experiments.spec.TaskCost`) and k steps; the child is restarted
    for the next experiment.  ``total_budget`` caps the whole plan: each experiment gets at most its
    share of the time left, and the experiments it leaves no time for are listed without an estimate.
    ``progress`` prints one line per experiment (True: on stderr).
    """
    exps = [get_experiment(e) for e in experiments]
    check_choice("scale", scale, SCALES)
    budget = check_real("budget", budget, minimum=0.0, strict_minimum=True, maximum=MAX_BUDGET_S)
    hard_limit = 2 * budget + 60 if hard_limit is None else check_real("hard_limit", hard_limit, minimum=0.0,
                                                                          strict_minimum=True,
                                                                          maximum=3 * MAX_BUDGET_S)
    clock = check_choice("clock", clock, tuple(_CLOCKS))
    device = _check_device(device)
    if workers is not None:
        workers = check_int("workers", workers, minimum=1, maximum=4096)
    t0 = time.monotonic()
    stream = sys.stderr if progress is True else (progress or None)
    plans: list[ExperimentPlan] = []
    runner = _ChildRunner() if isolate else None
    if total_budget is not None:
        total_budget = check_real("total_budget", total_budget, minimum=0.0, strict_minimum=True,
                                  maximum=MAX_BUDGET_S * max(1, len(exps)))
    try:
        for i, exp in enumerate(exps):
            b, hard = budget, hard_limit
            if total_budget is not None:
                left = t0 + total_budget - time.monotonic()
                if left < 1.0:
                    cells = exp.grid(scale)
                    tasks = cell_tasks(exp, cells, scale)
                    plans.append(ExperimentPlan(exp.name, scale, _device_of(exp, device), len(cells), len(tasks),
                                                max((len(t) for t in tasks), default=0),
                                                error="not planned: the plan's time budget ran out"))
                    continue
                share = left / (len(exps) - i)
                b, hard = min(budget, share), min(hard_limit, max(share, left / 2))
            if runner is None:
                p = plan_experiment(exp, scale, device=device, workers=workers, budget=b, pilot_steps=pilot_steps,
                                    clock=clock)
            else:
                p = runner.plan(exp, scale, device, workers, b, pilot_steps, hard, clock)
            plans.append(p)
            if stream is not None:
                print(f"planned {p.experiment}: {_fmt_seconds(p.wall_seconds, p.lower_bound)} "
                      f"(pilots {p.plan_seconds:.0f} s)", file=stream, flush=True)
    finally:
        if runner is not None:
            runner.close()
    devices = sorted({p.device for p in plans})
    return Plan(scale, ", ".join(devices) or "-", plans, time.monotonic() - t0)


class _ChildRunner:
    """One child process (``python -m bnlab.experiments._pilot``) that pilots experiments one at a time."""

    def __init__(self):
        self._proc: subprocess.Popen | None = None
        self._log = None

    def _start(self) -> subprocess.Popen:
        import tempfile

        if self._proc is None or self._proc.poll() is not None:
            self._log = tempfile.TemporaryFile(mode="w+")
            env = dict(os.environ)
            # the child imports this very bnlab (a checkout on PYTHONPATH included)
            root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
            self._proc = subprocess.Popen([sys.executable, "-m", "bnlab.experiments._pilot"], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=self._log, text=True, env=env, bufsize=1)
        return self._proc

    def plan(self, exp: Experiment, scale: str, device, workers, budget: float, pilot_steps, hard_limit: float,
             clock: str) -> ExperimentPlan:
        import select

        proc = self._start()
        request = {"name": exp.name, "module": experiment_module(exp), "scale": scale, "device": device,
                   "workers": workers, "budget": budget, "pilot_steps": list(pilot_steps), "clock": clock}
        proc.stdin.write(json.dumps(request) + "\n")
        proc.stdin.flush()
        t0 = time.monotonic()
        answer, running, since, runs = None, None, None, 0
        while answer is None:
            ready, _, _ = select.select([proc.stdout], [], [], max(hard_limit - (time.monotonic() - t0), 0.0))
            line = proc.stdout.readline() if ready else ""
            if not line:
                break  # past the hard limit, or the child died
            msg = json.loads(line)
            if "progress" in msg:  # the child starts a pilot run: a whole task, or one cut to a few steps
                running, since, runs = msg, time.monotonic(), runs + 1
                continue
            answer = msg
        if answer is not None and "crash" not in answer:
            pilots = [Pilot(**q) for q in answer.pop("pilots", [])]
            return ExperimentPlan(pilots=pilots, **answer)
        died = answer is None and proc.poll() is not None
        if answer is None:
            self.close()
        elapsed = time.monotonic() - t0
        cells = exp.grid(scale)
        tasks = cell_tasks(exp, cells, scale)
        p = ExperimentPlan(exp.name, scale, _device_of(exp, device), len(cells), len(tasks),
                           max((len(t) for t in tasks), default=0), plan_seconds=elapsed)
        if answer is not None:
            p.error = answer["crash"]
        elif died:
            p.error = "the pilot process died: " + self._tail()
        elif running is not None and running["progress"] == "whole_task":
            # stopped while running one whole task: that task takes longer than it ran, and without a cost
            # model every task is taken to cost the same
            ran = time.monotonic() - since
            p.lower_bound = True
            p.workers = workers or _default_workers(p.device)
            p.task_seconds = [ran] * len(tasks)
            p.seconds = ran * len(tasks)
            p.wall_seconds = lpt_makespan(p.task_seconds, p.workers)
        elif running is not None and exp.cost is not None:
            # stopped while running task j cut to k steps: the whole task j does all of that run's work and
            # more, so it takes longer than the run ran; so does, per the cost model, every task of j's kind
            # with at least j's work per step and for the rest and at least k steps — unless the run was the
            # experiment's first (its warm-up), whose one-time costs (imports, data read from disk) a worker
            # pays once: then task j alone.  The others count 0.
            ran = time.monotonic() - since
            j, k = int(running["task"]), int(running["steps"])
            costs = _costs(exp, cells, tasks)
            cj = costs[j]
            p.lower_bound = True
            p.workers = workers or _default_workers(p.device)
            p.task_seconds = [ran if i == j or (runs > 1 and c.kind == cj.kind and c.steps >= k
                                                and c.step_work >= cj.step_work and c.fixed_work >= cj.fixed_work)
                              else 0.0 for i, c in enumerate(costs)]
            p.seconds = sum(p.task_seconds)
            p.wall_seconds = lpt_makespan(p.task_seconds, p.workers)
        elif running is None:
            # stopped before its first pilot run began: the child's start-up (imports) or the grid took it all
            p.error = (f"stopped at {hard_limit:.0f} s before its first pilot run began; give it more time "
                       "(--plan-budget)")
        else:
            p.error = (f"the pilot (a task cut to a few steps) ran past {hard_limit:.0f} s; give it more time "
                       "(--plan-budget)")
        return p

    def _tail(self) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        return _last_line(self._log.read()[-4000:])

    def close(self) -> None:
        if self._proc is not None:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            self._proc = None


# --------------------------------------------------------------------------- output
def _fmt_seconds(s: float | None, lower: bool = False) -> str:
    if s is None:
        return "n/a"
    pre = "≥ " if lower else ""
    if s < 90:
        return f"{pre}{s:.1f} s"
    if s < 3 * 3600:
        return f"{pre}{s / 60:.1f} min"
    return f"{pre}{s / 3600:.1f} h"


def _fmt_bytes(b: int | None) -> str:
    if b is None:
        return "n/a"
    return f"{b / 2 ** 20:.0f} MiB" if b < 2 ** 30 else f"{b / 2 ** 30:.2f} GiB"


def format_plan(plan: Plan) -> str:
    """The plan as a plain-text table: one row per experiment, then the total."""
    rows = [("reproduction", "device", "cells", "tasks", "cells/task", "1 worker", "workers", "wall", "memory/task",
             "pilots", "note")]
    for e in plan.experiments:
        note = (f"skipped: {e.skipped}" if e.skipped else f"error: {e.error}" if e.error
                else "lower bound: a pilot ran past its limit" if e.lower_bound else "")
        rows.append((e.experiment, e.device, str(e.cells), str(e.tasks), str(e.largest_task),
                     _fmt_seconds(e.seconds, e.lower_bound), str(e.workers), _fmt_seconds(e.wall_seconds, e.lower_bound),
                     _fmt_bytes(e.peak_bytes), f"{e.plan_seconds:.0f} s", note[:90]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    total = plan.seconds
    lines.append("")
    lines.append(f"total ({plan.scale} scale, reproductions one after the other): "
                 f"{_fmt_seconds(total, plan.lower_bound)}"
                 + ("" if total is not None else " (some reproductions have no estimate)")
                 + f"; the pilots took {plan.plan_seconds:.0f} s")
    return "\n".join(lines)
