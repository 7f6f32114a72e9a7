"""The sweep engine: run an experiment's grid on Dask, one committed result per cell, resumable.

The driver (the process calling :func:`run_sweep`) is the only writer of the
store.  It opens the sweep's SQLite file, adds the grid's cells, returns any
cell a previous driver left ``running`` to ``pending``, submits every pending
cell to a Dask client (``client.submit`` of a module-level function, so cells
travel by reference), and commits each outcome as it arrives
(``as_completed``).  Cells that an experiment's ``group`` puts together (a batched
ensemble at ``paper`` scale) are submitted as one task, ``run_group``, and still
committed one by one.  Hence:

* stopping the driver (Ctrl-C, SIGTERM, ``kill -9``) loses no finished cell
  and a resume runs only the cells without a committed result;
* a worker that dies (out of memory, segfault, ``kill``) loses only the cell
  it was running: Dask's scheduler reruns it on another worker (up to
  ``distributed.scheduler.allowed-failures`` deaths, default 3, after which
  the cell is recorded ``failed`` with ``KilledWorker``);
* a cell whose ``run_cell`` raises is recorded ``failed`` with its traceback
  and the sweep goes on.

Clusters: by default a ``LocalCluster`` of one worker process per available
core (``threads_per_worker=1, processes=True``; each worker also limits
OpenMP/MKL/torch to its share of the cores, cores // workers threads, so n
workers use n cores, not n²; ``threads=`` fixes the count instead);
``scheduler="tcp://host:8786"`` connects to an existing cluster (e.g. SLURM
via dask-jobqueue, see ``docs/experiments.md``); ``serial=True`` runs the
cells in-process, for debugging.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import signal
import threading
import time
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Iterator, Sequence

from bnlab import _task_checkpoint as _checkpoints
from bnlab import _threads
from bnlab._validation import atomic_output_path, check_choice, check_int, check_path, check_real
from bnlab.experiments._progress import SweepProgress
from bnlab.experiments._worker import (PINNED_ENV, THREADS_ENV, TaskCheckpoint, execute_task, library_versions,
                                       set_worker_threads)
from bnlab.experiments.registry import experiment_module, get_experiment, list_experiments
from bnlab.experiments.spec import SCALES, Experiment, cell_tasks
from bnlab.experiments.store import ResultsStore

__all__ = [
    "run_sweep",
    "run_grid",
    "grid_cells",
    "resume_sweep",
    "sweep_status",
    "export_sweep",
    "SweepSummary",
    "SweepStatus",
    "default_results_dir",
    "store_path",
    "resolve_store",
    "open_client",
    "set_client_threads",
    "check_scheduler_address",
    "checkpoint_folder",
    "DEFAULT_CHECKPOINT_EVERY",
]

#: seconds between two checkpoints of a task's trainer (:func:`run_sweep`'s ``checkpoint_every``)
DEFAULT_CHECKPOINT_EVERY = _checkpoints.DEFAULT_EVERY

_KILLED_HINT = (
    "the worker running this cell died repeatedly (distributed.scheduler.allowed-failures); "
    "typical causes: out of memory, a crash in native code, a job killed by the batch system"
)


_SCHEDULER_RE = re.compile(r"^(?:(?:tcp|tls|inproc|ucx|ws|wss)://)?[A-Za-z0-9_.\-\[\]:%]+:\d{1,5}/?$")


def check_scheduler_address(scheduler: Any) -> str:
    """A Dask scheduler address such as ``tcp://host:8786`` (protocol optional, port required)."""
    if not isinstance(scheduler, str) or not _SCHEDULER_RE.match(scheduler.strip()):
        raise ValueError(
            f"scheduler={scheduler!r} is not allowed: expected a Dask scheduler address like tcp://host:8786"
        )
    return scheduler.strip()


def default_results_dir() -> Path:
    """``$BNLAB_RESULTS`` if set, else ``bnlab-results`` in the current directory."""
    return Path(os.environ.get("BNLAB_RESULTS") or "bnlab-results")


def store_path(name: str, scale: str, results_dir: str | os.PathLike | None = None) -> Path:
    """The store of (experiment ``name``, ``scale``): ``<results_dir>/<name>-<scale>.sqlite``."""
    if results_dir is not None and not str(results_dir).strip():
        raise ValueError(f"results_dir={str(results_dir)!r} is not allowed: expected a directory path")
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
    return Path(results_dir if results_dir is not None else default_results_dir()) / f"{safe}-{scale}.sqlite"


def resolve_store(target: str | os.PathLike, scale: str = "small", results_dir: str | os.PathLike | None = None) -> Path:
    """A store path from either a ``.sqlite`` path or an experiment name (+ ``scale``, ``results_dir``)."""
    if not isinstance(target, (str, os.PathLike)) or not str(target).strip():
        raise ValueError(f"target={target!r} is not allowed: expected a .sqlite store or an experiment name")
    p = Path(target)
    try:
        is_file = p.is_file()
    except OSError:  # e.g. a name too long for the file system: not an existing store
        is_file = False
    if p.suffix == ".sqlite" or is_file or os.sep in str(target):
        return p
    check_choice("scale", scale, SCALES)
    return store_path(str(target), scale, results_dir)


@dataclass(frozen=True)
class SweepSummary:
    """What a :func:`run_sweep` call did."""

    experiment: str
    scale: str
    store: Path
    total: int  # cells in the grid
    done: int  # cells done now (including earlier runs)
    failed: int
    pending: int  # cells without a result (only after an interruption)
    executed: int  # cells whose outcome this call committed
    reused: int  # cells already done before this call
    wall_time: float  # seconds

    @property
    def complete(self) -> bool:
        return self.pending == 0


@dataclass(frozen=True)
class SweepStatus:
    """The state of a sweep's store (see :func:`sweep_status`)."""

    experiment: str
    scale: str
    store: Path
    module: str | None
    created: str
    updated: str
    total: int
    counts: dict[str, int]
    cell_seconds: float  # sum of run_cell durations of finished cells
    mean_cell_seconds: float | None
    failures: list[dict] = field(default_factory=list)  # key, params, error (last line), attempts
    versions: dict = field(default_factory=dict)
    driver: dict | None = None  # the last driver recorded in the store: pid, host, started
    driver_alive: bool = False  # a process holds the store's writer lock now
    interrupted: int = 0  # cells left "running" by a driver that is gone (a resume runs them again)
    # the checkpoints its tasks keep beside the store (bnlab._task_checkpoint.kept): an interrupted task whose
    # file is listed goes on from it when the sweep is resumed
    checkpoints: list[dict] = field(default_factory=list)


# -- clusters ------------------------------------------------------------------------------------------


def _available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


#: Dask settings of the clusters bnlab starts itself (an existing cluster keeps its own).
_LOCAL_CLUSTER_CONFIG = {
    # Dask's nannies start workers with MALLOC_TRIM_THRESHOLD_=65536, which also switches off glibc's
    # adaptive mmap threshold: every tensor above 128 KiB is then a fresh mmap, page-faulted in and unmapped
    # again.  For the sweeps' small-network training that made a cell cost ~30 % more CPU, mostly system
    # time (measured: a Fig. 3a column, 2.2 s of system time instead of 0.8 s).  Workers get the
    # environment's own malloc settings instead, as serial mode has.
    "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None,
    # The statistical profiler (a stack sample every 10 ms), the 500 ms system monitor and the 20 ms tick
    # feed a dashboard bnlab does not show; measured, they cost each busy worker ~5 % of a core besides
    # its cell (1–2 % with these settings).  The memory monitor, which guards against a runaway cell,
    # keeps its default.
    "distributed.worker.profile.enabled": False,
    "distributed.admin.system-monitor.interval": "5s",
    "distributed.admin.tick.interval": "500ms",
}


@contextlib.contextmanager
def open_client(scheduler: str | None = None, workers: int | None = None, threads: int | None = None) -> Iterator[Any]:
    """A Dask ``Client``: connected to ``scheduler`` if given, else to a new ``LocalCluster``.

    The local cluster has ``workers`` (default: the available cores) worker
    processes of one Dask thread each, its HTTP server on a free port (concurrent
    sweeps never clash); it is shut down on exit.  Each worker runs torch, OpenMP,
    MKL and OpenBLAS with ``threads`` threads if given (fixed: the chooser of small
    work leaves it), else with its share of the cores, max(1, cores // workers)
    (which the training entry points lower to one thread for small work; see
    :mod:`bnlab._threads`).  An existing cluster is left running; ``threads`` is then
    set on the workers connected now (a worker that joins later keeps its own
    setting: ``BNLAB_WORKER_THREADS`` in its environment, else one thread).
    """
    from distributed import Client, LocalCluster

    if threads is not None:
        threads = _threads.check_threads(threads)
    if scheduler is not None:
        if not isinstance(scheduler, str) or not scheduler:
            raise ValueError(f"scheduler must be an address like 'tcp://host:8786', got {scheduler!r}")
        if workers is not None:
            raise ValueError("workers applies to a local cluster only; an existing cluster (scheduler=) has its own")
        try:
            client = Client(scheduler, timeout="30s")
        except (OSError, TimeoutError) as exc:
            raise ValueError(f"cannot connect to the Dask scheduler at {scheduler!r}: {exc}") from None
        try:
            if threads is not None:
                set_client_threads(client, threads)
            yield client
        finally:
            client.close()
        return
    n = _available_cores() if workers is None else check_int("workers", workers, minimum=1)
    share = str(threads if threads is not None else _worker_share(_available_cores(), n))
    import dask

    with dask.config.set(_LOCAL_CLUSTER_CONFIG):
        cluster = LocalCluster(
            n_workers=n,
            threads_per_worker=1,
            processes=True,
            dashboard_address=":0",  # a free port: several sweeps on one machine never collide
            silence_logs=logging.ERROR,
            env={"OMP_NUM_THREADS": share, "MKL_NUM_THREADS": share, "OPENBLAS_NUM_THREADS": share,
                 THREADS_ENV: share, PINNED_ENV: "1" if threads is not None else "0"},
        )
    client = Client(cluster)
    try:
        from bnlab.experiments._dask_plugins import IgnoreSigint, QuietHeartbeatLoss

        client.register_plugin(IgnoreSigint())
        client.register_plugin(QuietHeartbeatLoss())
        yield client
    finally:
        _close_bounded(client, cluster)


#: seconds each of the local cluster's client and cluster may take to close (a worker busy in a cell is
#: stopped by its nanny within ~5 s; this bounds a teardown that an interrupt left waiting)
CLOSE_TIMEOUT_S = 30.0


def _close_bounded(client: Any, cluster: Any, timeout: float | None = None) -> None:
    """Close the local ``client`` and ``cluster``, each within ``timeout`` seconds (default
    :data:`CLOSE_TIMEOUT_S`): a teardown that does not finish is reported by a warning and given up,
    never waited on (the worker processes are this process's daemonic children: they end with it)."""
    timeout = CLOSE_TIMEOUT_S if timeout is None else timeout
    for what, part in (("client", client), ("cluster", cluster)):
        try:
            part.close(timeout=timeout)
        except (TimeoutError, OSError, RuntimeError) as exc:
            warnings.warn(f"the local Dask {what} did not close within {timeout:g} s "
                          f"({type(exc).__name__}: {exc}); its worker processes end with this process",
                          RuntimeWarning, stacklevel=3)


def _worker_share(cores: int, workers: int) -> int:
    """Intra-op threads of each of ``workers`` local workers on ``cores`` cores: cores // workers,
    at least one (more workers than cores share them; n workers never run n² threads)."""
    return max(1, cores // workers)


def set_client_threads(client: Any, threads: int) -> None:
    """Fix the intra-op thread count (torch, OpenMP, BLAS) of every worker of ``client`` connected
    now to ``threads`` (the chooser of small work leaves it; see :func:`open_client`)."""
    client.run(set_worker_threads, _threads.check_threads(threads), True)


def _gpu_resources(client, experiment: Experiment) -> dict | None:
    # Ask for a GPU only where workers advertise one; otherwise the cells would wait forever.
    if not experiment.uses_gpu:
        return None
    # Recent distributed lists only 5 workers unless asked for all (n_workers=-1).
    info = client.scheduler_info(n_workers=-1) if _accepts_n_workers(client) else client.scheduler_info()
    workers = info.get("workers", {})
    if any(w.get("resources", {}).get("GPU", 0) >= 1 for w in workers.values()):
        return {"GPU": 1}
    return None


def _accepts_n_workers(client) -> bool:
    import inspect

    try:
        return "n_workers" in inspect.signature(client.scheduler_info).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return False


# -- the engine ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """Within the main thread, SIGTERM stops the sweep like Ctrl-C (clean requeue of running cells)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _commit(store: ResultsStore, key: str, outcome: dict, progress: SweepProgress) -> None:
    meta = {k: outcome.get(k) for k in ("started", "finished", "duration", "worker", "host", "versions")}
    if outcome["ok"]:
        store.record_done(key, outcome["metrics"], **meta)
    else:
        store.record_failed(key, outcome["error"], **meta)
        last = outcome["error"].strip().splitlines()[-1] if outcome["error"].strip() else "error"
        progress.write(f"cell {key} failed: {last}")
    progress.update(outcome["ok"])


def _tasks(experiment: Experiment, rows, scale: str) -> list[tuple[list, Any]]:
    """The pending rows as tasks: ``(rows, run_group or None)``, groups of :attr:`Experiment.group` first-seen order."""
    out = []
    for idx in cell_tasks(experiment, [r.params for r in rows], scale):
        members = [rows[i] for i in idx]
        grouped = experiment.group is not None and experiment.group(dict(members[0].params), scale) is not None
        out.append((members, experiment.run_group if grouped else None))
    return out


def _commit_task(store: ResultsStore, members, outcomes, progress: SweepProgress) -> None:
    for row, outcome in zip(members, outcomes):
        _commit(store, row.key, outcome, progress)


def checkpoint_folder(store: Path) -> Path:
    """The folder beside ``store`` in which its tasks keep checkpoints: ``<store>.checkpoints``.

    ``ValueError`` naming it where something other than a folder is there (a file, or a symbolic link: a
    task's checkpoints are read and written there, so a planted link is refused, as the store's lock is)."""
    folder = store.with_name(store.name + ".checkpoints")
    if os.path.islink(folder):
        raise ValueError(f"checkpoint folder {str(folder)!r} is not allowed: it is a symbolic link; bnlab keeps a "
                         "sweep's checkpoints only in a real folder beside its store (remove the link)")
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ValueError(f"checkpoint folder {str(folder)!r} is not allowed: it exists and is not a folder")
    return folder


def _task_checkpoint(members, folder: Path | None, every: float | None) -> TaskCheckpoint | None:
    """Where the task of ``members`` keeps its trainers' checkpoints: ``folder``/<a hash of its cells' keys>."""
    if folder is None or every is None:
        return None
    name = hashlib.sha256(",".join(r.key for r in members).encode()).hexdigest()[:24]
    # absolute: a worker's working folder need not be the driver's
    return TaskCheckpoint(os.path.abspath(folder), name, float(every))


def _run_serial(experiment: Experiment, tasks, store: ResultsStore, progress: SweepProgress,
                checkpoints: tuple[Path | None, float | None] = (None, None)) -> int:
    executed = 0
    for members, run_group in tasks:
        store.mark_submitted([r.key for r in members])
        outcomes = execute_task(experiment.run_cell, run_group, [r.params for r in members], False,
                                experiment.uses_gpu, experiment.cell, experiment.name,
                                _task_checkpoint(members, *checkpoints))
        _commit_task(store, members, outcomes, progress)
        executed += len(members)
    return executed


def _run_dask(experiment: Experiment, tasks, store: ResultsStore, progress: SweepProgress, client, retries: int,
              stopped: list, checkpoints: tuple[Path | None, float | None] = (None, None)) -> int:
    """Run ``tasks`` on ``client``, committing each as it finishes; the number of cells run.  Stopped before
    the end (Ctrl-C, an error), the futures still in flight are handed to ``stopped``, for the caller to
    cancel (:func:`_cancel_bounded`) once it has put the store right."""
    from distributed import KilledWorker, as_completed

    resources = _gpu_resources(client, experiment)
    store.mark_submitted([r.key for members, _ in tasks for r in members])
    tag = uuid.uuid4().hex[:8]
    # One map call submits the whole grid in one message; the functions travel by reference.  A task is
    # one cell, or the cells of one group (trained together, committed one by one).
    futs = client.map(
        execute_task,
        [experiment.run_cell] * len(tasks),
        [run_group for _, run_group in tasks],
        [[r.params for r in members] for members, _ in tasks],
        [True] * len(tasks),
        [experiment.uses_gpu] * len(tasks),
        [experiment.cell] * len(tasks),
        [experiment.name] * len(tasks),
        [_task_checkpoint(members, *checkpoints) for members, _ in tasks],
        key=[f"bnlab-{experiment.name}-{members[0].key}{'-group' if len(members) > 1 else ''}-{tag}"
             for members, _ in tasks],
        pure=False,
        retries=retries,
        resources=resources,
    )
    futures = {f: members for f, (members, _) in zip(futs, tasks)}
    executed = 0
    try:
        # with_results: results are gathered by the client's event loop as they arrive, not one round trip each.
        for fut, result in as_completed(futs, with_results=True, raise_errors=False):
            members = futures.pop(fut)
            if fut.status == "error":  # the task itself failed: KilledWorker, unpicklable cell, ...
                exc = result[1]
                hint = f"\n{_KILLED_HINT}" if isinstance(exc, KilledWorker) else ""
                outcomes = [{"ok": False, "error": f"{type(exc).__name__}: {exc}{hint}"}] * len(members)
            else:
                outcomes = result
            _commit_task(store, members, outcomes, progress)
            fut.release()
            executed += len(members)
    finally:
        if futures:  # interrupted: nothing more will be committed for these
            stopped.extend(futures)
    return executed


#: seconds a cancellation of the futures in flight may take after an interrupt
CANCEL_TIMEOUT_S = 10.0


def _cancel_bounded(client: Any, futures: list, timeout: float | None = None) -> None:
    """``client.cancel(futures)``, waited on for at most ``timeout`` seconds (default
    :data:`CANCEL_TIMEOUT_S`): ``Client.cancel`` takes no timeout and waits on the client's event loop,
    which an interrupt may have left busy; past the bound a warning says so and the stop goes on (closing
    the client releases the futures on the scheduler anyway)."""
    timeout = CANCEL_TIMEOUT_S if timeout is None else timeout
    finished = threading.Event()

    def cancel() -> None:
        try:
            client.cancel(futures)
        except Exception:  # noqa: BLE001 — a lost connection: closing the client releases them
            pass
        finally:
            finished.set()

    threading.Thread(target=cancel, name="bnlab-cancel", daemon=True).start()
    if not finished.wait(timeout):
        warnings.warn(f"cancelling {len(futures)} Dask tasks in flight did not finish within {timeout:g} s; "
                      "stopping without waiting (closing the client releases them)", RuntimeWarning, stacklevel=3)


def run_sweep(
    experiment: str | Experiment,
    scale: str = "small",
    *,
    results_dir: str | os.PathLike | None = None,
    store: str | os.PathLike | None = None,
    client: Any = None,
    scheduler: str | None = None,
    workers: int | None = None,
    serial: bool = False,
    retries: int = 0,
    retry_failed: bool = False,
    progress: bool | IO = True,
    threads: int | None = None,
    checkpoint_every: float | None = DEFAULT_CHECKPOINT_EVERY,
) -> SweepSummary:
    """Run (or continue) the sweep of ``experiment`` at ``scale``; return what happened.

    Parameters
    ----------
    experiment:
        An :class:`~bnlab.experiments.spec.Experiment`, a registered name, or
        ``"package.module:NAME"`` (see :func:`~bnlab.experiments.registry.get_experiment`).
    scale:
        One of :data:`~bnlab.experiments.spec.SCALES`: ``"small"``, ``"medium"``, ``"paper"``.
    results_dir, store:
        The store file is ``store`` if given, else
        ``<results_dir>/<name>-<scale>.sqlite`` (``results_dir`` defaults to
        ``$BNLAB_RESULTS`` or ``bnlab-results``).  An existing store is
        continued: its done cells are reused, never recomputed.
    client, scheduler, workers, serial:
        Where cells run: an existing Dask ``client``; else a client connected
        to ``scheduler``; else a new ``LocalCluster`` of ``workers`` processes
        (default: available cores); ``serial=True`` runs in this process.
    retries:
        Dask ``retries=`` for a task that fails outside ``run_cell`` (a
        ``run_cell`` exception is a recorded result, not retried).  Worker
        deaths are retried by the scheduler independently of this.
    retry_failed:
        Run cells recorded ``failed`` again (e.g. after fixing a bug).
    progress:
        Show the progress bar on stderr (True), not at all (False), or on the given stream.
    threads:
        Intra-op threads (torch, OpenMP, BLAS) of every process that runs cells, fixed: each
        worker of the local cluster, the workers of ``client``/``scheduler`` connected now, or
        this process for the duration of a ``serial`` run.  Default: a local worker gets its share
        of the cores (cores // workers), an existing worker keeps its own setting, a serial run
        this process's count; the training entry points lower these to one thread for small
        work (:mod:`bnlab._threads`, docs/experiments.md "Threads").
    checkpoint_every:
        Seconds between two checkpoints of a task's training (the ``checkpoint_every`` of
        :func:`bnlab.nets.train_ensemble` and :func:`bnlab.nets.train`; default 300), kept in ``<store>.checkpoints/`` and removed when the task
        finishes: a task interrupted after a save (Ctrl-C, a time limit, a killed worker) goes on from it
        when the sweep is resumed, instead of from its first step.  ``None``: no checkpoints.  Workers on
        machines that do not share the store's file system run their tasks without (docs/paper-scale.md).

    Returns
    -------
    SweepSummary

    Raises
    ------
    ValueError
        Bad arguments, an unknown experiment, a grid that is not a list of
        JSON-serializable dicts, a store of another sweep, a store being
        written by another live process.
    KeyboardInterrupt
        On Ctrl-C or SIGTERM, after committing every finished cell and
        returning the cells in flight to ``pending``.
    """
    exp = get_experiment(experiment)
    check_choice("scale", scale, SCALES)
    retries = check_int("retries", retries, minimum=0)
    if workers is not None:
        workers = check_int("workers", workers, minimum=1, maximum=4096)
    if threads is not None:
        threads = _threads.check_threads(threads)
    if scheduler is not None:
        scheduler = check_scheduler_address(scheduler)
    if checkpoint_every is not None:
        checkpoint_every = check_real("checkpoint_every", checkpoint_every, minimum=0.0)
    if serial and (client is not None or scheduler is not None):
        raise ValueError("serial=True runs in this process; do not also give client= or scheduler=")
    cells = grid_cells(exp, scale)
    path = Path(store) if store is not None else store_path(exp.name, scale, results_dir)
    summary, _ = run_grid(exp, scale, cells, path, client=client, scheduler=scheduler, workers=workers, serial=serial,
                          retries=retries, retry_failed=retry_failed, progress=progress, threads=threads,
                          checkpoint_every=checkpoint_every)
    return summary


def grid_cells(exp: Experiment, scale: str) -> list[dict]:
    """``exp.grid(scale)``, checked to be a list of dicts (``ValueError`` otherwise)."""
    cells = exp.grid(scale)
    if not isinstance(cells, (list, tuple)) or not all(isinstance(c, dict) for c in cells):
        raise ValueError(f"{exp.name}.grid({scale!r}) must return a list of dicts, got {type(cells).__name__}")
    return list(cells)


def run_grid(
    exp: Experiment, scale: str, cells: Sequence[dict], path: Path, *, client: Any = None,
    scheduler: str | None = None, workers: int | None = None, serial: bool = False, retries: int = 0,
    retry_failed: bool = False, progress: bool | IO = True, threads: int | None = None,
    checkpoint_every: float | None = DEFAULT_CHECKPOINT_EVERY,
) -> tuple[SweepSummary, list]:
    """:func:`run_sweep` for a grid already computed (``cells``, from :func:`grid_cells`) and a store path,
    arguments already checked; returns the summary and the grid's rows (``CellRow``, in grid order) read
    through the same open store, so a caller that needs both (the report) opens the store once."""
    t0 = time.perf_counter()
    folder = checkpoint_folder(path) if checkpoint_every is not None else None
    checkpoints = (folder, checkpoint_every)
    connection = contextlib.ExitStack()
    if scheduler is not None and client is None:
        # connect before the store is opened: an unreachable scheduler is refused with nothing created
        client = connection.enter_context(open_client(scheduler, workers))
    with connection, ResultsStore(path) as st:
        keys = st.initialize(exp.name, scale, cells, module=experiment_module(exp), versions=library_versions())
        st.requeue_running()
        if retry_failed:
            st.requeue_failed(keys)
        before = st.counts(keys)
        rows = st.cells(status="pending", keys=keys)
        stream = progress if (progress is not True and progress is not False) else None
        bar = SweepProgress(len(keys), before["done"], before["failed"], desc=f"{exp.name} [{scale}]",
                            file=stream, enabled=progress is not False)
        executed = 0
        # the local cluster is torn down after the except clause below (the outer stack): the store is
        # consistent and the user told so before its workers are stopped, however long that takes
        stopped: list = []  # futures in flight when the run stopped, cancelled after the store is put right
        dask_client = client
        with contextlib.ExitStack() as own_cluster:
            try:
                with _sigterm_as_interrupt():
                    tasks = _tasks(exp, rows, scale)
                    if not tasks:
                        pass
                    elif serial:
                        with _threads.pinned(threads):
                            executed = _run_serial(exp, tasks, st, bar, checkpoints)
                    elif client is not None:
                        if threads is not None:
                            set_client_threads(client, threads)
                        executed = _run_dask(exp, tasks, st, bar, client, retries, stopped, checkpoints)
                    else:
                        dask_client = own_cluster.enter_context(open_client(scheduler, workers, threads))
                        executed = _run_dask(exp, tasks, st, bar, dask_client, retries, stopped, checkpoints)
            except BaseException as exc:
                # Ctrl-C, SIGTERM, a lost scheduler...: what finished is committed; what was in flight runs again later.
                requeued = st.requeue_running()
                what = "interrupted" if isinstance(exc, KeyboardInterrupt) else f"stopped by {type(exc).__name__}"
                bar.write(
                    f"{what}: {bar.done} cells done are saved in {path}; {requeued} cells in flight returned to "
                    f"pending; continue with: bnlab sweep resume {path}"
                )
                if stopped:
                    _cancel_bounded(dask_client, stopped)
                raise
            finally:
                bar.close()
        after = st.counts(keys)
        final = st.cells(keys=keys)
    if folder is not None:
        with contextlib.suppress(OSError):
            folder.rmdir()  # once no task keeps a checkpoint (a folder that is not empty stays)
    summary = SweepSummary(
        experiment=exp.name,
        scale=scale,
        store=path,
        total=len(keys),
        done=after["done"],
        failed=after["failed"],
        pending=after["pending"] + after["running"],
        executed=executed,
        reused=before["done"],
        wall_time=time.perf_counter() - t0,
    )
    return summary, final


def _read_info(path: Path) -> dict:
    with ResultsStore(path, readonly=True) as st:
        info = st.sweep_info()
    if info is None:
        raise ValueError(f"results store {str(path)!r} holds no sweep yet")
    return info


def _experiment_of_store(info: dict, path: Path) -> Experiment:
    """The experiment a store names, found without importing anything the store names.

    A store is data that anyone could have written: its ``module`` column is never
    imported (that would let a planted store make bnlab import any importable module).
    The experiment is looked up by name in bnlab's registry (the reproductions and
    :func:`~bnlab.experiments.registry.register_experiment`), or in the recorded module
    only when this process has already imported it itself.
    """
    import sys

    name, module = info["experiment"], info.get("module")
    known = list_experiments()
    if name in known:
        return known[name]
    if isinstance(module, str) and module in sys.modules:
        for exp in getattr(sys.modules[module], "EXPERIMENTS", None) or ():
            if isinstance(exp, Experiment) and exp.name == name:
                return exp
    raise ValueError(
        f"results store {str(path)!r} holds sweep {name!r}, which is not a registered experiment; bnlab does not "
        f"import the module the store names ({module!r}). Continue it by naming the experiment yourself:  "
        f"bnlab sweep run {module}:{name} --store {path}   (or register_experiment() it in Python)"
    )


def resume_sweep(store: str | os.PathLike, **kwargs: Any) -> SweepSummary:
    """Continue the sweep stored in ``store`` (same keyword arguments as :func:`run_sweep`).

    The experiment is found by the name recorded in the store among the registered
    experiments (the store's recorded module is never imported: see
    :func:`_experiment_of_store`); its current grid is used, done cells are reused.
    """
    path = Path(store)
    info = _read_info(path)
    exp = _experiment_of_store(info, path)
    kwargs.pop("results_dir", None)
    return run_sweep(exp, info["scale"], store=path, **kwargs)


def sweep_status(store: str | os.PathLike) -> SweepStatus:
    """Counts per status, time spent, and the failed cells with the last line of their error."""
    path = Path(store)
    with ResultsStore(path, readonly=True) as st:
        info = st.sweep_info()
        if info is None:
            raise ValueError(f"results store {str(path)!r} holds no sweep yet")
        counts = st.counts()
        done = st.cells(status="done")
        failed = st.cells(status="failed")
        driver = st.driver_info()
        alive = st.writer_alive()
    durations = [r.duration for r in done if r.duration is not None]
    failures = [
        {
            "key": r.key,
            "params": r.params,
            "attempts": r.attempts,
            "error": (r.error or "").strip().splitlines()[-1] if (r.error or "").strip() else "",
        }
        for r in failed
    ]
    return SweepStatus(
        experiment=info["experiment"],
        scale=info["scale"],
        store=path,
        module=info.get("module"),
        created=info["created"],
        updated=info["updated"],
        total=sum(counts.values()),
        counts=counts,
        cell_seconds=float(sum(durations)),
        mean_cell_seconds=(sum(durations) / len(durations)) if durations else None,
        failures=failures,
        versions=info["versions"],
        driver=driver,
        driver_alive=alive,
        interrupted=0 if alive else counts["running"],
        checkpoints=_task_checkpoint_files(path),
    )


def _task_checkpoint_files(store: Path) -> list[dict]:
    """:func:`bnlab._task_checkpoint.kept` of the store's checkpoint folder; [] where a planted file or link
    stands in its place (status reports; run and resume refuse it)."""
    try:
        folder = checkpoint_folder(store)
    except ValueError:
        return []
    return _checkpoints.kept(folder)


def export_sweep(store: str | os.PathLike, output: str | os.PathLike, format: str | None = None) -> Path:
    """Write every cell of the store as one table row to CSV or Parquet; return the output path.

    Columns: ``experiment``, ``scale``, ``key``, ``idx``, ``status``,
    ``attempts``, ``started``, ``finished``, ``duration``, ``worker``,
    ``host``, ``error``, ``versions`` (JSON), then ``param.<name>`` and
    ``metric.<name>`` per parameter and metric.  Scalar values stay scalars;
    lists, dicts and columns mixing types are written as JSON text.
    ``format`` is ``"csv"`` or ``"parquet"`` (default: from the suffix of ``output``).
    """
    import json

    import pandas as pd

    # written by atomic_output_path: a link planted at the path is replaced, never followed
    out = check_path("output", output, replaced=True)
    if format is None:
        suffix = out.suffix.lower().lstrip(".")
        format = {"csv": "csv", "parquet": "parquet", "pq": "parquet"}.get(suffix)
        if format is None:
            raise ValueError(f"cannot tell the format from output={str(out)!r}; give format='csv' or 'parquet'")
    check_choice("format", format, ("csv", "parquet"))
    suffix_format = {"csv": "csv", "parquet": "parquet", "pq": "parquet"}.get(out.suffix.lower().lstrip("."))
    if suffix_format is not None and suffix_format != format:
        raise ValueError(
            f"format={format!r} is not allowed for output {str(out)!r}: its suffix says {suffix_format}; "
            f"name the file .{'parquet' if format == 'parquet' else 'csv'} or drop --format"
        )
    path = Path(store)
    with ResultsStore(path, readonly=True) as st:
        info = st.sweep_info() or {"experiment": None, "scale": None}
        rows = st.cells()
    records = []
    for r in rows:
        rec: dict[str, Any] = {
            "experiment": info["experiment"],
            "scale": info["scale"],
            "key": r.key,
            "idx": r.idx,
            "status": r.status,
            "attempts": r.attempts,
            "started": r.started,
            "finished": r.finished,
            "duration": r.duration,
            "worker": r.worker,
            "host": r.host,
            "error": r.error,
            "versions": None if r.versions is None else json.dumps(r.versions, sort_keys=True),
        }
        for k, v in r.params.items():
            rec[f"param.{k}"] = v
        for k, v in (r.metrics or {}).items():
            rec[f"metric.{k}"] = v
        records.append(rec)
    df = pd.DataFrame.from_records(records)
    for col in df.columns:
        if col.startswith(("param.", "metric.")):
            values = [v for v in df[col] if v is not None and not (isinstance(v, float) and v != v)]
            kinds = {bool if isinstance(v, bool) else (float if isinstance(v, (int, float)) else type(v)) for v in values}
            if len(kinds) > 1 or kinds & {list, dict}:
                df[col] = [None if v is None else json.dumps(v, sort_keys=True) for v in df[col]]
    out.parent.mkdir(parents=True, exist_ok=True)
    # a temporary file beside ``out``, renamed over it: a link planted at ``out`` is never followed
    with atomic_output_path(out, name="output") as tmp:
        if format == "csv":
            df.to_csv(tmp, index=False)
        else:
            df.to_parquet(tmp, index=False)
    return out
