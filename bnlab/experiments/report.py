"""The report: every reproduction's claim, figure and paper-vs-bnlab table on one self-contained HTML page.

:func:`build_report` runs (or reuses from the results stores) the sweep of
each registered reproduction at one scale, calls its ``plot`` and
``compare``, and writes ``<out>/index.html``.  Each section gets a *verdict*
computed from its comparison rows (:func:`verdict`): ``reproduced`` (every
checked row agrees), ``partly``, ``not_reproduced``, ``not_judged`` (no row
could be judged at this scale, each with its reason), ``skipped`` (the cells
cannot run on this machine, with the reason) or ``error`` (the sweep, plot or
table failed); the run status (did the cells run) is reported beside it.  The page loads nothing from
the network: the CSS is inline and every figure is embedded as a ``data:``
URI (the PNG/SVG files also stay in ``<out>/figures/<name>/``).  A
reproduction whose module fails to import, whose grid raises, whose cells
fail, or whose ``plot``/``compare`` raises is shown with its error; it never
stops the report.  ``<out>/report.json`` holds the same content for scripts.
"""
from __future__ import annotations

import base64
import contextlib
import datetime as _dt
import hashlib
import inspect
import json
import os
import re
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any, Iterable, Sequence

from bnlab import _threads
from bnlab._validation import check_choice, check_real
from bnlab.experiments.registry import discovery_errors, get_experiment, list_experiments
from bnlab.experiments.spec import SCALES, VERDICTS, Comparison, Experiment, library_versions
from bnlab.experiments.store import ResultsStore, cell_key
from bnlab.experiments.sweep import (DEFAULT_CHECKPOINT_EVERY, grid_cells, open_client, run_grid, set_client_threads,
                                     store_path)

__all__ = ["build_report", "reproduce", "verdict", "ledger", "Report", "ReportSection", "VERDICTS"]

_MAX_FAILURES_SHOWN = 10
_MIME = {".png": "image/png", ".svg": "image/svg+xml", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".gif": "image/gif"}


@dataclass
class ReportSection:
    """One reproduction on the page."""

    name: str
    paper: str
    figure: str
    title: str
    claim: str
    status: str  # ok | partial (some cells failed) | failed (no figure or nothing done) | error | skipped
    total: int = 0
    done: int = 0
    failed: int = 0
    reused: int = 0
    store: str = ""
    figures: list[str] = field(default_factory=list)  # file paths
    comparisons: list[dict] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)  # {"what", "text"}
    notes: list[dict] = field(default_factory=list)  # {"what", "text"}: not errors (e.g. skipped cells)
    failures: list[dict] = field(default_factory=list)  # {"key", "params", "error"}
    verdict: str = "error"  # one of VERDICTS, from the comparison rows (see verdict())
    verdict_reason: str = ""
    settings: list[dict] = field(default_factory=list)  # {"what", "paper", "bnlab", "why"} at this scale
    checks: list[dict] = field(default_factory=list)  # {"name", "meaning"}
    limitations: str = ""
    figures_reused: bool = False  # the figures on disk were kept: same records, same plot code, same files


@dataclass
class Report:
    """What :func:`build_report` wrote."""

    index: Path
    scale: str
    sections: list[ReportSection]
    broken_modules: dict[str, str]
    seconds: float

    @property
    def ok(self) -> bool:
        """Every reproduction's cells ran (says nothing about agreement: see :attr:`all_reproduced`)."""
        return not self.broken_modules and all(s.status in ("ok", "skipped") for s in self.sections)

    @property
    def verdict_counts(self) -> dict[str, int]:
        """How many sections have each verdict (a module that failed to import counts as ``error``)."""
        counts = {v: 0 for v in VERDICTS}
        for s in self.sections:
            counts[s.verdict] += 1
        counts["error"] += len(self.broken_modules)
        return counts

    @property
    def all_reproduced(self) -> bool:
        """Every reproduction that is not skipped is ``reproduced`` (what ``bnlab report --strict`` checks)."""
        return not self.broken_modules and all(s.verdict in ("reproduced", "skipped") for s in self.sections)

    @property
    def not_reproduced(self) -> dict[str, str]:
        """What fails ``--strict``: each section that is neither reproduced nor skipped, with its verdict,
        and each reproduction module that failed to import (``error``)."""
        out = {s.name: s.verdict for s in self.sections if s.verdict not in ("reproduced", "skipped")}
        out.update(dict.fromkeys(self.broken_modules, "error"))
        return out


def verdict(status: str, comparisons: Sequence[dict], *, failed_cells: int = 0, skip_reason: str = "",
            errors: Sequence[dict] = ()) -> tuple[str, str]:
    """The verdict of a reproduction and its reason, from its run status and comparison rows.

    ``skipped`` when every cell was skipped (the reason is the cells' own); ``error`` when the sweep
    could not run, nothing finished, or there is no row (nothing to judge); ``not_judged`` when there are
    rows but none has a criterion at this scale (the reason: the rows' own, e.g. too close to call on the
    seeds run); otherwise by the rows whose ``agrees`` is not None: all agree → ``reproduced``, some →
    ``partly``, none → ``not_reproduced``.  A row too close to call (``too_close_to_call``) could have
    disagreed, so with one, all agreeing is only ``partly``.  A ``reproduced`` with failed cells or a
    failed plot/table is downgraded to ``partly`` (the rows then rest on part of the grid).
    """
    if status == "skipped":
        return "skipped", skip_reason or "every cell was skipped"
    if status in ("error", "failed") and not comparisons:
        what = "; ".join(e["what"] for e in errors) or "nothing finished"
        return "error", what
    judged = [c for c in comparisons if c.get("agrees") is not None]
    if not comparisons:
        return "error", "no comparison row: nothing to judge"
    if not judged:
        trouble = [e["what"] for e in errors] + ([f"{failed_cells} cells failed"] if failed_cells else [])
        if trouble or status in ("error", "failed"):
            return "error", "no comparison row could be judged, and " + ("; ".join(trouble) or f"the run {status}")
        # each distinct reason's head (before its first colon): the rows below the figure give the whole reason
        why = list(dict.fromkeys(str(c.get("reason") or "no criterion").split(":")[0] for c in comparisons))
        return "not_judged", f"none of {len(comparisons)} rows could be judged: " + "; ".join(why)
    n_ok = sum(bool(c["agrees"]) for c in judged)
    reason = f"{n_ok} of {len(judged)} checked rows agree"
    close = sum(bool(c.get("too_close_to_call")) for c in comparisons)
    if n_ok < len(judged):
        if close:
            reason += f" ({close} more too close to call)"
        return ("not_reproduced" if n_ok == 0 else "partly"), reason
    # a row too close to call was checked and could have disagreed: every judged row agreeing is not the claim
    caveats = ([f"{failed_cells} cell{'s' if failed_cells != 1 else ''} failed"] if failed_cells else []) + [
        e["what"] for e in errors] + ([f"{close} row{'s' if close != 1 else ''} too close to call"] if close else [])
    if caveats:
        return "partly", reason + ", but " + "; ".join(caveats)
    return "reproduced", reason


class _LazyClient:
    """A Dask client started on first use only (no cluster when every cell is in the stores)."""

    def __init__(self, stack: contextlib.ExitStack, client: Any, scheduler: str | None, workers: int | None,
                 threads: int | None = None):
        self._stack, self._client, self._scheduler, self._workers = stack, client, scheduler, workers
        self._threads = threads

    def __call__(self) -> Any:
        if self._client is None:
            self._client = self._stack.enter_context(open_client(self._scheduler, self._workers, self._threads))
        elif self._threads is not None and not getattr(self, "_threads_set", False):
            set_client_threads(self._client, self._threads)  # a client given by the caller
        self._threads_set = True
        return self._client


def _say(progress, text: str) -> None:
    """One progress line on stderr (or the given stream) when progress is on."""
    if progress is False or progress is None:
        return
    import sys

    stream = sys.stderr if progress is True else progress
    print(text, file=stream, flush=True)


def _anchor(name: str) -> str:
    return "exp-" + re.sub(r"[^A-Za-z0-9_-]+", "-", name)


def _data_uri(path: Path) -> str:
    mime = _MIME.get(path.suffix.lower())
    if mime is None:
        raise ValueError(f"figure {str(path)!r} is not PNG/SVG/JPEG/GIF")
    return f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode('ascii')}"


def _stored_rows(path: Path, keys: Sequence[str]) -> list | None:
    """The store's rows of ``keys`` (read-only, no lock taken), or None when there is no readable store
    (the sweep then opens it for writing and says what is wrong with it, if anything)."""
    if not path.is_file():
        return None
    try:
        with ResultsStore(path, readonly=True) as st:
            return st.cells(keys=list(keys))
    except ValueError:
        return None


def _needs_run(rows: list | None, keys: Sequence[str], retry_failed: bool) -> bool:
    """Whether ``rows`` (:func:`_stored_rows`) lack a committed outcome for some cell of ``keys``."""
    if rows is None:
        return True
    finished = {"done", "failed"} if not retry_failed else {"done"}
    return len(rows) < len(set(keys)) or any(r.status not in finished for r in rows)


def _section(
    exp: Experiment, scale: str, results_dir, outdir: Path, retry_failed: bool, get_client, serial: bool,
    progress, *, prepared: tuple[list[dict], list[str]] | None = None,
    checkpoint_every: float | None = DEFAULT_CHECKPOINT_EVERY,
) -> ReportSection:
    """Run or reuse one reproduction, plot and tabulate it, and judge it (:func:`verdict`); ``prepared``: its
    grid and cell keys, where the caller has computed them."""
    sec = _run_section(exp, scale, results_dir, outdir, retry_failed, get_client, serial, progress, prepared=prepared,
                       checkpoint_every=checkpoint_every)
    # one line for the verdict (the page and the terminal table show it inline): distinct reasons by "; "
    skip_reason = "; ".join(line for n in sec.notes if "skipped" in n["what"] for line in n["text"].splitlines())
    sec.verdict, sec.verdict_reason = verdict(sec.status, sec.comparisons, failed_cells=sec.failed,
                                              skip_reason=skip_reason, errors=sec.errors)
    return sec


def _run_section(
    exp: Experiment, scale: str, results_dir, outdir: Path, retry_failed: bool, get_client, serial: bool,
    progress, *, prepared: tuple[list[dict], list[str]] | None = None,
    checkpoint_every: float | None = DEFAULT_CHECKPOINT_EVERY,
) -> ReportSection:
    path = store_path(exp.name, scale, results_dir)
    sec = ReportSection(
        name=exp.name, paper=exp.paper, figure=exp.figure, title=exp.title, claim=exp.claim, status="ok",
        store=str(path),
        settings=[{"what": s.what, "paper": s.paper, "bnlab": s.at(scale), "why": s.why} for s in exp.settings],
        checks=[{"name": c.name, "meaning": c.meaning} for c in exp.checks],
        limitations=exp.limitations if scale != "paper" and isinstance(exp.limitations, str) else "",
    )
    try:
        # the grid and its keys once; the store opened once: read-only when every cell has an outcome,
        # else for writing by the sweep, whose final rows come back through that same handle (a store
        # that exists but lacks cells is looked at read-only first, then opened for the run)
        cells, keys = prepared if prepared is not None else (None, None)
        if cells is None:
            cells = grid_cells(exp, scale)
            keys = [cell_key(p) for p in cells]
        rows = _stored_rows(path, keys)
        if _needs_run(rows, keys, retry_failed):
            kwargs = {"serial": True} if serial else {"client": get_client()}
            summary, rows = run_grid(exp, scale, cells, path, retry_failed=retry_failed, progress=progress,
                                     checkpoint_every=checkpoint_every, **kwargs)
            sec.reused = summary.reused
        else:
            sec.reused = sum(r.status == "done" for r in rows)
    except KeyboardInterrupt:
        raise
    except (ValueError, OSError) as exc:
        # bad input (a store path that is a file, a planted link, ...) or the file system: the message says
        # what, a traceback would only hide it
        sec.status = "error"
        sec.errors.append({"what": "The sweep could not run.", "text": f"{type(exc).__name__}: {exc}"})
        return sec
    except Exception:
        sec.status = "error"
        sec.errors.append({"what": "The sweep could not run.", "text": traceback.format_exc()})
        return sec
    sec.total = len(keys)
    done = [r for r in rows if r.status == "done"]
    failed = [r for r in rows if r.status == "failed"]
    sec.done, sec.failed = len(done), len(failed)
    sec.failures = [{"key": r.key, "params": r.params, "error": r.error or ""} for r in failed]
    records = [r.to_record() for r in done]
    figdir = outdir / "figures" / re.sub(r"[^A-Za-z0-9_.-]+", "_", exp.name)
    figdir.mkdir(parents=True, exist_ok=True)
    if not records:
        sec.status = "failed"
        sec.errors.append({"what": "No cell finished, so there is no figure.",
                           "text": "see the failed cells below" if failed else "the grid is empty"})
        return sec
    # Cells may declare themselves skipped ({"skipped": True, "skip_reason": ...}, e.g. a dataset that is
    # not on this machine): that is neither a success nor a failure, and the page must say so.
    skipped = [r for r in records if r.metrics.get("skipped")]
    if skipped:
        reasons = sorted({str(r.metrics.get("skip_reason", "no reason given")) for r in skipped})
        sec.notes.append({"what": f"{len(skipped)} of {len(records)} cells were skipped.", "text": "\n".join(reasons)})
        if len(skipped) == len(records):
            sec.status = "failed" if failed else "skipped"  # nothing to plot or compare: no placeholder figure
            return sec
    digest = _figure_digest(exp, scale, done)
    cached = _cached_figures(figdir, digest)
    if cached is not None:
        _say(progress, f"reusing the figures of {exp.name} (same records, plot code and files)")
        sec.figures, sec.figures_reused = [str(p) for p in cached], True
    else:
        _say(progress, f"plotting {exp.name} ({len(records)} cells) …")
        _remove_manifest(figdir)  # a failed plot leaves no manifest that could vouch for half-written files
        try:
            import matplotlib.pyplot as plt

            try:
                figures = [Path(p) for p in (exp.plot(records, figdir) or [])]
            finally:
                plt.close("all")
            missing = [str(p) for p in figures if not p.is_file()]
            if missing:
                raise ValueError(f"plot returned paths that do not exist: {missing}")
            for p in figures:
                _data_uri(p)  # validates the type before the page is written
            sec.figures = [str(p) for p in figures]
            if digest is not None:
                _write_manifest(figdir, digest, figures)
        except Exception:
            sec.errors.append({"what": "plot() raised.", "text": traceback.format_exc()})
    if scale != "paper" and callable(exp.limitations):
        # the limitation text is read off the records it describes, so page and table cannot disagree
        try:
            sec.limitations = str(exp.limitations(records))
        except Exception:
            sec.errors.append({"what": "limitations() raised.", "text": traceback.format_exc()})
    try:
        comps = list(exp.compare(records) or [])
        for c in comps:
            if not isinstance(c, Comparison):
                raise ValueError(f"compare() returned {c!r}, which is not a Comparison")
        sec.comparisons = [asdict(c) for c in comps]
    except Exception:
        sec.errors.append({"what": "compare() raised.", "text": traceback.format_exc()})
    if sec.errors:
        sec.status = "failed" if not sec.figures else "partial"
    elif failed:
        sec.status = "partial"
    return sec


#: Beside a reproduction's figures: the digest of what they were drawn from and each file's SHA-256.
FIGURE_MANIFEST = ".figures.json"


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class _Undescribable(Exception):
    """A plot callable or argument with no description that is the same in every process."""


def _describe_plot(fn: Any, modules: set[str], depth: int = 0) -> Any:
    """A JSON-able description of ``fn`` that is the same in every process, adding to ``modules`` the
    modules whose code it runs: ``module.qualname`` for a function, method or class, and for a
    :func:`functools.partial` its function and bound arguments (``partial(_plot, letter="a")`` and
    ``partial(_plot, letter="b")`` draw different figures).  The ``repr`` of a partial or of most
    objects names a memory address, so it would be another key in every run (issue 25: nine
    reproductions with partial plots were never reused); an argument that cannot be described
    without one raises :class:`_Undescribable` (the figure is then redrawn, never reused).  A
    closure's captured values are not described: a plot made by a factory is keyed by the factory's
    source, with the experiment's name beside it in the key."""
    import functools

    if depth > 20:
        raise _Undescribable("nested too deeply")
    if isinstance(fn, functools.partial):
        return {"partial": _describe_plot(fn.func, modules, depth + 1),
                "args": [_describe_value(a, modules, depth + 1) for a in fn.args],
                "keywords": {str(k): _describe_value(v, modules, depth + 1) for k, v in sorted(fn.keywords.items())}}
    if inspect.ismodule(fn):
        modules.add(fn.__name__)
        return {"module": fn.__name__}
    if inspect.ismethod(fn):
        return {"method": _describe_plot(fn.__func__, modules, depth + 1),
                "of": _describe_value(fn.__self__, modules, depth + 1)}
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if (inspect.isfunction(fn) or inspect.isclass(fn) or inspect.isbuiltin(fn)) and isinstance(module, str) \
            and isinstance(qualname, str):
        modules.add(module)
        return f"{module}.{qualname}"
    raise _Undescribable(f"{type(fn).__name__} object")


def _describe_value(v: Any, modules: set[str], depth: int) -> Any:
    """A bound argument of a plot partial as JSON: plain values and containers of them, callables
    and modules by :func:`_describe_plot`; anything else raises :class:`_Undescribable`."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return repr(v)  # json has no NaN/inf; repr round-trips
    if isinstance(v, (list, tuple)):
        return {type(v).__name__: [_describe_value(x, modules, depth + 1) for x in v]}
    if isinstance(v, dict) and all(isinstance(k, str) for k in v):
        return {"dict": {k: _describe_value(x, modules, depth + 1) for k, x in sorted(v.items())}}
    return _describe_plot(v, modules, depth + 1)


#: (module name, SHA-256 of its source, the packages followed) -> the modules of those packages it
#: imports (see _plot_sources)
_deps_cache: dict[tuple[str, bytes, tuple[str, ...]], list[str]] = {}


def _imported_names(source: bytes, module: str, is_package: bool) -> list[str]:
    """Every name an ``import`` statement anywhere in ``source`` (module level or inside a function:
    bnlab imports lazily) may load, with relative imports resolved: ``from .a import b`` in
    ``pkg.mod`` names ``pkg.a`` and ``pkg.a.b`` (``b`` may be a module or a name in ``pkg.a``)."""
    import ast

    package = module if is_package else module.rpartition(".")[0]
    out: list[str] = []
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        tree = None
    # imports are statements: walk statements only (their bodies, handlers and cases), not expressions
    stack: list[ast.AST] = [tree] if tree is not None else []
    while stack:
        node = stack.pop()
        stack.extend(c for c in ast.iter_child_nodes(node)
                     if isinstance(c, (ast.stmt, ast.excepthandler, ast.match_case)))
        if isinstance(node, ast.Import):
            out.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".") if package else []
                if node.level - 1 > len(parts):
                    continue
                base = ".".join(parts[: len(parts) - (node.level - 1)])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            if base:
                out.append(base)
                out.extend(f"{base}.{a.name}" for a in node.names if a.name != "*")
    return out


def _module_file(name: str, roots: dict[str, Path]) -> tuple[Path, bool] | None:
    """Where module ``name`` lives, found on disk without importing it: ``(file, is_package)``, or None
    (not a module of the packages in ``roots``: top-level name -> its ``__init__.py`` or, for a
    single-file top-level module, its file)."""
    top, _, rest = name.partition(".")
    root = roots.get(top)
    if root is None:
        return None
    if root.name != "__init__.py":
        return (root, False) if not rest else None
    base = root.parent.joinpath(*rest.split(".")) if rest else root.parent
    if (base / "__init__.py").is_file():
        return base / "__init__.py", True
    if rest and base.with_suffix(".py").is_file():
        return base.with_suffix(".py"), False
    return None


def _plot_sources(modules: Iterable[str]) -> list[tuple[str, bytes]]:
    """The source of every module the figures may depend on: the plot function's module(s) and, in
    the same top-level package (bnlab), every module they import, transitively, at module level or
    inside a function — a change to bnlab.theory that moves a theory curve drawn by a heatmap
    redraws it.  Modules of other packages (matplotlib, numpy) are keyed by their versions instead
    (:func:`~bnlab.experiments.spec.library_versions`).  Returns ``(module name, SHA-256 of its
    source)`` sorted by name.

    Every file is read and hashed on every call (a few MB for all of bnlab); only what its import
    statements resolve to is cached, keyed by the module's name and content hash, so parsing ~100
    modules happens once per process instead of once per reproduction."""
    import sys

    roots: dict[str, Path] = {}
    for name in modules:
        top = name.split(".")[0]
        f = getattr(sys.modules.get(top), "__file__", None)
        if f and f.endswith(".py"):
            roots[top] = Path(f)
    seen: dict[str, bytes] = {}
    todo = list(modules)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        found = _module_file(name, roots)
        if found is None:
            continue
        path, is_package = found
        try:
            source = path.read_bytes()
        except OSError:
            continue
        sha = hashlib.sha256(source).digest()
        seen[name] = sha
        key = (name, sha, tuple(sorted(roots)))
        deps = _deps_cache.get(key)
        if deps is None:
            # a submodule runs its packages' __init__ first: they count too
            parts = name.split(".")
            named = [".".join(parts[:i]) for i in range(1, len(parts))]
            named += _imported_names(source, name, is_package)
            deps = sorted({n for n in named if n.split(".")[0] in roots and _module_file(n, roots) is not None})
            _deps_cache[key] = deps
        todo.extend(deps)
    return sorted(seen.items())


def _figure_digest(exp: Experiment, scale: str, rows) -> str | None:
    """SHA-256 of everything the figures are drawn from: the finished cells (key, parameters, metrics),
    the scale, the plot callable (:func:`_describe_plot`: function and bound arguments), the source
    of every module of its package it may run (:func:`_plot_sources`) and the library versions
    (bnlab, matplotlib, ...).  None where the plot callable has no stable description: then the
    figures are always redrawn."""
    modules: set[str] = set()
    try:
        plot = _describe_plot(exp.plot, modules)
    except _Undescribable:
        return None
    h = hashlib.sha256()
    h.update(json.dumps({"experiment": exp.name, "scale": scale, "plot": plot, "versions": library_versions()},
                        sort_keys=True, default=str).encode())
    for name, sha in _plot_sources(modules):
        h.update(name.encode() + b"\0" + sha)
    for r in sorted(rows, key=lambda r: r.key):
        h.update(json.dumps([r.key, r.params, r.metrics], sort_keys=True, default=str).encode())
    return h.hexdigest()


def _cached_figures(figdir: Path, digest: str | None) -> list[Path] | None:
    """The figures recorded in ``figdir``'s manifest if they were drawn from ``digest`` and every file is
    still the regular file that was written (same SHA-256); None otherwise (redraw)."""
    path = figdir / FIGURE_MANIFEST
    if digest is None:
        return None
    try:
        if path.is_symlink() or not path.is_file():
            return None
        manifest = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(manifest, dict) or manifest.get("digest") != digest:
            return None
        files = manifest.get("figures")
        if not isinstance(files, list) or not files:
            return None
        out = []
        for entry in files:
            name, sha = entry["name"], entry["sha256"]
            p = figdir / name
            # a plain file name directly in figdir: never a path out of it, a link or anything else
            if Path(name).name != name or name.startswith(".") or p.is_symlink() or not p.is_file():
                return None
            if _sha256_file(p) != sha:
                return None
            out.append(p)
        return out
    except (OSError, ValueError, KeyError, TypeError):
        return None  # unreadable or hand-edited: redraw


def _remove_manifest(figdir: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        (figdir / FIGURE_MANIFEST).unlink()


def _write_manifest(figdir: Path, digest: str, figures: Sequence[Path]) -> None:
    """Record the figures just drawn; figures outside ``figdir`` are never reused (no manifest)."""
    entries = []
    for p in figures:
        if p.parent.resolve() != figdir.resolve() or p.is_symlink():
            return
        entries.append({"name": p.name, "sha256": _sha256_file(p)})
    _write_text(figdir / FIGURE_MANIFEST, json.dumps({"digest": digest, "figures": entries}, indent=1))


def _figure_views(paths: Sequence[str], name: str) -> list[dict]:
    """One entry per figure: the raster image shown (PNG preferred), every other format linked.

    Files with the same stem are one figure in several formats (``fig1ab.png`` + ``fig1ab.svg``):
    the page shows the PNG once and links the SVG (embedded as a data: URI, so the page stays
    self-contained), instead of showing the same figure twice at half width.
    """
    by_stem: dict[str, list[Path]] = {}
    for p in map(Path, paths):
        by_stem.setdefault(p.stem, []).append(p)
    views = []
    for stem, files in by_stem.items():
        order = {".png": 0, ".jpg": 1, ".jpeg": 1, ".gif": 2, ".svg": 3}
        files = sorted(files, key=lambda f: order.get(f.suffix.lower(), 9))
        shown = files[0]
        views.append({
            "name": shown.name,
            "alt": f"{name}: {stem}",
            "src": _data_uri(shown),
            "links": [{"name": f.name, "href": _data_uri(f)} for f in files[1:]],
        })
    return views


def _render(report: Report, generated: str, led: dict[str, Any] | None = None) -> str:
    import jinja2

    templates = Path(__file__).with_name("templates")
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates)),
        autoescape=jinja2.select_autoescape(["html"]),
        undefined=jinja2.StrictUndefined,
    )
    by_paper: dict[str, list[dict]] = {}
    views = []
    for s in report.sections:
        judged = [c for c in s.comparisons if c["agrees"] is not None]
        view = {
            **asdict(s),
            "anchor": _anchor(s.name),
            "n_judged": len(judged),
            "n_agree": sum(bool(c["agrees"]) for c in judged),
            "n_close": sum(bool(c.get("too_close_to_call")) for c in s.comparisons),
            "verdict_label": s.verdict.replace("_", " "),
            "figures": _figure_views(s.figures, s.name),
            "failures": [
                {
                    "params": json.dumps(f["params"], sort_keys=True),
                    "last_line": f["error"].strip().splitlines()[-1] if f["error"].strip() else "error",
                    "error": f["error"],
                }
                for f in s.failures[:_MAX_FAILURES_SHOWN]
            ],
            "failures_hidden": max(0, len(s.failures) - _MAX_FAILURES_SHOWN),
        }
        views.append(view)
        by_paper.setdefault(s.paper, []).append(view)
    broken = [{"module": m, "error": e, "anchor": _anchor(m)} for m, e in sorted(report.broken_modules.items())]
    versions = {k: (v or "—") for k, v in library_versions().items()}
    counts = report.verdict_counts
    return env.get_template("report.html").render(
        css=(templates / "report.css").read_text(),
        verdict_counts=[(v.replace("_", " "), v, counts[v]) for v in VERDICTS],
        scale=report.scale,
        generated=generated,
        total_seconds=report.seconds,
        versions=versions,
        sections=views,
        papers=list(by_paper.items()),
        broken=broken,
        ledger=led,
        ledger_badge=_LEDGER_BADGE,
    )


_LEDGER_BADGE = {"agrees": "v-reproduced", "partly": "v-partly", "disagrees": "v-not_reproduced",
                 "not judged": "v-skipped", "tested": "c-tested", "not run": "v-skipped", "not checked": "c-none"}


def _row_problems(sections: Sequence[ReportSection]) -> list[str]:
    """Comparison rows the ledger cannot place: not judged without a reason, or judged but matching no
    declared check (so no claim can own its verdict)."""
    from bnlab.experiments.spec import check_for

    out = []
    for s in sections:
        names = [c["name"] for c in s.checks]
        for c in s.comparisons:
            if c.get("agrees") is None and not c.get("reason"):
                out.append(f"{s.name}: row {c['quantity']!r} is not judged and gives no reason")
            if c.get("agrees") is not None and check_for(c["quantity"], names) is None:
                out.append(f"{s.name}: judged row {c['quantity']!r} matches no declared check")
    return out


def ledger(sections: Sequence[ReportSection]) -> dict[str, Any]:
    """The claim ledger (:mod:`bnlab.claims`) judged by this run's sections: a verdict per claim from the
    rows of its reproduction checks, counts per paper and overall, and the rows it cannot place."""
    from bnlab import claims
    from bnlab.experiments.spec import check_for

    rows = claims.claim_verdicts(claims.all_claims(), {s.name: asdict(s) for s in sections}, check_for)
    papers = []
    for key, paper in claims.PAPERS.items():
        mine = [r for r in rows if r["paper"] == key]
        papers.append({"key": key, "title": paper.title, "short": paper.short, "page": f"claims-{key}.html",
                       "counts": claims.summarize(mine), "claims": mine,
                       "problems": _row_problems([s for s in sections if claims.paper_of_experiment(s.name) == key])})
    return {"counts": claims.summarize(rows), "papers": papers, "verdicts": list(claims.VERDICTS)}


def _anchor_of(name: str) -> str:
    return "index.html#" + _anchor(name)


def _write_ledger_pages(outdir: Path, led: dict[str, Any], scale: str, generated: str) -> list[Path]:
    """One page per paper, ``claims-<paper>.html``: claim, location, kind, checks, strength, verdict."""
    import jinja2

    from bnlab.claims import check_link

    templates = Path(__file__).with_name("templates")
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(templates)),
                             autoescape=jinja2.select_autoescape(["html"]), undefined=jinja2.StrictUndefined)
    css = (templates / "report.css").read_text()
    paths = []
    for paper in led["papers"]:
        views = []
        for c in paper["claims"]:
            links = []
            for link in c["links"]:
                exp, check = check_link(link["link"])
                links.append({**link, "experiment": exp, "check": check, "href": _anchor_of(exp),
                              "badge": _LEDGER_BADGE[link["verdict"]]})
            views.append({**c, "badge": _LEDGER_BADGE[c["verdict"]], "link_views": links})
        html = env.get_template("claims.html").render(
            css=css, paper=paper, claims=views, scale=scale, generated=generated,
            others=[p for p in led["papers"] if p["key"] != paper["key"]], verdicts=led["verdicts"],
            badge=_LEDGER_BADGE)
        path = outdir / paper["page"]
        _write_text(path, html)
        paths.append(path)
    return paths


#: sweeps of the report in flight at once: the next reproduction's cells queue on the cluster behind the
#: current one's, so no worker idles while a section's last cells finish or its figures are drawn
_SWEEPS_IN_FLIGHT = 2


def _sections(exps: Sequence[Experiment], scale: str, results_dir, outdir: Path, retry_failed: bool, get_client,
              serial: bool, progress, *, checkpoint_every: float | None = DEFAULT_CHECKPOINT_EVERY
              ) -> list[ReportSection]:
    """Every reproduction's section, in order.  The sweeps run ahead on the cluster, ``_SWEEPS_IN_FLIGHT`` at
    a time, submitted in the sections' order (Dask runs earlier submissions first); figures, tables and
    verdicts are made here, in this thread (matplotlib's pyplot is not thread-safe), each once its sweep is
    done.  A sweep that raised is run again by its section, which reports the error where it belongs.
    Each section's grid is computed once, here, and handed to its section."""
    prepared: dict[str, tuple[list[dict], list[str]]] = {}
    pending = []
    for e in [] if serial else exps:
        try:
            cells = grid_cells(e, scale)
        except Exception:
            continue  # its section reports the error
        keys = [cell_key(p) for p in cells]
        prepared[e.name] = (cells, keys)
        if _needs_run(_stored_rows(store_path(e.name, scale, results_dir), keys), keys, retry_failed):
            pending.append(e)
    if len(pending) < 2:
        return [_section(exp, scale, results_dir, outdir, retry_failed, get_client, serial, progress,
                         prepared=prepared.get(exp.name), checkpoint_every=checkpoint_every) for exp in exps]
    from concurrent.futures import ThreadPoolExecutor

    client = get_client()  # one cluster, started here (not by two threads at once)

    def sweep(exp: Experiment):
        try:
            summary, _ = run_grid(exp, scale, prepared[exp.name][0], store_path(exp.name, scale, results_dir),
                                  retry_failed=retry_failed, progress=progress, client=client,
                                  checkpoint_every=checkpoint_every)
            return summary
        except Exception:
            return None

    pool = ThreadPoolExecutor(max_workers=_SWEEPS_IN_FLIGHT, thread_name_prefix="bnlab-sweep")
    try:
        ahead = {e.name: pool.submit(sweep, e) for e in pending}
        sections = []
        for exp in exps:
            summary = ahead[exp.name].result() if exp.name in ahead else None
            # the sweep above already retried failed cells: the section only reads (a failed cell runs once)
            sec = _section(exp, scale, results_dir, outdir, retry_failed and summary is None, get_client, serial,
                           progress, prepared=prepared.get(exp.name), checkpoint_every=checkpoint_every)
            if summary is not None:
                sec.reused = summary.reused
            sections.append(sec)
        return sections
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # Ctrl-C: queued sweeps never start


def build_report(
    out: str | os.PathLike = "bnlab-report",
    *,
    scale: str = "small",
    results_dir: str | os.PathLike | None = None,
    only: Sequence[str] | None = None,
    experiments: Iterable[Experiment] | None = None,
    client: Any = None,
    scheduler: str | None = None,
    workers: int | None = None,
    serial: bool = False,
    retry_failed: bool = True,
    progress: bool | IO = True,
    threads: int | None = None,
    checkpoint_every: float | None = DEFAULT_CHECKPOINT_EVERY,
) -> Report:
    """Run or reuse every reproduction's sweep at ``scale`` and write ``<out>/index.html``.

    Parameters
    ----------
    out:
        Output directory (created): ``index.html``, ``report.json`` and ``figures/<name>/``.
    scale:
        ``"small"`` (default; minutes on 2 cores), ``"medium"`` (about an hour) or ``"paper"``.
    results_dir:
        Where the sweeps' stores are (default ``$BNLAB_RESULTS`` or ``bnlab-results``):
        finished cells are reused, missing ones computed.
    only:
        Names of the reproductions to include (default: all registered).
    experiments:
        Explicit experiments instead of the registry (used by tests).
    client, scheduler, workers, serial:
        Where cells run (see :func:`~bnlab.experiments.sweep.run_sweep`).  One
        cluster serves every reproduction; none is started when every cell is
        already in the stores.
    retry_failed:
        Run cells recorded ``failed`` again (default True: after a fix, the
        report shows the fixed reproduction).
    progress:
        Progress bars on stderr (True), none (False), or on a given stream.
    threads:
        Intra-op threads of every process that runs cells, fixed (see
        :func:`~bnlab.experiments.sweep.run_sweep`; default: each local worker its share of the cores).
    checkpoint_every:
        Seconds between two checkpoints of a task's training, so that an interrupted report goes
        on mid-task (see :func:`~bnlab.experiments.sweep.run_sweep`; default 300; ``None``: none).

    Returns
    -------
    Report
        The sections (status, verdict, counts, figures, comparisons, errors) and the page's path;
        ``report.json`` beside the page holds the same, with the top-level ``verdicts`` counts.
    """
    check_choice("scale", scale, SCALES)
    if threads is not None:  # before anything is created
        threads = _threads.check_threads(threads)
    if checkpoint_every is not None:
        checkpoint_every = check_real("checkpoint_every", checkpoint_every, minimum=0.0)
    os.environ.setdefault("MPLBACKEND", "Agg")  # figures are files; never open a window
    t0 = time.perf_counter()
    outdir = Path(out)
    outdir.mkdir(parents=True, exist_ok=True)
    if experiments is not None:
        exps = list(experiments)
        broken: dict[str, str] = {}
    else:
        if only:
            exps = [get_experiment(n) for n in only]
        else:
            exps = list(list_experiments().values())
        broken = {} if only else discovery_errors()
    with contextlib.ExitStack() as stack:
        get_client = _LazyClient(stack, client, scheduler, workers, threads)
        if serial:
            stack.enter_context(_threads.pinned(threads))
        sections = _sections(exps, scale, results_dir, outdir, retry_failed, get_client, serial, progress,
                             checkpoint_every=checkpoint_every)
    _say(progress, "writing the page …")
    report = Report(index=outdir / "index.html", scale=scale, sections=sections, broken_modules=broken,
                    seconds=time.perf_counter() - t0)
    generated = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    # written beside their paths and renamed over them: a link planted at index.html, a ledger page or
    # report.json is replaced, never followed (bnlab._validation.atomic_output_path)
    led = ledger(sections)
    _write_text(report.index, _render(report, generated, led))
    _write_ledger_pages(outdir, led, scale, generated)
    _write_text(
        outdir / "report.json",
        json.dumps(
            {
                "scale": scale,
                "generated": generated,
                "seconds": report.seconds,
                "ok": report.ok,
                "all_reproduced": report.all_reproduced,
                "verdicts": report.verdict_counts,
                "sections": [asdict(s) for s in sections],
                "broken_modules": broken,
                "claims": led,
            },
            indent=2,
            default=str,
        ),
    )
    return report


def _write_text(path: Path, text: str) -> None:
    from bnlab._validation import atomic_output_path

    with atomic_output_path(path, name="out") as tmp:
        tmp.write_text(text, encoding="utf-8")


def reproduce(
    experiment: str | Experiment,
    *,
    scale: str = "small",
    out: str | os.PathLike = "bnlab-report",
    results_dir: str | os.PathLike | None = None,
    client: Any = None,
    scheduler: str | None = None,
    workers: int | None = None,
    serial: bool = False,
    retry_failed: bool = True,
    progress: bool | IO = True,
    threads: int | None = None,
    checkpoint_every: float | None = DEFAULT_CHECKPOINT_EVERY,
) -> ReportSection:
    """Run (or reuse) one reproduction's sweep, write its figures to ``<out>/figures/<name>/``, tabulate it.

    ``out`` defaults to ``bnlab-report``, the folder of :func:`build_report`: the figures land where
    the report looks for them, and a later report reuses them while their records are unchanged.

    Same arguments as :func:`build_report`; returns the section the report
    would show (status, verdict, counts, figure paths, comparisons, errors).
    """
    check_choice("scale", scale, SCALES)
    os.environ.setdefault("MPLBACKEND", "Agg")
    exp = get_experiment(experiment)
    outdir = Path(out)
    if threads is not None:
        threads = _threads.check_threads(threads)
    if checkpoint_every is not None:
        checkpoint_every = check_real("checkpoint_every", checkpoint_every, minimum=0.0)
    with contextlib.ExitStack() as stack:
        if serial:
            stack.enter_context(_threads.pinned(threads))
        return _section(exp, scale, results_dir, outdir, retry_failed,
                        _LazyClient(stack, client, scheduler, workers, threads), serial, progress,
                        checkpoint_every=checkpoint_every)
