"""Yang et al. 2019: the theory section — eigenvalues, gradient explosion and depth scale from several routes.

``yang2019-theory`` evaluates, for each cell (φ, B, method), the forward
eigenvalues λ_L↑, λ_M↑ (Thms 3.7, 3.8), the backward eigenvalues λ_G↓ (the
gradient explosion rate), λ_L↓, λ_M↓ (Thms 3.9, 3.10, G.12), the cross-batch
rate λ_M̃ (Thm 3.11) and the depth scale ξ = 1/log λ_G↓ with the predicted
maximum trainable depth 16ξ (§4).  ``compare`` puts the paper's stated values
beside bnlab's: the relu limit π/(π−1), the identity rate (B−2)/(B−3), the
relu forward limits 1 and π/(2(π−1)), the identity cross-batch rate, the
agreement of the independent routes, and the 16ξ line of Fig. 3.

Scales: ``small`` (< 1 min on one core): φ ∈ {relu, identity, tanh,
alpha_relu(α=0.75)} (BSB1 is attracting for all of them: α = 1.5 would break the symmetry at B ≥ 16), B ∈ {4, 8, 32, 128}, methods closed/sphere/gegenbauer/
montecarlo (20 000 samples, B ≤ 32).  ``paper``: B ∈ {4, …, 1024}, every method, 200 000
Monte Carlo samples.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from bnlab.experiments.cells import Cell, cell_param
from bnlab.experiments.spec import Check, Comparison, Experiment, Record, Setting
from bnlab.reproductions.plotting import grid_ticks, plain_log_ticks, pyplot, save_figure

__all__ = ["TheoryCell", "EXPERIMENTS", "run_theory_cell"]

_PAPER = "Yang et al. 2019 (ICLR), A Mean Field Theory of Batch Normalization"
_PHIS = {
    "relu": {"phi": "relu"},
    "identity": {"phi": "identity"},
    "tanh": {"phi": "tanh"},
    "alpha_relu(alpha=0.75)": {"phi": "alpha_relu", "alpha": 0.75},
}
_SCALES = {
    "small": dict(batch_sizes=[4, 8, 32, 128], n_samples=20_000, montecarlo_max_b=32),
    "paper": dict(batch_sizes=[4, 5, 6, 8, 12, 16, 24, 32, 64, 128, 256, 512, 1024], n_samples=200_000,
                  montecarlo_max_b=1024),
}


def _grid(scale: str) -> list[dict]:
    from bnlab._validation import check_choice

    s = _SCALES[check_choice("scale", scale, tuple(_SCALES))]
    cells = []
    for label, spec in _PHIS.items():
        for b in s["batch_sizes"]:
            methods = ["sphere"] + (["montecarlo"] if b <= s["montecarlo_max_b"] else [])
            if label in ("relu", "identity"):
                methods.insert(0, "closed")
            if label != "tanh":
                methods.insert(0, "laplace")
            # the Gegenbauer route sums the kinked-φ tails through moments (theory.gegenbauer):
            # accurate and cheap at every B
            methods.append("gegenbauer")
            for m in methods:
                cells.append(dict(label=label, **spec, batch_size=b, method=m, n_samples=s["n_samples"], seed=17 + b))
    return cells


@dataclass(frozen=True, kw_only=True)
class TheoryCell(Cell):
    """The parameters of a theory cell: one (φ, B, method) of the forward, backward and cross-batch theory."""

    label: str  # how the report names φ
    phi: str  # an activation name (bnlab.activations.get_activation checks it)
    alpha: float | None = None  # α of alpha_relu
    batch_size: int = cell_param(minimum=2)
    method: str  # a theory method (bnlab.theory checks it)
    n_samples: int = cell_param(minimum=1)
    seed: int = cell_param(minimum=0)


def run_theory_cell(params: TheoryCell | dict) -> dict:
    """Forward, backward, cross-batch quantities of one (φ, B, method); MC cells also return standard errors."""
    from bnlab.activations import get_activation
    from bnlab.theory import backward_eigenvalues, forward_eigenvalues
    from bnlab.theory.analyze import depth_scale, max_trainable_depth
    from bnlab.theory.cross_batch import cross_batch_analysis

    cell = TheoryCell.parse(params)
    extra = {} if cell.alpha is None else {"alpha": cell.alpha}
    act = get_activation(cell.phi, **extra)
    b, method = cell.batch_size, cell.method
    mc = dict(n_samples=cell.n_samples, seed=cell.seed) if method == "montecarlo" else {}
    fw = forward_eigenvalues(act, b, method=method, **mc)
    bw = backward_eigenvalues(act, b, method=method, **mc)
    cbm = {"n_samples": mc["n_samples"], "seed": mc["seed"]} if mc else {}
    cb = cross_batch_analysis(act, b, method=method, **cbm)
    out = dict(
        forward_lambda_L=fw.lambda_L, forward_lambda_M=fw.lambda_M,
        grad_explosion_rate=bw.lambda_G, backward_lambda_L=bw.lambda_L, backward_lambda_M=bw.lambda_M,
        cross_batch_rate=cb.rate, cross_batch_c_star=cb.c_star,
        depth_scale=depth_scale(bw.lambda_G), max_trainable_depth=max_trainable_depth(bw.lambda_G),
    )
    if method == "montecarlo":
        out.update(grad_explosion_rate_stderr=bw.stderr[0], forward_lambda_L_stderr=fw.stderr[0],
                   cross_batch_rate_stderr=cb.stderr[1])
    return out


def _by(records, **match):
    return [r for r in records if all(r.params.get(k) == v for k, v in match.items())]


def _plot(records: Sequence[Record], outdir: Path) -> list[Path]:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    markers = {"closed": "-", "sphere": "o", "gegenbauer": "x", "montecarlo": "s"}
    for label in _PHIS:
        color = None
        for method, style in markers.items():
            rs = sorted(_by(records, label=label, method=method), key=lambda r: r.params["batch_size"])
            if not rs:
                continue
            bs = [r.params["batch_size"] for r in rs]
            ys = [r.metrics["grad_explosion_rate"] for r in rs]
            kw = dict(color=color, label=f"{label} ({method})")
            if method == "montecarlo":
                line = axes[0].errorbar(bs, ys, yerr=[3 * r.metrics["grad_explosion_rate_stderr"] for r in rs],
                                        fmt="s", ms=3, mfc="none", **kw)
                color = line[0].get_color()
            else:
                line = axes[0].plot(bs, ys, style, mfc="none", **kw)[0]
                color = line.get_color()
            if method in ("closed", "sphere") and (method == "closed" or label not in ("relu", "identity")):
                axes[1].plot(bs, [r.metrics["max_trainable_depth"] for r in rs], "-o", ms=3, color=color, label=label)
    axes[0].axhline(math.pi / (math.pi - 1), ls="--", c="k", lw=0.8, label="π/(π−1)")
    axes[0].set(xscale="log", yscale="log", xlabel="batch size B",
                ylabel=r"$\lambda_{G\downarrow}$ (gradient explosion rate)",
                title=r"Thms 3.9, 3.10: $\lambda_{G\downarrow}$ by method")
    axes[0].legend(fontsize=6, ncol=2)
    axes[1].axhline(16 / math.log(math.pi / (math.pi - 1)), ls="--", c="k", lw=0.8, label="relu, B → ∞")
    axes[1].set(xscale="log", yscale="log", xlabel="batch size B",
                ylabel=r"$16\xi = 16/\log\lambda_{G\downarrow}$", title="§4: predicted max trainable depth")
    axes[1].legend(fontsize=7)
    bs = sorted({r.params["batch_size"] for r in records})
    for ax in axes:
        if bs:
            grid_ticks(ax, "x", bs)
        plain_log_ticks(ax, "y")
    fig.tight_layout()
    return save_figure(fig, outdir, "yang2019_theory_rates")


def _rel(a, b):
    return abs(a - b) / abs(b)


def _compare(records: Sequence[Record]) -> list[Comparison]:
    from bnlab.theory import backward_eigenvalues, cross_batch_rate, forward_eigenvalues

    rows = []
    lim = math.pi / (math.pi - 1)
    big = backward_eigenvalues("relu", 10**6, method="closed").lambda_G
    rows.append(Comparison("relu λ_G↓ as B → ∞ (Thm 3.10)", f"π/(π−1) ≈ {lim:.4f}", f"{big:.6f} at B = 10⁶",
                           _rel(big, lim) < 1e-5))
    rs = _by(records, label="relu")
    if rs:
        bmax = max(r.params["batch_size"] for r in rs)
        vals = [r.metrics["grad_explosion_rate"] for r in rs if r.params["batch_size"] == bmax and r.params["method"] != "montecarlo"]
        rows.append(Comparison(f"relu λ_G↓ at B = {bmax}, all exact routes", "decreases to π/(π−1)",
                               ", ".join(f"{v:.8f}" for v in vals), all(v > lim for v in vals)))
    ident = [r for r in _by(records, label="identity") if r.params["method"] != "montecarlo"]
    if ident:
        err = max(_rel(r.metrics["grad_explosion_rate"], (r.params["batch_size"] - 2) / (r.params["batch_size"] - 3)) for r in ident)
        rows.append(Comparison("identity λ_G↓ (Thm 3.9)", "(B−2)/(B−3) exactly", f"max relative deviation {err:.1e} over {len(ident)} cells",
                               err < 1e-9))
    fw = forward_eigenvalues("relu", 10**7, method="closed")
    rows.append(Comparison("relu λ_L↑, λ_M↑ as B → ∞ (Thm 3.7)", f"↗ 1, ↗ π/(2(π−1)) ≈ {math.pi / (2 * (math.pi - 1)):.4f}",
                           f"{fw.lambda_L:.6f}, {fw.lambda_M:.6f} at B = 10⁷",
                           abs(fw.lambda_L - 1) < 1e-5 and abs(fw.lambda_M - math.pi / (2 * (math.pi - 1))) < 1e-5))
    cb = [cross_batch_rate("identity", b) for b in (4, 32, 1024)]
    rows.append(Comparison("identity cross-batch rate (Thm 3.11)", "(B−1)/2·P(B/2,1/2)⁻² < 1, ↗ 1",
                           ", ".join(f"{v:.6f}" for v in cb) + " at B = 4, 32, 1024", all(x < y < 1 for x, y in zip(cb, cb[1:]))))
    # agreement between the independent routes
    worst, n, worst_geg, n_geg = 0.0, 0, 0.0, 0
    z_worst = 0.0
    for label in _PHIS:
        for b in {r.params["batch_size"] for r in _by(records, label=label)}:
            cell = _by(records, label=label, batch_size=b)
            exact = [r for r in cell if r.params["method"] != "montecarlo"]
            ref = next((r for r in exact if r.params["method"] in ("closed", "laplace", "sphere")), None)
            if ref is None:
                continue
            for r in exact:
                d = _rel(r.metrics["grad_explosion_rate"], ref.metrics["grad_explosion_rate"])
                if r.params["method"] == "gegenbauer":
                    worst_geg, n_geg = max(worst_geg, d), n_geg + 1
                else:
                    worst, n = max(worst, d), n + 1
            for r in cell:
                if r.params["method"] == "montecarlo":
                    # identity: every sample gives the same value, stderr ≈ 1e-18; floor it at rounding level
                    se = max(r.metrics["grad_explosion_rate_stderr"], 1e-12 * abs(ref.metrics["grad_explosion_rate"]))
                    z = abs(r.metrics["grad_explosion_rate"] - ref.metrics["grad_explosion_rate"]) / se
                    z_worst = max(z_worst, z)
    rows.append(Comparison("λ_G↓ routes: closed vs Laplace (F.33/G.12) vs sphere", "(independent routes; the paper gives each)",
                           f"max relative spread {worst:.1e} over {n} cells", worst < 1e-7))
    rows.append(Comparison("λ_G↓ routes: Gegenbauer series (Thm 3.9) vs the above",
                           "(series; kinked-φ tails summed through moments)",
                           f"max relative spread {worst_geg:.1e} over {n_geg} cells", worst_geg < 1e-6))
    rows.append(Comparison("λ_G↓ routes: Monte Carlo vs exact", "(simulation within its error)",
                           f"max |z| = {z_worst:.2f}", z_worst < 4.0))
    below = all(
        r.metrics["grad_explosion_rate"] > 1 for r in records
    )
    rows.append(Comparison("λ_G↓ > 1 for every φ (Thm 3.9)", "gradients always explode", "all cells > 1" if below else "a cell ≤ 1", below))
    depth = 16 / math.log(lim)
    rows.append(Comparison("16ξ for relu, B → ∞ (§4, Fig. 3a)", "networks deeper than about 50 layers untrainable",
                           f"16ξ → {depth:.1f} layers", None,
                           reason="the paper's \"about 50 layers\" is read off its Fig. 3a, not stated as a number; "
                           "Fig. 3a's rows judge the measured boundary against 16ξ"))
    return rows


EXPERIMENTS = [
    Experiment(
        name="yang2019-theory",
        paper=_PAPER,
        figure="§3.1–3.2, Thms 3.7–3.11, §4",
        title="Theory: gradient explosion rate, eigenvalues, cross-batch rate and depth scale by several methods",
        claim="At the BSB1 fixed point batchnorm networks explode gradients at the rate λ_G↓ > 1 for every "
        "nonlinearity (Thm 3.9), π/(π−1) ≈ 1.467 for relu as B → ∞ (Thm 3.10) and (B−2)/(B−3) for the identity; "
        "the forward eigenvalues for relu tend to 1 and π/(2(π−1)) (Thm 3.7); two batches decorrelate at the rate "
        "λ_M̃ < 1, maximal for the identity (Thm 3.11); the trainable depth is about 16ξ = 16/log λ_G↓ (§4).",
        grid=_grid,
        run_cell=run_theory_cell,
        cell=TheoryCell,
        plot=_plot,
        compare=_compare,
        uses_gpu=False,
        limitations="None at this scale: the theory is evaluated exactly at B ≤ 128 (Monte Carlo with 20 000 "
        "samples at B ≤ 32); the paper scale adds batch sizes up to 1024 and 200 000 samples.",
        settings=[
            Setting("batch sizes B", "(theorems: every B ≥ 4)", ", ".join(map(str, _SCALES["small"]["batch_sizes"])),
                    ", ".join(map(str, _SCALES["paper"]["batch_sizes"]))),
            Setting("φ", "relu, identity (closed forms); any φ (Thm 3.9)", ", ".join(_PHIS), ", ".join(_PHIS)),
            Setting("Monte Carlo samples", "—", f"{_SCALES['small']['n_samples']:,} (B ≤ "
                    f"{_SCALES['small']['montecarlo_max_b']})".replace(",", " "),
                    f"{_SCALES['paper']['n_samples']:,}".replace(",", " ")),
        ],
        checks=[
            Check("relu λ_G↓", "at B = 10⁶ within 1e-5 (relative) of π/(π−1) (Thm 3.10), and at the largest grid "
                  "B above it by every exact route (the rate decreases to its limit)"),
            Check("identity λ_G↓", "within 1e-9 (relative) of (B−2)/(B−3) in every cell (Thm 3.9's linear rate)"),
            Check("relu λ_L↑, λ_M↑", "at B = 10⁷ within 1e-5 of 1 and π/(2(π−1)) (Thm 3.7's limits)"),
            Check("identity cross-batch rate", "(B−1)/2·P(B/2, 1/2)⁻² increasing in B and < 1 at B = 4, 32, 1024 "
                  "(Thm 3.11)"),
            Check("λ_G↓ routes", "closed form, Laplace and spherical quadrature agree within 1e-7 (relative), the "
                  "Gegenbauer series within 1e-6, Monte Carlo within 4 standard errors"),
            Check("λ_G↓ > 1 for every φ", "agrees when every cell's rate exceeds 1 (Thm 3.9: gradients always explode)"),
            Check("16ξ for relu, B → ∞", "not judged: the paper's \"about 50 layers\" is read off a figure"),
        ],
    )
]
