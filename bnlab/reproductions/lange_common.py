"""What Lange et al.'s training figures share: the (batch size, method, seed) grid, a trained cell's
metrics, the per-cell final accuracies and the accuracy/loss-per-epoch figure.

Used by :mod:`bnlab.reproductions.lange_fc` (Figs. 3-4, the fully connected network),
:mod:`bnlab.reproductions.lange_fig5` (Fig. 5, the 5-layer CNN) and, for the labels and the mean,
:mod:`bnlab.reproductions.lange_resnet` (Figs. 6-7); each figure keeps its own methods,
scales, cell runner and paper comparisons.  This module declares no experiment.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Mapping, Sequence

from bnlab.experiments.cells import Cell, cell_param
from bnlab.experiments.spec import Record, TaskCost
from bnlab.reproductions.plotting import pyplot, save_figure

__all__ = ["LangeCell", "LABEL", "CHUNKED",
           "training_grid", "extra_seed_cells", "train_cell", "chunked_group", "run_chunked_cells",
           "cell_cost", "shorten_cells", "final_accuracies", "finals_by_seed", "paired_difference", "seeds_text",
           "plot_training_curves", "mean"]

#: ``data_order`` of the paper-scale cells that train in chunks of one epoch (bnlab.reproductions.chunked), so
#: that the seeds of one (batch size, method) train as one batched ensemble
CHUNKED = "per_chunk"

#: The legend name of every method a Lange figure trains.
LABEL = {"none": "vanilla", "bn": "BN", "brn": "Batch Renorm", "ln": "LN", "bnp": "BNP", "bn4": "BN w/ 4 things"}
_COLORS = {"none": "tab:gray", "bn": "tab:blue", "brn": "tab:purple", "ln": "tab:green", "bnp": "tab:red",
           "bn4": "tab:orange"}


def training_grid(scales: Mapping[str, dict], methods: Mapping[int, Sequence[str]], scale: str,
                  chunked: Sequence[str] = ()) -> list[dict]:
    """One MNIST cell per (batch size, method, seed) of ``methods`` at ``scales[scale]``.

    ``scales[scale]`` holds ``train_size`` and ``epochs`` per batch size, ``test_size`` and ``seeds``.
    At ``paper`` scale the cells of the methods in ``chunked`` train one epoch per chunk
    (``data_order="per_chunk"``), the seeds of one (batch size, method) as one ensemble
    (:func:`chunked_group`, :func:`run_chunked_cells`).  A ``scale`` not in ``scales`` raises
    ``ValueError`` naming it.
    """
    from bnlab._validation import check_choice

    s = scales[check_choice("scale", scale, tuple(scales))]
    return [
        dict(dataset="mnist", batch_size=b, norm=norm, epochs=s["epochs"][b], train_size=s["train_size"][b],
             test_size=s["test_size"], seed=seed,
             # (BN and Batch Renorm at batch 1 record the first step's error: nothing to train in chunks)
             **({"data_order": CHUNKED} if scale == "paper" and norm in chunked
                and not (b == 1 and norm in ("bn", "brn")) else {}))
        for b, norms in methods.items() for norm in norms for seed in s["seeds"]
    ]


def extra_seed_cells(cells: Sequence[dict], pairs, seeds: Sequence[int]) -> list[dict]:
    """Copies of the cells whose (batch size, method) is in ``pairs``, one per seed of ``seeds`` that the grid
    does not already hold: restarts where a comparison needs an interval, without training every method again."""
    have = {(c["batch_size"], c["norm"], c["seed"]) for c in cells}
    out = []
    for c in cells:
        if (c["batch_size"], c["norm"]) in pairs and c["seed"] == min(s for (b, n, s) in have
                                                                       if (b, n) == (c["batch_size"], c["norm"])):
            out += [{**c, "seed": s} for s in seeds if (c["batch_size"], c["norm"], s) not in have]
    return out


@dataclass(frozen=True, kw_only=True)
class LangeCell(Cell):
    """The parameters of a Lange et al. training cell (:func:`training_grid`): one network with ``norm`` trained
    on ``dataset`` at mini-batch ``batch_size`` for ``epochs`` (fractional allowed), on the first
    ``train_size`` / ``test_size`` images drawn with ``seed`` (all when null).  ``data_order="per_chunk"``
    (the ``paper`` grids) trains one epoch per chunk (:func:`run_chunked_cells`)."""

    dataset: Literal["mnist", "fashion_mnist", "cifar10", "cifar100", "digits"]  # bnlab.data.DATASET_NAMES
    batch_size: int = cell_param(minimum=1)
    # bnlab.optim.training.TRAIN_NORMS, spelled out: importing it would import torch when the registry
    # discovers the reproductions (tests/experiments/test_cells.py checks that the two agree)
    norm: Literal["bnp", "bnp_gn", "none", "bn", "brn", "ln", "gn"]
    epochs: float = cell_param(minimum=0.0, strict_minimum=True)
    train_size: int | None = cell_param(minimum=1)
    test_size: int | None = cell_param(minimum=1)
    seed: int = cell_param(minimum=0)
    data_order: Literal["per_chunk"] | None = None
    device: str = "cpu"  # set by the engine for a GPU; not part of the cell's identity


def train_cell(model: str, params: LangeCell | dict) -> dict:
    """Train ``model`` ("fc" or "cnn") on one grid cell (:func:`training_grid`; a :class:`LangeCell` or its
    dict) with :func:`bnlab.optim.training.train_network`; the cell's metrics, or skipped ones when the data
    set is missing."""
    from bnlab.data import DatasetNotFoundError
    from bnlab.optim.training import train_network

    cell = LangeCell.parse(params)
    if cell.data_order == CHUNKED:
        return run_chunked_cells(model, [cell], ensemble=False)[0]
    try:
        res = train_network(model=model, norm=cell.norm, dataset=cell.dataset, batch_size=cell.batch_size,
                            epochs=cell.epochs, train_size=cell.train_size, test_size=cell.test_size, seed=cell.seed,
                            device=cell.device)
    except DatasetNotFoundError as exc:
        return {"skipped": True, "skip_reason": str(exc)}
    return {"trainable": True, "epochs": res.epochs, "test_accuracy": res.test_accuracy,
            "final_train_loss": res.final_train_loss, "diverged": res.diverged, "learning_rate": res.learning_rate,
            "steps": res.steps, "seconds": res.seconds}


def chunked_group(params: dict, scale: str) -> str | None:
    """The ensemble a chunked cell trains in: the seeds of one (batch size, method) — and of one seed only
    where the cells draw seeded subsets (``train_size``/``test_size`` set), whose data differ by seed."""
    if params.get("data_order") != CHUNKED:
        return None
    drop = ("device",) if params.get("train_size") is not None or params.get("test_size") is not None \
        else ("seed", "device")
    return repr(sorted((k, v) for k, v in params.items() if k not in drop))


def run_chunked_cells(model: str, cells: Sequence[LangeCell | dict], ensemble: bool = True) -> list[dict]:
    """Train the chunked cells of one :func:`chunked_group` — the network of
    :func:`bnlab.optim.training.train_network` with its learning rate, one epoch per chunk
    (:func:`bnlab.reproductions.chunked.train_in_chunks`), a test pass after each — and return each cell's
    :func:`train_cell` metrics.  ``ensemble=False`` trains one network at a time; so do conv nets on a CPU
    (a loop is faster there than vmap's grouped convolutions): the same numbers to rounding either way.
    """
    import math
    import time

    from bnlab.data import DatasetNotFoundError, load_dataset
    from bnlab.optim.training import build_network, default_learning_rate
    from bnlab.reproductions.chunked import train_in_chunks

    cells = [LangeCell.parse(c) for c in cells]
    if not cells:
        raise ValueError("cells=[] is not allowed: a group holds at least one cell")
    first = cells[0]
    if any(dataclasses.replace(c, seed=first.seed) != first for c in cells) or first.data_order != CHUNKED:
        raise ValueError(f"cells={[c.params for c in cells]!r} are not allowed as one group: they differ in more "
                         f"than the seed or are not chunked")
    try:
        train = load_dataset(first.dataset, "train")
        test = load_dataset(first.dataset, "test")
    except DatasetNotFoundError as exc:
        return [{"skipped": True, "skip_reason": str(exc)} for _ in cells]
    if first.train_size is not None:  # seeded draws, as train_network's (one seed per group then)
        train = train.subset(first.train_size, seed=first.seed)
    if first.test_size is not None:
        test = test.subset(first.test_size, seed=first.seed)
    b, norm = first.batch_size, first.norm
    lr = default_learning_rate(model, norm, b)
    nets = [build_network(model, norm, tuple(train.x.shape[1:]), train.num_classes, seed=c.seed) for c in cells]
    per_epoch = len(train.y) // b
    total = max(1, int(round(first.epochs * per_epoch)))
    bounds = sorted({per_epoch * e for e in range(1, total // per_epoch + 1)} | {total})
    device = first.device
    together = ensemble and (model == "fc" or str(device).startswith("cuda"))
    t0 = time.perf_counter()
    results = train_in_chunks(nets, train, bounds, lrs=[lr] * len(cells), seeds=[c.seed for c in cells],
                              batch_size=b, device=device, ensemble=together, test_data=test)
    seconds = time.perf_counter() - t0
    out = []
    for r in results:
        rows = [{"epoch": ch["step"] // per_epoch if ch["step"] % per_epoch == 0 else round(ch["step"] / per_epoch, 6),
                 "train_loss": ch["train_loss"], "test_accuracy": ch["test_accuracy"]} for ch in r.chunks]
        final_loss = r.final_train_loss
        acc = rows[-1]["test_accuracy"] if rows and not r.diverged else 1.0 / train.num_classes
        if r.diverged:  # as train_network: a last row at the step it stopped
            rows.append({"epoch": round(r.steps / per_epoch, 6), "train_loss": final_loss, "test_accuracy": acc})
        out.append({"trainable": True, "epochs": rows, "test_accuracy": acc,
                    "final_train_loss": final_loss if math.isfinite(final_loss) else None, "diverged": r.diverged,
                    "learning_rate": lr, "steps": r.steps, "seconds": seconds})
    return out


def cell_cost(model: str, cells: Sequence[dict]) -> TaskCost:
    """A Lange task's SGD steps and relative work (batch × networks per step; the test passes for the rest),
    for a plan; one kind per (model, method, batch size) — BNP's step and a batch of 1 cost differently."""
    from bnlab.experiments.spec import TaskCost

    c = cells[0]
    n_train = c.get("train_size") or (60_000 if c["dataset"] == "mnist" else 50_000)
    n_test = c.get("test_size") or 10_000
    steps = max(1, int(round(float(c["epochs"]) * (n_train // int(c["batch_size"])))))
    epochs = max(1, math.ceil(float(c["epochs"])))
    return TaskCost(f"{model}-{c['norm']}-b{c['batch_size']}", steps, float(int(c["batch_size"]) * len(cells)),
                    float(n_test * epochs * len(cells)))


def shorten_cells(cells: Sequence[dict], steps: int) -> list[dict]:
    """The task cut to about ``steps`` SGD steps (``epochs`` scaled down, one chunk), for a plan's pilot."""
    out = []
    for c in cells:
        c = dict(c)
        n_train = c.get("train_size") or (60_000 if c["dataset"] == "mnist" else 50_000)
        c["epochs"] = min(float(c["epochs"]), float(steps) / (n_train // int(c["batch_size"])))
        out.append(c)
    return out


def final_accuracies(records: Sequence[Record]) -> dict[tuple[int, str], list[float]]:
    """Final test accuracy of every trained, non-diverged cell, keyed by (batch size, method)."""
    out: dict[tuple[int, str], list[float]] = {}
    for r in records:
        m = r.metrics
        if m.get("trainable") and m.get("test_accuracy") is not None and not m.get("diverged"):
            out.setdefault((r.params["batch_size"], r.params["norm"]), []).append(m["test_accuracy"])
    return out


def finals_by_seed(records: Sequence[Record]) -> dict[tuple[int, str], dict[int, float]]:
    """Final test accuracy of every trained, non-diverged cell: ``{(batch size, method): {seed: accuracy}}``."""
    out: dict[tuple[int, str], dict[int, float]] = {}
    for r in records:
        m = r.metrics
        if m.get("trainable") and m.get("test_accuracy") is not None and not m.get("diverged"):
            out.setdefault((r.params["batch_size"], r.params["norm"]), {})[int(r.params["seed"])] = m["test_accuracy"]
    return out


def paired_difference(records: Sequence[Record], batch: int, a: str, b: str) -> tuple[float, float, float, int] | None:
    """Mean of ``a − b`` over the seeds both methods finished at ``batch`` and its 95 % t-interval:
    ``(mean, low, high, n seeds)``; the interval is (−inf, inf) with one seed; None without a common seed."""
    import math

    from scipy import stats

    by = finals_by_seed(records)
    xa, xb = by.get((batch, a), {}), by.get((batch, b), {})
    common = sorted(set(xa) & set(xb))
    if not common:
        return None
    d = [xa[s] - xb[s] for s in common]
    m = sum(d) / len(d)
    if len(d) < 2:
        return m, -math.inf, math.inf, 1
    sd = math.sqrt(sum((x - m) ** 2 for x in d) / (len(d) - 1))
    half = float(stats.t.ppf(0.975, len(d) - 1)) * sd / math.sqrt(len(d))
    return m, m - half, m + half, len(d)


def seeds_text(n: int) -> str:
    """"1 seed" or "n seeds, 95 % t-interval", for a comparison row."""
    return "1 seed: no interval" if n == 1 else f"{n} seeds, 95 % t-interval"


def mean(values: Sequence[float]) -> float:
    """The arithmetic mean of a non-empty sequence."""
    return sum(values) / len(values)


def plot_training_curves(records: Sequence[Record], outdir: Path, *, methods: Mapping[int, Sequence[str]],
                         panel_title: str, suptitle: str, stem: str) -> list[Path]:
    """One panel per batch size (largest first): test accuracy (solid, min-max band over seeds) and
    training loss (dashed, second axis) per epoch for each method; saved as ``stem``.png/.svg.

    ``panel_title`` is formatted with ``b`` (the batch size).  Returns the written paths ([] without records).
    """
    import numpy as np

    plt = pyplot()
    batches = sorted({r.params["batch_size"] for r in records}, reverse=True)
    if not batches:
        return []
    fig, axes = plt.subplots(1, len(batches), figsize=(4.6 * len(batches), 3.8), squeeze=False)
    for ax, b in zip(axes[0], batches):
        ax2 = ax.twinx()
        for norm in methods.get(b, ()):
            runs = [r.metrics for r in records if r.params["batch_size"] == b and r.params["norm"] == norm
                    and r.metrics.get("epochs")]
            if not runs:
                continue
            ep = np.array([row["epoch"] for row in runs[0]["epochs"]])
            acc = np.array([[row["test_accuracy"] for row in m["epochs"]] for m in runs
                            if len(m["epochs"]) == len(ep)], dtype=float)
            loss = np.array([[row["train_loss"] for row in m["epochs"]] for m in runs
                             if len(m["epochs"]) == len(ep)], dtype=float)
            ax.plot(ep, acc.mean(0), "-o", ms=3, color=_COLORS[norm], label=LABEL[norm])
            if len(acc) > 1:
                ax.fill_between(ep, acc.min(0), acc.max(0), color=_COLORS[norm], alpha=0.2)
            ax2.plot(ep, loss.mean(0), "--", color=_COLORS[norm])
        ax.set_xlabel("epoch")
        ax.set_ylabel("test accuracy (solid)")
        ax2.set_ylabel("training loss (dashed)")
        ax.set_title(panel_title.format(b=b), fontsize=10)
        ax.legend(fontsize=8, loc="center right")
    fig.suptitle(suptitle, fontsize=10)
    fig.tight_layout()
    return save_figure(fig, outdir, stem)
