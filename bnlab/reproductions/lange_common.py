"""What Lange et al.'s training figures share: the (batch size, method, seed) grid, a trained cell's
metrics, the per-cell final accuracies and the accuracy/loss-per-epoch figure.

Used by :mod:`bnlab.reproductions.lange_fc` (Figs. 3-4, the fully connected network),
:mod:`bnlab.reproductions.lange_fig5` (Fig. 5, the 5-layer CNN) and, for the labels and the mean,
:mod:`bnlab.reproductions.lange_resnet` (Figs. 6-7); each figure keeps its own methods,
scales, cell runner and paper comparisons.  This module declares no experiment.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

from bnlab.experiments.spec import Record
from bnlab.reproductions.plotting import pyplot, save_figure

__all__ = ["LABEL", "training_grid", "extra_seed_cells", "train_cell", "final_accuracies", "finals_by_seed",
           "paired_difference", "seeds_text", "plot_training_curves", "mean"]

#: The legend name of every method a Lange figure trains.
LABEL = {"none": "vanilla", "bn": "BN", "brn": "Batch Renorm", "ln": "LN", "bnp": "BNP"}
_COLORS = {"none": "tab:gray", "bn": "tab:blue", "brn": "tab:purple", "ln": "tab:green", "bnp": "tab:red"}


def training_grid(scales: Mapping[str, dict], methods: Mapping[int, Sequence[str]], scale: str) -> list[dict]:
    """One MNIST cell per (batch size, method, seed) of ``methods`` at ``scales[scale]``.

    ``scales[scale]`` holds ``train_size`` and ``epochs`` per batch size, ``test_size`` and ``seeds``.
    A ``scale`` not in ``scales`` raises ``ValueError`` naming it.
    """
    from bnlab._validation import check_choice

    s = scales[check_choice("scale", scale, tuple(scales))]
    return [
        dict(dataset="mnist", batch_size=b, norm=norm, epochs=s["epochs"][b], train_size=s["train_size"][b],
             test_size=s["test_size"], seed=seed)
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


def train_cell(model: str, params: dict) -> dict:
    """Train ``model`` ("fc" or "cnn") on one grid cell (:func:`training_grid`) with
    :func:`bnlab.optim.training.train_network`; the cell's metrics, or skipped ones when the data set is missing."""
    from bnlab.data import DatasetNotFoundError
    from bnlab.optim.training import train_network

    try:
        res = train_network(model=model, norm=params["norm"], dataset=params["dataset"],
                            batch_size=params["batch_size"], epochs=params["epochs"],
                            train_size=params["train_size"], test_size=params["test_size"], seed=params["seed"],
                            device=params.get("device", "cpu"))
    except DatasetNotFoundError as exc:
        return {"skipped": True, "skip_reason": str(exc)}
    return {"trainable": True, "epochs": res.epochs, "test_accuracy": res.test_accuracy,
            "final_train_loss": res.final_train_loss, "diverged": res.diverged, "learning_rate": res.learning_rate,
            "steps": res.steps, "seconds": res.seconds}


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
