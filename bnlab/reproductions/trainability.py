"""Trainability sweeps shared by Yang et al. 2019, Figs. 3–5: the training cell, the maximum trainable depth.

One cell trains a BN-MLP (Yang et al. 2019, Eq. 7) of a given depth, width and BN batch size on
MNIST, Fashion-MNIST or CIFAR-10 and reports its test accuracy (:func:`run_trainability_cell`).
The records of a sweep become a test-accuracy heatmap over (x, depth) with the mean field
prediction of the maximum trainable depth, 16ξ with ξ = 1/log λ_G↓(B) (Yang et al. 2019, §4 and
Thm 3.10), drawn over it (:func:`heatmap`), and comparison rows between the measured and the
predicted maximum trainable depth (:func:`compare_depths`).

"Trainable" means a test accuracy above chance + ½·(best accuracy of the sweep − chance)
(:func:`trainable_threshold`); the measured maximum trainable depth at an x is the deepest grid
depth that is trainable (:func:`measured_max_depth`).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import textwrap
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Sequence

import numpy as np

from bnlab.experiments.cells import Cell, cell_param
from bnlab.experiments.spec import Check, Comparison, Record, TaskCost
from bnlab.reproductions.plotting import grid_ticks, pyplot, save_figure

__all__ = [
    "CIFAR_MISSING",
    "METRIC_KEYS",
    "load_dataset_subset",
    "TrainabilityCell",
    "OPTIMIZER_NAMES",
    "optimizer_factory",
    "run_trainability_cell",
    "run_trainability_ensemble",
    "ensemble_group",
    "PER_NETWORK",
    "run_trainability_group",
    "trainability_cost",
    "trainability_shorten",
    "expand_records",
    "expand_cells",
    "as_columns",
    "theory_max_depth",
    "trainable_threshold",
    "measured_max_depth",
    "heatmap",
    "compare_depths",
    "DEPTH_WINDOW",
    "NEAR_THRESHOLD",
    "DEPTH_CHECKS",
    "describe_grid",
    "boundary_summary",
]

#: The measured boundary agrees with 16ξ when [deepest trainable depth, next grid depth] overlaps
#: [16ξ/DEPTH_WINDOW, DEPTH_WINDOW·16ξ].
DEPTH_WINDOW = 1.6

#: Test accuracy this close to the trainable threshold is too close to call on one seed.  At the small scale's
#: budgets a single network's accuracy near the depth boundary is a draw whose standard deviation over seeds
#: reaches this much on Fig. 5's tanh grids of 150 steps (yang2019-fig5c-sigma4, seeds 0–5, depths 40–60:
#: 0.02–0.10 per cell; yang2019-fig5a, seeds 0–3: up to 0.11) and half of it on Fig. 3's ReLU grids of 200–600
#: steps (yang2019-fig3a, seeds 0–3: up to 0.05, at its B = 8 boundary), where the rule is conservative.
#: Where a sweep has one seed per cell and counting one such cell the other way would change a depth row's
#: reading, the row is not judged (:func:`compare_depths`): the seed, not the network, would decide it.  With
#: several seeds the rows are judged on the mean accuracy, whose spread is smaller, and each seed's own boundary
#: is shown beside it.  The paper-scale grids have one seed too; their spread (10 epochs instead of 150–600
#: steps) is unmeasured and presumably smaller, so there the rule errs on the side of not judging.
NEAR_THRESHOLD = 0.1

CIFAR_MISSING = "CIFAR-10 not present: bnlab data download cifar10 (170 MB, checksum-verified), then re-run"

#: metric keys returned by :func:`run_trainability_cell`
METRIC_KEYS = ("test_accuracy", "diverged", "diverged_at_step", "steps", "final_train_loss", "chance", "skipped")


#: optimizer names a trainability cell's ``optimizer`` parameter may hold (part of stored cell identities)
OPTIMIZER_NAMES = ("sgd", "rmsprop")


def optimizer_factory(name: str, lr: float, momentum: float = 0.0):
    """The torch optimizer factory ``params -> Optimizer`` a cell's ``optimizer`` name stands for.

    ``"sgd"``: plain SGD (Yang et al. 2019, Figs. 3a,b,d, 4, 5).  ``"rmsprop"`` (Fig. 3c): RMSProp with
    TensorFlow's defaults — decay ``alpha=0.9`` and ``eps=1e-10`` — which the paper's experiments used;
    torch's default ``alpha=0.99`` averages the squared gradients over a ten times longer window.  The
    name-to-optimizer mapping belongs to these reproductions; :func:`bnlab.nets.train` takes the factory.
    """
    import torch

    from bnlab._validation import check_choice, check_real

    name = check_choice("optimizer", name, OPTIMIZER_NAMES)
    lr = check_real("lr", lr, minimum=0.0, strict_minimum=True)
    momentum = check_real("momentum", momentum, minimum=0.0, maximum=1.0)
    if name == "sgd":
        return functools.partial(torch.optim.SGD, lr=lr, momentum=momentum)
    return functools.partial(torch.optim.RMSprop, lr=lr, alpha=0.9, eps=1e-10, momentum=momentum)


# --------------------------------------------------------------------------- cells
@functools.lru_cache(maxsize=4)
def load_dataset_subset(dataset: str, n_train: int, n_test: int):
    """The first n_train / n_test images (flattened) of a dataset, cached per worker process."""
    from bnlab.data import load_dataset

    tr = load_dataset(dataset, "train")
    te = load_dataset(dataset, "test")
    n_train = min(n_train, tr.x.shape[0])
    n_test = min(n_test, te.x.shape[0])
    xtr = tr.x[:n_train].reshape(n_train, -1).contiguous()
    xte = te.x[:n_test].reshape(n_test, -1).contiguous()
    return (xtr, tr.y[:n_train].clone()), (xte, te.y[:n_test].clone()), tr.num_classes


@dataclass(frozen=True, kw_only=True)
class TrainabilityCell(Cell):
    """The parameters of a trainability cell (:attr:`bnlab.experiments.spec.Experiment.cell`), parsed once.

    One BN-MLP (Yang et al. 2019, Eq. 7) of ``depth`` hidden layers initialized with ``seed``, or a whole
    column: every (depth, seed) of ``depths`` × ``seeds`` trained as one ensemble
    (:func:`run_trainability_ensemble`).  ``bn_batch`` is B of the BN statistics, ``batch_size`` the
    training batch (a multiple of ``bn_batch``; larger means ghost batches, Fig. 3b); the cell trains for
    ``steps`` or ``epochs`` (exactly one of them).
    """

    dataset: Literal["mnist", "fashion_mnist", "cifar10", "cifar100", "digits"]  # bnlab.data.DATASET_NAMES
    width: int = cell_param(minimum=1)
    bn_batch: int = cell_param(minimum=2)
    batch_size: int = cell_param(minimum=2)
    lr: float = cell_param(minimum=0.0, strict_minimum=True)
    n_train: int = cell_param(minimum=1)
    n_test: int = cell_param(minimum=1)
    depth: int | None = cell_param(None, minimum=1)
    seed: int | None = cell_param(None, minimum=0)
    depths: tuple[int, ...] | None = cell_param(None, minimum=1)
    seeds: tuple[int, ...] | None = cell_param(None, minimum=0)
    steps: int | None = cell_param(None, minimum=1)
    epochs: float | None = cell_param(None, minimum=0.0, strict_minimum=True)
    phi: str = "relu"
    gamma: float = 1.0
    beta: float = 0.0
    eps: float = cell_param(1e-3, minimum=0.0)
    sigma_w2: float = cell_param(1.0, minimum=0.0, strict_minimum=True)
    optimizer: Literal["sgd", "rmsprop"] = "sgd"  # OPTIMIZER_NAMES
    device: str = "cpu"  # set by the engine for a GPU; not part of the cell's identity

    def check(self) -> None:
        single = self.depth is not None or self.seed is not None
        column = self.depths is not None or self.seeds is not None
        if single == column:
            raise ValueError(f"cell parameters depth={self.depth!r}, seed={self.seed!r}, depths={self.depths!r}, "
                             f"seeds={self.seeds!r} are not allowed: give depth and seed (one network) or depths "
                             f"and seeds (a column)")
        if single and (self.depth is None or self.seed is None):
            raise ValueError(f"cell parameters depth={self.depth!r}, seed={self.seed!r} are not allowed: a "
                             f"single-network cell gives both")
        if column and not (self.depths and self.seeds):
            raise ValueError(f"cell parameters depths={self.depths!r}, seeds={self.seeds!r} are not allowed: a "
                             f"column gives at least one of each")
        if (self.steps is None) == (self.epochs is None):
            raise ValueError(f"cell parameters steps={self.steps!r}, epochs={self.epochs!r} are not allowed: give "
                             f"exactly one of 'steps' and 'epochs'")
        if self.batch_size % self.bn_batch:
            raise ValueError(f"cell parameter batch_size={self.batch_size} is not allowed: expected a multiple of "
                             f"bn_batch={self.bn_batch} (the BN statistics are taken over sub-batches of bn_batch)")

    @property
    def networks(self) -> list[tuple[int, int]]:
        """The ``(depth, seed)`` of every network the cell trains (a column: seeds outer, depths inner)."""
        if self.depths is None:
            return [(self.depth, self.seed)]
        return [(d, s) for s in self.seeds for d in self.depths]

    @property
    def length(self) -> dict:
        """``{"steps": …}`` or ``{"epochs": …}``: how long the cell trains (:func:`bnlab.nets.train`)."""
        return {"steps": self.steps} if self.steps is not None else {"epochs": self.epochs}


def _cell_data(cell: TrainabilityCell):
    """``(train, test, num_classes)`` of a cell, or its skipped metrics when the data set is missing.

    (The cell's thread count is its worker's share of the cores, lowered for small work by the
    training entry points: bnlab._threads, docs/experiments.md "Threads".)
    """
    from bnlab.data import DatasetNotFoundError

    try:
        return load_dataset_subset(cell.dataset, cell.n_train, cell.n_test)
    except DatasetNotFoundError as exc:  # report, don't fail the sweep
        reason = CIFAR_MISSING if cell.dataset == "cifar10" else f"{cell.dataset} not present: {exc}"
        return {"skipped": True, "skip_reason": reason}


def _bn_mlp(cell: TrainabilityCell, in_features: int, num_classes: int, *, depth: int, seed: int):
    """The cell's BN-MLP of ``depth`` hidden layers initialized with ``seed`` (the other settings from ``cell``)."""
    from bnlab.nets import BNMLP

    return BNMLP(in_features, num_classes, depth=depth, width=cell.width, phi=cell.phi, gamma=cell.gamma,
                 beta=cell.beta, eps=cell.eps,
                 sub_batch_size=None if cell.bn_batch == cell.batch_size else cell.bn_batch,
                 sigma_w2=cell.sigma_w2, seed=seed)


def run_trainability_cell(params: TrainabilityCell | dict) -> dict:
    """Train one BN-MLP of a trainability sweep and return its test accuracy.

    ``params``: a :class:`TrainabilityCell` (what the engine hands over), or its dict, parsed here —
    keys ``dataset``, ``phi``, ``gamma``, ``beta``, ``eps``, optional ``sigma_w2`` (default 1),
    ``depth``, ``width``, ``bn_batch`` (B of the BN statistics),
    ``batch_size`` (training batch, a multiple of ``bn_batch``),
    ``optimizer``, ``lr``, ``steps`` or ``epochs``, ``n_train``, ``n_test``,
    ``seed``; optional ``device`` (default ``"cpu"``).

    A cell with ``depths`` and ``seeds`` (lists) instead of ``depth`` and ``seed`` is a whole column
    trained as one ensemble: :func:`run_trainability_ensemble`.

    Returns the metrics ``test_accuracy``, ``diverged``, ``diverged_at_step``,
    ``steps``, ``final_train_loss``, ``chance`` and ``skipped`` (False), or
    ``{"skipped": True, "skip_reason": …}`` when the dataset is not on the
    machine (CIFAR-10 without ``bnlab data download cifar10``).
    """
    from bnlab.nets import train_classifier

    cell = TrainabilityCell.parse(params)
    if cell.depths is not None:
        return run_trainability_ensemble(cell)
    data = _cell_data(cell)
    if isinstance(data, dict):
        return data
    train, test, num_classes = data
    model = _bn_mlp(cell, train[0].shape[1], num_classes, depth=cell.depth, seed=cell.seed)
    result = train_classifier(
        model,
        train,
        test,
        optimizer=optimizer_factory(cell.optimizer, cell.lr),
        batch_size=cell.batch_size,
        seed=cell.seed,
        device=cell.device,
        **cell.length,
    )
    out = result.to_dict()
    out["skipped"] = False
    return out


def run_trainability_ensemble(params: TrainabilityCell | dict) -> dict:
    """Train every (depth, seed) of one trainability column together (:func:`bnlab.nets.train_ensemble`).

    ``params``: a column :class:`TrainabilityCell` (or its dict) — the keys of :func:`run_trainability_cell`
    with ``depths`` (a list) in place of ``depth`` and ``seeds`` (a list) in place of ``seed``.  Network
    (depth d, seed s) is initialized with seed s
    and draws its batches from a generator seeded with s — the same network and data order as
    :func:`run_trainability_cell` with ``depth=d, seed=s`` gives, trained with the same numbers to
    float32 rounding (``tests/nets/test_ensemble.py``).  Depths are stacked without padding (layer l
    is computed for the networks deeper than l only), so one column costs Σ depths, in a few large
    batched products instead of many tiny ones.

    Returns ``{"networks": [metrics of run_trainability_cell + "depth", "seed"], "skipped": False}``,
    or the skipped metrics; :func:`expand_records` turns its record into one record per network.
    """
    cell = TrainabilityCell.parse(params)
    if cell.depths is None:
        raise ValueError(f"depth={cell.depth!r}, seed={cell.seed!r} is not allowed: an ensemble cell gives depths "
                         f"and seeds (lists)")
    return _column_metrics(cell, _train_networks([(cell, d, s) for d, s in cell.networks]))


def _column_metrics(cell: TrainabilityCell, rows: list[dict] | dict) -> dict:
    """A column cell's metrics from its networks' rows (in ``cell.networks`` order), or the skipped metrics."""
    if isinstance(rows, dict):
        return dict(rows)
    for (d, s), row in zip(cell.networks, rows):
        row.update(depth=d, seed=s)
    return {"networks": rows, "skipped": False}


def _train_networks(nets: Sequence[tuple[TrainabilityCell, int, int]]) -> list[dict] | dict:
    """Train the BN-MLPs ``nets`` = [(cell, depth, seed), …] as one ensemble — each network with its cell's
    γ, β, ε (per-network constants of the stack) and every other setting from the first cell (the callers
    check that they agree); each network's metrics as :func:`run_trainability_cell` returns them, or the
    skipped metrics."""
    from bnlab.nets import train_ensemble

    first = nets[0][0]
    data = _cell_data(first)
    if isinstance(data, dict):
        return data
    train, test, num_classes = data
    models = [_bn_mlp(c, train[0].shape[1], num_classes, depth=d, seed=s) for c, d, s in nets]
    # the optimizer names of optimizer_factory: RMSProp with TensorFlow's decay 0.9 and ε 1e-10
    results = train_ensemble(models, train, test_data=test, lr=first.lr, batch_size=first.batch_size,
                             optimizer=first.optimizer, rmsprop_alpha=0.9, rmsprop_eps=1e-10,
                             seeds=[s for _, _, s in nets], device=first.device, **first.length)
    rows = []
    for r in results:
        row = r.to_dict()
        row["skipped"] = False
        rows.append(row)
    return rows


#: A trainability cell's settings that are per-network constants of one BN-MLP stack (``_BNMLPStack``:
#: (M, 1, 1) tensors), besides depth and seed: cells that differ only in these can train as one ensemble.
PER_NETWORK = ("depth", "seed", "depths", "seeds", "gamma", "beta", "eps")


def ensemble_group(params: dict, scale: str) -> str | None:
    """The batched ensemble a trainability cell trains in (:attr:`Experiment.group`).

    ``paper`` scale (one network per cell): the cell's column — the cells that differ only in ``depth`` and
    ``seed``, one x of the heatmap — trained by :func:`run_trainability_group` and stored one network
    per cell.  A column of the paper's grids is 13–17 networks of width 384, large enough to fill its
    device, and the columns are spread over the GPUs and workers.

    ``small`` scale (one column per cell): every column of the heatmap that differs only in γ, β or ε
    (:data:`PER_NETWORK`) — all x values of a Fig. 5 panel — trains as one ensemble.  On a CPU a
    width-128 network's step is dominated by per-operator overhead, which the columns then share:
    the five panels took 87.0 s as one ensemble each against 139.8 s one column at a time, with the same
    metrics (docs/trainability.md; ``benchmarks/bench_trainability_groups.py``).  Columns that differ in
    B, the learning rate or the training length (Fig. 3) are never grouped: each is a group of its own.
    ``medium`` scale keeps a task per column: its deeper grids (Fig. 5d to depth 720) are layer-bound, not
    overhead-bound, and one task per panel would leave the other workers idle at the end of the run.
    """
    if scale == "paper" and "depths" not in params:
        ignored: tuple[str, ...] = ("depth", "seed", "device")
    elif scale == "small" and "depths" in params:
        ignored = (*PER_NETWORK, "device")
    else:
        return None
    return repr(sorted((k, v) for k, v in params.items() if k not in ignored))


def run_trainability_group(cells: Sequence[TrainabilityCell | dict]) -> list[dict]:
    """Train the cells of one :func:`ensemble_group` as one ensemble; one metrics dict per cell, in order.

    ``cells``: :class:`TrainabilityCell` objects (what the engine hands over) or their dicts, single-network
    cells or columns, that agree on every setting but those of :data:`PER_NETWORK`.  Each cell gets what
    :func:`run_trainability_cell` returns for it, to the rounding of the batched products
    (``tests/reproductions/test_paper_scale.py``, ``tests/reproductions/test_trainability_groups.py``).
    """
    cells = [TrainabilityCell.parse(c) for c in cells]
    if not cells:
        raise ValueError("cells=[] is not allowed: a group holds at least one cell")

    def base(c: TrainabilityCell) -> TrainabilityCell:
        return dataclasses.replace(c, **dict.fromkeys(PER_NETWORK))

    if len({c.depths is None for c in cells}) > 1 or any(base(c) != base(cells[0]) for c in cells[1:]):
        raise ValueError(f"cells={[c.params for c in cells]!r} are not allowed as one group: they differ in more "
                         f"than {', '.join(PER_NETWORK)} (or mix single networks and columns)")
    rows = _train_networks([(c, d, s) for c in cells for d, s in c.networks])
    if isinstance(rows, dict):  # skipped (the data set is missing): every cell says so
        return [dict(rows) for _ in cells]
    out, at = [], 0
    for c in cells:
        mine, at = rows[at:at + len(c.networks)], at + len(c.networks)
        out.append(_column_metrics(c, mine) if c.depths is not None else mine[0])
    return out


def _full_steps(params: dict) -> int:
    """The steps a cell trains: ``steps``, or ``round(epochs · ⌊n_train/batch⌋)`` as :func:`bnlab.nets.train`."""
    if "steps" in params:
        return int(params["steps"])
    return max(1, int(round(float(params["epochs"]) * (int(params["n_train"]) // int(params["batch_size"])))))


def trainability_cost(cells: Sequence[dict]) -> TaskCost:
    """What a trainability task costs (:attr:`Experiment.cost`): its steps and, in multiply-adds, the work
    of one step (forward + backward ≈ 3 × batch × the networks' weights) and of the rest (the test pass)."""
    nets = [n for n in expand_cells(cells)]
    first = nets[0]
    width, features = int(first["width"]), _FEATURES.get(str(first["dataset"]), 784)
    weights = sum(features * width + int(n["depth"]) * width * width + 10 * width for n in nets)
    return TaskCost("column", _full_steps(first), 3.0 * int(first["batch_size"]) * weights,
                    float(int(first["n_test"]) + 1) * weights)


def trainability_shorten(cells: Sequence[dict], steps: int) -> list[dict]:
    """The task cut to ``steps`` training steps (:attr:`Experiment.shorten`): the same networks, data and test."""
    out = []
    for c in cells:
        c = {k: v for k, v in c.items() if k not in ("steps", "epochs")}
        c["steps"] = int(steps)
        out.append(c)
    return out


#: input features of the data sets the trainability cells train on (flattened images)
_FEATURES = {"mnist": 784, "fashion_mnist": 784, "cifar10": 3072, "digits": 64}


def expand_records(records: Sequence[Record]) -> list[Record]:
    """One record per network: an ensemble record (:func:`run_trainability_ensemble`) becomes a record
    with ``depth`` and ``seed`` per network; single-network records pass through."""
    out = []
    for r in records:
        if "depths" not in r.params:
            out.append(r)
            continue
        base = {k: v for k, v in r.params.items() if k not in ("depths", "seeds")}
        if r.metrics.get("skipped", False) or "networks" not in r.metrics:
            out.append(Record({**base, "depth": int(r.params["depths"][0]), "seed": int(r.params["seeds"][0])},
                              r.metrics))
            continue
        for row in r.metrics["networks"]:
            metrics = {k: v for k, v in row.items() if k not in ("depth", "seed")}
            out.append(Record({**base, "depth": row["depth"], "seed": row["seed"]}, metrics))
    return out


def as_columns(cells: Sequence[dict]) -> list[dict]:
    """Group single-network cells that differ only in ``depth`` and ``seed`` into ensemble cells
    (``depths``, ``seeds``: one :func:`run_trainability_ensemble` each), in first-seen order.

    A column trains every depth × seed of it, so a group whose (depth, seed) pairs are not a full
    product is refused."""
    groups: dict[str, list[dict]] = {}
    for c in cells:
        key = repr(sorted((k, v) for k, v in c.items() if k not in ("depth", "seed")))
        groups.setdefault(key, []).append(c)
    out = []
    for members in groups.values():
        depths = sorted({int(c["depth"]) for c in members})
        seeds = sorted({int(c["seed"]) for c in members})
        if len(members) != len(depths) * len(seeds):
            raise ValueError(f"cells={members!r} are not allowed as one column: depths × seeds is not complete")
        base = {k: v for k, v in members[0].items() if k not in ("depth", "seed")}
        out.append({**base, "depths": depths, "seeds": seeds})
    return out


def expand_cells(cells: Sequence[dict]) -> list[dict]:
    """The networks of a grid: ensemble cells (``depths``, ``seeds``) listed one network per dict."""
    out = []
    for c in cells:
        if "depths" not in c:
            out.append(c)
            continue
        base = {k: v for k, v in c.items() if k not in ("depths", "seeds")}
        out.extend({**base, "depth": d, "seed": s} for s in c["seeds"] for d in c["depths"])
    return out


# --------------------------------------------------------------------------- theory
@functools.lru_cache(maxsize=512)
def theory_max_depth(phi: str, batch_size: int, eps: float = 0.0, gamma: float = 1.0, beta: float = 0.0) -> float | None:
    """16ξ, ξ = 1/log λ_G↓ from ``bnlab.theory.analyze`` (Yang et al. 2019 §4); None if unavailable.

    Infinite (returned as ``inf``) when λ_G↓ ≤ 1 (no gradient explosion).
    """
    from bnlab.theory import analyze

    try:
        res = analyze(phi, int(batch_size), eps=float(eps), gamma=float(gamma), beta=float(beta))
    except (ValueError, ArithmeticError) as exc:
        # a plot/report must not die on one theory point; say so and leave a gap in the line
        warnings.warn(f"16ξ unavailable for {phi}, B={batch_size}, ε={eps}, γ={gamma}, β={beta}: {exc}", stacklevel=2)
        return None
    if res.max_trainable_depth is None:
        # the theory has no rate here (e.g. a non-BSB1 fixed point); its warnings say why
        warnings.warn(f"16ξ undefined for {phi}, B={batch_size}, ε={eps}, γ={gamma}, β={beta}: "
                      f"{'; '.join(map(str, getattr(res, 'warnings', ()))) or 'no rate'}", stacklevel=2)
        return None
    val = float(res.max_trainable_depth)
    return val if math.isfinite(val) else math.inf


#: What the rows of :func:`compare_depths` test (shown in the report under every trainability figure).
DEPTH_CHECKS = (
    Check("max trainable depth at", f"a cell counts as trained when its test accuracy (mean over its seeds) exceeds "
          f"chance + ½·(best accuracy of the sweep − chance); the measured maximum trainable depth at an x is the "
          f"deepest grid depth that trains.  Agrees when the measured boundary [deepest trainable depth, next grid "
          f"depth] overlaps [16ξ/{DEPTH_WINDOW:g}, {DEPTH_WINDOW:g}·16ξ]; where the deepest grid depth trains and "
          f"lies below 16ξ/{DEPTH_WINDOW:g}, the grid cannot test the claim and the row is not judged; with one seed "
          f"per cell, where counting one cell within {NEAR_THRESHOLD:g} of the threshold (about one standard deviation "
          f"of a single network's accuracy over seeds at the small budgets) the other way would change the reading, "
          f"the row is too close to call and not judged"),
    Check("cells with depth ≥ 2·16ξ that fail to train", "agrees when every such cell fails"),
    Check("cells with depth ≤ 16ξ/2 that train", "agrees when at least 80 % of them train"),
)


def describe_grid(cells: Sequence[dict]) -> dict[str, str]:
    """The settings of a trainability grid in words, read off the cells themselves (so the report's
    scale table cannot drift from the grid): width, depths, BN batch, training batch, length, η,
    training images, seeds."""
    cells = expand_cells(cells)

    def values(key):
        return sorted({c[key] for c in cells if key in c})

    def listed(key):
        return ", ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values(key))

    opt = {"sgd": "SGD", "rmsprop": "RMSProp"}.get(str(cells[0].get("optimizer", "sgd")) if cells else "sgd", "")
    lengths = [f"{v} {opt} steps" for v in values("steps")] + [f"{v:g} epochs" for v in values("epochs")]
    ratios = sorted({round(c["lr"] / c["bn_batch"], 12) for c in cells})
    return {
        "width": listed("width"),
        "depths": listed("depth"),
        "bn_batch": listed("bn_batch"),
        "batch_size": listed("batch_size"),
        "length": ", ".join(lengths),
        "lr": ", ".join(f"{r:g}·B" for r in ratios),
        "n_train": listed("n_train"),
        "seeds": str(len(values("seed"))),
    }


# --------------------------------------------------------------------------- records → tables
def _usable(records: Sequence[Record]) -> list[Record]:
    return [r for r in expand_records(records) if not r.metrics.get("skipped", False)]


def _accuracy_table(records: Sequence[Record], xkey: str):
    """(xs, depths, mean accuracy array [depth, x]) over seeds; NaN where missing."""
    recs = _usable(records)
    xs = sorted({float(r.params[xkey]) for r in recs})
    depths = sorted({int(r.params["depth"]) for r in recs})
    acc = np.full((len(depths), len(xs)), np.nan)
    sums: dict[tuple[int, int], list[float]] = {}
    for r in recs:
        key = (depths.index(int(r.params["depth"])), xs.index(float(r.params[xkey])))
        sums.setdefault(key, []).append(float(r.metrics["test_accuracy"]))
    for (i, j), v in sums.items():
        acc[i, j] = float(np.mean(v))
    return np.array(xs), np.array(depths), acc


def trainable_threshold(records: Sequence[Record]) -> float:
    """chance + ½·(best accuracy − chance): the accuracy above which a cell counts as trained."""
    recs = _usable(records)
    chance = float(np.mean([r.metrics["chance"] for r in recs]))
    best = max(float(r.metrics["test_accuracy"]) for r in recs)
    return chance + 0.5 * (best - chance)


def measured_max_depth(depths: np.ndarray, acc_column: np.ndarray, threshold: float) -> int | None:
    """Deepest grid depth whose accuracy exceeds ``threshold`` (None if none does)."""
    ok = [int(d) for d, a in zip(depths, acc_column) if np.isfinite(a) and a > threshold]
    return max(ok) if ok else None


def _edges(v: np.ndarray, log: bool) -> np.ndarray:
    t = np.log(v) if log else v.astype(float)
    if len(t) == 1:
        e = np.array([t[0] - 0.5, t[0] + 0.5])
    else:
        mid = 0.5 * (t[1:] + t[:-1])
        e = np.concatenate([[t[0] - (mid[0] - t[0])], mid, [t[-1] + (t[-1] - mid[-1])]])
    return np.exp(e) if log else e


def heatmap(
    records: Sequence[Record],
    outdir: Path,
    *,
    name: str,
    xkey: str,
    xlabel: str,
    xlog: bool,
    title: str,
    theory_curve,
) -> list[Path]:
    """Write ``<name>.png`` and ``.svg``: accuracy over (x, depth) with the white dashed 16ξ curve.

    ``theory_curve(x_fine) -> array`` gives 16ξ at the x values (NaN where unknown).  Both axes
    are ticked at the grid's own values.  No figure (an empty list) when every cell was skipped:
    the report states the reason instead of drawing a placeholder.
    """
    recs = _usable(records)
    if not recs:
        return []
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    xs, depths, acc = _accuracy_table(recs, xkey)
    xe, ye = _edges(xs, xlog), _edges(depths.astype(float), False)
    mesh = ax.pcolormesh(xe, ye, acc, cmap="viridis", vmin=0.0, vmax=1.0, shading="flat")
    fig.colorbar(mesh, ax=ax, label="test accuracy")
    if xlog:
        ax.set_xscale("log")
    # 16 theory points: each analyze() call costs ~0.5 s for non-closed-form φ
    # (over the swept range only: no theory extrapolated beyond the measured cells)
    x_fine = np.geomspace(xs[0], xs[-1], 16) if xlog else np.linspace(xs[0], xs[-1], 16)
    y = np.asarray(theory_curve(x_fine), dtype=float)
    finite = y[np.isfinite(y)]
    if finite.size and finite.min() > ye[-1]:
        # the prediction lies above every plotted depth: say where, instead of a line off the plot
        ax.text(0.5, 0.97, f"16ξ = {finite.min():.0f}–{finite.max():.0f} (theory): above the deepest grid depth",
                transform=ax.transAxes, ha="center", va="top", fontsize=8, color="w")
    elif finite.size:
        ax.plot(x_fine, np.minimum(y, ye[-1] * 10), "w--", lw=2, label="16ξ (theory)")
        ax.legend(loc="upper right", fontsize=8, framealpha=0.3)
    elif np.any(np.isposinf(y)):
        ax.text(0.5, 0.97, "16ξ = ∞ over this range (λ_G↓ ≤ 1: no gradient explosion)", transform=ax.transAxes,
                ha="center", va="top", fontsize=8, color="w")
    else:
        ax.text(0.02, 0.98, "16ξ undefined over this range (BSB2, or the theory raised: see the warnings)", transform=ax.transAxes,
                va="top", fontsize=6, color="w", wrap=True)
    ax.set_ylim(ye[0], ye[-1])
    ax.set_xlim(xe[0], xe[-1])
    grid_ticks(ax, "x", xs)
    grid_ticks(ax, "y", depths)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("depth L")
    # no line break inside "B = 32": non-breaking spaces around "=" (textwrap splits on ASCII spaces only)
    ax.set_title(textwrap.fill(title.replace(" = ", "\u00a0=\u00a0"), 70, break_on_hyphens=False), fontsize=9)
    fig.tight_layout()
    return save_figure(fig, outdir, name)


def _deepest_text(d: int | None) -> str:
    return "none" if d is None else str(d)


def _boundary(depths: np.ndarray, acc_column: np.ndarray, threshold: float) -> tuple[int | None, float, float]:
    """(deepest trainable depth or None, lo, hi): the measured boundary lies in [lo, hi] — between the deepest
    trainable depth and the next grid depth (∞ past the grid; [0, first depth] where nothing trains)."""
    d = measured_max_depth(depths, acc_column, threshold)
    if d is None:
        return None, 0.0, float(depths[0])
    k = int(np.searchsorted(depths, d))
    return d, float(d), float(depths[k + 1]) if k + 1 < len(depths) else math.inf


def _reading(lo: float, hi: float, t: float) -> bool | None:
    """Whether the boundary [lo, hi] overlaps the window around 16ξ = ``t`` (finite or ∞); None where the deepest
    grid depth trains and lies below 16ξ/DEPTH_WINDOW (the grid ends before the window: it cannot test the claim)."""
    if math.isinf(hi) and math.isfinite(t) and lo < t / DEPTH_WINDOW:
        return None
    return bool(lo <= DEPTH_WINDOW * t and hi >= t / DEPTH_WINDOW)


def _deciding_near_cells(depths: np.ndarray, acc_column: np.ndarray, threshold: float,
                         t: float) -> list[tuple[int, float, bool | None]]:
    """The cells of one column within :data:`NEAR_THRESHOLD` of ``threshold`` that decide its reading:
    (depth, accuracy, the reading were that cell alone counted the other way), for each such cell."""
    base = _reading(*_boundary(depths, acc_column, threshold)[1:], t)
    out = []
    for i, a in enumerate(acc_column):
        if np.isfinite(a) and abs(a - threshold) < NEAR_THRESHOLD:
            other = acc_column.copy()
            other[i] = threshold - 1.0 if a > threshold else threshold + 1.0
            flipped = _reading(*_boundary(depths, other, threshold)[1:], t)
            if flipped != base:
                out.append((int(depths[i]), float(a), flipped))
    return out


def _reading_text(reading: bool | None) -> str:
    return {True: "agree", False: "disagree", None: "be untestable (the grid would end below the window)"}[reading]


def compare_depths(records: Sequence[Record], *, xkey: str, xname: str, theory_at) -> list[Comparison]:
    """Rows "max trainable depth at x: paper ≈ 16ξ = …, bnlab: deepest trainable depth = …".

    ``agrees`` is True when the measured boundary interval [deepest trainable
    depth, next grid depth] overlaps [16ξ/DEPTH_WINDOW, DEPTH_WINDOW·16ξ]; None when the
    theory is unavailable, when the deepest grid depth trains and lies below
    16ξ/DEPTH_WINDOW (the grid ends before the window: it cannot contradict the
    claim, so the row is not counted as agreement), or — with one seed per cell — when
    counting one cell within :data:`NEAR_THRESHOLD` of the trainable threshold the other
    way would change the row's reading (too close to call: the seed would decide it).
    See :data:`DEPTH_CHECKS`.
    """
    recs = _usable(records)
    if not recs:
        reasons = sorted({str(r.metrics.get("skip_reason", "")) for r in records}) or ["no records"]
        return [Comparison("max trainable depth", "≈ 16ξ", "skipped: " + "; ".join(reasons), None,
                           reason="every cell was skipped: " + "; ".join(reasons))]
    xs, depths, acc = _accuracy_table(recs, xkey)
    thr = trainable_threshold(recs)
    seeds = sorted({int(r.params.get("seed", 0)) for r in recs})
    per_seed = {sd: _accuracy_table([r for r in recs if int(r.params.get("seed", 0)) == sd], xkey) for sd in seeds}
    rows = []
    for j, x in enumerate(xs):
        d, lo, hi = _boundary(depths, acc[:, j], thr)
        t = theory_at(x)
        xs_txt = f"{x:g}"
        if d is None:
            meas = f"no depth trains (accuracy ≤ {thr:.2f})"
        else:
            meas = f"deepest depth with accuracy > {thr:.2f} = {d}" + (
                f" (fails at {int(hi)})" if math.isfinite(hi) else " (deepest in grid)")
        # how many restarts the boundary rests on, and where each restart alone puts it
        if len(seeds) == 1:
            meas += "; 1 seed"
        else:
            alone = []
            for sd in seeds:
                sxs, sdepths, sacc = per_seed[sd]
                col = list(sxs).index(x) if x in sxs else None
                alone.append("–" if col is None else _deepest_text(measured_max_depth(sdepths, sacc[:, col], thr)))
            meas += f"; mean of {len(seeds)} seeds (each alone: {', '.join(alone)})"
        quantity = f"max trainable depth at {xname}={xs_txt}"
        if t is None:
            rows.append(Comparison(quantity, "≈ 16ξ (theory unavailable)", meas, None,
                                   reason="the theory has no 16ξ here (no BSB1 rate, or it raised: see the warnings)"))
            continue
        paper = "16ξ = ∞ (no explosion)" if not math.isfinite(t) else f"≈ 16ξ = {t:.1f}"
        agree = _reading(lo, hi, t)
        if agree is None:
            rows.append(Comparison(quantity, f"≈ 16ξ = {t:.1f}",
                                   meas + f"; the grid ends below 16ξ/{DEPTH_WINDOW:g} = {t / DEPTH_WINDOW:.0f}: "
                                   "not tested", None,
                                   reason=f"the deepest grid depth trains and lies below 16ξ/{DEPTH_WINDOW:g}: the "
                                   "grid cannot contradict the claim"))
            continue
        near = _deciding_near_cells(depths, acc[:, j], thr, t) if len(seeds) == 1 else []
        if near:
            cells = "; ".join(f"depth {dd} at {a:.3f} (counted the other way the row would {_reading_text(r)})"
                              for dd, a, r in near)
            rows.append(Comparison(quantity, paper, meas + f" — would {_reading_text(agree)}; too close to call", None,
                                   reason=f"too close to call on one seed: {cells} — within {NEAR_THRESHOLD:g} of the "
                                   f"threshold {thr:.3f}, about one standard deviation of a single network's accuracy "
                                   "over seeds at this budget, so the seed would decide the row (NEAR_THRESHOLD in "
                                   "bnlab.reproductions.trainability)", too_close_to_call=True))
            continue
        rows.append(Comparison(quantity, paper, meas, agree))
    # the qualitative claim: far beyond 16ξ nothing trains, well below it nets train
    above = below = above_ok = below_ok = 0
    for j, x in enumerate(xs):
        t = theory_at(x)
        if t is None or not math.isfinite(t):
            continue
        for i, d in enumerate(depths):
            if not np.isfinite(acc[i, j]):
                continue
            if d >= 2 * t:
                above += 1
                above_ok += acc[i, j] <= thr
            elif d <= t / 2:
                below += 1
                below_ok += acc[i, j] > thr
    if above:
        rows.append(Comparison("cells with depth ≥ 2·16ξ that fail to train", "all", f"{above_ok}/{above}", bool(above_ok == above)))
    if below:
        rows.append(Comparison("cells with depth ≤ 16ξ/2 that train", "all (≥ 80% here)", f"{below_ok}/{below}", bool(below_ok >= 0.8 * below)))
    return rows


def boundary_summary(records: Sequence[Record], *, xkey: str, xname: str, theory_at) -> str:
    """One sentence of the measured boundaries, read off ``records`` (so a section's prose cannot disagree
    with its table): the deepest trainable depth and the failing next depth at each x beside 16ξ, whether
    each lies in the window of :data:`DEPTH_CHECKS`, where the boundary sits relative to 16ξ, and how
    many restarts it rests on."""
    recs = _usable(records)
    if not recs:
        return "Nothing ran in this run (every cell was skipped)."
    xs, depths, acc = _accuracy_table(recs, xkey)
    thr = trainable_threshold(recs)
    seeds = sorted({int(r.params.get("seed", 0)) for r in recs})
    deepest, failing, theory, ratios, outside, untested, close = [], [], [], [], [], [], []
    for j, x in enumerate(xs):
        d, lo, hi = _boundary(depths, acc[:, j], thr)
        t = theory_at(x)
        deepest.append(_deepest_text(d))
        failing.append(str(int(hi)) if d is not None and math.isfinite(hi) else "–")
        theory.append("?" if t is None else ("∞" if not math.isfinite(t) else f"{t:.1f}"))
        if t is None:
            continue
        reading = _reading(lo, hi, t)
        if reading is None:
            untested.append(f"{x:g}")  # the grid ends below the window (compare_depths does not judge it)
            continue
        if len(seeds) == 1 and _deciding_near_cells(depths, acc[:, j], thr, t):
            close.append(f"{x:g}")  # too close to call on one seed (compare_depths does not judge it)
            continue
        if math.isfinite(t) and d is not None:
            ratios.append(d / t)
        if not reading:
            outside.append(f"{x:g}")
    judged = len(xs) - len(untested) - len(close)
    where = ("inside the window at every judged " + xname if not outside else
             f"outside the window at {xname} = {', '.join(outside)}") if judged else "no boundary could be judged"
    if untested:
        where += (f"; at {xname} = {', '.join(untested)} the deepest grid depth trains and lies below "
                  f"16ξ/{DEPTH_WINDOW:g}, so those rows are not judged")
    if close:
        where += (f"; at {xname} = {', '.join(close)} the reading rests on a cell within {NEAR_THRESHOLD:g} of the "
                  "threshold on one seed, so those rows are not judged (too close to call)")
    trained = [int(d) for i, d in enumerate(depths) if np.any(acc[i] > thr)]
    text = (f"Measured in this run ({len(seeds)} seed{'s' if len(seeds) != 1 else ''}, accuracy threshold "
            f"{thr:.2f}): the deepest trainable depth is {', '.join(deepest)} (next grid depth {', '.join(failing)}) "
            f"at {xname} = {', '.join(f'{x:g}' for x in xs)}, against 16ξ = {', '.join(theory)} — {where}")
    if ratios:
        text += f"; the boundary sits at {min(ratios):.2f}–{max(ratios):.2f} × 16ξ"
    if trained and trained[-1] < depths[-1]:
        text += f"; nothing deeper than {trained[-1]} trains"
    return text + "."
