"""Lange et al. (BNP), Figs. 3-4: the fully connected network at mini-batch sizes 60, 6 and 1.

The network: three hidden layers of 100, ReLU, post-activation normalization, Glorot-uniform
weights, SGD with the paper's tuned learning rates (Table 2; the batch-6 and batch-1 rows are the
paper's CIFAR-10 values, the only ones it reports there).  Methods: vanilla (``none``), BN, Batch
Renorm (batch 6 and 1), LayerNorm and BNP (the vanilla network + ``bnlab.optim.BNPreconditioner``
with ρ = 0.99, ε₁ = 1e-2, ε₂ = 1e-4).  The paper runs MNIST and CIFAR-10 at batch 60 (Fig. 3) and
CIFAR-10 at batch 6 and 1 (Fig. 4); CIFAR-10 is not available offline here, so every cell uses
MNIST (stated in the report).

At batch 1 BN and Batch Renorm are attempted for real: the cell records the error the first
training step raises (the mini-batch variance of one sample is zero), which is the paper's "BN and
BN Renorm do not train".

Scales.  ``small``: 10 000 / 5 000 / 2 000 training images at batch 60 / 6 / 1 (seeded draws) for
6 / 3 / 3 epochs, 2 000 test images, one seed — minutes on 2 CPU cores.  ``paper``: the full 60 000 / 10 000, 20 / 10 / 5
epochs, five seeds (the paper shows the range of 5 runs).  At ``paper`` scale the five seeds of vanilla, BN and LN at one batch
size train as one batched ensemble, one epoch per chunk with a fresh data order per chunk
(:mod:`bnlab.reproductions.chunked`; the per-epoch test accuracy is read between chunks); BNP and Batch
Renorm train one network per cell.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from bnlab.experiments.spec import Check, Comparison, Experiment, Record
from bnlab.reproductions.lange_common import LABEL as _LABEL
from bnlab.reproductions.lange_common import final_accuracies as _finals
from bnlab.reproductions.lange_common import mean as _mean
from bnlab.reproductions.lange_common import (LangeCell, cell_cost, chunked_group, extra_seed_cells,
                                              paired_difference, plot_training_curves, run_chunked_cells, seeds_text,
                                              shorten_cells, train_cell, training_grid)

__all__ = ["EXPERIMENTS", "run_cell", "run_group", "cost"]

_PAPER = "Lange, Helfrich & Ye, Batch Normalization Preconditioning for Neural Network Training (JMLR)"
_METHODS = {60: ("none", "bn", "ln", "bnp"), 6: ("none", "bn", "brn", "ln", "bnp"),
            1: ("none", "bn", "brn", "ln", "bnp")}
_SCALES = {
    # small: ≥ 3 evaluations per curve and ≥ 1 000 steps at batch 60 (BNP's running averages with
    # ρ = 0.99 need ~100 steps to forget their initialization μ = 0, σ² = 1).
    "small": dict(train_size={60: 10000, 6: 5000, 1: 2000}, test_size=2000, epochs={60: 6, 6: 3, 1: 3},
                  seeds=(0,)),
    "paper": dict(train_size={60: None, 6: None, 1: None}, test_size=None, epochs={60: 20, 6: 10, 1: 5},
                  seeds=(0, 1, 2, 3, 4)),
}


#: methods whose paper-scale cells train one epoch per chunk, the seeds of one (batch size, method) as one
#: batched ensemble; BNP (an optimizer hook) and Batch Renorm (a host-side step counter) cannot run under
#: vmap and train one network per cell
_CHUNKED = ("none", "bn", "ln")


#: small scale (and so medium): restarts of the cells whose comparisons need an interval over seeds (the paper shows 5 runs)
_SMALL_EXTRA = dict(pairs={(60, "bn"), (60, "bnp"), (60, "none"), (6, "bn"), (6, "bnp"), (6, "none")}, seeds=(1, 2))
#: "comparable": the 95 % interval of BNP − BN lies within ±this
_COMPARABLE = 0.02


#: methods drawn in the figure but in no comparison row: at small scale they run at medium only (LayerNorm's three
#: cells cost ~18 s of the report's CPU, measured 2026-11-27 at bcd6d07); medium and paper run every method
_FIGURE_ONLY = ("ln",)


def _grid(scale: str) -> list[dict]:
    # the restarts stay at small scale although they cost ~1 minute of the report: with one seed the interval
    # rows go unjudged, and at batch 6 they disagree — the verdict would read "reproduced" only because the
    # disagreeing rows were dropped (measured 2026-11-27: partly 4/6 with them, reproduced 3/3 without)
    cells = training_grid(_SCALES, _METHODS, "small" if scale == "medium" else scale, chunked=_CHUNKED)
    if scale in ("small", "medium"):
        cells += extra_seed_cells(cells, _SMALL_EXTRA["pairs"], _SMALL_EXTRA["seeds"])
    if scale == "small":
        cells = [c for c in cells if c["norm"] not in _FIGURE_ONLY]
    return cells


def run_group(cells: list[LangeCell | dict]) -> list[dict]:
    """The chunked cells of one (batch size, method) — its seeds — trained together
    (:func:`bnlab.reproductions.lange_common.run_chunked_cells`)."""
    return run_chunked_cells("fc", cells)


def cost(cells: list[dict]):
    """What a task costs, for a plan (:func:`bnlab.reproductions.lange_common.cell_cost`)."""
    return cell_cost("fc", cells)


def run_cell(params: LangeCell | dict) -> dict:
    """Train one (batch size, method, seed); BN/BRN at batch 1 record the error of a real first step
    (``params``: a :class:`~bnlab.reproductions.lange_common.LangeCell`, what the engine hands over, or its dict)."""
    from bnlab.optim.training import build_network

    cell = LangeCell.parse(params)
    b, norm = cell.batch_size, cell.norm
    if b == 1 and norm in ("bn", "brn"):
        import torch
        from bnlab.nets import train

        net = build_network("fc", norm, (1, 28, 28), 10, seed=cell.seed)
        x = torch.rand(4, 1, 28, 28, generator=torch.Generator().manual_seed(cell.seed))
        y = torch.arange(4) % 10
        try:
            train(net, (x, y), optimizer=lambda p: torch.optim.SGD(p, lr=0.01), batch_size=1, steps=1)
        except (ValueError, RuntimeError) as exc:
            return {"trainable": False, "error": str(exc).splitlines()[0][:300]}
        return {"trainable": True, "error": None}
    return train_cell("fc", cell)


def _plot(records: Sequence[Record], outdir: Path) -> list[Path]:
    return plot_training_curves(records, outdir, methods=_METHODS, panel_title="FC 3×100, MNIST, mini-batch {b}",
                                suptitle="Lange et al. Figs. 3-4 (BNP vs vanilla, BN, Batch Renorm, LN)",
                                stem="lange_fc")


def _limitations(records: Sequence[Record]) -> str:
    """What the small scale changes, with this run's seeds and budgets read off the records."""
    by = {}
    for r in records:
        by.setdefault(r.params["batch_size"], set()).add(r.params["seed"])
    parts = []
    for b in sorted(by, reverse=True):
        cells = [r for r in records if r.params["batch_size"] == b and r.params.get("train_size")]
        if cells:
            parts.append(f"{cells[0].params['train_size']} images × {cells[0].params['epochs']} epochs at batch {b}")
    seeds = {b: len(v) for b, v in by.items()}
    return ("MNIST at every batch size (CIFAR-10, the paper's data set for Figs. 3 right and 4, is not available "
            f"offline); {'; '.join(parts)}; 2 000 test images.  Seeds: "
            + ", ".join(f"{n} at batch {b}" for b, n in sorted(seeds.items(), reverse=True))
            + " (the paper: 5 runs)"
            + (" — the batch-60 and batch-6 comparisons of BNP, BN and vanilla restart with more seeds so that "
               "'comparable' and 'outperforms' are judged on an interval, the other methods run once."
               if max(seeds.values(), default=1) > 1 else
               " — with one seed the 'comparable' and 'outperforms' rows are not judged.")
            + ("" if any(r.params["norm"] in _FIGURE_ONLY for r in records) else
               "  LayerNorm, in the figure but in no comparison, runs at medium scale (bnlab report --scale medium; "
               "the small grid is sized for the report's 10 minutes on 2 cores)."))


def _compare(records: Sequence[Record]) -> list[Comparison]:
    finals = _finals(records)
    rows = []
    fails = [r for r in records if r.params["batch_size"] == 1 and r.params["norm"] in ("bn", "brn")]
    for r in fails:
        m = r.metrics
        rows.append(Comparison(
            quantity=f"{_LABEL[r.params['norm']]} at mini-batch size 1",
            paper="does not train (Fig. 4, right)",
            bnlab=("first step fails: " + m["error"]) if not m.get("trainable") else "trained",
            agrees=not m.get("trainable", True),
        ))
    if (1, "bnp") in finals:
        acc = _mean(finals[(1, "bnp")])
        rows.append(Comparison(
            quantity="BNP test accuracy at mini-batch size 1 (online learning)",
            paper="trains, faster than vanilla (Fig. 4 right; CIFAR-10)",
            bnlab=f"{acc:.4f} on MNIST" + (f" (vanilla {_mean(finals[(1, 'none')]):.4f})" if (1, "none") in finals
                                           else ""),
            agrees=acc > 0.85 and acc >= _mean(finals.get((1, "none"), [0.0])) - 0.01,
        ))
    d = paired_difference(records, 60, "bnp", "bn")
    dv = paired_difference(records, 60, "bnp", "none")
    if d is not None:
        m, lo, hi, n = d
        ok = None if n < 2 else bool(-_COMPARABLE <= lo and hi <= _COMPARABLE and (dv is None or dv[1] > 0))
        rows.append(Comparison(
            quantity="mini-batch 60: final test accuracy, BNP − BN and BNP − vanilla over seeds",
            paper="BN and BNP comparable, both above vanilla (Fig. 3, MNIST)",
            bnlab=f"BNP − BN {m:+.4f} [{lo:+.4f}, {hi:+.4f}]" + (
                "" if dv is None else f", BNP − vanilla {dv[0]:+.4f} [{dv[1]:+.4f}, {dv[2]:+.4f}]")
            + f" ({seeds_text(n)}; BNP {_mean(finals[(60, 'bnp')]):.4f}, BN {_mean(finals[(60, 'bn')]):.4f})",
            agrees=ok, reason="" if ok is not None else "one seed: an interval needs at least two"))
    for other, label in (("bn", "BN"), ("none", "vanilla")):
        d = paired_difference(records, 6, "bnp", other)
        if d is None:
            continue
        m, lo, hi, n = d
        others = ", ".join(f"{_LABEL[k]} {_mean(finals[(6, k)]):.4f}" for k in ("bnp", "bn", "brn", "ln", "none")
                           if (6, k) in finals)
        rows.append(Comparison(
            quantity=f"mini-batch 6: BNP − {label}, final test accuracy over seeds",
            paper=f"BNP outperforms {label} at mini-batch 6 (Fig. 4 left; CIFAR-10)",
            bnlab=f"{m:+.4f} [{lo:+.4f}, {hi:+.4f}] ({seeds_text(n)}; means: {others}; MNIST)",
            agrees=None if n < 2 else bool(lo > 0),
            reason="" if n >= 2 else "one seed: an interval needs at least two"))
    return rows


EXPERIMENTS = [
    Experiment(
        name="lange-fc",
        paper=_PAPER,
        figure="Figs. 3-4 (fully connected)",
        title="BNP vs vanilla, BN, Batch Renorm and LN on a 3×100 network at mini-batch 60, 6 and 1",
        claim="BNP matches BN at mini-batch 60, beats BN at mini-batch 6, and trains at mini-batch 1 where BN "
        "and Batch Renorm cannot (§5, Figs. 3-4).  Run on MNIST at every batch size (CIFAR-10 is not "
        "available offline).",
        grid=_grid,
        medium_grid=True,
        run_cell=run_cell,
        cell=LangeCell,
        plot=_plot,
        compare=_compare,
        uses_gpu=True,
        group=chunked_group,
        run_group=run_group,
        cost=cost,
        shorten=shorten_cells,
        checks=[
            Check("BN at mini-batch size 1", "agrees when the first training step of BN at batch 1 raises (the "
                  "variance of one sample is zero): 'does not train'"),
            Check("Batch Renorm at mini-batch size 1", "the same for Batch Renorm"),
            Check("BNP test accuracy at mini-batch size 1", "agrees when BNP trained online reaches test accuracy "
                  "> 0.85 and at least the vanilla network's − 0.01"),
            Check("mini-batch 60: final test accuracy", f"'comparable': the 95 % t-interval over seeds of the paired "
                  f"difference BNP − BN (same seed, same data) lies within ±{_COMPARABLE:g}, and the interval of "
                  "BNP − vanilla lies above 0; not judged with one seed"),
            Check("mini-batch 6: BNP − BN", "'outperforms': the 95 % t-interval over seeds of BNP − BN (paired by "
                  "seed) lies above 0; not judged with one seed"),
            Check("mini-batch 6: BNP − vanilla", "the same for BNP − vanilla"),
        ],
        limitations=_limitations,
    )
]
