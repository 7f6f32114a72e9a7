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
import fcntl
import hashlib
import json
import math
import os
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from bnlab.experiments.spec import Record

__all__ = ["ResultsStore", "CellRow", "cell_key", "grid_hash", "canonical_json", "STATUSES"]

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
"""


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


def _decode(row: sqlite3.Row) -> CellRow:
    def j(text):
        return None if text is None else json.loads(text)

    return CellRow(
        key=row["key"],
        idx=row["idx"],
        params=json.loads(row["params"]),
        status=row["status"],
        metrics=j(row["metrics"]),
        error=row["error"],
        attempts=row["attempts"],
        submitted=row["submitted"],
        started=row["started"],
        finished=row["finished"],
        duration=row["duration"],
        worker=row["worker"],
        host=row["host"],
        versions=j(row["versions"]),
    )


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
        if self.readonly:
            if not self.path.is_file():
                raise ValueError(f"results store {str(self.path)!r} does not exist")
            self._conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=30.0)
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._acquire_lock()
            self._conn = sqlite3.connect(str(self.path), timeout=30.0)
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
        self._conn.row_factory = sqlite3.Row
        if not self.readonly:
            version = self._conn.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, _SCHEMA_VERSION):
                self.close()
                raise ValueError(f"{str(self.path)!r} has store schema version {version}; this bnlab reads {_SCHEMA_VERSION}")
            with self._conn:
                self._conn.executescript(_SCHEMA)
                self._conn.execute(f"PRAGMA user_version = {_SCHEMA_VERSION}")
        else:
            try:
                self._conn.execute("SELECT 1 FROM sweep LIMIT 1").fetchall()
            except sqlite3.DatabaseError as exc:
                self.close()
                raise ValueError(f"{str(self.path)!r} is not a bnlab results store: {exc}") from None

    # -- lifecycle -----------------------------------------------------------
    def _acquire_lock(self) -> None:
        lock_path = self.path.with_name(self.path.name + ".lock")
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ValueError(
                f"results store {str(self.path)!r} is being written by another running sweep "
                f"(lock {str(lock_path)!r} is held); wait for it or stop it first"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    def close(self) -> None:
        conn = getattr(self, "_conn", None)
        if conn is not None:
            conn.close()
            self._conn = None
        if self._lock_fd is not None:
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
    def sweep_info(self) -> dict | None:
        """The ``sweep`` row as a dict (``versions`` decoded), or None for a new store."""
        row = self._conn.execute("SELECT * FROM sweep WHERE id = 1").fetchone()
        if row is None:
            return None
        info = dict(row)
        info["versions"] = json.loads(info["versions"])
        return info

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
    def requeue_running(self) -> int:
        """Return cells left ``running`` (by a killed or interrupted driver) to ``pending``; return how many."""
        conn = self._writable()
        with conn:
            cur = conn.execute("UPDATE cells SET status = 'pending' WHERE status = 'running'")
        return cur.rowcount

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

    def records(self, keys: Sequence[str] | None = None) -> list[Record]:
        """The finished cells as :class:`~bnlab.experiments.spec.Record` (grid order)."""
        return [r.to_record() for r in self.cells(status="done", keys=keys)]
