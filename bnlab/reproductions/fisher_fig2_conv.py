"""The Fisher paper, Fig. 2's convolutional panel: the explosion boundary over (log10 η, γ) with the η* line.

``fisher-fig2-conv`` — as ``fisher-fig2`` (the same training: one batched ensemble of (η, seed) networks per
γ row, momentum SGD μ = 0.9 on ½‖f − onehot(y)‖², explosion = a training loss that is not finite or exceeds
10⁶), for the paper's convolutional network conv:1x28x28-c30k3s2-c60k3s2-c90k3s2-fc10 (§4: three 3×3
convolutions of stride 2 with 30, 60, 90 channels and a fully connected output; BN after each convolution;
σ_w² = 2, σ_b² = 0.5, β = 0).  Beside the boundary: η* = 2(1+μ)/λ̄max from the printed recursions, from the
corrected ones in eval and in train mode (docs/fisher.md, errata E2–E4: the printed conv bound is 10²–10⁵ too
large), and 2(1+μ)/λmax measured at initialization.

Scales: ``small`` 5 000 MNIST images, 40 steps of batch 64, η = 10^(k/4) for k = −12 … 2, 1 seed, γ ∈
{0.25, 4} (the two ends of the paper's γ range, whose boundaries lie two decades apart; sized for ``bnlab
report``'s budget); ``paper`` 60 000 images, 5 epochs, 21 η, 5 seeds, 10 γ.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from bnlab.experiments.spec import Check, Comparison, Experiment, Record, Setting
from bnlab.reproductions.fisher_fig2 import GammaRowCell, eta_init, quarter_decades, train_phase_row

__all__ = ["EXPERIMENTS", "run_cell"]

_PAPER = "Mean-field analysis of batch normalization (the Fisher paper), Fig. 2 (convolutional panel)"
_ARCH = "conv:1x28x28-c30k3s2-c60k3s2-c90k3s2-fc10"
_MOMENTUM = 0.9
_SCALES = {
    "small": dict(arch=_ARCH, loss="mse", n_train=5_000, n_test=1_000, steps=40, batch=64,
                  etas=quarter_decades(-12, 2), seeds=[0], gammas=[0.25, 4.0]),
    "paper": dict(arch=_ARCH, loss="mse", n_train=60_000, n_test=10_000, steps=5 * 60_000 // 64, batch=64,
                  etas=quarter_decades(-16, 4), seeds=[0, 1, 2, 3, 4],
                  gammas=[round(float(g), 4) for g in np.geomspace(0.1, 5.0, 10)]),
}
_ETA_STARS = (("eta_star_paper", "as printed", "r--"), ("eta_star_measured_eval", "corrected, eval", "r-"),
              ("eta_star_measured_train", "corrected, train", "m-"))


def _grid(scale: str) -> list[dict]:
    from bnlab._validation import check_choice

    s = _SCALES[check_choice("scale", scale, tuple(_SCALES))]
    return [dict(gamma=g, seed=0, **{k: v for k, v in s.items() if k != "gammas"}) for g in s["gammas"]]


def run_cell(params: GammaRowCell | dict) -> dict:
    """One γ row: the (η, seed) ensemble on images of shape (1, 28, 28), its boundaries, the three η* and η_init."""
    import torch

    from bnlab.data import DatasetNotFoundError
    from bnlab.fisher import fisher_order_parameters
    from bnlab.reproductions.fisher_data import mnist_subsets

    cell = GammaRowCell.parse(params)
    torch.set_num_threads(1)
    try:
        tr, te = mnist_subsets(cell.n_train, cell.n_test)
    except DatasetNotFoundError as exc:
        return {"skipped": True, "skip_reason": str(exc)}
    shape = (1, 28, 28)
    train = (tr.x.reshape((len(tr),) + shape), tr.y)
    test = (te.x.reshape((len(te),) + shape), te.y)
    kw = dict(norm="bn", gamma=cell.gamma, sigma_w2=2.0, sigma_b2=0.5, loss=cell.loss)
    out = dict(skipped=False, **train_phase_row(cell.arch, cell.etas, cell.seeds, train, test,
                                                 steps=cell.steps, batch=cell.batch,
                                                 data_seed=cell.seed, **kw))
    out["eta_init"] = eta_init(cell.arch, train, **kw)
    for key, fkw in (("eta_star_measured_eval", dict(formula="measured", bn_mode="eval")),
                     ("eta_star_measured_train", dict(formula="measured", bn_mode="train")),
                     ("eta_star_paper", dict(formula="paper", bn_mode="eval"))):
        out[key] = fisher_order_parameters(cell.arch, gamma=cell.gamma, sigma_w2=2.0, sigma_b2=0.5,
                                           momentum=_MOMENTUM, **fkw).eta_star
    return out


def _done(records: Sequence[Record]) -> list[Record]:
    return sorted([r for r in records if not r.metrics.get("skipped")], key=lambda r: r.params["gamma"])


def _plot(records: Sequence[Record], outdir: Path) -> list[Path]:
    import matplotlib

    from bnlab.reproductions.plotting import pyplot, save_figure

    plt = pyplot()
    done = _done(records)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if done:
        etas = np.log10(done[0].metrics["etas"])
        ys = np.arange(len(done))
        z = np.array([[np.nan if v is None else v for v in r.metrics["test_loss"]] for r in done], dtype=float)
        mesh = ax.pcolormesh(etas, ys, np.ma.masked_invalid(z), shading="nearest", cmap="viridis",
                             norm=matplotlib.colors.LogNorm())
        fig.colorbar(mesh, ax=ax, label="test loss (white: explosion)")
        for key, label, style in _ETA_STARS:
            ax.plot(np.log10([r.metrics[key] for r in done]), ys, style, label=f"η* ({label})")
        ax.plot(np.log10([r.metrics["eta_init"] for r in done]), ys, "c:", label="2(1+μ)/λmax measured at init")
        b = [r.metrics.get("boundary") for r in done]
        ax.plot([np.log10(v) if v else np.nan for v in b], ys, "wo", mec="k", ms=5, label="explosion boundary")
        ax.set_yticks(ys, [f"{r.params['gamma']:g}" for r in done])
        ax.set(xlabel="log10 η", ylabel="γ", title=f"Fig. 2 (conv): {_ARCH} on MNIST")
        ax.legend(fontsize=6, loc="lower left")
    fig.tight_layout()
    return save_figure(fig, outdir, "fisher_fig2_conv")


def _compare(records: Sequence[Record]) -> list[Comparison]:
    done = _done(records)
    rows = []
    for key, label, _ in _ETA_STARS:
        for r in done:
            b, e = r.metrics.get("boundary"), r.metrics.get(key)
            ratio = e / b if b and e else None
            rows.append(Comparison(
                f"η* ({label}) / explosion boundary, conv net, γ = {r.params['gamma']:g} (within a factor 2?)",
                "the η* line falls on the boundary (Fig. 2, conv panel)",
                "no boundary located in the η grid" if ratio is None
                else f"{ratio:.2g} (η* {e:.3g}, boundary {b:.3g}; 1 seed)",
                None if ratio is None else bool(0.5 <= ratio <= 2.0)))
    ratios = [r.metrics["eta_init"] / r.metrics["boundary"] for r in done
              if r.metrics.get("boundary") and r.metrics.get("eta_init")]
    rows.append(Comparison("2(1+μ)/λmax at init / explosion boundary, conv net (the bound's gap or training's?)", "—",
                           ", ".join(f"γ={r.params['gamma']:g}: {x:.2g}" for r, x in zip(done, ratios)) + " (1 seed)",
                           None))
    return rows


def _settings() -> list[Setting]:
    s, p = _SCALES["small"], _SCALES["paper"]
    etas = lambda d: f"{len(d['etas'])} log-spaced in [{min(d['etas']):g}, {max(d['etas']):g}]"
    return [
        Setting("network", "3 conv layers (3×3, stride 2; 30, 60, 90 channels) + FC output, BN after each conv",
                _ARCH, _ARCH),
        Setting("data set", "MNIST and CIFAR-10 panels", "MNIST", "MNIST", "CIFAR-10 is not available offline"),
        Setting("loss", "not stated (the theory's ½‖f − y‖²)", "½‖f − onehot(y)‖²", "½‖f − onehot(y)‖²"),
        Setting("training images", "60 000", str(s["n_train"]), str(p["n_train"])),
        Setting("steps (batch 64)", "5 epochs", str(s["steps"]), str(p["steps"])),
        Setting("η grid", "not stated", etas(s), etas(p)),
        Setting("γ rows", "not stated", ", ".join(f"{g:g}" for g in s["gammas"]), f"{len(p['gammas'])} in [0.1, 5]"),
        Setting("seeds per (γ, η)", "5", str(len(s["seeds"])), str(len(p["seeds"]))),
    ]


EXPERIMENTS = [
    Experiment(
        name="fisher-fig2-conv",
        paper=_PAPER,
        figure="Fig. 2 (convolutional panel)",
        title="Learning-rate phase diagram of the paper's BN conv net with the η* line",
        claim="For the convolutional network too, the (γ, log10 η) plane splits into convergent and exploding "
        "regions and the predicted maximal learning rate η* closely agrees with the boundary, over three orders of "
        "magnitude of η (§4, Fig. 2).",
        grid=_grid,
        run_cell=run_cell,
        cell=GammaRowCell,
        plot=_plot,
        compare=_compare,
        uses_gpu=False,
        settings=_settings(),
        checks=[Check("η*", "agrees when η* / the explosion boundary lies in [0.5, 2] (one row per γ and formula: as "
                      "printed, corrected in eval mode, corrected in train mode); a row without a located boundary "
                      "is not judged")],
        limitations=f"Small scale: {_SCALES['small']['steps']} steps of batch {_SCALES['small']['batch']} on "
        f"{_SCALES['small']['n_train']} MNIST images, one seed, γ ∈ "
        f"{{{', '.join(f'{g:g}' for g in _SCALES['small']['gammas'])}}} (the paper: 5 epochs, 5 restarts, a γ range): "
        "an η just above the limit, whose loss grows slowly, may not reach the explosion threshold in so few steps, "
        "so the located boundary can sit one grid step high; the boundary is located to a factor 1.33 (η at "
        "10^(1/4) spacing).",
    )
]
