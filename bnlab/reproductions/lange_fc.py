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

from bnlab.experiments.spec import Comparison, Experiment, Record
from bnlab.reproductions.lange_common import LABEL as _LABEL
from bnlab.reproductions.lange_common import final_accuracies as _finals
from bnlab.reproductions.lange_common import mean as _mean
from bnlab.reproductions.lange_common import (cell_cost, chunked_group, plot_training_curves, run_chunked_cells,
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


def _grid(scale: str) -> list[dict]:
    return training_grid(_SCALES, _METHODS, scale, chunked=_CHUNKED)


def run_group(cells: list[dict]) -> list[dict]:
    """The chunked cells of one (batch size, method) — its seeds — trained together
    (:func:`bnlab.reproductions.lange_common.run_chunked_cells`)."""
    return run_chunked_cells("fc", cells)


def cost(cells: list[dict]):
    """What a task costs, for a plan (:func:`bnlab.reproductions.lange_common.cell_cost`)."""
    return cell_cost("fc", cells)


def run_cell(params: dict) -> dict:
    """Train one (batch size, method, seed); BN/BRN at batch 1 record the error of a real first step."""
    from bnlab.optim.training import build_network

    b, norm = params["batch_size"], params["norm"]
    if b == 1 and norm in ("bn", "brn"):
        import torch
        from bnlab.nets import train

        net = build_network("fc", norm, (1, 28, 28), 10, seed=params["seed"])
        x = torch.rand(4, 1, 28, 28, generator=torch.Generator().manual_seed(params["seed"]))
        y = torch.arange(4) % 10
        try:
            train(net, (x, y), optimizer=lambda p: torch.optim.SGD(p, lr=0.01), batch_size=1, steps=1)
        except (ValueError, RuntimeError) as exc:
            return {"trainable": False, "error": str(exc).splitlines()[0][:300]}
        return {"trainable": True, "error": None}
    return train_cell("fc", params)


def _plot(records: Sequence[Record], outdir: Path) -> list[Path]:
    return plot_training_curves(records, outdir, methods=_METHODS, panel_title="FC 3×100, MNIST, mini-batch {b}",
                                suptitle="Lange et al. Figs. 3-4 (BNP vs vanilla, BN, Batch Renorm, LN)",
                                stem="lange_fc")


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
    if (60, "bnp") in finals and (60, "bn") in finals:
        a_bnp, a_bn = _mean(finals[(60, "bnp")]), _mean(finals[(60, "bn")])
        a_van = _mean(finals.get((60, "none"), [0.0]))
        rows.append(Comparison(
            quantity="mini-batch 60: final test accuracy BNP vs BN vs vanilla",
            paper="BN and BNP comparable, both above vanilla (Fig. 3, MNIST)",
            bnlab=f"BNP {a_bnp:.4f}, BN {a_bn:.4f}, vanilla {a_van:.4f}",
            agrees=abs(a_bnp - a_bn) <= 0.02 and a_bnp >= a_van - 0.005,
        ))
    if (6, "bnp") in finals and (6, "bn") in finals:
        a_bnp, a_bn = _mean(finals[(6, "bnp")]), _mean(finals[(6, "bn")])
        others = ", ".join(f"{_LABEL[n]} {_mean(finals[(6, n)]):.4f}" for n in ("brn", "ln", "none") if (6, n) in finals)
        rows.append(Comparison(
            quantity="mini-batch 6: final test accuracy",
            paper="BNP above BN and vanilla; Batch Renorm and LN close to BNP (Fig. 4 left; CIFAR-10)",
            bnlab=f"BNP {a_bnp:.4f}, BN {a_bn:.4f}, {others} (MNIST)",
            agrees=a_bnp >= a_bn - 0.005 and a_bnp >= _mean(finals.get((6, "none"), [0.0])) - 0.005,
        ))
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
        run_cell=run_cell,
        plot=_plot,
        compare=_compare,
        uses_gpu=True,
        group=chunked_group,
        run_group=run_group,
        cost=cost,
        shorten=shorten_cells,
    )
]
