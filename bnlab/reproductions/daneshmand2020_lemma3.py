"""Daneshmand et al. 2020, Lemma 3: vanilla linear (residual) networks collapse to rank one.

``daneshmand2020-lemma3``: the normalized products H̃_ℓ = B_ℓ X / ‖B_ℓ‖, B_ℓ = Π (I + γ W_k)
(Eq. 6), d = N = 32, for Gaussian (Lemma 3a) and uniform U[−√3, √3] (Lemma 3b) weights and
γ ∈ {0.1, 0.5, 1} plus γ = ∞ (plain products W_ℓ ⋯ W_1).  Shown: the ratio σ_2/σ_1 of H̃_ℓ
(its decay is the gap between the top two Lyapunov exponents) and r(H̃_ℓ) − 1, mean over
chains.  Lemma 3b only proves collapse along a subsequence ℓ_k; the paper's footnote 7
reports it along every ℓ, which is what is measured here.

Scales: ``small`` depth 3 000, 4 chains; ``paper`` depth 100 000, 10 chains.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Sequence

import numpy as np

from bnlab.experiments.cells import Cell, cell_param
from bnlab.experiments.spec import Check, Comparison, Experiment, Record
from bnlab.reproductions.plotting import pyplot, save_figure

__all__ = ["EXPERIMENTS", "Lemma3Cell", "run_cell"]

_PAPER = "Daneshmand et al. 2020 (NeurIPS), Batch normalization provably avoids rank collapse"
_SCALES = {"small": dict(depth=3_000, chains=4), "paper": dict(depth=100_000, chains=10)}


def _grid(scale: str) -> list[dict]:
    from bnlab._validation import check_choice

    s = _SCALES[check_choice("scale", scale, tuple(_SCALES))]
    return [dict(width=32, batch_size=32, depth=s["depth"], chains=s["chains"], init=init, residual_gamma=g,
                 seed=500 + 10 * i + j)
            for i, init in enumerate(("gaussian", "uniform")) for j, g in enumerate((0.1, 0.5, 1.0, "inf"))]


@dataclass(frozen=True, kw_only=True)
class Lemma3Cell(Cell):
    """The parameters of a Lemma 3 cell: ``chains`` chains of a residual network without normalization
    (``init``, ``residual_gamma``), ``depth`` layers of ``width`` × ``batch_size`` representations."""

    width: int = cell_param(minimum=1)
    batch_size: int = cell_param(minimum=2)
    depth: int = cell_param(minimum=1)
    chains: int = cell_param(minimum=1)
    init: Literal["gaussian", "uniform"]
    residual_gamma: float | Literal["inf"] = cell_param(minimum=0.0, strict_minimum=True)  # "inf": no residual branch
    seed: int = cell_param(minimum=0)
    device: str = "cpu"  # set by the engine for a GPU; not part of the cell's identity


def run_cell(params: Lemma3Cell | dict) -> dict:
    """One (init, γ): per-layer σ_2/σ_1 and r(H̃) − 1 (log-spaced layers), final ranks (``params``: a
    :class:`Lemma3Cell`, what the engine hands over, or its dict)."""
    from bnlab.rank import run_chain

    cell = Lemma3Cell.parse(params)
    res = run_chain(cell.width, cell.batch_size, cell.depth, chains=cell.chains, norm="none", init=cell.init,
                    residual_gamma=cell.residual_gamma, seed=cell.seed, device=cell.device)
    sv = res.singular_values
    ratio = sv[..., 1] / sv[..., 0]
    # the layer where σ_2/σ_1 first drops below 1e-8 in every chain (None if never)
    below = np.all(ratio < 1e-8, axis=0)
    first = int(res.layers[np.argmax(below)]) if below.any() else None
    return dict(
        layers=res.layers.tolist(),
        sv_ratio=np.exp(np.log(np.maximum(ratio, 1e-300)).mean(0)).tolist(),  # geometric mean over chains
        r_minus_one=np.maximum(res.rank_lower_bound - 1.0, 0.0).mean(0).tolist(),
        final_r=float(res.final_rank_lower_bound.max()),
        final_soft_rank=float(res.final_soft_rank.max()),
        final_numerical_rank=float(res.final_numerical_rank.max()),
        final_sv_ratio=float(ratio[:, -1].max()),
        collapse_layer=first,
    )


def _plot(records: Sequence[Record], outdir: Path) -> list[Path]:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, init in zip(axes, ("gaussian", "uniform")):
        for rec in sorted(records, key=lambda r: str(r.params["residual_gamma"])):
            if rec.params["init"] != init:
                continue
            x = np.maximum(np.asarray(rec.metrics["layers"]), 0.5)
            ax.plot(x, np.maximum(rec.metrics["sv_ratio"], 1e-18), label=f"γ = {rec.params['residual_gamma']}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("layer ℓ")
        ax.set_title(f"vanilla linear, {init} weights, d = N = 32")
    axes[0].set_ylabel("σ_2 / σ_1 of B_ℓ X (geometric mean over chains)")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, outdir, "daneshmand2020_lemma3")


def _limitations(records: Sequence[Record]) -> str:
    depth = max((r.params["depth"] for r in records), default=0)
    chains = sorted({r.params["chains"] for r in records})
    return (f"Depth {depth} with {', '.join(map(str, chains))} chains per cell (the paper scale: 100 000 and 10).  "
            "Lemma 3 is a limit; at γ = 0.1 the top two Lyapunov exponents are close, so σ_2/σ_1 is still far from "
            "rounding level at this depth (it is in the table), while rank_½ and r(H̃) have reached one.")


def _compare(records: Sequence[Record]) -> list[Comparison]:
    rows = []
    for rec in sorted(records, key=lambda r: (r.params["init"], str(r.params["residual_gamma"]))):
        p, m = rec.params, rec.metrics
        below = (f"σ_2/σ_1 < 1e-8 from layer {m['collapse_layer']}" if m["collapse_layer"] is not None
                 else f"σ_2/σ_1 not yet < 1e-8 at L = {p['depth']}")
        rows.append(Comparison(
            quantity=f"{p['init']} weights, γ = {p['residual_gamma']}: H̃_L at L = {p['depth']} "
                     f"(worst of {p['chains']})",
            paper="converges to rank one (Lemma 3a/3b)",
            bnlab=f"σ_2/σ_1 = {m['final_sv_ratio']:.1e}, r(H) = {m['final_r']:.6f}, rank_1/2 = "
                  f"{m['final_soft_rank']:.0f}, {below}",
            agrees=bool(m["final_soft_rank"] == 1 and m["final_r"] < 1 + 1e-6),
        ))
    return rows


EXPERIMENTS = [
    Experiment(
        name="daneshmand2020-lemma3",
        paper=_PAPER,
        figure="Lemma 3 (Eq. 6)",
        title="Vanilla linear residual products collapse to rank one (Gaussian and uniform weights)",
        claim="For γ ∈ (0, 1) and Gaussian or uniform weights, the normalized product B_ℓ X / ‖B_ℓ‖ of the "
        "linear residual network converges to a rank-one matrix: skip connections do not prevent rank collapse.",
        grid=_grid,
        run_cell=run_cell,
        cell=Lemma3Cell,
        plot=_plot,
        compare=_compare,
        uses_gpu=True,
        checks=[
            Check("gaussian weights", "agrees when, in the worst of the chains, rank_½ of H̃_L is 1 and r(H̃_L) < 1 + 1e-6 "
                  "(Lemma 3a: convergence to rank one)"),
            Check("uniform weights", "the same for U[−√3, √3] weights, read at every layer ℓ = L (footnote 7's "
                  "stronger form of Lemma 3b's subsequence)"),
        ],
        limitations=_limitations,
    )
]
