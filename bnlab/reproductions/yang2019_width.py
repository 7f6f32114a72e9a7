"""Finite-width networks converge to the mean field theory at rate 1/width (Yang et al. 2019, §3; issue #4).

``yang2019-width``: for widths N on a doubling grid, the bias of two simulated
quantities relative to the mean field limit, on a log–log plot with the fitted
slope (expected ≈ −1, i.e. O(1/N) corrections):

* Σ^L: ReLU, B = 32 — the relative Frobenius distance between the ensemble mean
  of the BSB1 projection of Σ^l (layers past the transient) and the theory's
  fixed point Σ* = BSB1(q*, c*) (Thm 3.5; :func:`bnlab.theory.bsb1_fixed_point`).
  Averaging over networks, layers and the B² entries removes the Monte Carlo
  noise (O(1/sqrt(N·networks·layers)/B)) well below the bias at these widths.
* λ_G: tanh, B = 32 — |simulated − theory| (Thm 3.9,
  :func:`bnlab.theory.gradient_explosion_rate`).  (For ReLU the O(1/N) term of
  λ_G is too small to measure against the Monte Carlo error: −0.1 % at N = 256.)

The slope is the least-squares slope of log|bias| on log N with its standard
error from the residuals.  Scales: ``small`` N ∈ {64, 128, 256, 512}, depth
20, ReLU 16·N/64 networks (the Monte Carlo error of the ensemble mean ∝
1/sqrt(networks·N) must stay below the bias ∝ 1/N; the slow forward mode
λ_L↑ ≈ 0.93 correlates the layers), tanh 16 networks; ``paper`` N ∈ {64, …,
4096}, 100·N/64 ReLU and 100 tanh networks, depth 30.
Below N ≈ 2B the bias is not yet in its 1/N regime (at N = 32, B = 32 the
fitted Σ slope over 32–256 was −0.71).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from bnlab.experiments.cells import Cell, cell_param
from bnlab.experiments.spec import Check, Comparison, Experiment, Record, Setting
from bnlab.reproductions.plotting import grid_ticks, pyplot, save_figure

__all__ = ["WidthCell", "EXPERIMENTS", "run_cell", "fit_loglog_slope"]

_PAPER = "Yang et al. 2019 (ICLR), A Mean Field Theory of Batch Normalization"
_B = 32
_SCALES = {
    "small": dict(widths=[64, 128, 256, 512], relu_networks=16, tanh_networks=16, depth=20),
    "paper": dict(widths=[64, 128, 256, 512, 1024, 2048, 4096], relu_networks=100, tanh_networks=100, depth=30),
}


def _check_scale(scale: str) -> dict:
    from bnlab._validation import check_choice

    return _SCALES[check_choice("scale", scale, tuple(_SCALES))]


def _grid(scale: str) -> list[dict]:
    s = _check_scale(scale)
    return [
        # Monte Carlo error of the ensemble mean ∝ 1/sqrt(networks·N), bias ∝ 1/N: networks ∝ N keeps
        # the bias-to-noise ratio of the Σ measurement constant across widths
        dict(batch_size=_B, width=w, depth=s["depth"], relu_networks=s["relu_networks"] * w // s["widths"][0],
             tanh_networks=s["tanh_networks"], seed=3000 + w, rate_estimator="step_ratio")
        for w in s["widths"]
    ]


@dataclass(frozen=True, kw_only=True)
class WidthCell(Cell):
    """The parameters of a width cell: ``relu_networks`` ReLU and ``tanh_networks`` tanh BN networks of one width."""

    batch_size: int = cell_param(minimum=2)
    width: int = cell_param(minimum=1)
    depth: int = cell_param(minimum=1)
    relu_networks: int = cell_param(minimum=1)
    tanh_networks: int = cell_param(minimum=1)
    seed: int = cell_param(minimum=0)
    rate_estimator: str = "step_ratio"  # bnlab.compare's rate estimator
    device: str = "cpu"  # set by the engine for a GPU; not part of the cell's identity


def run_cell(params: WidthCell | dict) -> dict:
    """One width: the bias of Σ^L (ReLU) and of λ_G (tanh) relative to the theory."""
    from bnlab.compare import compare_with_theory
    from bnlab.sim import simulate

    cell = WidthCell.parse(params)
    b, width, depth = cell.batch_size, cell.width, cell.depth
    dev = cell.device
    relu = simulate("relu", b, width, depth, cell.relu_networks, measure_gradients=False,
                    seed=cell.seed, dtype="float64", device=dev)
    first = depth // 4 + 1  # past the transient
    state = compare_with_theory(relu, quantities=("q_star", "c_star"), state_layers=(first, depth))
    q_star, c_star = state["q_star"].theory, state["c_star"].theory
    q = float(relu.q[:, first - 1 :].mean())
    # the entries of Σ are averaged (off-diagonal = q·c per network and layer), not q and c separately
    qc = float((relu.q * relu.c)[:, first - 1 :].mean())
    # ‖BSB1(q, qc) − Σ*‖_F / ‖Σ*‖_F, BSB1 written by its diagonal and off-diagonal entries
    num = b * (q - q_star) ** 2 + b * (b - 1) * (qc - q_star * c_star) ** 2
    den = b * q_star**2 + b * (b - 1) * (q_star * c_star) ** 2
    tanh = simulate("tanh", b, width, depth, cell.tanh_networks, seed=cell.seed + 1,
                    dtype="float32", device=dev)
    rate = compare_with_theory(tanh, quantities="grad_explosion_rate",
                               rate_options={"estimator": cell.rate_estimator})
    fit = rate["grad_explosion_rate"]
    theory = fit.theory
    return dict(
        sigma_bias=math.sqrt(num / den), q=q, c=qc / q, q_star=q_star, c_star=c_star,
        grad_rate=fit.simulated, grad_rate_ci=list(fit.ci), theory_grad_rate=theory,
        grad_rate_bias=None if theory is None else fit.simulated - theory,
    )


def fit_loglog_slope(widths, errors) -> tuple[float, float]:
    """Least-squares slope of log|error| on log width and its standard error (None-free inputs)."""
    x = np.log(np.asarray(widths, dtype=np.float64))
    y = np.log(np.abs(np.asarray(errors, dtype=np.float64)))
    if x.size < 3:
        raise ValueError("fit_loglog_slope needs at least 3 widths")
    xc = x - x.mean()
    slope = float(xc @ (y - y.mean()) / (xc @ xc))
    resid = y - y.mean() - slope * xc
    se = float(math.sqrt(resid @ resid / (x.size - 2) / (xc @ xc)))
    return slope, se


def _series(records: Sequence[Record]):
    recs = sorted(records, key=lambda r: r.params["width"])
    w = np.array([r.params["width"] for r in recs])
    sig = np.array([r.metrics["sigma_bias"] for r in recs])
    lam = [r.metrics["grad_rate_bias"] for r in recs]
    lam = None if any(v is None for v in lam) else np.abs(np.array(lam))
    return recs, w, sig, lam


def _plot(records: Sequence[Record], outdir: Path) -> list[Path]:
    plt = pyplot()
    recs, w, sig, lam = _series(records)
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for y, label in ((sig, r"$\Sigma^L$ (ReLU): $\|\bar\Sigma - \Sigma^*\| / \|\Sigma^*\|$"),
                     (lam, r"$\lambda_G$ (tanh): $|\hat\lambda - \lambda|$")):
        if y is None or len(y) < 3:
            continue
        slope, se = fit_loglog_slope(w, y)
        pts = ax.loglog(w, y, "o", label=f"{label}, slope {slope:.2f} ± {se:.2f}")
        fit_line = np.exp(np.polyval(np.polyfit(np.log(w), np.log(y), 1), np.log(w)))
        ax.loglog(w, fit_line, "-", color=pts[0].get_color(), lw=0.8)
    if len(w):
        ax.loglog(w, sig[0] * w[0] / w, "k:", lw=0.8, label="∝ 1/width")
    ax.set_xlabel("width N")
    ax.set_ylabel("bias relative to the mean field limit")
    ax.set_title(f"Finite-width corrections, B = {_B}")
    if len(w):
        grid_ticks(ax, "x", w)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, outdir, "yang2019_width")


def _compare(records: Sequence[Record]) -> list[Comparison]:
    recs, w, sig, lam = _series(records)
    rows = []
    for y, what in ((sig, "Σ^L (ReLU, B = 32)"), (lam, "λ_G (tanh, B = 32)")):
        if y is None or len(y) < 3:
            continue
        slope, se = fit_loglog_slope(w, y)
        rows.append(Comparison(
            quantity=f"log–log slope of the bias of {what} vs width",
            paper="−1 (mean field limit with O(1/width) corrections)",
            bnlab=f"{slope:.2f} ± {se:.2f} over widths {w.min()}–{w.max()}",
            agrees=bool(abs(slope + 1) <= max(0.25, 2 * se)),
        ))
    return rows


EXPERIMENTS = [
    Experiment(
        name="yang2019-width",
        paper=_PAPER,
        figure="§3 (mean field limit)",
        title="1/width convergence of Σ^L and λ_G to the theory",
        claim="The mean field theory is the infinite-width limit: simulated finite networks approach the BSB1 "
        "fixed point and the gradient explosion rate of the theory with corrections of order 1/width.",
        grid=_grid,
        run_cell=run_cell,
        cell=WidthCell,
        plot=_plot,
        compare=_compare,
        uses_gpu=True,
        settings=[
            Setting("widths N", "(not a figure of the paper: its infinite-width limit)",
                    ", ".join(map(str, _SCALES["small"]["widths"])), ", ".join(map(str, _SCALES["paper"]["widths"]))),
            Setting("B", "—", str(_B), str(_B)),
            Setting("depth", "—", str(_SCALES["small"]["depth"]), str(_SCALES["paper"]["depth"])),
            Setting("networks", "—", f"ReLU {_SCALES['small']['relu_networks']}·N/64, tanh "
                    f"{_SCALES['small']['tanh_networks']}", f"ReLU {_SCALES['paper']['relu_networks']}·N/64, tanh "
                    f"{_SCALES['paper']['tanh_networks']}",
                    "the Monte Carlo error of the ReLU ensemble mean ∝ 1/√(networks·N) must stay below the bias ∝ 1/N"),
        ],
        checks=[Check("log–log slope of the bias", "agrees when the least-squares slope of log|bias| on log N is "
                      "within max(0.25, 2 standard errors) of −1")],
        limitations=f"Widths {', '.join(map(str, _SCALES['small']['widths']))} (paper scale: up to "
        f"{_SCALES['paper']['widths'][-1]}) and depth {_SCALES['small']['depth']}; not a figure of the paper: it "
        "checks the premise of every mean-field figure, that the theory is the infinite-width limit.",
    )
]
