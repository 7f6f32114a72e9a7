"""Daneshmand et al. 2020, Figs. 8 and 9: the regularity constant α and E‖M‖²_F of the BN chain's
invariant distribution, by ergodic averages (App. E, Eq. 49).

``daneshmand2020-fig89``: one cell per (d, γ) runs the linear BN chain H_{ℓ+1} = BN_{0,1}(H_ℓ + γW_ℓH_ℓ)
(Eq. 7; Gaussian W, N = d) through :func:`bnlab.rank.invariant_moments` and records the ergodic means of
Tr diag(M²)², Tr M³ (their ratio is α, Def. 3), ‖M‖²_F and r(H), with batch-means standard errors.

* Fig. 8 / Lemma 10: α < 1, and α < 0.9 for d > 10 (γ = 1 and 0.1); α decreases with d (Thm 14's remark).
* Fig. 9 / Lemma 13: E‖M‖²_F ≤ d^{3/2}/√(1 − α); log₂ E‖M‖²_F against log₂ d follows d^{1.5}.

Scales: ``small`` d ∈ {8, 16, 32, 64}, γ ∈ {1, 0.1}, 2 000 layers after 100 of burn-in (≈ 25 s of CPU);
``paper`` d ∈ {4, …, 256}, L = 10⁵ as the captions state.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from bnlab.experiments.cells import Cell, cell_param
from bnlab.experiments.spec import Check, Comparison, Experiment, Record, Setting
from bnlab.reproductions.plotting import pyplot, save_figure

__all__ = ["EXPERIMENTS", "MomentsCell", "run_cell"]

_PAPER = "Daneshmand et al. 2020 (NeurIPS), Batch normalization provably avoids rank collapse"
_SCALES = {
    "small": dict(widths=[8, 16, 32, 64], gammas=[1.0, 0.1], depth=2_000, burn_in=100),
    "paper": dict(widths=[4, 8, 16, 32, 64, 128, 256], gammas=[1.0, 0.1], depth=100_000, burn_in=1_000),
}
#: α's threshold and the width beyond which Fig. 8 shows α below it
_ALPHA_MAX, _D_MIN = 0.9, 10


def _grid(scale: str) -> list[dict]:
    from bnlab._validation import check_choice

    s = _SCALES[check_choice("scale", scale, tuple(_SCALES))]
    return [dict(width=d, residual_gamma=g, depth=s["depth"], burn_in=s["burn_in"], seed=800 + d)
            for g in s["gammas"] for d in s["widths"]]


@dataclass(frozen=True, kw_only=True)
class MomentsCell(Cell):
    """The parameters of a Figs. 8/9 cell: the ergodic averages of one chain of width d, γ, after ``burn_in``."""

    width: int = cell_param(minimum=1)
    depth: int = cell_param(minimum=1)
    residual_gamma: float = cell_param(minimum=0.0, strict_minimum=True)
    burn_in: int = cell_param(minimum=0)
    seed: int = cell_param(minimum=0)
    device: str = "cpu"  # set by the engine for a GPU; not part of the cell's identity


def run_cell(params: MomentsCell | dict) -> dict:
    """One (d, γ): the ergodic averages of :func:`bnlab.rank.invariant_moments` and the bounds at its α
    (``params``: a :class:`MomentsCell`, what the engine hands over, or its dict)."""
    from bnlab.rank import invariant_moments

    cell = MomentsCell.parse(params)
    res = invariant_moments(cell.width, cell.depth, residual_gamma=cell.residual_gamma, burn_in=cell.burn_in,
                            seed=cell.seed, device=cell.device)
    return res.to_dict()


def _by_gamma(records: Sequence[Record]) -> dict[float, list[Record]]:
    out: dict[float, list[Record]] = {}
    for r in records:
        out.setdefault(float(r.params["residual_gamma"]), []).append(r)
    return {g: sorted(v, key=lambda r: r.params["width"]) for g, v in sorted(out.items(), reverse=True)}


def _slope_ci(x, y) -> tuple[float, float, float]:
    from scipy import stats

    x, y = np.asarray(x, float), np.asarray(y, float)
    fit = stats.linregress(x, y)
    half = float(stats.t.ppf(0.975, len(x) - 2)) * fit.stderr if len(x) > 2 else math.inf
    return float(fit.slope), float(fit.slope - half), float(fit.slope + half)


def _plot(records: Sequence[Record], outdir: Path) -> list[Path]:
    plt = pyplot()
    fig, (a8, a9) = plt.subplots(1, 2, figsize=(10, 4))
    for g, recs in _by_gamma(records).items():
        d = np.array([r.params["width"] for r in recs])
        a = np.array([r.metrics["alpha"] for r in recs])
        se = np.array([r.metrics["alpha_stderr"] for r in recs])
        a8.errorbar(d, a, yerr=2 * se, fmt="o-", capsize=3, label=f"γ = {g:g}")
        f = np.array([r.metrics["means"]["frobenius2"] for r in recs])
        bound = np.array([r.metrics["lemma13_bound"] for r in recs])
        a9.plot(np.log2(d), np.log2(f), "o-", label=f"γ = {g:g}: E‖M‖²_F")
        a9.plot(np.log2(d), np.log2(bound), ":", label=f"γ = {g:g}: d^1.5/√(1−α) (Lemma 13)")
    ds = sorted({r.params["width"] for r in records})
    if ds:
        a9.plot(np.log2(ds), 1.5 * np.log2(ds), "g--", label="log₂ d^1.5")
    a8.axhline(_ALPHA_MAX, color="k", ls=":", lw=1)
    a8.axvline(_D_MIN, color="k", ls=":", lw=1)
    a8.set_xscale("log", base=2)
    a8.set_xlabel("width d (= N)")
    a8.set_ylabel("regularity constant α (± 2 SE)")
    a8.set_title("Fig. 8: α of the invariant distribution", fontsize=10)
    a9.set_xlabel("log₂ d")
    a9.set_ylabel("log₂ of the ergodic mean")
    a9.set_title("Fig. 9: E‖M(H)‖²_F against d", fontsize=10)
    for ax in (a8, a9):
        ax.legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, outdir, "daneshmand2020_fig89")


def _compare(records: Sequence[Record]) -> list[Comparison]:
    rows = []
    for g, recs in _by_gamma(records).items():
        L = recs[0].params["depth"]
        for r in recs:
            d, m = r.params["width"], r.metrics
            a, se = m["alpha"], m["alpha_stderr"]
            judged = d > _D_MIN
            rows.append(Comparison(
                f"α below 0.9 for d > 10, γ = {g:g}, d = {d} (L = {L})",
                "α < 0.9 for d > 10 (Fig. 8); α < 1 (Lemma 10)",
                f"α = {a:.4f} ± {se:.4f} (SE)",
                bool(a + 2 * se < _ALPHA_MAX) if judged else None,
                reason="" if judged else f"d = {d} ≤ {_D_MIN}: Fig. 8 makes no claim here"))
        alphas = [r.metrics["alpha"] for r in recs]
        ses = [r.metrics["alpha_stderr"] for r in recs]
        falls = all(a1 - a2 > 2 * math.hypot(s1, s2) for a1, a2, s1, s2 in zip(alphas, alphas[1:], ses, ses[1:]))
        rows.append(Comparison(
            f"α decreases with d, γ = {g:g}",
            "α is decreasing with respect to d (Fig. 8, remark after Thm 14)",
            ", ".join(f"d={r.params['width']}: {r.metrics['alpha']:.4f}" for r in recs), bool(falls)))
        for r in recs:
            m = r.metrics
            f, fse, bound = m["means"]["frobenius2"], m["stderr"]["frobenius2"], m["lemma13_bound"]
            rows.append(Comparison(
                f"Lemma 13 bound, γ = {g:g}, d = {r.params['width']}",
                "E‖M‖²_F ≤ d^{3/2}/√(1 − α) (Eq. 50)",
                f"E‖M‖²_F = {f:.1f} ± {fse:.1f} against {bound:.1f} (ratio {f / bound:.2f})",
                bool(f + 2 * fse <= bound)))
        if len(recs) >= 3:
            d = [r.params["width"] for r in recs]
            f = [r.metrics["means"]["frobenius2"] for r in recs]
            slope, lo, hi = _slope_ci(np.log2(d), np.log2(f))
            rows.append(Comparison(
                f"exponent of E‖M‖²_F in d, γ = {g:g} (d = {min(d)}…{max(d)})",
                "follows d^{1.5} (Fig. 9; O(d^{3/2}) by Lemma 13)",
                f"{slope:.3f}, 95 % CI [{lo:.3f}, {hi:.3f}]",
                bool(slope <= 1.5 and hi < 2.0)))
    return rows


def _settings() -> list[Setting]:
    s, p = _SCALES["small"], _SCALES["paper"]
    fmt = lambda v: ", ".join(f"{x:g}" for x in v)
    return [
        Setting("widths d (= N)", "not listed (Fig. 8: d from a few to a few hundred)", fmt(s["widths"]),
                fmt(p["widths"])),
        Setting("γ", "1 and 0.1", fmt(s["gammas"]), fmt(p["gammas"])),
        Setting("layers averaged L", "10⁵", f"{s['depth']} after {s['burn_in']} of burn-in",
                f"{p['depth']} after {p['burn_in']} of burn-in",
                "2 CPU cores: 2 000 layers already give α to ±0.002 (batch-means SE)"),
        Setting("weights", "standard Gaussian (Def. 1)", "standard Gaussian", "standard Gaussian"),
        Setting("chains", "1 (one long chain, Eq. 49)", "1", "1"),
    ]


EXPERIMENTS = [
    Experiment(
        name="daneshmand2020-fig89",
        paper=_PAPER,
        figure="Figs. 8–9 (Def. 3, Lemmas 10 and 13)",
        title="Regularity constant α and E‖M‖²_F of the BN chain's invariant distribution",
        claim="The regularity constant α = E Tr diag(M²)² / E Tr M³ of the invariant distribution of the linear BN "
        "chain is below 0.9 for d > 10 (γ = 1 and 0.1) and decreases with d (Fig. 8); consequently "
        "E‖M‖²_F ≤ d^{3/2}/√(1 − α) (Lemma 13), and the ergodic E‖M‖²_F follows d^{1.5} (Fig. 9).",
        grid=_grid,
        run_cell=run_cell,
        cell=MomentsCell,
        plot=_plot,
        compare=_compare,
        uses_gpu=False,
        settings=_settings(),
        checks=[
            Check("α below 0.9 for d > 10",
                  "agrees when α + 2 standard errors < 0.9 (batch means over 20 consecutive layer blocks); rows with "
                  "d ≤ 10 are shown unjudged (the figure claims nothing there)"),
            Check("α decreases with d",
                  "agrees when α falls from each width to the next by more than 2 combined standard errors"),
            Check("Lemma 13 bound",
                  "agrees when the ergodic E‖M‖²_F + 2 SE is at most d^{3/2}/√(1 − α) at the same run's α"),
            Check("exponent of E‖M‖²_F in d",
                  "agrees when the least-squares slope of log₂ E‖M‖²_F on log₂ d is ≤ 1.5 and its 95 % t-interval "
                  "excludes 2 (the exponent of a rank collapse, ‖M‖²_F → d²)"),
        ],
        limitations="2 000 layers per cell instead of 10⁵ and widths up to 64: α and E‖M‖²_F are ergodic "
        "averages, so the shorter chain costs precision (standard errors ≈ 0.001–0.002 on α, shown), not bias "
        "beyond the burn-in; widths beyond 64 are left to the paper scale.",
    )
]
