"""The Fisher paper, Fig. 2 (FC, MNIST): test loss over (log10 η, γ) after training, with the η* line.

``fisher-fig2`` — one cell per γ trains, as one batched ensemble (:func:`bnlab.fisher.train_ensemble`:
``torch.func.stack_module_state`` + ``vmap``), every (η, seed) network of the FC BN architecture with
momentum SGD (μ = 0.9), σ_w² = 2, σ_b² = 0.5, β = 0, and records the test loss and whether the
parameters exploded. The paper's white region is "parameter explosion for at least one of the runs";
the **measured divergence boundary** of a γ row is defined here as the geometric mean of the largest
η at which no seed exploded and the smallest η above it at which one did. A second, looser boundary
("no learning") treats a mean test loss ≥ 0.9·ln 10 (90 % of chance) like an explosion. Beside it: η* =
2(1+μ)/λ̄max from the corrected recursions in eval mode (the paper's model), in train mode, and from
the printed recursions.

Scales. ``small`` (a few CPU minutes): fc:784-128-128-128-10, 10 000 MNIST training images, 300 steps
of batch 64 (≈ 2 epochs), 2 000 test images, η on 13 log-spaced values in [1e-3, 10], 2 seeds, 3 γ
(0.25, 1, 4: the ends and the middle of the paper's range, so η* still spans three decades).
``paper``: fc:784-1000-1000-1000-10, 60 000 images, 5 epochs of batch 64, 25 η values, 5 seeds, 10 γ.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import numpy as np

from bnlab.experiments.spec import Comparison, Experiment, Record, Setting

__all__ = ["EXPERIMENTS", "run_phase_cell", "divergence_boundary"]

_PAPER = "Mean-field analysis of batch normalization (the Fisher paper), Fig. 2"
_SCALES = {
    "small": dict(arch="fc:784-128-128-128-10", n_train=10_000, n_test=2_000, steps=300, batch=64,
                  etas=[round(float(e), 6) for e in np.geomspace(1e-3, 10.0, 13)], seeds=[0, 1],
                  gammas=[0.25, 1.0, 4.0]),
    "paper": dict(arch="fc:784-1000-1000-1000-10", n_train=60_000, n_test=10_000, steps=5 * 60_000 // 64,
                  batch=64, etas=[round(float(e), 6) for e in np.geomspace(1e-4, 10.0, 25)], seeds=[0, 1, 2, 3, 4],
                  gammas=[round(float(g), 4) for g in np.geomspace(0.1, 5.0, 10)]),
}


def _grid(scale: str) -> list[dict]:
    from bnlab._validation import check_choice

    s = _SCALES[check_choice("scale", scale, tuple(_SCALES))]
    return [dict(gamma=g, seed=0, **{k: v for k, v in s.items() if k != "gammas"}) for g in s["gammas"]]


def _settings() -> list[Setting]:
    # read off _SCALES, so the report's table cannot drift from the grid
    s, p = _SCALES["small"], _SCALES["paper"]

    def etas(d):
        return f"{len(d['etas'])} log-spaced in [{min(d['etas']):g}, {max(d['etas']):g}]"

    return [
        Setting("network", "fc:784-1000-1000-1000-10", s["arch"], p["arch"]),
        Setting("training images", "60 000", str(s["n_train"]), str(p["n_train"])),
        Setting("steps (batch 64)", "5 epochs", str(s["steps"]), str(p["steps"])),
        Setting("η grid", "not stated", etas(s), etas(p)),
        Setting("γ rows", "not stated", ", ".join(f"{g:g}" for g in s["gammas"]),
                f"{len(p['gammas'])} log-spaced in [{min(p['gammas']):g}, {max(p['gammas']):g}]",
                "small: 3 rows (the ends and the middle) to fit bnlab report's 10 minutes on 2 CPU cores"),
        Setting("seeds per (γ, η)", "5 random restarts", str(len(s["seeds"])), str(len(p["seeds"]))),
    ]


def divergence_boundary(etas: Sequence[float], exploded_any: Sequence[bool]) -> float | None:
    """Geometric mean of the largest stable η and the next (exploding) η; None without a transition."""
    pairs = sorted(zip(etas, exploded_any))
    stable = [e for e, x in pairs if not x]
    if not stable:
        return None
    top = max(stable)
    above = [e for e, x in pairs if x and e > top]
    if not above:
        return None
    return math.sqrt(top * min(above))


def run_phase_cell(params: dict) -> dict:
    """Train the (η, seed) ensemble of one γ row; test losses, explosions, the boundary and η*."""
    from bnlab.data import DatasetNotFoundError, load_dataset, standardize
    from bnlab.fisher import fisher_order_parameters, train_ensemble

    try:
        tr = load_dataset("mnist", "train").subset(int(params["n_train"]), seed=0)
        te = load_dataset("mnist", "test").subset(int(params["n_test"]), seed=0)
    except DatasetNotFoundError as exc:
        return {"skipped": True, "skip_reason": str(exc)}
    tr, te = standardize(tr, te)
    x, xt = tr.x.reshape(len(tr), -1), te.x.reshape(len(te), -1)
    configs = [dict(eta=e, gamma=params["gamma"], seed=s) for e in params["etas"] for s in params["seeds"]]
    res = train_ensemble(params["arch"], configs, x, tr.y, xt, te.y, steps=int(params["steps"]),
                         batch_size=int(params["batch"]), momentum=0.9, data_seed=int(params["seed"]))
    etas = params["etas"]
    loss, exploded_any = [], []
    for e in etas:
        rows = [i for i, c in enumerate(res.configs) if c["eta"] == e]
        ex = any(res.exploded[i] for i in rows)
        exploded_any.append(ex)
        vals = [res.test_loss[i] for i in rows]
        loss.append(None if ex or not all(np.isfinite(vals)) else float(np.mean(vals)))
    failed = [ex or (v is not None and v >= 0.9 * math.log(10)) for ex, v in zip(exploded_any, loss)]
    out = dict(skipped=False, etas=etas, test_loss=loss, exploded_any=exploded_any,
               boundary=divergence_boundary(etas, exploded_any),
               boundary_no_learning=divergence_boundary(etas, failed))
    for key, kw in (("eta_star_measured_eval", dict(formula="measured", bn_mode="eval")),
                    ("eta_star_measured_train", dict(formula="measured", bn_mode="train")),
                    ("eta_star_paper", dict(formula="paper", bn_mode="eval"))):
        out[key] = fisher_order_parameters(params["arch"], gamma=params["gamma"], sigma_w2=2.0, sigma_b2=0.5,
                                           momentum=0.9, **kw).eta_star
    return out


def _plot(records: Sequence[Record], outdir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    done = sorted([r for r in records if not r.metrics.get("skipped")], key=lambda r: r.params["gamma"])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if done:
        etas = np.log10(done[0].metrics["etas"])
        gam = [r.params["gamma"] for r in done]
        z = np.array([[np.nan if v is None else v for v in r.metrics["test_loss"]] for r in done], dtype=float)
        mesh = ax.pcolormesh(etas, np.arange(len(gam)), np.ma.masked_invalid(z), shading="nearest", cmap="viridis",
                             norm=matplotlib.colors.LogNorm())
        fig.colorbar(mesh, ax=ax, label="test loss (white: explosion in ≥ 1 run)")
        ys = np.arange(len(gam))
        for key, style, label in (("eta_star_paper", "r--", "η* (as printed)"),
                                  ("eta_star_measured_eval", "r-", "η* (corrected, eval)"),
                                  ("eta_star_measured_train", "m-", "η* (corrected, train)")):
            ax.plot(np.log10([r.metrics[key] for r in done]), ys, style, label=label)
        b = [r.metrics["boundary"] for r in done]
        ax.plot([np.log10(v) if v else np.nan for v in b], ys, "wo", mec="k", label="measured boundary (explosion)")
        b2 = [r.metrics.get("boundary_no_learning") for r in done]
        ax.plot([np.log10(v) if v else np.nan for v in b2], ys, "ws", mec="k", ms=4, label="boundary (no learning)")
        ax.set_yticks(ys, [f"{g:g}" for g in gam])
        ax.set(xlabel="log10 η", ylabel="γ", title=f"Fig. 2: {done[0].params['arch']} on MNIST")
        ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    path = outdir / "fisher_fig2.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]


def _compare(records: Sequence[Record]) -> list[Comparison]:
    done = sorted([r for r in records if not r.metrics.get("skipped")], key=lambda r: r.params["gamma"])
    rows = []
    for bkey, bname in (("boundary", "explosion boundary"), ("boundary_no_learning", "no-learning boundary")):
        for key, label in (("eta_star_paper", "as printed"), ("eta_star_measured_eval", "corrected, eval"),
                           ("eta_star_measured_train", "corrected, train")):
            ratios = [r.metrics[key] / r.metrics[bkey] for r in done if r.metrics.get(bkey)]
            if not ratios:
                continue
            ok = all(0.5 <= x <= 2.0 for x in ratios) and len(ratios) == len(done)
            rows.append(Comparison(f"η* ({label}) / measured {bname}, per γ (within a factor 2?)",
                                   "the η* line falls on the boundary (Fig. 2)",
                                   ", ".join(f"{x:.2g}" for x in ratios) + f" over {len(ratios)}/{len(done)} γ rows",
                                   ok))
    return rows


EXPERIMENTS = [
    Experiment(
        name="fisher-fig2",
        paper=_PAPER,
        figure="Fig. 2 (FC, MNIST)",
        title="Learning-rate phase diagram over (log10 η, γ) with the predicted η* line",
        claim="The (γ, log10 η) plane splits into convergent and exploding phases, and η* = 2(1+μ)/λ̄max "
        "from the mean-field bound falls on the measured boundary over three decades of η.",
        grid=_grid,
        run_cell=run_phase_cell,
        plot=_plot,
        compare=_compare,
        uses_gpu=False,
        settings=_settings(),
    )
]
