"""Where a trainer inside one task of a sweep keeps its checkpoint (issue 27: paper-scale tasks resume mid-task).

The results store commits whole cells, so a task interrupted before it finishes (a batch job's time
limit, a killed worker, Ctrl-C) would start over.  Around each task the engine (``bnlab.experiments``)
names a folder, the task and how often to save (:func:`task_checkpoints`); a trainer that can resume
(:func:`bnlab.nets.train_ensemble`, :func:`bnlab.nets.train`) asks :func:`claim` for its file — the n-th
trainer call of the task gets ``<folder>/<task>-<n>.pt``, so a task that trains several times in turn
resumes each — and the
engine removes the task's files once it has finished (:func:`discard`).  Shared by both parts, like
:mod:`bnlab._run_length`: neither imports the other.
"""
from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from typing import Iterator

__all__ = ["task_checkpoints", "claim", "discard", "kept", "DEFAULT_EVERY"]

#: seconds between two saves of a task's trainer, unless the sweep says otherwise: a task shorter than
#: this (every task at the ``small`` scale on a CPU, most at ``paper`` scale on a GPU) never writes one
DEFAULT_EVERY = 300.0

_state = threading.local()


@contextlib.contextmanager
def task_checkpoints(directory: str | os.PathLike, task: str, every: float) -> Iterator[None]:
    """Within it (in this thread), trainers keep their checkpoints in ``directory`` under the name ``task``,
    saving every ``every`` seconds.  Nested uses restore the outer one on exit, also after an exception."""
    before = getattr(_state, "slot", None)
    _state.slot = [Path(directory), str(task), float(every), 0]
    try:
        yield
    finally:
        _state.slot = before


def claim() -> tuple[Path, float] | None:
    """The checkpoint file and save interval of the next trainer call within :func:`task_checkpoints`, or
    None outside it."""
    slot = getattr(_state, "slot", None)
    if slot is None:
        return None
    directory, task, every, n = slot
    slot[3] = n + 1
    return directory / f"{task}-{n}.pt", every


def discard(directory: str | os.PathLike, task: str) -> int:
    """Remove the checkpoints of ``task`` in ``directory`` (and temporary files a killed save left); links
    are removed, never followed.  Returns how many files went."""
    removed = 0
    folder = Path(directory)
    for pattern in (f"{task}-*.pt", f".{task}-*.pt.*.tmp.pt"):
        for p in folder.glob(pattern):
            try:
                os.unlink(p)
                removed += 1
            except (FileNotFoundError, IsADirectoryError, PermissionError):
                pass
    return removed


def kept(directory: str | os.PathLike) -> list[dict]:
    """The checkpoints kept in ``directory`` (a sweep's ``<store>.checkpoints``): per file its name, size in
    bytes and when it was last saved (UTC, ISO 8601), newest first; [] where there is no such folder.  Only
    regular files named as :func:`claim` names them are listed — nothing is read or followed (a link or a
    temporary file a killed save left is not a checkpoint a task resumes from)."""
    import datetime
    import stat

    folder = Path(directory)
    out = []
    try:
        entries = list(os.scandir(folder)) if folder.is_dir() and not folder.is_symlink() else []
    except OSError:
        return []
    for entry in entries:
        if entry.name.startswith(".") or not entry.name.endswith(".pt"):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        saved = datetime.datetime.fromtimestamp(st.st_mtime, datetime.timezone.utc)
        out.append({"file": entry.name, "bytes": st.st_size, "saved": saved.isoformat(timespec="seconds")})
    return sorted(out, key=lambda d: d["saved"], reverse=True)
