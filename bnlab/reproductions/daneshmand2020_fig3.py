"""Daneshmand et al. 2020, Fig. 3: the Ω(√d) rank of BN chains (3a) and BN amplifying small variations (3b).

``daneshmand2020-fig3a`` (Theorem 2): linear BN chains H_{ℓ+1} = BN_{0,1}(H_ℓ + γ W_ℓ H_ℓ)
(Eq. 1, BN without mean subtraction, unit-variance Gaussian W, Gaussian inputs with N = d),
the soft rank rank_½ averaged over the depth, for widths d and several γ (γ = ∞: no skip).
The exponent of the Ω(√d) law is the least-squares slope of log(mean rank) on log d, with a
95 % t-interval from the residuals; Theorem 2 is a lower bound Ω(√d), so the row agrees when the
whole interval lies at or above ½ (a slope whose interval reaches below ½ is not Ω(√d) at this
confidence).

``daneshmand2020-fig3b``: nearly collinear inputs X = u 1ᵀ + δ E (δ = 10⁻²), the top 10
singular values of H_ℓ (at tr M = d) along a BN chain: BN amplifies the small variations and
shrinks the top singular value within a few layers, while a vanilla chain keeps X collinear.
``small``: d = N = 32, 60 layers, one chain per norm; ``paper``: 200 layers, five seeds (the caption
states neither d nor the depth).

Scales: ``small`` d ∈ {8, 16, 32, 64, 128}, depth 2 000 (every 2nd layer averaged), 2 chains,
γ ∈ {0.1, ∞}; ``paper`` d ∈ {8, 16, 32, 64, 128, 256}, L = 10⁶ as in the paper (every layer),
γ ∈ {0.01 (the authors' script), 0.1, 0.5, ∞}, 2 chains.
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

__all__ = ["EXPERIMENTS", "Fig3aCell", "Fig3bCell", "run_cell_3a", "run_cell_3b", "fit_exponent"]

_PAPER = "Daneshmand et al. 2020 (NeurIPS), Batch normalization provably avoids rank collapse"
_SCALES = {
    "small": dict(widths=[8, 16, 32, 64, 128], depth=2_000, measure_every=2, chains=2, gammas=[0.1, "inf"]),
    "paper": dict(widths=[8, 16, 32, 64, 128, 256], depth=1_000_000, measure_every=1, chains=2,
                  gammas=[0.01, 0.1, 0.5, "inf"]),
}


def _check_scale(scale: str) -> dict:
    from bnlab._validation import check_choice

    return _SCALES[check_choice("scale", scale, tuple(_SCALES))]


def _grid_3a(scale: str) -> list[dict]:
    s = _check_scale(scale)
    return [dict(width=w, batch_size=w, depth=s["depth"], measure_every=s["measure_every"], chains=s["chains"],
                 residual_gamma=g, seed=300 + w) for g in s["gammas"] for w in s["widths"]]


@dataclass(frozen=True, kw_only=True)
class Fig3aCell(Cell):
    """The parameters of a Fig. 3a cell: ``chains`` chains of a residual BN-without-mean network of width d."""

    width: int = cell_param(minimum=1)
    batch_size: int = cell_param(minimum=2)
    depth: int = cell_param(minimum=1)
    chains: int = cell_param(minimum=1)
    measure_every: int = cell_param(minimum=1)
    residual_gamma: float | Literal["inf"] = cell_param(minimum=0.0, strict_minimum=True)  # "inf": no residual branch
    seed: int = cell_param(minimum=0)
    device: str = "cpu"  # set by the engine for a GPU; not part of the cell's identity


def run_cell_3a(params: Fig3aCell | dict) -> dict:
    """One (d, γ): rank_½ and r(H) averaged over the depth, per chain (``params``: a :class:`Fig3aCell`, what
    the engine hands over, or its dict)."""
    from bnlab.rank import run_chain

    cell = Fig3aCell.parse(params)
    res = run_chain(cell.width, cell.batch_size, cell.depth, chains=cell.chains, norm="bn_nomean",
                    residual_gamma=cell.residual_gamma, seed=cell.seed, measure_every=cell.measure_every,
                    record_layers=[0], device=cell.device)
    return dict(mean_soft_rank=float(res.mean_soft_rank.mean()), per_chain_mean_soft_rank=res.mean_soft_rank.tolist(),
                std_soft_rank=float(res.std_soft_rank.mean()),
                mean_r_lower_bound=float(res.mean_rank_lower_bound.mean()))


def fit_exponent(widths, ranks) -> tuple[float, float, float]:
    """Slope of log(rank) on log(width) and its 95 % t-interval (residual standard error)."""
    from scipy import stats

    x = np.log(np.asarray(widths, dtype=np.float64))
    y = np.log(np.asarray(ranks, dtype=np.float64))
    if x.size < 3:
        raise ValueError(f"widths is not allowed: the fit needs at least 3 widths, got {x.size}")
    xc = x - x.mean()
    slope = float(xc @ (y - y.mean()) / (xc @ xc))
    resid = y - y.mean() - slope * xc
    se = math.sqrt(float(resid @ resid) / (x.size - 2) / float(xc @ xc))
    half = float(stats.t.ppf(0.975, x.size - 2)) * se
    return slope, slope - half, slope + half


def _by_gamma(records: Sequence[Record]) -> dict:
    out: dict = {}
    for rec in records:
        out.setdefault(str(rec.params["residual_gamma"]), []).append(rec)
    return {g: sorted(v, key=lambda r: r.params["width"]) for g, v in out.items()}


def _plot_3a(records: Sequence[Record], outdir: Path) -> list[Path]:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.5))
    widths_all = []
    for g, recs in _by_gamma(records).items():
        w = np.array([r.params["width"] for r in recs])
        m = np.array([r.metrics["mean_soft_rank"] for r in recs])
        s = np.array([r.metrics["std_soft_rank"] for r in recs])
        widths_all.extend(w.tolist())
        label = f"γ = {g}"
        if len(w) >= 3:
            slope, lo, hi = fit_exponent(w, m)
            label += f": slope {slope:.2f} [{lo:.2f}, {hi:.2f}]"
        ax.errorbar(w, m, yerr=s, fmt="o-", capsize=3, label=label)
    if widths_all:
        w = np.unique(widths_all)
        ax.plot(w, np.sqrt(w), "k:", label="√d")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("width d (= N)")
    ax.set_ylabel("rank_1/2 averaged over depth (± std over layers)")
    ax.set_title("BN linear chains: rank vs width (Thm 2)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, outdir, "daneshmand2020_fig3a")


#: Ω(√d): the exponent of the mean rank in d
_EXPONENT = 0.5


def _limitations_3a(records: Sequence[Record]) -> str:
    depth = max((r.params["depth"] for r in records), default=0)
    widths = sorted({r.params["width"] for r in records})
    gammas = sorted({str(r.params["residual_gamma"]) for r in records})
    chains = sorted({r.params["chains"] for r in records})
    every = records[0].params["measure_every"] if records else "?"
    return (f"Depth {depth} (the rank averaged over every {every} layers; the paper: 10⁶, every layer), d = {', '.join(map(str, widths))} (the paper: up to 256), γ ∈ {{{', '.join(gammas)}}} (the "
            f"paper's figure: several γ including the authors' 0.01), {', '.join(map(str, chains))} chains per "
            "cell.  Thm 2 is a limit L → ∞; the exponent is fitted over five widths, so its interval is wide "
            "enough that only a slope clearly below ½ fails.")


def _compare_3a(records: Sequence[Record]) -> list[Comparison]:
    rows = []
    for g, recs in _by_gamma(records).items():
        w = np.array([r.params["width"] for r in recs])
        m = np.array([r.metrics["mean_soft_rank"] for r in recs])
        if len(w) < 3:
            continue
        slope, lo, hi = fit_exponent(w, m)
        ratio = m / np.sqrt(w)
        rows.append(Comparison(
            quantity=f"γ = {g}: exponent of mean rank_1/2 vs d (d = {w.min()}…{w.max()}, "
                     f"L = {recs[0].params['depth']})",
            paper="Ω(√d): exponent ≥ 1/2 (Thm 2; Fig. 3a follows √d)",
            bnlab=f"{slope:.3f}, 95 % CI [{lo:.3f}, {hi:.3f}]; rank/√d from {ratio.min():.2f} to {ratio.max():.2f}",
            agrees=bool(lo >= _EXPONENT),
        ))
    return rows


#: Fig. 3b: one chain per norm at ``small``; five seeds and a longer chain at ``paper`` (the caption states
#: neither the width nor the depth; d = N = 32 as in Fig. 2)
_SCALES_3B = {"small": dict(depth=60, seeds=[31]), "paper": dict(depth=200, seeds=[31, 32, 33, 34, 35])}


def _grid_3b(scale: str) -> list[dict]:
    _check_scale(scale)
    s = _SCALES_3B[scale]
    return [dict(width=32, batch_size=32, depth=s["depth"], delta=1e-2, norm=norm, seed=seed)
            for seed in s["seeds"] for norm in ("bn_nomean", "none")]


@dataclass(frozen=True, kw_only=True)
class Fig3bCell(Cell):
    """The parameters of a Fig. 3b cell: one chain from inputs ``delta``-close to collinear."""

    width: int = cell_param(minimum=1)
    batch_size: int = cell_param(minimum=2)
    depth: int = cell_param(minimum=1)
    delta: float = cell_param(minimum=0.0)
    norm: Literal["bn_nomean", "none"]
    seed: int = cell_param(minimum=0)
    device: str = "cpu"  # set by the engine for a GPU; not part of the cell's identity


def run_cell_3b(params: Fig3bCell | dict) -> dict:
    """Top-10 singular values of H_ℓ (at tr M = d) along one chain from nearly collinear inputs (``params``: a
    :class:`Fig3bCell`, what the engine hands over, or its dict)."""
    import torch

    from bnlab.rank import run_chain

    cell = Fig3bCell.parse(params)
    d, n = cell.width, cell.batch_size
    gen = torch.Generator().manual_seed(cell.seed)
    u = torch.randn(d, 1, generator=gen, dtype=torch.float64)
    x = u @ torch.ones(1, n, dtype=torch.float64) + cell.delta * torch.randn(d, n, generator=gen, dtype=torch.float64)
    res = run_chain(d, n, cell.depth, inputs=x, norm=cell.norm, seed=cell.seed, record_layers=range(cell.depth + 1),
                    device=cell.device)
    return dict(layers=res.layers.tolist(), top_singular_values=res.singular_values[0, :, :10].tolist())


def _plot_3b(records: Sequence[Record], outdir: Path) -> list[Path]:
    plt = pyplot()
    first = min(r.params["seed"] for r in records)  # one chain per norm (the paper scale has five seeds)
    recs = sorted((r for r in records if r.params["seed"] == first), key=lambda r: r.params["norm"])
    fig, axes = plt.subplots(1, len(recs), figsize=(5 * len(recs), 4), sharey=True, squeeze=False)
    for ax, rec in zip(axes[0], recs):
        sv = np.array(rec.metrics["top_singular_values"])
        for i in range(sv.shape[1]):
            ax.plot(rec.metrics["layers"], sv[:, i], lw=1)
        ax.set_yscale("log")
        ax.set_xlabel("layer ℓ")
        kind = "BN" if rec.params["norm"] != "none" else "vanilla"
        ax.set_title(f"{kind}: top 10 σ_i(H_ℓ), δ = {rec.params['delta']}")
    axes[0][0].set_ylabel("singular value (tr M = d)")
    fig.tight_layout()
    return save_figure(fig, outdir, "daneshmand2020_fig3b")


#: "quickly amplifies the small variations": σ_2 grows more than 10× along the chain (and σ_1 falls)
_AMPLIFY = 10.0


def _limitations_3b(records: Sequence[Record]) -> str:
    depth = max((r.params["depth"] for r in records), default=0)
    seeds = sorted({r.params["seed"] for r in records})
    return (f"One chain per norm ({len(seeds)} seed{'s' if len(seeds) != 1 else ''}), d = N = 32, depth {depth}; "
            "the caption states neither d nor the depth (the paper scale: 200 layers, five seeds).")


def _compare_3b(records: Sequence[Record]) -> list[Comparison]:
    rows = []
    several = len({r.params["seed"] for r in records}) > 1
    for rec in sorted(records, key=lambda r: (r.params["seed"], r.params["norm"])):
        sv = np.array(rec.metrics["top_singular_values"])
        s1_0, s2_0, s1_l, s2_l = sv[0, 0], sv[0, 1], sv[-1, 0], sv[-1, 1]
        bn = rec.params["norm"] != "none"
        grew = s2_l / s2_0
        rows.append(Comparison(
            quantity=f"{'BN' if bn else 'vanilla'}: σ_1, σ_2 of H_0 → H_{rec.params['depth']} (nearly collinear X"
                     + (f", seed {rec.params['seed']})" if several else ")"),
            paper=("BN amplifies the small variations and reduces the largest" if bn
                   else "(not shown; no amplification)"),
            bnlab=f"σ_1 {s1_0:.2f} → {s1_l:.2f}, σ_2 {s2_0:.3f} → {s2_l:.3f} (×{grew:.0f})",
            agrees=bool(grew > _AMPLIFY and s1_l < s1_0) if bn else bool(grew < _AMPLIFY),
        ))
    return rows


EXPERIMENTS = [
    Experiment(
        name="daneshmand2020-fig3a",
        paper=_PAPER,
        figure="Fig. 3a (Thm 2)",
        title="Rank of BN linear chains vs width: the Ω(√d) law",
        claim="The soft rank rank_1/2 of BN linear networks, averaged over depth, grows at least like √d, for a "
        "wide range of residual strengths γ including γ = ∞ (no skip connection).",
        grid=_grid_3a,
        run_cell=run_cell_3a,
        cell=Fig3aCell,
        plot=_plot_3a,
        compare=_compare_3a,
        uses_gpu=True,
        checks=[Check("γ = …: exponent of mean rank_1/2 vs d",
                      f"agrees when the whole 95 % t-interval of the least-squares slope of log(mean rank_½) on log d "
                      f"lies at or above {_EXPONENT:g} (Ω(√d) as a lower bound: a slope of 0.4 must fail)")],
        limitations=_limitations_3a,
    ),
    Experiment(
        name="daneshmand2020-fig3b",
        paper=_PAPER,
        figure="Fig. 3b",
        title="BN amplifies small variations of nearly collinear inputs",
        claim="Given nearly collinear inputs, BN quickly amplifies the smaller singular values of H_ℓ while "
        "reducing the largest one.",
        grid=_grid_3b,
        run_cell=run_cell_3b,
        cell=Fig3bCell,
        plot=_plot_3b,
        compare=_compare_3b,
        uses_gpu=False,
        checks=[
            Check("BN: σ_1, σ_2 of H_0", f"agrees when σ_2 grows more than {_AMPLIFY:g}× from H_0 to the last layer "
                  "and σ_1 falls (singular values at tr M = d)"),
            Check("vanilla: σ_1, σ_2 of H_0", f"agrees when σ_2 grows less than {_AMPLIFY:g}× (no amplification)"),
        ],
        limitations=_limitations_3b,
    ),
]
