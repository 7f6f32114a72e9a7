"""Daneshmand et al. 2020, Fig. 2: log rank of the last hidden layer vs depth, BN vs vanilla.

``daneshmand2020-fig2``: width d = 32 and N = 32 Gaussian inputs; linear and ReLU MLPs
(Linear → Norm → φ, no skip: γ = ∞) with standard BN (``norm="bn"``) or none; the rank of
H_ℓ at every (log-spaced) depth, mean and 95 % confidence interval over 10 independent
chains (the paper: 10 runs).  Two ranks are shown: the numerical rank (the paper's
``torch.matrix_rank``, here with float64 and ``torch.linalg.matrix_rank``'s tolerance) and the
soft rank rank_½ (Eq. 3, read at tr M = d).  The paper's claim: the rank of vanilla networks
keeps dropping with depth (towards one), while BN stabilizes it above √d.

Scales: ``small`` depth 1 000; ``paper`` depth 50 000 (the authors' script's length).
A chain of depth L is one streamed run (:func:`bnlab.rank.run_chain`): the rank at depth ℓ of
an L-layer network is the rank of the chain's layer ℓ.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Sequence

import numpy as np

from bnlab.experiments.cells import Cell, cell_param
from bnlab.experiments.spec import Check, Comparison, Experiment, Record
from bnlab.reproductions.plotting import pyplot, save_figure

__all__ = ["EXPERIMENTS", "Fig2Cell", "run_cell"]

_PAPER = "Daneshmand et al. 2020 (NeurIPS), Batch normalization provably avoids rank collapse"
_D = 32
_SCALES = {"small": dict(depth=1_000, chains=10), "paper": dict(depth=50_000, chains=10)}


def _grid(scale: str) -> list[dict]:
    from bnlab._validation import check_choice

    s = _SCALES[check_choice("scale", scale, tuple(_SCALES))]
    return [dict(width=_D, batch_size=_D, depth=s["depth"], chains=s["chains"], norm=norm, activation=act,
                 seed=2020 + 10 * i + j)
            for i, norm in enumerate(("bn", "none")) for j, act in enumerate(("linear", "relu"))]


def _ci95(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # mean and the t-interval over chains (axis 0)
    from scipy import stats

    n = x.shape[0]
    m = x.mean(0)
    half = stats.t.ppf(0.975, n - 1) * x.std(0, ddof=1) / math.sqrt(n) if n > 1 else np.zeros_like(m)
    return m, m - half, m + half


@dataclass(frozen=True, kw_only=True)
class Fig2Cell(Cell):
    """The parameters of a Fig. 2 cell: ``chains`` chains of ``depth`` layers (``norm``, ``activation``)."""

    width: int = cell_param(minimum=1)
    batch_size: int = cell_param(minimum=2)
    depth: int = cell_param(minimum=1)
    chains: int = cell_param(minimum=1)
    norm: Literal["bn", "none"]
    activation: Literal["linear", "relu"]
    seed: int = cell_param(minimum=0)
    device: str = "cpu"  # set by the engine for a GPU; not part of the cell's identity


def run_cell(params: Fig2Cell | dict) -> dict:
    """One (norm, activation): per-layer numerical and soft rank over ``chains`` chains (``params``: a
    :class:`Fig2Cell`, what the engine hands over, or its dict)."""
    from bnlab.rank import run_chain

    cell = Fig2Cell.parse(params)
    res = run_chain(cell.width, cell.batch_size, cell.depth, chains=cell.chains, norm=cell.norm,
                    phi=cell.activation, seed=cell.seed, device=cell.device)
    out = {"layers": res.layers.tolist()}
    for key, arr in (("numerical_rank", res.numerical_rank), ("soft_rank", res.soft_rank)):
        m, lo, hi = _ci95(arr)
        out[key] = m.tolist()
        out[f"{key}_ci"] = [lo.tolist(), hi.tolist()]
    out["mean_soft_rank"] = float(res.mean_soft_rank.mean())
    out["final_soft_rank"] = float(res.final_soft_rank.mean())
    out["final_numerical_rank"] = float(res.final_numerical_rank.mean())
    return out


def _plot(records: Sequence[Record], outdir: Path) -> list[Path]:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    colors = {"bn": "C0", "none": "C1"}
    for ax, act in zip(axes, ("linear", "relu")):
        for rec in records:
            p, m = rec.params, rec.metrics
            if p["activation"] != act:
                continue
            x = np.maximum(np.asarray(m["layers"]), 0.5)  # layer 0 (the input) at x = 0.5 on the log axis
            label = "BN" if p["norm"] == "bn" else "vanilla"
            for key, style in (("numerical_rank", "-"), ("soft_rank", "--")):
                y = np.log(np.maximum(m[key], 1e-12))
                lo, hi = (np.log(np.maximum(v, 1e-12)) for v in m[f"{key}_ci"])
                ax.plot(x, y, style, color=colors[p["norm"]],
                        label=f"{label}, {'numerical rank' if key == 'numerical_rank' else 'rank_1/2'}")
                ax.fill_between(x, lo, hi, color=colors[p["norm"]], alpha=0.15)
        ax.axhline(math.log(math.sqrt(_D)), color="k", lw=0.8, ls=":", label="log √d")
        ax.set_xscale("log")
        ax.set_xlabel("layer ℓ (number of layers)")
        ax.set_title(f"{act}, d = N = {_D}")
    axes[0].set_ylabel("log rank of H_ℓ")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, outdir, "daneshmand2020_fig2")


def _limitations(records: Sequence[Record]) -> str:
    depth = max((r.params["depth"] for r in records), default=0)
    chains = sorted({r.params["chains"] for r in records})
    return (f"Depth {depth} (the authors' script: 50 000) with {', '.join(map(str, chains))} chains per curve, as "
            "the paper's 10 runs.  The rows read the last layer; whether 50 times more layers would move them is not "
            "measured at this scale (the mean rank_½ over layers is in the table beside the last layer's).")


def _compare(records: Sequence[Record]) -> list[Comparison]:
    rows = []
    for rec in sorted(records, key=lambda r: (r.params["activation"], r.params["norm"])):
        p, m = rec.params, rec.metrics
        depth = p["depth"]
        if p["norm"] == "bn":
            rows.append(Comparison(
                quantity=f"BN {p['activation']}: rank_1/2 of H_L at L = {depth} (mean of {p['chains']} chains)",
                paper=f"stays above √d = {math.sqrt(_D):.2f}",
                bnlab=f"{m['final_soft_rank']:.2f} (numerical rank {m['final_numerical_rank']:.1f}; mean rank_1/2 "
                      f"over layers {m['mean_soft_rank']:.2f})",
                agrees=bool(m["final_soft_rank"] >= math.sqrt(_D)),
            ))
        else:
            rows.append(Comparison(
                quantity=f"vanilla {p['activation']}: rank_1/2 of H_L at L = {depth}",
                paper="collapses towards 1",
                bnlab=f"{m['final_soft_rank']:.2f} (numerical rank {m['final_numerical_rank']:.1f})",
                agrees=bool(m["final_soft_rank"] <= 1.5),
            ))
    return rows


EXPERIMENTS = [
    Experiment(
        name="daneshmand2020-fig2",
        paper=_PAPER,
        figure="Fig. 2",
        title="Rank of the last hidden layer vs depth, BN vs vanilla (linear and ReLU, d = 32)",
        claim="The rank of the hidden representation of vanilla networks drops with depth towards one, while "
        "batch normalization keeps it above √d, for linear and ReLU MLPs.",
        grid=_grid,
        run_cell=run_cell,
        cell=Fig2Cell,
        plot=_plot,
        compare=_compare,
        uses_gpu=True,
        checks=[
            Check("BN …: rank_1/2 of H_L", "agrees when the mean rank_½ over the chains at the last layer is at "
                  "least √d (Fig. 2: BN stabilizes the rank above √d)"),
            Check("vanilla …: rank_1/2 of H_L", "agrees when the mean rank_½ at the last layer is at most 1.5 "
                  "(collapsed to rank one)"),
        ],
        limitations=_limitations,
    )
]
