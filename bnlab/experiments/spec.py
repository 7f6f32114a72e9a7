"""How a paper reproduction is declared (the contract between reproductions and the sweep engine).

A reproduction is declared once, as an :class:`Experiment`: a grid of cells per
scale, a function that runs one cell, a function that plots finished records,
and a function that tabulates what the paper reports beside what bnlab
measured.  Reproductions live in :mod:`bnlab.reproductions`, one
module per figure/table, each exposing ``EXPERIMENTS: list[Experiment]``.
The sweep engine runs the cells (Dask), stores records (SQLite), and the
report calls ``plot`` and ``compare``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from bnlab._vocabulary import SCALES  # defined there so that the CLI reads it without importing this package
from bnlab.experiments.cells import Cell

__all__ = ["Experiment", "Record", "Comparison", "Setting", "Check", "TaskCost", "SCALES", "VERDICTS", "cell_device",
           "cell_tasks", "library_versions", "check_for"]



@dataclass(frozen=True)
class Record:
    """One finished cell: its parameters (including ``seed``) and the metrics ``run_cell`` returned."""

    params: Mapping[str, Any]
    metrics: Mapping[str, Any]


@dataclass(frozen=True)
class Comparison:
    """One row of a reproduction's report table."""

    quantity: str
    paper: str  # what the paper reports, as text (e.g. "π/(π−1) ≈ 1.467")
    bnlab: str  # what bnlab computed or measured, as text
    agrees: bool | None = None  # None when there is no sharp criterion
    reason: str = ""  # why the row is not judged (required when ``agrees`` is None; shown in the report)
    #: not judged because the seeds run cannot decide it — it could read either way (``agrees`` is then None).
    #: Unlike a row the grid cannot test, such a row keeps a reproduction from ``reproduced``: its claim was
    #: checked, and not settled.
    too_close_to_call: bool = False

    def __post_init__(self):
        if self.too_close_to_call and self.agrees is not None:
            raise ValueError(f"Comparison {self.quantity!r}: too_close_to_call=True needs agrees=None, got "
                             f"{self.agrees!r}")


#: What a reproduction's comparison rows add up to (see ``bnlab.experiments.report.verdict``):
#: every checked row agrees / some do / none do / there are rows but none could be judged at this scale,
#: each with its reason (e.g. too close to call on the seeds run) / the cells could not run here (with the
#: reason) / the sweep, plot or table failed or gave no row, so nothing can be judged.
VERDICTS = ("reproduced", "partly", "not_reproduced", "not_judged", "skipped", "error")


@dataclass(frozen=True)
class Setting:
    """One line of a reproduction's scale table: what the paper used beside what bnlab uses.

    ``small`` and ``paper_scale`` describe bnlab's ``small`` and ``paper`` scales (:data:`SCALES`);
    ``medium``, where the medium scale differs from the small one (more restarts, a longer grid), else
    ``None``; ``why`` says why a scale deviates from the paper, where it does.
    """

    what: str  # e.g. "width", "depth grid", "steps / epochs", "η", "training images", "restarts"
    paper: str  # what the paper used ("not stated" where it does not say)
    small: str
    paper_scale: str
    why: str = ""
    medium: str | None = None

    def at(self, scale: str) -> str:
        """This line's value at ``scale`` (one of :data:`SCALES`)."""
        if scale == "paper":
            return self.paper_scale
        if scale == "medium" and self.medium is not None:
            return self.medium
        return self.small


@dataclass(frozen=True)
class Check:
    """What one kind of comparison row tests: its criterion and agreement window, in words.

    ``name`` matches the start of the rows' ``quantity``; an ellipsis "…" in it stands for any text
    (``"γ = …: exponent"`` matches ``"γ = 0.1: exponent of …"``).  A row belongs to the check with the
    longest matching name (:func:`check_for`); the claim ledger (:mod:`bnlab.claims`) links claims to
    checks by these names.
    """

    name: str  # matches the start of the rows' ``quantity`` ("…" = any text)
    meaning: str  # what agreement means, with the window (e.g. "… within [16ξ/1.6, 1.6·16ξ]")


def _check_pattern(name: str) -> re.Pattern[str]:
    return re.compile(".*?".join(re.escape(part) for part in name.split("…")), re.DOTALL)


def check_for(quantity: str, names) -> str | None:
    """The name of the check a comparison row with ``quantity`` belongs to: the longest of ``names``
    (literal text, "…" excluded) that matches the start of ``quantity``; None if none does."""
    best, best_len = None, -1
    for name in names:
        if _check_pattern(name).match(quantity):
            n = len(name.replace("…", ""))
            if n > best_len:
                best, best_len = name, n
    return best


@dataclass(frozen=True)
class TaskCost:
    """What one task of a sweep (a cell, or a group of cells trained together) costs, for a plan.

    ``steps`` is the number of training steps (iterations) the task runs; a pilot runs a few of them
    (:attr:`Experiment.shorten`) and extrapolates to ``steps``.  ``step_work`` and ``fixed_work`` are
    the relative costs of one step and of everything else (building the networks, the test pass) in
    any unit shared by the tasks of one ``kind`` (e.g. multiply-adds): a task that is not piloted is
    extrapolated from the piloted task of its kind in proportion to them.
    """

    kind: str
    steps: int = 1
    step_work: float = 1.0
    fixed_work: float = 1.0


@dataclass(frozen=True)
class Experiment:
    """A paper figure or table as a sweep.

    Attributes
    ----------
    name:
        Command-line name, e.g. ``"yang2019-fig3a"``.
    paper, figure, title, claim:
        Which paper and figure, a short title, and one paragraph saying what
        the paper claims (shown in the report).
    grid:
        ``grid(scale) -> list[dict]``: the cells of the sweep at ``scale``
        (one of :data:`SCALES`; ``"medium"`` reaches it only with ``medium_grid``, otherwise
        ``grid("medium")`` is ``grid("small")``); every dict is JSON-serializable and carries
        its seeds: a ``"seed"`` for a single run, or a ``"seeds"`` list for a
        cell that trains an ensemble (the trainability columns of
        :mod:`bnlab.reproductions.trainability`, which ``records`` expands
        back into one record per seed and depth).
    run_cell:
        ``run_cell(params) -> dict``: runs one cell and returns its metrics
        (JSON-serializable; deterministic given ``params``).  ``params`` is the cell parsed as
        :attr:`cell` declares it, or the cell's dict where the experiment declares no ``cell``.  It must be a
        module-level function (picklable for Dask workers).  A cell that
        cannot run on this machine for a legitimate reason (a dataset that is
        not present) returns ``{"skipped": True, "skip_reason": "..."}``; the
        report shows the reason, and a reproduction whose cells are all
        skipped has the status ``skipped``.
    plot:
        ``plot(records, outdir) -> list[Path]``: writes PNG/SVG figures of the
        finished records into ``outdir`` and returns their paths.
    compare:
        ``compare(records) -> list[Comparison]``: the paper's numbers beside
        bnlab's, for the report table.
    settings:
        The scale table: each :class:`Setting` states what the paper used beside bnlab's
        ``small`` and ``paper`` scales (width, depth grid, steps or epochs, η, data size,
        restarts, thresholds).  Data, so the report can show it beside the figure.
    checks:
        What each kind of comparison row tests and its agreement window (:class:`Check`).
    limitations:
        Where the ``small`` scale cannot show the claim: what, why, and the measurement that
        shows it (shown in the section at that scale).  Either text, or ``limitations(records) -> str``
        so that every number it states is read off the run it describes (a text quoting an earlier run
        says which run and commit).
    uses_gpu:
        Whether cells benefit from CUDA (the engine gives them a GPU when
        present): unless the cell's parameters set ``"device"``, ``run_cell``
        receives ``params["device"]`` = :func:`cell_device` (``"cuda:<i>"``
        when CUDA is present, else ``"cpu"``), which is not part of the cell's
        identity.  On a cluster whose workers declare a ``GPU`` resource the
        engine sends these cells only there.
    group, run_group:
        Batched training (optional, both or neither).  ``group(params, scale) -> str | None`` names the
        ensemble a cell trains in at ``scale``; the engine runs the pending cells of one name as one
        task, ``run_group(list_of_params) -> list_of_metrics`` (one metrics dict per cell, in order; a
        module-level function), and commits each cell's result on its own — cells stay the unit of
        storage and resume, and a resumed group trains only its unfinished cells.  ``None`` runs the
        cell alone through ``run_cell``.  ``run_group([p])`` must give the metrics ``run_cell(p)``
        gives, to the rounding of batched products (each reproduction's tests show it).
    medium_grid:
        Whether ``grid`` defines a ``medium`` grid of its own (the small grid with more restarts, or
        an investigation that does not fit the small budget).  Without it the medium scale runs the
        small grid, so a medium report holds every reproduction.
    cell:
        The declared kind of this experiment's cells (a :class:`~bnlab.experiments.cells.Cell` subclass),
        optional.  With it the engine parses each cell's dict once, where it hands the cell over, and
        ``run_cell`` / ``run_group`` receive :class:`~bnlab.experiments.cells.Cell` objects (a bad cell is
        recorded ``failed`` with a ``ValueError`` naming the experiment, the key, the value and what is
        allowed); without it they receive the dicts.  Either way the store keeps the dicts, so cell keys
        do not depend on it.
    cost, shorten:
        For a plan (:func:`bnlab.experiments.plan.plan_experiment`), optional.
        ``cost(cells) -> TaskCost`` says what a task (the cells that run together) costs;
        ``shorten(cells, steps) -> cells`` returns the task cut to ``steps`` training steps, with the
        same work per step (the pilot).  Without them a pilot runs whole tasks.
    """

    name: str
    paper: str
    figure: str
    title: str
    claim: str
    grid: Callable[[str], list[dict]]
    run_cell: Callable[[dict], dict]
    plot: Callable[[Sequence[Record], Path], list[Path]]
    compare: Callable[[Sequence[Record]], list[Comparison]] = field(default=lambda records: [])
    uses_gpu: bool = False
    settings: Sequence[Setting] = ()
    checks: Sequence[Check] = ()
    limitations: str | Callable[[Sequence[Record]], str] = ""
    group: Callable[[dict, str], str | None] | None = None
    run_group: Callable[[list[dict]], list[dict]] | None = None
    cost: Callable[[list[dict]], TaskCost] | None = None
    shorten: Callable[[list[dict], int], list[dict]] | None = None
    medium_grid: bool = False
    cell: type[Cell] | None = None

    def __post_init__(self) -> None:
        if (self.group is None) != (self.run_group is None):
            raise ValueError(f"experiment {self.name!r}: give both group and run_group, or neither")
        if self.cell is not None and not (isinstance(self.cell, type) and issubclass(self.cell, Cell)):
            raise ValueError(f"experiment {self.name!r}: cell={self.cell!r} is not allowed: expected a Cell subclass")
        if not self.medium_grid:
            # one place decides what "medium" means for a grid that knows only small and paper
            object.__setattr__(self, "grid", _SmallAtMedium(self.grid))


@dataclass(frozen=True)
class _SmallAtMedium:
    """``grid`` of an experiment without a medium grid: ``"medium"`` → the small grid."""

    small_and_paper: Callable[[str], list[dict]]

    def __call__(self, scale: str) -> list[dict]:
        return self.small_and_paper("small" if scale == "medium" else scale)


def cell_tasks(experiment: Experiment, cells: Sequence[Mapping[str, Any]], scale: str) -> list[list[int]]:
    """The tasks the engine runs for ``cells`` at ``scale``: lists of indices into ``cells``.

    Cells whose :attr:`Experiment.group` names the same ensemble form one task (in the order of their
    first cell); every other cell is a task of its own.  Without ``group`` every cell runs alone.
    """
    if experiment.group is None:
        return [[i] for i in range(len(cells))]
    tasks: list[list[int]] = []
    named: dict[str, list[int]] = {}
    for i, params in enumerate(cells):
        name = experiment.group(dict(params), scale)
        if name is None:
            tasks.append([i])
        elif name in named:
            named[name].append(i)
        else:
            named[name] = [i]
            tasks.append(named[name])
    return tasks


def cell_device() -> str:
    """The torch device a cell should use: ``"cuda:<i>"`` when CUDA is present, else ``"cpu"``.

    ``BNLAB_DEVICE`` (e.g. ``cpu``, ``cuda:1``) overrides the choice.  Inside
    a Dask worker whose name is an integer (a ``LocalCluster``), worker ``i``
    gets GPU ``i mod (number of GPUs)``, so several local workers spread over
    the GPUs instead of all using GPU 0.  Imports torch (call it inside
    ``run_cell``, not at module import).
    """
    import os

    forced = os.environ.get("BNLAB_DEVICE")
    if forced:
        return forced
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    index = 0
    try:
        from distributed import get_worker

        name = get_worker().name
        index = int(name) % torch.cuda.device_count()
    except (ImportError, ValueError, TypeError):
        index = 0
    return f"cuda:{index}"


_VERSION_PACKAGES = ("numpy", "scipy", "torch", "dask", "distributed", "pandas")
_versions_cache: dict | None = None


def library_versions() -> dict[str, str]:
    """Versions of python, bnlab and the numerical libraries (read from package metadata, no imports)."""
    global _versions_cache
    if _versions_cache is None:
        import platform
        from importlib import metadata

        out = {"python": platform.python_version(), "platform": platform.platform()}
        for pkg in ("bnlab",) + _VERSION_PACKAGES:
            try:
                out[pkg] = metadata.version(pkg)
            except metadata.PackageNotFoundError:
                out[pkg] = None
        _versions_cache = out
    return dict(_versions_cache)
