"""The Fisher paper, Fig. 4 (§6.5): smaller BN γ initialization converges faster.

The paper trains VGG16 and Preact-ResNet18 on CIFAR-10 with SGD (η = 0.1, μ = 0.9, weight decay
5e-4), 5 runs per γ, and shows learning curves. Its argument: λmax of the Fisher ∝ γ² (Claim 3.1;
with the corrected recursions exactly, docs/fisher.md), so at a fixed η a smaller γ is further below
the stability limit η* = 2(1+μ)/λ̄max.

``fisher-fig4`` — stand-ins that run in seconds on a CPU: a BN MLP and a small BN CNN (the Fisher
paper's random networks, :func:`bnlab.fisher.build_model`, σ_w² = 2, σ_b² = 0.5, γ as given, β = 0)
on MNIST, the paper's optimizer (SGD, lr 0.1, momentum 0.9, weight decay 5e-4, as torch.optim.SGD).
One cell = one network kind: every (γ, seed) network of it — the MLPs trained together as one
batched ensemble (:func:`bnlab.nets.train_ensemble`), the CNNs one after the other
(:func:`bnlab.nets.train`; on a CPU the vmapped convolutions are slower than a loop) — network (γ,
s) initialized with seed s and drawing its batches from a generator seeded with s. Per network: the
training loss of every step, the test accuracy at the end, and the convergence speed as the mean
training loss over the run (the area under the learning curve per step) and the first step at which
a running mean of 20 steps falls below ``loss_threshold``.

Why the stand-ins disagree (issue #23 item 6): each cell also measures the stability limit the paper's
argument rests on, per γ, on the seed-0 network at initialization (BN in train mode, one training batch of
``batch`` images): η* = 2(1+μ)/λmax (Eq. 7) from the Fisher's λmax (Eq. 10, measured with
:func:`bnlab.fisher.curvature_spectrum`; the paper's quantity), from the λmax of the Hessian of the
cross-entropy the stand-ins are trained on, and from the corrected mean-field bound (Claim 3.1,
:func:`bnlab.fisher.fisher_order_parameters`, train mode).  The rows put η/η* beside the speed and judge
the argument's own predictions at the cell's η, once with each measured η*: the fastest γ is the one whose
η is nearest η*/2 (the paper's best rate, footnote 1 and Fig. 2's band), and among the γ with η ≥ η*/2
the smaller γ is faster.  The ``medium`` scale adds cells whose learning rate the cell picks from its
measured Fisher η* (:data:`LR_RULES`): every γ at or below η*/2, η* splitting the γ, only the smallest γ
below η* (docs/fisher.md, "Fisher Fig. 4: why").
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Sequence

import numpy as np

from bnlab.experiments.cells import Cell, cell_param
from bnlab.experiments.spec import Check, Comparison, Experiment, Record, Setting, TaskCost
from bnlab.reproductions.fisher_data import mnist_subsets

__all__ = ["CurveCell", "EXPERIMENTS", "LR_RULES", "run_curve_cell", "stability_margins", "steps_to_threshold"]

_PAPER = "Mean-field analysis of batch normalization (the Fisher paper), Fig. 4 (§6.5)"
_NETS = {
    "mlp": "fc:784-128-128-128-10",
    "cnn": "conv:1x28x28-c16k3s2p1-c32k3s2p1-fc10",
}
_SCALES = {
    "small": dict(nets={"mlp": 200, "cnn": 120}, gammas=[0.1, 0.5, 1.0, 2.0], seeds=[0, 1], n_train=5_000,
                  n_test=1_000, batch=128, loss_threshold=0.5),
    "paper": dict(nets={"mlp": 2_000, "cnn": 2_000}, gammas=[0.1, 0.25, 0.5, 1.0, 2.0], seeds=[0, 1, 2, 3, 4],
                  n_train=60_000, n_test=10_000, batch=128, loss_threshold=0.3),
}
_LR, _MOMENTUM, _WEIGHT_DECAY = 0.1, 0.9, 5e-4
_WINDOW = 20
_SIGMA_W2, _SIGMA_B2 = 2.0, 0.5

#: The medium scale's learning rates, each picked by the cell from its measured Fisher η*(γ) (seed 0): at the
#: first every γ is at or below η*/2 (the argument predicts the largest γ fastest), at the second η* splits the
#: γ (slow or diverging large γ), at the third only the smallest γ is below its η* (the paper's best rate η*/2
#: for it, every other γ far beyond its η*).
LR_RULES = {
    "half_eta_star_of_largest_gamma": "η*(largest γ)/2",
    "geometric_mean_eta_star": "√(η*(smallest γ)·η*(largest γ))",
    "half_eta_star_of_smallest_gamma": "η*(smallest γ)/2",
}


def _grid(scale: str) -> list[dict]:
    """One cell per network kind at η = 0.1; ``medium`` adds one per kind and rule of :data:`LR_RULES`."""
    from bnlab._validation import check_choice

    check_choice("scale", scale, ("small", "medium", "paper"))
    s = _SCALES["small" if scale == "medium" else scale]
    lrs: list = [_LR] + (list(LR_RULES) if scale == "medium" else [])
    return [dict(net=net, arch=_NETS[net], steps=steps, lr=lr, gammas=s["gammas"], seeds=s["seeds"], seed=0,
                 n_train=s["n_train"], n_test=s["n_test"], batch=s["batch"], loss_threshold=s["loss_threshold"])
            for lr in lrs for net, steps in s["nets"].items()]


def stability_margins(arch: str, gammas: Sequence[float], x, y, *, seed: int = 0) -> list[dict]:
    """Per γ, the stability limits η* = 2(1+μ)/λmax (Fisher paper, Eq. 7; μ = 0.9) of the seed-``seed``
    network at initialization, BN in train mode on the batch ``(x, y)``: ``eta_star_fisher`` from the
    measured λmax of the Fisher (Eq. 10; the Gauss–Newton matrix of ½‖f − onehot(y)‖²),
    ``eta_star_loss_hessian`` from the measured λmax of the Hessian of the cross-entropy that fisher-fig4
    trains, and ``eta_star_bound`` from the corrected mean-field bound λ̄max (Claim 3.1, train mode,
    standardized inputs), each λmax beside it."""
    from bnlab.fisher import build_model, curvature_spectrum, eta_star, fisher_order_parameters

    out = []
    for g in gammas:
        model = build_model(arch, norm="bn", gamma=float(g), sigma_w2=_SIGMA_W2, sigma_b2=_SIGMA_B2, seed=seed)
        # tol 1e-2: λmax to 1 %, far finer than the factors between the γ (η* ∝ 1/γ²)
        fisher = curvature_spectrum(model, x, y, curvature="fisher", loss="mse", bn_mode="train", tol=1e-2)
        hess = curvature_spectrum(model, x, y, curvature="hessian", loss="cross_entropy", bn_mode="train",
                                  tol=1e-2)
        bound = fisher_order_parameters(arch, gamma=float(g), sigma_w2=_SIGMA_W2, sigma_b2=_SIGMA_B2,
                                        momentum=_MOMENTUM, bn_mode="train")
        out.append(dict(gamma=float(g), lambda_max_fisher=fisher.lambda_max, lambda_max_loss_hessian=hess.lambda_max,
                        lambda_max_bound=bound.lambda_max_bound,
                        eta_star_fisher=eta_star(fisher.lambda_max, _MOMENTUM),
                        eta_star_loss_hessian=eta_star(hess.lambda_max, _MOMENTUM),
                        eta_star_bound=bound.eta_star if math.isfinite(bound.eta_star) else None))
    return out


def _resolve_lr(lr, margins: list[dict]) -> float:
    """The cell's learning rate: a number as given, a rule of :data:`LR_RULES` from the Fisher η* per γ."""
    if not isinstance(lr, str):
        return float(lr)
    from bnlab._validation import check_choice

    rule = check_choice("lr", lr, tuple(LR_RULES))
    by_gamma = sorted(margins, key=lambda m: m["gamma"])
    small, large = by_gamma[0]["eta_star_fisher"], by_gamma[-1]["eta_star_fisher"]
    return {"half_eta_star_of_largest_gamma": large / 2, "geometric_mean_eta_star": math.sqrt(small * large),
            "half_eta_star_of_smallest_gamma": small / 2}[rule]


def steps_to_threshold(losses: Sequence[float], threshold: float, window: int = _WINDOW) -> int | None:
    """First step (1-based, counted at the window's end) whose running mean of ``window`` losses is ≤
    ``threshold``; None when it never is (or a loss is not finite before that)."""
    arr = np.asarray(losses, dtype=float)
    if arr.size < window:
        return None
    means = np.convolve(arr, np.ones(window) / window, mode="valid")
    hit = np.nonzero(means <= threshold)[0]
    if hit.size == 0 or not np.all(np.isfinite(arr[: hit[0] + window])):
        return None
    return int(hit[0] + window)


@dataclass(frozen=True, kw_only=True)
class CurveCell(Cell):
    """The parameters of a Fig. 4 cell: every (γ, seed) network of one kind (``net``, ``arch``) trained together."""

    net: Literal["mlp", "cnn"]
    arch: str  # an architecture string of bnlab.fisher.parse_arch (checked there)
    steps: int = cell_param(minimum=1)
    gammas: tuple[float, ...] = cell_param(minimum=0.0, strict_minimum=True)
    seeds: tuple[int, ...] = cell_param(minimum=0)
    seed: int = cell_param(minimum=0)
    n_train: int = cell_param(minimum=1)
    n_test: int = cell_param(minimum=1)
    batch: int = cell_param(minimum=2)
    loss_threshold: float = cell_param(minimum=0.0, strict_minimum=True)
    # a learning rate, or a rule of LR_RULES that picks it from the η* measured in the cell (medium scale)
    lr: float | Literal["half_eta_star_of_largest_gamma", "geometric_mean_eta_star",
                        "half_eta_star_of_smallest_gamma"] = 0.1
    device: str = "cpu"  # set by the engine for a GPU; not part of the cell's identity

    def check(self) -> None:
        if not self.gammas or not self.seeds:
            raise ValueError(f"cell parameters gammas={list(self.gammas)!r}, seeds={list(self.seeds)!r} are not "
                             f"allowed: give at least one of each")


def run_curve_cell(params: CurveCell | dict) -> dict:
    """Train every (γ, seed) network of one kind together; per network its per-step training loss, final
    test accuracy (eval mode) and speed: ``{"networks": [{"gamma", "seed", "train_loss", ...}], ...}``."""
    from bnlab.data import DatasetNotFoundError
    from bnlab.fisher import build_model, parse_arch
    import torch

    from bnlab.nets import train, train_ensemble

    cell = CurveCell.parse(params)
    try:
        tr, te = mnist_subsets(cell.n_train, cell.n_test)
    except DatasetNotFoundError as exc:
        return {"skipped": True, "skip_reason": str(exc)}
    flat = len(parse_arch(cell.arch).input_shape) == 1
    x = tr.x.reshape(len(tr), -1) if flat else tr.x
    xt = te.x.reshape(len(te), -1) if flat else te.x
    # the stability margins on the first `batch` training images, as many as one SGD step sees (128: ≈ 4 s of
    # CPU for both kinds and four γ, against ≈ 7 s on 256; η* moved by < 30 % between the two)
    nb = cell.batch
    margins = stability_margins(cell.arch, list(cell.gammas), x[:nb], tr.y[:nb])
    lr = _resolve_lr(cell.lr, margins)
    nets = [(g, seed) for g in cell.gammas for seed in cell.seeds]
    models = [build_model(cell.arch, norm="bn", gamma=g, sigma_w2=2.0, sigma_b2=0.5, seed=seed)
              for g, seed in nets]
    device = cell.device
    kw = dict(batch_size=cell.batch, steps=cell.steps, test_data=(xt, te.y), device=device)
    if flat or str(device).startswith("cuda"):  # on a GPU the conv nets too (one batched call, not 25 launch-bound ones)
        results = train_ensemble(models, (x, tr.y), lr=lr, momentum=_MOMENTUM, weight_decay=_WEIGHT_DECAY,
                                 seeds=[seed for _, seed in nets], **kw)
    else:
        # conv nets one at a time (the same numbers to rounding, tests/nets/test_ensemble.py): under vmap
        # a convolution with per-network weights on per-network inputs is a grouped convolution, which
        # on the CPU made the 8-network CNN cell 1.7x slower than a loop (11.3 s against 6.8 s)
        opt = functools.partial(torch.optim.SGD, lr=lr, momentum=_MOMENTUM, weight_decay=_WEIGHT_DECAY)
        results = [train(m, (x, tr.y), optimizer=opt, seed=seed, **kw) for m, (_, seed) in zip(models, nets)]
    rows = []
    for (g, seed), r in zip(nets, results):
        losses = list(r.history)
        finite = not r.diverged and bool(np.all(np.isfinite(losses)))
        rows.append(dict(gamma=g, seed=seed, train_loss=losses, test_accuracy=r.test_accuracy,
                         mean_train_loss=float(np.mean(losses)) if finite else None,
                         steps_to_threshold=steps_to_threshold(losses, cell.loss_threshold)))
    return {"skipped": False, "lr": lr, "stability": margins, "networks": rows}


def curve_cost(cells: list[dict]) -> TaskCost:
    """One kind per network (each has one task): its steps; the work is relative (batch × networks)."""
    c = cells[0]
    nets = len(c["gammas"]) * len(c["seeds"])
    return TaskCost(str(c["net"]), int(c["steps"]), float(int(c["batch"]) * nets), float(int(c["n_test"]) * nets))


def curve_shorten(cells: list[dict], steps: int) -> list[dict]:
    """The task cut to ``steps`` SGD steps (for a plan's pilot)."""
    return [{**c, "steps": int(steps)} for c in cells]


def _lr_label(lr, resolved) -> str:
    """``η = 0.1`` for a fixed rate, ``η = η*(smallest γ)/2 = 0.75`` for a rule of :data:`LR_RULES`."""
    if isinstance(lr, str):
        return f"η = {LR_RULES.get(lr, lr)}" + (f" = {resolved:.3g}" if resolved is not None else "")
    return f"η = {float(lr):g}"


def _groups(records: Sequence[Record]) -> list[dict]:
    """One group per (network kind, learning rate) in grid order: its label, the resolved η, the
    stability margins ({γ: margins}) and {γ: [metrics of each seed's network]}."""
    order = [_LR, *LR_RULES]
    out: dict = {}
    for r in records:
        if r.metrics.get("skipped"):
            continue
        lr = r.params.get("lr", _LR)
        g = out.setdefault((r.params["net"], lr), dict(
            net=r.params["net"], lr=r.metrics.get("lr", lr if not isinstance(lr, str) else None),
            threshold=r.params["loss_threshold"], margins={}, by_gamma={}))
        g["label"] = f"{g['net']} at {_lr_label(lr, g['lr'])}"
        g["margins"].update({m["gamma"]: m for m in r.metrics.get("stability", [])})
        for row in r.metrics["networks"]:
            g["by_gamma"].setdefault(row["gamma"], []).append(row)
    return [out[k] for k in sorted(out, key=lambda k: (order.index(k[1]) if k[1] in order else len(order), k[0]))]


def _plot(records: Sequence[Record], outdir: Path) -> list[Path]:
    from bnlab.reproductions.plotting import pyplot, save_figure

    plt = pyplot()
    groups = _groups(records)
    n = max(len(groups), 1)
    cols = min(n, 2)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.8 * rows), squeeze=False)
    for ax, grp in zip(axes.flat, groups):
        for g, recs in sorted(grp["by_gamma"].items()):
            curves = np.array([r["train_loss"] for r in recs], dtype=float)
            mean = np.nanmean(curves, axis=0)
            smooth = np.convolve(mean, np.ones(_WINDOW) / _WINDOW, mode="valid")
            m = grp["margins"].get(g)
            extra = f", η/η* (Fisher) = {grp['lr'] / m['eta_star_fisher']:.2g}" if m and grp["lr"] else ""
            ax.plot(np.arange(_WINDOW, len(mean) + 1), smooth, label=f"γ = {g:g}{extra}")
        ax.set(xlabel="step", ylabel=f"training loss (running mean of {_WINDOW})", yscale="log",
               title=f"Fig. 4 stand-in: {grp['label']}")
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(groups):]:
        ax.set_visible(False)
    fig.tight_layout()
    # written beside its path and renamed: a link planted at the figure's name is never followed
    return save_figure(fig, outdir, "fisher_fig4", dpi=120, bbox_inches=None)


# the η* of each judged stability row: (metrics key, name in the row)
_ETA_STARS = (("eta_star_fisher", "Fisher"), ("eta_star_loss_hessian", "cross-entropy Hessian"))
_UNJUDGED_RATIOS = ("the stability margin the paper's argument reads the speed from; the rows after it judge "
                    "the argument's predictions from it")


def _seed_means(by_gamma: dict, key: str) -> list[float]:
    """Per γ (ascending) the seed mean of ``key``; ∞ where a network diverged or never got there."""
    out = []
    for g in sorted(by_gamma):
        vals = [r[key] for r in by_gamma[g]]
        out.append(float(np.mean(vals)) if all(v is not None for v in vals) else math.inf)
    return out


def _fmt(v: float, spec: str = ".3g") -> str:
    return "diverged" if v == math.inf else format(v, spec)


def _stability_rows(grp: dict, gammas: list, means: list) -> list[Comparison]:
    """η/η* per γ, and per η* (Fisher, loss Hessian) the two predictions of the paper's argument at this η:
    the fastest γ is the one whose η/η* is nearest ½ (Fig. 2's best band, η ≈ η*/2), and among the γ with
    η ≥ η*/2 (the γ whose η* the rate reaches) the mean training loss rises with γ."""
    eta, margins = grp["lr"], grp["margins"]
    if eta is None or any(g not in margins for g in gammas):
        return [Comparison(f"η/η* per γ, {grp['label']}", "η* = 2(1+μ)/λmax (Eq. 7), λmax ∝ γ²",
                           "not measured",
                           None, "the cells carry no stability margins (recorded before they were measured)")]
    ratios = {key: [eta / margins[g][key] for g in gammas] for key, _ in _ETA_STARS}
    bound = [eta / margins[g]["eta_star_bound"] if margins[g]["eta_star_bound"] else 0.0 for g in gammas]
    rows = [Comparison(
        f"η/η* per γ, {grp['label']}", "η* = 2(1+μ)/λmax (Eq. 7) with λmax ∝ γ² (Claim 3.1)",
        "; ".join(f"γ={g:g}: {ratios['eta_star_fisher'][i]:.2g} (Fisher), "
                  f"{ratios['eta_star_loss_hessian'][i]:.2g} (cross-entropy Hessian), {bound[i]:.2g} (bound)"
                  for i, g in enumerate(gammas)), None, _UNJUDGED_RATIOS)]
    fastest = gammas[int(np.argmin(means))]
    for key, name in _ETA_STARS:
        r = ratios[key]
        predicted = gammas[int(np.argmin([abs(math.log(2 * x)) for x in r]))]
        rows.append(Comparison(
            f"fastest γ has η/η* nearest ½, η* from the {name}, {grp['label']}",
            "fastest training at η ≈ η*/2 (Fig. 2's band), so at a fixed η the γ with η*(γ) ≈ 2η",
            f"η/η* nearest ½ at γ = {predicted:g}; lowest mean training loss at γ = {fastest:g}",
            predicted == fastest))
        near = [i for i, x in enumerate(r) if x >= 0.5]
        vals = ", ".join(f"γ={gammas[i]:g}: {_fmt(means[i])} (η/η* {r[i]:.2g})" for i in near)
        if len(near) < 2:
            rows.append(Comparison(
                f"mean training loss rises with γ where η ≥ η*/2, η* from the {name}, {grp['label']}",
                "smaller γ converges faster where η reaches η* (§6.5)", vals or "no γ", None,
                "fewer than two γ with η ≥ η*/2 at this η: the argument predicts no order among the others"))
            continue
        ok = all(means[b] > means[a] for a, b in zip(near, near[1:]))
        rows.append(Comparison(
            f"mean training loss rises with γ where η ≥ η*/2, η* from the {name}, {grp['label']}",
            "smaller γ converges faster where η reaches η* (§6.5)", vals, ok))
    return rows


def _compare(records: Sequence[Record]) -> list[Comparison]:
    rows = []
    for grp in _groups(records):
        by_gamma = grp["by_gamma"]
        gammas = sorted(by_gamma)
        means = _seed_means(by_gamma, "mean_train_loss")
        # "smaller γ converges faster": the mean training loss over the run must rise with γ
        ok = all(b > a for a, b in zip(means, means[1:]))
        rows.append(Comparison(f"mean training loss over the run against γ, {grp['label']} (rises with γ?)",
                               "smaller γ initialization converges faster (Fig. 4)",
                               ", ".join(f"γ={g:g}: {_fmt(m)}" for g, m in zip(gammas, means)), ok))
        hits = _seed_means(by_gamma, "steps_to_threshold")
        ok = all(b >= a for a, b in zip(hits, hits[1:])) and hits[0] < hits[-1]
        rows.append(Comparison(f"steps until the training loss is ≤ {grp['threshold']:g}, {grp['label']} "
                               "(rises with γ?)", "smaller γ initialization converges faster (Fig. 4)",
                               ", ".join(f"γ={g:g}: {'never' if h == math.inf else f'{h:.0f}'}"
                                         for g, h in zip(gammas, hits)), ok))
        rows.extend(_stability_rows(grp, gammas, means))
    return rows


def _setting_rows() -> list[Setting]:
    s, p = _SCALES["small"], _SCALES["paper"]
    return [
        Setting("networks", "VGG16 and Preact-ResNet18, CIFAR-10",
                f"BN MLP {_NETS['mlp']} and BN CNN {_NETS['cnn']}, MNIST",
                "same stand-ins, full MNIST", "VGG16 / ResNet18 on CIFAR-10 take hours per run on this CPU"),
        Setting("γ grid", "several γ (values not stated)", ", ".join(f"{g:g}" for g in s["gammas"]),
                ", ".join(f"{g:g}" for g in p["gammas"])),
        Setting("optimizer", "SGD η = 0.1, μ = 0.9, weight decay 5e-4", "same", "same"),
        Setting("learning rate", "0.1", "0.1", "0.1",
                "medium: to test the argument where it predicts an order, rates placed against the measured η*",
                medium="0.1 and, per network kind, " + ", ".join(LR_RULES.values())
                + " (η* from the Fisher's λmax measured at initialization by the cell)"),
        Setting("steps / epochs", "full training (learning curves over epochs)",
                ", ".join(f"{k}: {v} steps" for k, v in s["nets"].items()) + f" of batch {s['batch']}",
                ", ".join(f"{k}: {v} steps" for k, v in p["nets"].items()) + f" of batch {p['batch']}"),
        Setting("restarts", "5", str(len(s["seeds"])), str(len(p["seeds"]))),
        Setting("convergence threshold", "none (curves shown)", f"training loss ≤ {s['loss_threshold']:g}",
                f"training loss ≤ {p['loss_threshold']:g}", "a number to compare instead of reading a curve"),
    ]


EXPERIMENTS = [
    Experiment(
        name="fisher-fig4",
        paper=_PAPER,
        figure="Fig. 4 (small stand-ins)",
        title="Learning curves of BN networks for several γ initializations at a fixed learning rate",
        claim="Since λmax of the Fisher grows as γ², a smaller γ initialization lets SGD at a fixed learning "
        "rate (0.1, momentum 0.9) converge faster (§6.5, Fig. 4).",
        grid=_grid,
        run_cell=run_curve_cell,
        cell=CurveCell,
        plot=_plot,
        compare=_compare,
        uses_gpu=True,
        cost=curve_cost,
        shorten=curve_shorten,
        medium_grid=True,
        settings=_setting_rows(),
        checks=[
            Check("mean training loss over the run against γ",
                  "agrees when the seed-averaged mean training loss strictly rises from each γ to the next larger"),
            Check("steps until the training loss",
                  "agrees when the seed-averaged steps to the threshold never fall as γ grows and the largest γ "
                  "needs more than the smallest (a run that never reaches it counts as infinitely slow)"),
            Check("η/η* per γ",
                  "not judged: η/η* of every γ for the Fisher's and the cross-entropy Hessian's λmax measured at "
                  "initialization (seed 0, BN in train mode, one batch) and for the mean-field bound"),
            Check("fastest γ has η/η* nearest ½",
                  "agrees when the γ with the lowest seed-averaged mean training loss is the γ whose η/η* is "
                  "nearest ½ in log scale (the paper's best band η ≈ η*/2, Fig. 2): the argument's prediction of "
                  "which γ is fastest at a fixed η"),
            Check("mean training loss rises with γ where η ≥ η*/2",
                  "agrees when, among the γ with η ≥ η*/2, the seed-averaged mean training loss strictly rises "
                  "with γ (a diverged network counts as infinitely slow); not judged with fewer than two such γ"),
        ],
        limitations="Stand-ins, not VGG16/ResNet18 on CIFAR-10: a 3-layer MLP and a 2-layer CNN on MNIST, a "
        "few hundred steps and 2 seeds. The claim concerns the optimizer's stability relative to γ², which "
        "these networks share (Claim 3.1 holds for any depth); what a deep residual network adds (skip "
        "connections, depth-dependent λmax) is not tested here. The η/η* rows measure λmax at initialization "
        "only, on the seed-0 network and one batch of training images; during training λmax moves (BN makes the "
        "weights before it scale-invariant, so a rate beyond η* grows their norm and lowers the effective rate "
        "instead of diverging).",
    )
]
