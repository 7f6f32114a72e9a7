"""Daneshmand et al. 2020, Fig. 4 / Fig. 12: pre-training vs BN vs vanilla at increasing depth (Fashion-MNIST).

``daneshmand2020-fig4``: the training loss of ReLU MLPs of width 128 at depths 8, 16 and 32
(``paper``: also 4), for vanilla nets, vanilla nets pre-trained layer-wise with T = 25 steps per
layer (Algorithm 1) and BN nets — Fig. 4 is on CIFAR-10, its Fig. 12 twin on Fashion-MNIST, which
is what runs here.  The claim: the slow-down with depth is much milder for pre-trained nets than
for vanilla ones.  Each cell is :func:`bnlab.reproductions.daneshmand2020_fig6.run_cell` (the same
models, pre-training and SGD budget: 500 steps at lr 0.01, batch 64, 20 000 images at ``small``;
``paper``: 20 000 steps, 60 000 images, 3 seeds, the networks of one architecture and depth trained as one
batched ensemble between the tracked steps).
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from bnlab.experiments.spec import Comparison, Experiment, Record
from bnlab.reproductions.plotting import pyplot, save_figure
from bnlab.reproductions.daneshmand2020_fig6 import CHUNKED, cost, group, run_cell, run_group, shorten

__all__ = ["EXPERIMENTS", "run_cell"]

_PAPER = "Daneshmand et al. 2020 (NeurIPS), Batch normalization provably avoids rank collapse"
_KINDS = ("vanilla", "pretrain25", "bn")
_SCALES = {
    "small": dict(depths=[8, 16, 32], n_train=20_000, n_eval=5_000, n_test=2_000, steps=500, seeds=[0]),
    "paper": dict(depths=[4, 8, 16, 32], n_train=60_000, n_eval=10_000, n_test=10_000, steps=20_000,
                  seeds=[0, 1, 2]),
}


def _grid(scale: str) -> list[dict]:
    from bnlab._validation import check_choice

    s = _SCALES[check_choice("scale", scale, tuple(_SCALES))]
    # paper scale: chunks between the tracked steps, the kinds of one architecture and every seed of a depth
    # trained as one batched ensemble (daneshmand2020_fig6.group / run_group); small scale: one network per cell
    order = {"data_order": CHUNKED} if scale == "paper" else {}
    return [dict(kind=k, depth=depth, width=128, lr=0.01, batch_size=64, steps=s["steps"], n_train=s["n_train"],
                 n_eval=s["n_eval"], n_test=s["n_test"], seed=seed, **order)
            for seed in s["seeds"] for depth in s["depths"] for k in _KINDS]


def _final_loss(m: dict) -> float:
    curve = np.asarray(m["loss_curve"])
    return float(curve[-3:, 1].mean()) if len(curve) else float("nan")


def _plot(records: Sequence[Record], outdir: Path) -> list[Path]:
    plt = pyplot()
    recs = [r for r in records if not r.metrics.get("skipped")]
    depths = sorted({r.params["depth"] for r in recs})
    fig, axes = plt.subplots(1, max(1, len(depths)), figsize=(4.5 * max(1, len(depths)), 4), sharey=True,
                             squeeze=False)
    for ax, depth in zip(axes[0], depths):
        for i, kind in enumerate(_KINDS):
            for j, rec in enumerate(r for r in recs if r.params["depth"] == depth and r.params["kind"] == kind):
                curve = np.asarray(rec.metrics["loss_curve"])
                ax.plot(curve[:, 0], curve[:, 1], color=f"C{i}", label=kind if j == 0 else None)
        ax.set_title(f"depth {depth}")
        ax.set_xlabel("SGD step")
    axes[0][0].set_ylabel("training loss (smoothed)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Fashion-MNIST MLPs (width 128): pre-training vs BN vs vanilla")
    fig.tight_layout()
    return save_figure(fig, outdir, "daneshmand2020_fig4")


def _compare(records: Sequence[Record]) -> list[Comparison]:
    loss: dict = {}
    acc: dict = {}
    for rec in records:
        if not rec.metrics.get("skipped"):
            key = (rec.params["kind"], rec.params["depth"])
            loss.setdefault(key, []).append(_final_loss(rec.metrics))
            if "train_accuracy" in rec.metrics:
                acc.setdefault(key, []).append(rec.metrics["train_accuracy"])
    rows = []
    for depth in sorted({d for (_, d) in loss}):
        if ("vanilla", depth) not in loss or ("pretrain25", depth) not in loss:
            continue
        v, p = float(np.mean(loss[("vanilla", depth)])), float(np.mean(loss[("pretrain25", depth)]))
        b = float(np.mean(loss.get(("bn", depth), [np.nan])))
        rows.append(Comparison(
            quantity=f"depth {depth}: final training loss, pre-trained vs vanilla (BN beside)",
            paper="pre-training makes deep vanilla nets train (much milder slow-down with depth)",
            bnlab=f"pre-trained {p:.3f}, vanilla {v:.3f}, BN {b:.3f}"
                  + ("" if not acc else "; training accuracy " + ", ".join(
                      f"{k} {np.mean(acc[(k, depth)]):.3f}" for k in _KINDS if (k, depth) in acc)),
            agrees=bool(p < v - 0.05) if v > 2.0 else None,  # a sharp test only where vanilla is stuck
        ))
    return rows


EXPERIMENTS = [
    Experiment(
        name="daneshmand2020-fig4",
        paper=_PAPER,
        figure="Fig. 4 / Fig. 12 (Fashion-MNIST)",
        title="Pre-training vs BN vs vanilla at increasing depth",
        claim="With the rank-raising pre-training, deep vanilla MLPs train where plain vanilla ones are stuck; "
        "the slow-down with depth is much less severe than for vanilla networks.",
        grid=_grid,
        run_cell=run_cell,
        plot=_plot,
        compare=_compare,
        uses_gpu=True,
        group=group,
        run_group=run_group,
        cost=cost,
        shorten=shorten,
    )
]
