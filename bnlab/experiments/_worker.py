"""What runs on a Dask worker (or in-process in serial mode): one cell, measured and never raising.

Kept free of heavy imports so that unpickling a task on a fresh worker is cheap.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import json
import math
import os
import socket
import stat
import time
import traceback
import warnings
from dataclasses import dataclass
from typing import Any, Callable

from bnlab.experiments.spec import library_versions  # public in spec (the report reads it too)

__all__ = ["execute_cell", "execute_group", "execute_task", "library_versions", "jsonable_metrics", "TaskCheckpoint"]

#: Environment of a worker process: its torch thread count (its share of the cores), and "1" where the
#: user fixed it (``--threads``; the chooser of small work then leaves it alone).  The local cluster
#: sets both (bnlab.experiments.sweep.open_client); a worker without them runs one thread per process.
THREADS_ENV = "BNLAB_WORKER_THREADS"
PINNED_ENV = "BNLAB_WORKER_THREADS_PINNED"

_threads_applied: tuple[int, bool] | None = None


def worker_threads() -> tuple[int, bool]:
    """``(threads, pinned)`` of this worker process, from its environment (default ``(1, False)``)."""
    try:
        threads = max(1, int(os.environ.get(THREADS_ENV, "1")))
    except ValueError:
        threads = 1
    return threads, os.environ.get(PINNED_ENV) == "1"


def set_worker_threads(threads: int, pinned: bool = True) -> None:
    """Make ``threads`` this worker's count from now on (``client.run`` on an existing cluster)."""
    os.environ[THREADS_ENV] = str(int(threads))
    os.environ[PINNED_ENV] = "1" if pinned else "0"
    _limit_threads()


def _limit_threads() -> None:
    """The worker's share of the cores for BLAS/OpenMP/torch (:func:`worker_threads`): the cluster's
    parallelism is its workers, each with cores // workers threads.

    Without this, n workers × n cores threads oversubscribe the machine.  The
    environment variables matter for libraries imported later (torch reads
    them at import); ``torch.set_num_threads`` for a torch already imported.
    The chooser of small work (bnlab._threads) may lower the count further for
    a cell's tiny operators, unless the user fixed it (pinned).
    """
    global _threads_applied
    threads, pinned = worker_threads()
    import sys

    from bnlab import _threads

    if _threads_applied != (threads, pinned):
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            os.environ[var] = str(threads)
        _threads.pin_threads(threads if pinned else None, apply=False)
        _threads_applied = (threads, pinned)
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != threads:  # also after a cell that changed it
        torch.set_num_threads(threads)


def _jsonable(obj: Any) -> Any:
    # NumPy scalars/arrays and tuples become plain JSON values; anything else must already be one.
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (str, bool, int, float)) or obj is None:
        return obj
    tolist = getattr(obj, "tolist", None)  # numpy scalars and arrays, torch tensors
    if callable(tolist):
        if hasattr(obj, "detach"):
            obj = obj.detach().cpu()
            tolist = obj.tolist
        return _jsonable(tolist())
    raise TypeError(f"metric value {obj!r} of type {type(obj).__name__} is not JSON-serializable")


def jsonable_metrics(metrics: Any) -> dict:
    """``run_cell``'s return value as a JSON-ready dict (NaN/inf allowed); TypeError otherwise."""
    if not isinstance(metrics, dict):
        raise TypeError(f"run_cell must return a dict of metrics, returned {type(metrics).__name__}: {metrics!r}")
    out = _jsonable(metrics)
    json.dumps(out)  # fail here, on the worker, rather than in the driver's commit
    return out


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


def _worker_name() -> str:
    import sys

    distributed = sys.modules.get("distributed")  # never import it just to ask (serial mode stays light)
    if distributed is not None:
        try:
            w = distributed.get_worker()
            return f"{w.name}@{w.address}"
        except ValueError:  # not inside a worker
            pass
    return f"pid{os.getpid()}"


def _typed(cell: type | None, experiment: str, params: dict) -> Any:
    """``params`` parsed as the experiment's declared cell kind (:mod:`bnlab.experiments.cells`), or the
    dict itself for an experiment that declares none."""
    if cell is None:
        return params
    from bnlab.experiments.cells import parse_cell

    return parse_cell(cell, params, experiment=experiment)


def execute_cell(
    run_cell: Callable[[Any], dict], params: dict, limit_threads: bool = True, uses_gpu: bool = False,
    cell: type | None = None, experiment: str = "",
) -> dict:
    """Run ``run_cell(params)`` and return the outcome; exceptions become ``{"ok": False, "error": traceback}``.

    For a ``uses_gpu`` experiment whose cell has no ``"device"`` parameter,
    ``run_cell`` gets ``params["device"] = cell_device()`` (CUDA when present,
    else CPU); the device is not part of the cell's identity (its key) and is
    recorded in ``versions["device"]``.

    With ``cell`` (the experiment's declared :class:`~bnlab.experiments.cells.Cell` kind) the dict is
    parsed here, once, and ``run_cell`` gets the typed cell; a refused cell (its ``ValueError`` names
    ``experiment``, the key, the value and what is allowed) is a failed outcome like any exception.

    The returned dict has ``ok``, ``metrics`` or ``error``, ``started``,
    ``finished`` (ISO-8601 UTC), ``duration`` (seconds, monotonic clock),
    ``worker``, ``host``, ``pid`` and ``versions``.
    """
    if limit_threads:
        _limit_threads()
    started = _now()
    t0 = time.perf_counter()
    out: dict[str, Any]
    versions = library_versions()
    try:
        call_params = dict(params)
        if uses_gpu and "device" not in call_params:
            from bnlab.experiments.spec import cell_device

            call_params["device"] = versions["device"] = cell_device()
        metrics = jsonable_metrics(run_cell(_typed(cell, experiment, call_params)))
        out = {"ok": True, "metrics": metrics, "error": None}
    except Exception:  # a failing cell is a result, not a crash of the sweep
        out = {"ok": False, "metrics": None, "error": traceback.format_exc()}
    duration = time.perf_counter() - t0
    out.update(
        started=started,
        finished=_now(),
        duration=duration if math.isfinite(duration) else None,
        worker=_worker_name(),
        host=socket.gethostname(),
        pid=os.getpid(),
        versions=versions,
    )
    return out


def execute_group(
    run_group: Callable[[list[Any]], list[dict]], cells: list[dict], limit_threads: bool = True,
    uses_gpu: bool = False, cell: type | None = None, experiment: str = "",
) -> list[dict]:
    """Run ``run_group(cells)`` (cells trained together) and return one outcome per cell, in order.

    Each outcome is :func:`execute_cell`'s dict.  Every cell of the group gets the group's ``started``,
    ``finished``, worker and versions, and an equal share of its duration (so the durations of a
    sweep's cells still add up to the time spent).  When ``run_group`` raises, or returns anything but
    one metrics dict per cell, every cell of the group fails with that error.  With ``cell`` the dicts
    are parsed as in :func:`execute_cell` (one refused cell fails the group with its message).
    """
    if limit_threads:
        _limit_threads()
    started = _now()
    t0 = time.perf_counter()
    versions = library_versions()
    n = len(cells)
    try:
        call_cells = [dict(p) for p in cells]
        if uses_gpu:
            from bnlab.experiments.spec import cell_device

            device = cell_device()
            for p in call_cells:
                if "device" not in p:
                    p["device"] = versions["device"] = device
        results = run_group([_typed(cell, experiment, p) for p in call_cells])
        if not isinstance(results, (list, tuple)) or len(results) != n:
            raise TypeError(f"run_group must return a list of {n} metrics dicts (one per cell), returned "
                            f"{type(results).__name__}" + (f" of length {len(results)}"
                                                         if isinstance(results, (list, tuple)) else ""))
        outs = [{"ok": True, "metrics": jsonable_metrics(m), "error": None} for m in results]
    except Exception:  # a failing group is a result for each of its cells, not a crash of the sweep
        error = traceback.format_exc()
        outs = [{"ok": False, "metrics": None, "error": error} for _ in range(n)]
    duration = time.perf_counter() - t0
    share = duration / max(n, 1) if math.isfinite(duration) else None
    finished, worker, host = _now(), _worker_name(), socket.gethostname()
    for out in outs:
        out.update(started=started, finished=finished, duration=share, worker=worker, host=host, pid=os.getpid(),
                   versions=versions)
    return outs


@dataclass(frozen=True)
class TaskCheckpoint:
    """Where the trainers of one task keep their checkpoints (:mod:`bnlab._task_checkpoint`): ``directory``
    (the folder beside the store), the task's ``name`` (a hash of its cells' keys) and ``every`` (seconds
    between two saves)."""

    directory: str
    name: str
    every: float


def _checkpoint_folder(directory: str) -> bool:
    """Whether this worker can keep checkpoints in ``directory`` (created, mode 0700, if missing): a real
    folder, not a link.  On a worker that cannot (another machine without the store's file system, a
    planted link) the task runs without checkpoints and a warning says why."""
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        st = os.lstat(directory)
    except OSError as exc:
        warnings.warn(f"checkpoints of this task are not kept: {directory!r} cannot be created ({exc.strerror})",
                      RuntimeWarning, stacklevel=3)
        return False
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        warnings.warn(f"checkpoints of this task are not kept: {directory!r} is not a folder (a link or a file)",
                      RuntimeWarning, stacklevel=3)
        return False
    return True


def execute_task(
    run_cell: Callable[[Any], dict], run_group: Callable[[list[Any]], list[dict]] | None, cells: list[dict],
    limit_threads: bool = True, uses_gpu: bool = False, cell: type | None = None, experiment: str = "",
    checkpoint: TaskCheckpoint | None = None,
) -> list[dict]:
    """One task of a sweep: ``run_group(cells)`` for a group (:func:`execute_group`), else ``run_cell`` of its
    one cell (:func:`execute_cell`); a list of one outcome per cell either way.  ``cell`` and ``experiment``:
    the experiment's declared cell kind and its name (:attr:`bnlab.experiments.spec.Experiment.cell`).

    With ``checkpoint``, the trainers of the task that can resume (:func:`bnlab.nets.train_ensemble`,
    :func:`bnlab.nets.train`) save their state there while they run and go on from it when the task runs
    again after an interruption; once every cell of the task has succeeded, its checkpoints are removed (a
    failed task keeps them)."""
    if run_group is None and len(cells) != 1:
        raise ValueError(f"a task without run_group holds one cell, not {len(cells)}")
    from bnlab import _task_checkpoint

    keeps = checkpoint is not None and _checkpoint_folder(checkpoint.directory)
    scope = (_task_checkpoint.task_checkpoints(checkpoint.directory, checkpoint.name, checkpoint.every) if keeps
             else contextlib.nullcontext())
    with scope:
        if run_group is None:
            outcomes = [execute_cell(run_cell, cells[0], limit_threads, uses_gpu, cell, experiment)]
        else:
            outcomes = execute_group(run_group, cells, limit_threads, uses_gpu, cell, experiment)
    if keeps and all(o["ok"] for o in outcomes):
        _task_checkpoint.discard(checkpoint.directory, checkpoint.name)
    return outcomes
