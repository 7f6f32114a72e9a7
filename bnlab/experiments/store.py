"""The results store: one SQLite file per sweep, a finished cell committed once.

A sweep is an (experiment, scale) pair; its store holds one ``sweep`` row
(what was swept, with which library versions) and one ``cells`` row per cell
of the grid.  A cell is identified by its *key*, a stable hash of the
canonical JSON of its parameters (:func:`cell_key`), so the same parameters
always map to the same row however the grid is reordered or extended.

Guarantees
----------
* **Single writer.**  Only the process driving the sweep writes; it holds an
  exclusive ``flock`` on ``<store>.lock`` for as long as the store is open for
  writing.  The lock is released by the kernel when the process dies (even by
  ``kill -9``), so a crashed driver never blocks a resume.
* **A finished cell is committed once.**  ``record_done`` writes status,
  metrics, timings, worker and versions in one transaction, and only if the
  cell is not already ``done``; a done cell is never selected to run again.
* **Nothing finished is lost.**  The journal is in WAL mode with
  ``synchronous=NORMAL``: a committed transaction survives the death of the
  process (only a power loss or OS crash can lose the last transactions).
* **Nothing outside the store is touched.**  The lock file is opened with
  ``O_NOFOLLOW`` (a planted symlink is refused) and never truncated or written; the
  store is locked through its resolved path, so a symlinked alias takes the same
  lock; the driver's pid, host and start are kept in the store's ``driver`` table.
* **Only bnlab stores are opened.**  A directory, device, over-long path, a file that
  is not SQLite, another program's SQLite database (never given bnlab's tables), a
  corrupted file (``PRAGMA quick_check``) or a damaged one (a missing table, malformed
  JSON in a row) is refused with one ``ValueError`` naming the path;
  :func:`salvage_store` copies what is readable into a new store.
* **Interrupted cells run again.**  Cells left ``running`` by a killed driver
  are returned to ``pending`` when the store is next opened for writing
  (:meth:`ResultsStore.requeue_running`).

Schema (``PRAGMA user_version = 1``)
------------------------------------
``sweep``: ``id`` (always 1), ``experiment``, ``scale``, ``module`` (where the
experiment is defined, so a resume can find it), ``grid_hash``, ``n_cells``,
``created``, ``updated`` (ISO-8601 UTC), ``versions`` (JSON).

``cells``: ``key`` (primary key), ``idx`` (position in the grid), ``params``
(JSON), ``status`` (``pending`` | ``running`` | ``done`` | ``failed``),
``metrics`` (JSON or NULL), ``error`` (text or NULL), ``attempts`` (times
submitted), ``submitted``, ``started``, ``finished`` (ISO-8601 UTC),
``duration`` (seconds spent in ``run_cell``), ``worker``, ``host``,
``versions`` (JSON, measured on the worker).
"""
from __future__ import annotations

import datetime as _dt
import errno
import fcntl
import hashlib
import json
import math
import os
import socket
import sqlite3
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from bnlab._validation import check_path
from bnlab.experiments.spec import SCALES, Record

__all__ = ["ResultsStore", "CellRow", "cell_key", "grid_hash", "canonical_json", "STATUSES", "salvage_store"]

STATUSES = ("pending", "running", "done", "failed")
_SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sweep (
    id          INTEGER PRIMARY KEY CHECK (id = 1),
    experiment  TEXT NOT NULL,
    scale       TEXT NOT NULL,
    module      TEXT,
    grid_hash   TEXT NOT NULL,
    n_cells     INTEGER NOT NULL,
    created     TEXT NOT NULL,
    updated     TEXT NOT NULL,
    versions    TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS cells (
    key         TEXT PRIMARY KEY,
    idx         INTEGER NOT NULL,
    params      TEXT NOT NULL,
    status      TEXT NOT NULL CHECK (status IN ('pending', 'running', 'done', 'failed')),
    metrics     TEXT,
    error       TEXT,
    attempts    INTEGER NOT NULL DEFAULT 0,
    submitted   TEXT,
    started     TEXT,
    finished    TEXT,
    duration    REAL,
    worker      TEXT,
    host        TEXT,
    versions    TEXT
);
CREATE INDEX IF NOT EXISTS cells_status ON cells (status);
CREATE TABLE IF NOT EXISTS driver (
    id          INTEGER PRIMARY KEY CHECK (id = 1),
    pid         INTEGER NOT NULL,
    host        TEXT NOT NULL,
    started     TEXT NOT NULL
);
"""

_COLUMNS = {
    "sweep": {"id", "experiment", "scale", "module", "grid_hash", "n_cells", "created", "updated", "versions"},
    "cells": {"key", "idx", "params", "status", "metrics", "error", "attempts", "submitted", "started", "finished",
              "duration", "worker", "host", "versions"},
}

_SALVAGE = (
    "Salvage its finished cells into a new store with:  bnlab sweep salvage STORE NEW.sqlite  "
    "(then continue with: bnlab sweep resume NEW.sqlite)"
)

def _resolved(path: Path) -> Path:
    """``path`` with symlinks and ``..`` resolved (the parent when the file does not exist yet)."""
    return Path(os.path.realpath(path))


def _uri_path(path: Path) -> str:
    from urllib.parse import quote

    return quote(str(path))


def _corrupt(path: Path, exc: BaseException) -> ValueError:
    return ValueError(f"{str(path)!r} is a corrupted or unreadable results store ({exc}). {_SALVAGE}")


def _check_store_path(path: Path, *, readonly: bool) -> None:
    """Refuse directories, devices, links to nothing, over-long paths and unwritable folders (ValueError).

    :func:`bnlab._validation.check_path` does the checking; a dangling link that aliases a store
    another driver is creating right now is that driver's, which the message says first.
    """
    if os.path.islink(path) and not os.path.exists(path):
        _refuse_if_locked(Path(os.path.realpath(path)), str(path))
    check_path("store", path, readonly=readonly, expected="a path to a .sqlite file")


#: How a lock file is opened to probe it: never through a link, and without blocking (a FIFO planted at
#: ``<store>.lock`` would otherwise hang the open until something writes to it — ``sweep status`` too).
_LOCK_PROBE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def _refuse_irregular_lock(fd: int, lock_path: Path) -> None:
    """``ValueError`` (closing ``fd``) if the opened lock file is not a regular file (a FIFO, a device)."""
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"lock file {str(lock_path)!r} is not a regular file; remove it")


def _refuse_if_locked(real: Path, text: str) -> None:
    """``ValueError`` if a live driver holds ``<real>.lock`` (probed without creating anything)."""
    lock_path = real.with_name(real.name + ".lock")
    try:
        fd = os.open(lock_path, _LOCK_PROBE_FLAGS)
    except OSError:
        return
    try:
        _refuse_irregular_lock(fd, lock_path)
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ValueError(
            f"results store {text!r} is being written by another running sweep (its lock is held); wait for it "
            "or stop it first"
        ) from None
    finally:
        os.close(fd)


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


def canonical_json(obj: Any) -> str:
    """JSON with sorted keys and no whitespace: equal parameters give equal text.

    Raises ``ValueError`` for values JSON cannot represent exactly (NumPy
    scalars, sets, non-finite floats), because such a value would make the
    cell key ambiguous.
    """
    try:
        return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"cell parameters must be JSON-serializable with finite floats (use int/float/str/bool/list/dict), "
            f"got {obj!r}: {exc}"
        ) from None


def cell_key(params: Mapping[str, Any]) -> str:
    """Stable identity of a cell: the first 32 hex digits of SHA-256 of its canonical JSON."""
    if not isinstance(params, Mapping):
        raise ValueError(f"a cell's parameters must be a dict, got {type(params).__name__}: {params!r}")
    return hashlib.sha256(canonical_json(dict(params)).encode()).hexdigest()[:32]


def grid_hash(keys: Iterable[str]) -> str:
    """Hash of the set of cell keys (order-independent)."""
    return hashlib.sha256("\n".join(sorted(keys)).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class CellRow:
    """One row of the ``cells`` table, decoded."""

    key: str
    idx: int
    params: dict
    status: str
    metrics: dict | None
    error: str | None
    attempts: int
    submitted: str | None
    started: str | None
    finished: str | None
    duration: float | None
    worker: str | None
    host: str | None
    versions: dict | None

    def to_record(self) -> Record:
        return Record(params=self.params, metrics=self.metrics or {})


class _Damaged(ValueError):
    """Malformed content in a store (a damaged or hand-edited file)."""


def _decode(row: sqlite3.Row) -> CellRow:
    """Decode one row, refusing malformed content (a damaged or hand-edited store) with a ValueError."""
    key = row["key"]

    def j(column, kind=dict):
        text = row[column]
        if text is None:
            return None
        try:
            value = json.loads(text)
        except (TypeError, ValueError) as exc:
            raise _Damaged(f"cell {key!r}: column {column} is not valid JSON ({exc})") from None
        if not isinstance(value, kind):
            raise _Damaged(f"cell {key!r}: column {column} holds {text[:60]!r}, expected a JSON object")
        return value

    params = j("params")
    if params is None:
        raise _Damaged(f"cell {key!r}: its params are missing")
    if row["status"] not in STATUSES:
        raise _Damaged(f"cell {key!r}: status {row['status']!r} is not one of {STATUSES}")
    metrics = j("metrics")
    if row["status"] == "done" and metrics is None:  # record_done always writes a JSON object
        raise _Damaged(f"cell {key!r}: it is done but its metrics are missing")
    return CellRow(
        key=key,
        idx=row["idx"],
        params=params,
        status=row["status"],
        metrics=metrics,
        error=row["error"],
        attempts=row["attempts"],
        submitted=row["submitted"],
        started=row["started"],
        finished=row["finished"],
        duration=row["duration"],
        worker=row["worker"],
        host=row["host"],
        versions=j("versions"),
    )


def _guarded(method):
    """Turn SQLite errors and malformed rows met while reading into one clear ValueError naming the store."""
    import functools

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except sqlite3.Error as exc:
            raise _corrupt(self.path, exc) from None
        except ValueError as exc:
            if isinstance(exc, _Damaged):
                raise ValueError(f"{str(self.path)!r} is a damaged results store: {exc}. {_SALVAGE}") from None
            raise

    return wrapper


class ResultsStore:
    """One sweep's SQLite file.

    Parameters
    ----------
    path:
        The ``.sqlite`` file (created with its parent directory when
        ``readonly`` is false).
    readonly:
        Open for reading only (``bnlab sweep status``/``export``, or while
        another process drives the sweep).  A read-only store takes no lock.

    Raises
    ------
    ValueError
        When ``readonly`` and the file does not exist, when the file is not a
        bnlab store, or when another live process holds the writer lock.
    """

    def __init__(self, path: str | os.PathLike, *, readonly: bool = False):
        self.path = Path(path)
        self.readonly = bool(readonly)
        self._lock_fd: int | None = None
        self._conn = None
        _check_store_path(self.path, readonly=self.readonly)
        # The store is identified by its resolved path: an alias through a symlink (or `a/../b`)
        # takes the same lock as the real path, so it cannot escape the single-writer rule.
        self.real_path = _resolved(self.path)
        try:
            self._check_side_files()
            if self.readonly:
                self._conn = sqlite3.connect(f"file:{_uri_path(self.real_path)}?mode=ro", uri=True, timeout=30.0)
            else:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._acquire_lock()
                self._create_side_files()
                self._conn = sqlite3.connect(str(self.real_path), timeout=30.0)
            self._conn.row_factory = sqlite3.Row
            self._check_contents()
            if not self.readonly:
                self._conn.execute("PRAGMA journal_mode=WAL")
                self._conn.execute("PRAGMA synchronous=NORMAL")
                with self._conn:
                    self._conn.executescript(_SCHEMA)
                    self._conn.execute(f"PRAGMA user_version = {_SCHEMA_VERSION}")
                self._record_driver()
        except sqlite3.Error as exc:
            self.close()
            raise _corrupt(self.path, exc) from None
        except BaseException:
            self.close()
            raise

    def _check_side_files(self) -> None:
        """Refuse a store whose SQLite side files (``-wal``, ``-shm``, ``-journal``) are links or not files.

        SQLite opens them with plain ``open()``, which follows a symbolic link: a link planted at
        ``<store>-wal`` or ``-shm`` would make it write journal pages or shared memory into the file the
        link points to.  A writer then creates the ``-wal`` and ``-shm`` files itself, with ``O_NOFOLLOW``
        and while it holds the lock, so none can be planted between this check and SQLite's open.
        """
        for suffix in ("-wal", "-shm", "-journal"):
            side = self.real_path.with_name(self.real_path.name + suffix)
            try:
                st = os.lstat(side)
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise ValueError(f"cannot check the store's side file {str(side)!r}: {exc.strerror}") from None
            if stat.S_ISLNK(st.st_mode):
                raise ValueError(
                    f"the store's side file {str(side)!r} is a symbolic link; bnlab does not follow it "
                    "(remove it if you did not create it)"
                )
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"the store's side file {str(side)!r} is not a regular file; remove it")

    def _create_side_files(self) -> None:
        """Create ``-wal`` and ``-shm`` (empty, ``O_NOFOLLOW``) before SQLite does (see :meth:`_check_side_files`)."""
        for suffix in ("-wal", "-shm"):
            side = self.real_path.with_name(self.real_path.name + suffix)
            try:
                fd = os.open(side, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise ValueError(
                        f"the store's side file {str(side)!r} is a symbolic link; bnlab does not follow it "
                        "(remove it if you did not create it)"
                    ) from None
                raise ValueError(f"cannot create the store's side file {str(side)!r}: {exc.strerror}") from None
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise ValueError(f"the store's side file {str(side)!r} is not a regular file; remove it")
            finally:
                os.close(fd)

    def _check_contents(self) -> None:
        """Refuse files that are not SQLite, foreign databases and corrupted stores (clear ValueErrors)."""
        conn = self._conn
        size = self.real_path.stat().st_size if self.real_path.exists() else 0
        if size == 0:
            if self.readonly:
                raise ValueError(f"{str(self.path)!r} is not a bnlab results store: the file is empty")
            return  # a new store
        with open(self.real_path, "rb") as f:
            header = f.read(16)
        if header != b"SQLite format 3\x00":
            raise ValueError(
                f"{str(self.path)!r} is not a bnlab results store: not an SQLite database "
                f"(it starts with {header[:16]!r}); give another --store path"
            )
        check = conn.execute("PRAGMA quick_check(5)").fetchall()
        if [tuple(r) for r in check] != [("ok",)]:
            problems = "; ".join(str(r[0]) for r in check)
            raise ValueError(f"{str(self.path)!r} is a corrupted results store ({problems}). {_SALVAGE}")
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if version == 0 and not tables:
            if self.readonly:
                raise ValueError(f"{str(self.path)!r} is not a bnlab results store: it holds no tables")
            return  # an empty database: it becomes a store
        if version != _SCHEMA_VERSION:
            if version == 0:
                raise ValueError(
                    f"{str(self.path)!r} is not a bnlab results store: an SQLite database with other tables "
                    f"({', '.join(sorted(tables)) or 'none'}); bnlab does not add its tables to another "
                    "database, give another --store path"
                )
            raise ValueError(f"{str(self.path)!r} has store schema version {version}; this bnlab reads {_SCHEMA_VERSION}")
        missing = {"sweep", "cells"} - tables
        if missing:
            raise ValueError(
                f"{str(self.path)!r} is a damaged results store: table(s) {', '.join(sorted(missing))} missing. {_SALVAGE}"
            )
        for table, wanted in _COLUMNS.items():
            have = {r[1] for r in conn.execute(f"PRAGMA table_info({table})")}
            if not wanted <= have:
                raise ValueError(
                    f"{str(self.path)!r} is a damaged results store: table {table} lacks column(s) "
                    f"{', '.join(sorted(wanted - have))}. {_SALVAGE}"
                )

    def _record_driver(self) -> None:
        """Note this process as the store's driver (pid, host, start): ``sweep status`` reports it."""
        with self._conn:
            self._conn.execute(
                "INSERT OR REPLACE INTO driver (id, pid, host, started) VALUES (1, ?, ?, ?)",
                (os.getpid(), socket.gethostname(), _now()),
            )

    # -- lifecycle -----------------------------------------------------------
    def _lock_path(self) -> Path:
        return self.real_path.with_name(self.real_path.name + ".lock")

    def _acquire_lock(self) -> None:
        lock_path = self._lock_path()
        # O_NOFOLLOW: a symlink planted at <store>.lock is refused, never followed; the lock file is
        # never truncated or written (the driver's pid lives in the store), so even a planted hard
        # link cannot make bnlab overwrite another file.
        try:
            fd = os.open(lock_path, _LOCK_PROBE_FLAGS | os.O_CREAT, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise ValueError(
                    f"lock file {str(lock_path)!r} is a symbolic link; bnlab does not follow it "
                    "(remove it if you did not create it)"
                ) from None
            raise ValueError(f"cannot create the lock file {str(lock_path)!r}: {exc.strerror}") from None
        _refuse_irregular_lock(fd, lock_path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ValueError(
                f"results store {str(self.path)!r} is being written by another running sweep "
                f"(lock {str(lock_path)!r} is held); wait for it or stop it first"
            ) from None
        self._lock_fd = fd

    def writer_alive(self) -> bool:
        """Whether some process holds this store's writer lock now (a live driver).

        Probed without creating anything: no lock file means no driver; otherwise a
        non-blocking ``flock`` that succeeds (and is released at once) means the
        driver that held it is gone (killed: its cells left ``running`` are stale).
        """
        if self._lock_fd is not None:
            return True
        try:
            fd = os.open(self._lock_path(), _LOCK_PROBE_FLAGS)
        except OSError:
            return False
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # not a lock any driver holds (a run refuses it)
            os.close(fd)
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # closing releases a lock we may have taken
        return False

    def driver_info(self) -> dict | None:
        """The last driver recorded in the store (``pid``, ``host``, ``started``), or None."""
        try:
            row = self._conn.execute("SELECT pid, host, started FROM driver WHERE id = 1").fetchone()
        except sqlite3.OperationalError:  # a store written before the driver table existed
            return None
        return None if row is None else dict(row)

    def close(self) -> None:
        conn = getattr(self, "_conn", None)
        if conn is not None:
            conn.close()
            self._conn = None
        if getattr(self, "_lock_fd", None) is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> "ResultsStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _writable(self) -> sqlite3.Connection:
        if self.readonly:
            raise ValueError(f"results store {str(self.path)!r} was opened read-only")
        if self._conn is None:
            raise ValueError(f"results store {str(self.path)!r} is closed")
        return self._conn

    # -- the sweep row -------------------------------------------------------
    @_guarded
    def sweep_info(self) -> dict | None:
        """The ``sweep`` row as a dict (``versions`` decoded), or None for a new store."""
        row = self._conn.execute("SELECT * FROM sweep WHERE id = 1").fetchone()
        if row is None:
            return None
        info = dict(row)
        try:
            info["versions"] = json.loads(info["versions"])
        except (TypeError, ValueError):
            raise _Damaged("the sweep row's versions are not valid JSON") from None
        if not isinstance(info["experiment"], str) or info["scale"] not in SCALES:
            raise _Damaged(f"the sweep row names experiment {info['experiment']!r} at scale {info['scale']!r}")
        return info

    @_guarded
    def initialize(
        self,
        experiment: str,
        scale: str,
        cells: Sequence[Mapping[str, Any]],
        *,
        module: str | None = None,
        versions: Mapping[str, Any] | None = None,
    ) -> list[str]:
        """Declare the sweep and its grid; return the cell keys in grid order.

        A new store gets the sweep row and one ``pending`` row per cell.  An
        existing store must belong to the same experiment and scale; cells of
        the grid it does not hold yet are added as ``pending`` (the grid grew
        or changed) and finished cells are kept whatever the grid says, so
        changing a grid never loses results.  Two cells with equal parameters
        are an error (they would be one cell).
        """
        conn = self._writable()
        keys = [cell_key(p) for p in cells]
        seen: dict[str, int] = {}
        for i, k in enumerate(keys):
            if k in seen:
                raise ValueError(
                    f"grid cells {seen[k]} and {i} have identical parameters {dict(cells[i])!r}; "
                    f"give them different seeds or parameters"
                )
            seen[k] = i
        info = self.sweep_info()
        if info is not None and (info["experiment"], info["scale"]) != (experiment, scale):
            raise ValueError(
                f"results store {str(self.path)!r} holds sweep {info['experiment']!r} at scale {info['scale']!r}, "
                f"not {experiment!r} at scale {scale!r}"
            )
        now = _now()
        ghash = grid_hash(keys)
        with conn:
            if info is None:
                conn.execute(
                    "INSERT INTO sweep (id, experiment, scale, module, grid_hash, n_cells, created, updated, versions) "
                    "VALUES (1, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (experiment, scale, module, ghash, len(keys), now, now, json.dumps(dict(versions or {}))),
                )
            else:
                conn.execute(
                    "UPDATE sweep SET grid_hash = ?, n_cells = ?, updated = ?, module = COALESCE(?, module) WHERE id = 1",
                    (ghash, len(keys), now, module),
                )
            conn.executemany(
                "INSERT INTO cells (key, idx, params, status) VALUES (?, ?, ?, 'pending') "
                "ON CONFLICT (key) DO UPDATE SET idx = excluded.idx",
                [(k, i, canonical_json(dict(p))) for i, (k, p) in enumerate(zip(keys, cells))],
            )
        return keys

    # -- state transitions (driver only) -------------------------------------
    @_guarded
    def requeue_running(self) -> int:
        """Return cells left ``running`` (by a killed or interrupted driver) to ``pending``; return how many."""
        conn = self._writable()
        with conn:
            cur = conn.execute("UPDATE cells SET status = 'pending' WHERE status = 'running'")
        return cur.rowcount

    @_guarded
    def requeue_failed(self, keys: Iterable[str] | None = None) -> int:
        """Return ``failed`` cells (all, or those in ``keys``) to ``pending`` so they run again."""
        conn = self._writable()
        with conn:
            if keys is None:
                cur = conn.execute("UPDATE cells SET status = 'pending' WHERE status = 'failed'")
            else:
                cur = conn.executemany(
                    "UPDATE cells SET status = 'pending' WHERE status = 'failed' AND key = ?", [(k,) for k in keys]
                )
        return cur.rowcount

    @_guarded
    def mark_submitted(self, keys: Sequence[str]) -> None:
        """``pending`` → ``running`` for cells handed to the cluster (one transaction), counting an attempt."""
        conn = self._writable()
        now = _now()
        with conn:
            conn.executemany(
                "UPDATE cells SET status = 'running', attempts = attempts + 1, submitted = ? "
                "WHERE key = ? AND status = 'pending'",
                [(now, k) for k in keys],
            )

    def record_done(self, key: str, metrics: Mapping[str, Any], **meta: Any) -> bool:
        """Commit a finished cell in one transaction; return False if it was already done.

        ``meta`` may hold ``started``, ``finished``, ``duration``, ``worker``,
        ``host``, ``versions``.
        """
        return self._finish(key, "done", json.dumps(dict(metrics)), None, meta)

    def record_failed(self, key: str, error: str, **meta: Any) -> bool:
        """Commit a cell whose ``run_cell`` raised (or whose worker kept dying), with its error text."""
        return self._finish(key, "failed", None, str(error), meta)

    @_guarded
    def _finish(self, key: str, status: str, metrics: str | None, error: str | None, meta: Mapping) -> bool:
        conn = self._writable()
        unknown = set(meta) - {"started", "finished", "duration", "worker", "host", "versions"}
        if unknown:
            raise ValueError(f"unknown cell metadata {sorted(unknown)}")
        duration = meta.get("duration")
        if duration is not None and not math.isfinite(float(duration)):
            duration = None
        versions = meta.get("versions")
        with conn:
            cur = conn.execute(
                "UPDATE cells SET status = ?, metrics = ?, error = ?, started = ?, finished = ?, duration = ?, "
                "worker = ?, host = ?, versions = ? WHERE key = ? AND status != 'done'",
                (
                    status,
                    metrics,
                    error,
                    meta.get("started"),
                    meta.get("finished") or _now(),
                    None if duration is None else float(duration),
                    meta.get("worker"),
                    meta.get("host"),
                    None if versions is None else json.dumps(dict(versions)),
                    key,
                ),
            )
        return cur.rowcount == 1

    # -- queries -------------------------------------------------------------
    @_guarded
    def counts(self, keys: Sequence[str] | None = None) -> dict[str, int]:
        """Number of cells per status (every status present, zeros included)."""
        out = dict.fromkeys(STATUSES, 0)
        if keys is None:
            rows = self._conn.execute("SELECT status, COUNT(*) FROM cells GROUP BY status").fetchall()
            for status, n in rows:
                out[status] = n
        else:
            for row in self.cells(keys=keys):
                out[row.status] += 1
        return out

    @_guarded
    def cells(self, status: str | Sequence[str] | None = None, keys: Sequence[str] | None = None) -> list[CellRow]:
        """Decoded rows in grid order, optionally only those with ``status`` and/or in ``keys``."""
        sql = "SELECT * FROM cells"
        args: list[Any] = []
        where = []
        if status is not None:
            statuses = [status] if isinstance(status, str) else list(status)
            bad = [s for s in statuses if s not in STATUSES]
            if bad:
                raise ValueError(f"status must be one of {STATUSES}, got {bad}")
            where.append(f"status IN ({','.join('?' * len(statuses))})")
            args += statuses
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY idx, key"
        rows = [_decode(r) for r in self._conn.execute(sql, args).fetchall()]
        if keys is not None:
            wanted = set(keys)
            rows = [r for r in rows if r.key in wanted]
        return rows

    @_guarded
    def records(self, keys: Sequence[str] | None = None) -> list[Record]:
        """The finished cells as :class:`~bnlab.experiments.spec.Record` (grid order)."""
        return [r.to_record() for r in self.cells(status="done", keys=keys)]


def salvage_store(source: str | os.PathLike, target: str | os.PathLike) -> dict:
    """Copy every readable finished cell of a damaged store into a new store; return counts.

    Reads ``source`` read-only and row by row (a range of rows that fails to read is
    split until the unreadable rows are isolated), keeps the ``done`` cells whose
    params and metrics decode, and writes them to ``target`` (which must not exist) with
    the sweep's experiment and scale.  ``bnlab sweep resume TARGET`` then runs only the
    cells that were lost or unfinished.  Returns ``{"experiment", "scale", "recovered",
    "unreadable"}``.
    """
    src, dst = Path(source), Path(target)
    _check_store_path(src, readonly=True)
    if dst.exists() or dst.is_symlink():
        raise ValueError(f"target={str(dst)!r} is not allowed: it exists; salvage writes a new store")
    conn = sqlite3.connect(f"file:{_uri_path(_resolved(src))}?mode=ro", uri=True)
    conn.row_factory = sqlite3.Row
    try:
        try:
            info = conn.execute("SELECT experiment, scale, module, versions FROM sweep WHERE id = 1").fetchone()
        except sqlite3.Error as exc:
            raise ValueError(f"{str(src)!r}: the sweep row cannot be read ({exc}); nothing to salvage") from None
        if info is None or info["scale"] not in SCALES:
            raise ValueError(f"{str(src)!r}: no readable sweep row; nothing to salvage")
        good: list[CellRow] = []
        unreadable = 0

        def read(lo: int, hi: int) -> None:
            nonlocal unreadable
            try:
                rows = conn.execute("SELECT * FROM cells WHERE rowid BETWEEN ? AND ? AND status = 'done'",
                                    (lo, hi)).fetchall()
            except sqlite3.Error:
                if lo == hi:
                    unreadable += 1
                    return
                mid = (lo + hi) // 2
                read(lo, mid)
                read(mid + 1, hi)
                return
            for r in rows:
                try:
                    good.append(_decode(r))
                except (ValueError, IndexError, KeyError):
                    unreadable += 1

        try:
            top = conn.execute("SELECT max(rowid) FROM cells").fetchone()[0] or 0
        except sqlite3.Error:
            top = 1 << 20  # the b-tree's right edge is unreadable: probe a generous range
        for lo in range(1, top + 1, 4096):
            read(lo, min(top, lo + 4095))
    finally:
        conn.close()
    with ResultsStore(dst) as out:
        keys = out.initialize(info["experiment"], info["scale"], [r.params for r in good], module=info["module"])
        for key, row in zip(keys, good):
            out.record_done(key, row.metrics or {}, started=row.started, finished=row.finished,
                            duration=row.duration, worker=row.worker, host=row.host, versions=row.versions)
    return {"experiment": info["experiment"], "scale": info["scale"], "recovered": len(good),
            "unreadable": unreadable}
