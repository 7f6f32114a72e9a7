"""Daneshmand et al. 2020, Fig. 1: rank at initialization and training accuracy vs depth (Fashion-MNIST).

``daneshmand2020-fig1``: ReLU MLPs of width 128 and depth L ∈ {1, 2, 4, 8, 16, 32} ({1, 4, 16, 32} at ``small``) with
PyTorch's default initialization ("after random initialization as in PyTorch"), with BN before
every ReLU or without normalization.  Left panel: the numerical rank of the last hidden layer's
representation of a batch of 128 training images at initialization (float32 and the default
tolerance max(d, N)·eps ≈ 1.5e-5·σ_max, close to the paper's footnote σ_max·d·1e-7 = 1.3e-5·σ_max),
with r(H_L) beside it.  Right panel: training accuracy after SGD (batch 128) with the best of a
small step-size grid (the paper: grid-searched, 75 epochs, 5 runs).

Budget (``small``): the first 20 000 training images (standardized), 400 steps, lr 0.1 (the
better of {0.01, 0.1} at every depth where either trained, measured once with both), 1 seed;
accuracy on 5 000 training images.  ``paper``: 60 000 images, 75 epochs
(≈ 35 000 steps), lr ∈ {0.001, 0.01, 0.1}, 5 seeds; the 15 cells of one (norm, depth) train together as
one batched ensemble (:func:`run_group`, :func:`bnlab.nets.train_ensemble`).  Models:
:class:`bnlab.nets.MLP` (``init="torch_default"``); training: :func:`bnlab.nets.train`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Sequence

import numpy as np

from bnlab.experiments.cells import Cell, cell_param
from bnlab.experiments.spec import Check, Comparison, Experiment, Record, TaskCost
from bnlab.reproductions.plotting import pyplot, save_figure

__all__ = ["EXPERIMENTS", "RankCell", "run_cell", "group", "run_group"]

_PAPER = "Daneshmand et al. 2020 (NeurIPS), Batch normalization provably avoids rank collapse"
_DEPTHS = [1, 2, 4, 8, 16, 32]
#: small scale: every other depth of the curve (the rows compare BN and vanilla at the deepest, 32; depths 2 and 8
#: are points of the figure only and run at medium scale — bnlab report's 10 minutes on 2 cores)
_SMALL_DEPTHS = [1, 4, 16, 32]
_SCALES = {
    "small": dict(n_train=20_000, n_eval=5_000, steps=400, lrs=[0.1], seeds=[0]),
    # medium: two restarts at the deepest depth, where the rows compare BN and vanilla (an interval needs
    # seeds); at small scale the rows say "1 seed" (bnlab report's 10 minutes on 2 cores)
    "medium": dict(n_train=20_000, n_eval=5_000, steps=400, lrs=[0.1], seeds=[0], deepest_seeds=[1, 2]),
    "paper": dict(n_train=60_000, n_eval=10_000, epochs=75, lrs=[0.001, 0.01, 0.1], seeds=[0, 1, 2, 3, 4]),
}


def _grid(scale: str) -> list[dict]:
    from bnlab._validation import check_choice

    s = _SCALES[check_choice("scale", scale, tuple(_SCALES))]
    length = {"steps": s["steps"]} if "steps" in s else {"epochs": s["epochs"]}
    cells = [dict(depth=depth, width=128, norm=norm, lr=lr, batch_size=128, n_train=s["n_train"],
                  n_eval=s["n_eval"], seed=seed, **length)
             for seed in s["seeds"] for norm in ("bn", "none")
             for depth in (_SMALL_DEPTHS if scale == "small" else _DEPTHS) for lr in s["lrs"]]
    # restarts at the deepest depth only, where the rows compare BN and vanilla (an interval needs seeds)
    cells += [dict(c, seed=seed) for c in cells if c["depth"] == _DEPTHS[-1] and c["seed"] == s["seeds"][0]
              for seed in s.get("deepest_seeds", [])]
    return cells


def _data(n: int):
    """The first ``n`` Fashion-MNIST training images (flat, standardized) and labels, or the skip metrics."""
    from bnlab.data import DatasetNotFoundError, load_dataset

    try:
        data = load_dataset("fashion_mnist", "train")
    except (DatasetNotFoundError, OSError) as exc:
        return {"skipped": True, "skip_reason": f"Fashion-MNIST not available: {exc}"}
    x = data.x[:n].reshape(n, -1).float()
    x = (x - x.mean()) / x.std()
    return x, data.y[:n]


@dataclass(frozen=True, kw_only=True)
class RankCell(Cell):
    """The parameters of a Fig. 1 cell: one MLP (BN or none) whose rank is probed at initialization and
    which then trains with SGD for ``steps`` or ``epochs`` (exactly one of them)."""

    depth: int = cell_param(minimum=1)
    width: int = cell_param(minimum=1)
    norm: Literal["bn", "none"]
    lr: float = cell_param(minimum=0.0, strict_minimum=True)
    batch_size: int = cell_param(minimum=2)
    n_train: int = cell_param(minimum=1)
    n_eval: int = cell_param(minimum=1)
    seed: int = cell_param(minimum=0)
    steps: int | None = cell_param(None, minimum=1)
    epochs: float | None = cell_param(None, minimum=0.0, strict_minimum=True)
    device: str = "cpu"  # set by the engine for a GPU; not part of the cell's identity

    def check(self) -> None:
        if (self.steps is None) == (self.epochs is None):
            raise ValueError(f"cell parameters steps={self.steps!r}, epochs={self.epochs!r} are not allowed: give "
                             f"exactly one of 'steps' and 'epochs'")

    @property
    def length(self) -> dict:
        """``{"steps": …}`` or ``{"epochs": …}``: how long the cell trains."""
        return {"steps": self.steps} if self.steps is not None else {"epochs": self.epochs}


def _model_at_init(cell: RankCell, x):
    """The cell's MLP and its rank metrics at initialization (BN's running statistics reset after the probe)."""
    import torch

    from bnlab.nets import MLP
    from bnlab.rank import last_linear_name, rank_measures, record_representations, rescale_to_unit_trace

    model = MLP(784, [cell.width] * cell.depth, 10, norm=cell.norm, init="torch_default", seed=cell.seed)
    name = last_linear_name(model)
    with torch.no_grad(), record_representations(model, name, capture="input") as reps:
        model(x[: cell.batch_size])
    h = reps[name]
    m = rank_measures(h)
    out = dict(rank_init=int(m.numerical_rank), r_init=float(m.rank_lower_bound),
               soft_rank_init=int(rank_measures(rescale_to_unit_trace(h)).soft_rank))
    # the rank probe ran BN in train mode: reset its running statistics to their initial values
    for mod in model.modules():
        if hasattr(mod, "reset_running_stats"):
            mod.reset_running_stats()
    return model, out


def _after_training(model, res, cell: RankCell, x, y, out: dict) -> dict:
    import torch

    model.eval()
    with torch.no_grad():
        ne = cell.n_eval
        xe = x[:ne].to(next(model.parameters()).device)
        acc = float((model(xe).argmax(1).cpu() == y[:ne]).float().mean()) if not res.diverged else 0.1
    out.update(train_accuracy=acc, diverged=bool(res.diverged), final_train_loss=float(res.final_train_loss))
    return out


def run_cell(params: RankCell | dict) -> dict:
    """Rank of H_L at initialization, then training accuracy after the budget (``params``: a
    :class:`RankCell`, what the engine hands over, or its dict)."""
    import functools

    import torch

    from bnlab.nets import train as train_net

    cell = RankCell.parse(params)
    data = _data(cell.n_train)
    if isinstance(data, dict):
        return data
    x, y = data
    model, out = _model_at_init(cell, x)
    res = train_net(model, (x, y), optimizer=functools.partial(torch.optim.SGD, lr=cell.lr),
                    batch_size=cell.batch_size, seed=cell.seed, device=cell.device, **cell.length)
    return _after_training(model, res, cell, x, y, out)


def group(params: dict, scale: str) -> str | None:
    """At ``paper`` scale the cells of one (norm, depth) — every step size and seed — train as one ensemble."""
    if scale != "paper":
        return None
    return repr(sorted((k, v) for k, v in params.items() if k not in ("lr", "seed", "device")))


def run_group(cells: list[RankCell | dict]) -> list[dict]:
    """The cells of one (norm, depth) trained together (:func:`bnlab.nets.train_ensemble`, one step size and
    data order per network): each cell's :func:`run_cell` metrics, to the rounding of batched products."""
    from bnlab.nets import train_ensemble

    cells = [RankCell.parse(c) for c in cells]
    if not cells:
        raise ValueError("cells=[] is not allowed: a group holds at least one cell")
    base = cells[0]
    if any(dataclasses.replace(c, lr=base.lr, seed=base.seed) != base for c in cells):
        raise ValueError(f"cells={[c.params for c in cells]!r} are not allowed as one group: they differ in more "
                         f"than lr and seed")
    data = _data(base.n_train)
    if isinstance(data, dict):
        return [dict(data) for _ in cells]
    x, y = data
    models, outs = zip(*(_model_at_init(c, x) for c in cells))
    results = train_ensemble(list(models), (x, y), lr=[c.lr for c in cells], batch_size=base.batch_size,
                             seeds=[c.seed for c in cells], device=base.device, **base.length)
    return [_after_training(m, r, c, x, y, o) for m, r, c, o in zip(models, results, cells, outs)]


def cost(cells: list[dict]) -> TaskCost:
    """A task's steps and multiply-adds per step (forward + backward ≈ 3 × batch × weights) and for the rest
    (the rank probe and the accuracy pass), for a plan; BN and vanilla networks are separate kinds."""
    c = cells[0]
    weights = sum(784 * x["width"] + x["depth"] * x["width"] ** 2 + 10 * x["width"] for x in cells)
    steps = c["steps"] if "steps" in c else max(1, round(c["epochs"] * (c["n_train"] // c["batch_size"])))
    return TaskCost(c["norm"], int(steps), 3.0 * c["batch_size"] * weights, float(c["n_eval"] + c["batch_size"]) * weights)


def shorten(cells: list[dict], steps: int) -> list[dict]:
    """The task cut to ``steps`` SGD steps (for a plan's pilot)."""
    return [{**{k: v for k, v in c.items() if k not in ("steps", "epochs")}, "steps": int(steps)} for c in cells]


def _best(records: Sequence[Record]) -> dict:
    """(norm, depth) → (best train accuracy over the lr grid, mean over seeds), rank_init mean."""
    acc: dict = {}
    rank: dict = {}
    for rec in records:
        if rec.metrics.get("skipped"):
            continue
        p, m = rec.params, rec.metrics
        key = (p["norm"], p["depth"])
        acc.setdefault(key, {}).setdefault(p["seed"], []).append(m["train_accuracy"])
        rank.setdefault(key, []).append(m["rank_init"])
    return {k: (float(np.mean([max(v) for v in acc[k].values()])), float(np.mean(rank[k]))) for k in acc}


def _plot(records: Sequence[Record], outdir: Path) -> list[Path]:
    plt = pyplot()
    best = _best(records)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for norm, color, label in (("bn", "C0", "BN"), ("none", "C1", "vanilla")):
        depths = sorted(d for (nm, d) in best if nm == norm)
        axes[0].plot(depths, [best[(norm, d)][1] for d in depths], "o-", color=color, label=label)
        axes[1].plot(depths, [best[(norm, d)][0] for d in depths], "o-", color=color, label=label)
    axes[0].set_xlabel("depth (hidden layers)")
    axes[0].set_ylabel("numerical rank of H_L at init (N = 128)")
    axes[0].set_xscale("log", base=2)
    axes[1].set_xlabel("depth (hidden layers)")
    axes[1].set_ylabel("training accuracy (best step size)")
    axes[1].set_xscale("log", base=2)
    axes[0].legend()
    fig.suptitle("Fashion-MNIST, ReLU MLPs of width 128, PyTorch default initialization")
    fig.tight_layout()
    return save_figure(fig, outdir, "daneshmand2020_fig1")


#: "collapses" vs "keeps a high rank": BN's numerical rank at the deepest depth ≥ 4× vanilla's
_RANK_FACTOR = 4
#: "vanilla nets barely learn": BN's training accuracy beats vanilla's by more than 0.2 at the deepest depth
_ACC_MARGIN = 0.2


def _limitations(records: Sequence[Record]) -> str:
    """What the small scale changes, with this run's numbers read off the records."""
    best = _best(records)
    seeds = sorted({r.params["seed"] for r in records if not r.metrics.get("skipped")})
    steps = sorted({r.params.get("steps") for r in records if r.params.get("steps")})
    lrs = sorted({r.params["lr"] for r in records})
    bn = {d: a for (n, d), (a, _) in best.items() if n == "bn"}
    text = (f"{', '.join(map(str, steps))} SGD steps (batch 128) on {records[0].params['n_train']} images at "
            f"lr {', '.join(f'{v:g}' for v in lrs)} — the paper trains 75 epochs with a grid-searched step size — "
            f"and {len(seeds)} seed{'s' if len(seeds) != 1 else ''} (the paper: 5 runs).  The ranks are at "
            "initialization and do not depend on the budget; the accuracies do")
    if bn:
        lo, hi = min(bn), max(bn)
        text += f": in this run BN's training accuracy goes from {bn[lo]:.3f} at depth {lo} to {bn[hi]:.3f} at depth {hi}"
    return text + "."


def _compare(records: Sequence[Record]) -> list[Comparison]:
    best = _best(records)
    rows = []
    deepest = max((d for (_, d) in best), default=None)
    if deepest is None or ("bn", deepest) not in best or ("none", deepest) not in best:
        return rows
    bn_acc, bn_rank = best[("bn", deepest)]
    va_acc, va_rank = best[("none", deepest)]
    accs = {}
    for r in records:
        if not r.metrics.get("skipped") and r.params["depth"] == deepest:
            accs.setdefault(r.params["norm"], {}).setdefault(r.params["seed"], []).append(r.metrics["train_accuracy"])
    n_seeds = min(len(v) for v in accs.values()) if accs else 0
    seeds = "1 seed" if n_seeds == 1 else (f"mean of {n_seeds} seeds; BN " + ", ".join(
        f"{max(v):.3f}" for v in accs["bn"].values()) + ", vanilla " + ", ".join(
        f"{max(v):.3f}" for v in accs["none"].values()))
    rows.append(Comparison(
        quantity=f"rank of H_L at init, depth {deepest}: BN vs vanilla",
        paper="vanilla collapses with depth; BN keeps a high rank",
        bnlab=f"BN {bn_rank:.0f}, vanilla {va_rank:.0f} ({seeds})",
        agrees=bool(bn_rank >= _RANK_FACTOR * va_rank),
    ))
    rows.append(Comparison(
        quantity=f"training accuracy at depth {deepest}: BN vs vanilla",
        paper="vanilla nets barely learn beyond ~10 layers; BN nets drop only mildly",
        bnlab=f"BN {bn_acc:.3f}, vanilla {va_acc:.3f} ({seeds})",
        agrees=bool(min(max(v) for v in accs["bn"].values()) > max(max(v) for v in accs["none"].values())
                    + _ACC_MARGIN),
    ))
    return rows


EXPERIMENTS = [
    Experiment(
        name="daneshmand2020-fig1",
        paper=_PAPER,
        figure="Fig. 1",
        title="Rank at initialization and training accuracy vs depth, BN vs vanilla (Fashion-MNIST MLPs)",
        claim="The rank of the last hidden layer of vanilla MLPs collapses with depth and they stop learning "
        "beyond ~10 layers, while BN networks keep a high rank and train at depth 32.",
        grid=_grid,
        medium_grid=True,
        run_cell=run_cell,
        cell=RankCell,
        plot=_plot,
        compare=_compare,
        uses_gpu=True,
        group=group,
        run_group=run_group,
        cost=cost,
        shorten=shorten,
        checks=[
            Check("rank of H_L at init", f"agrees when BN's numerical rank of H_L (128 images, float32 tolerance) at "
                  f"the deepest depth is at least {_RANK_FACTOR}× the vanilla net's"),
            Check("training accuracy at depth", f"agrees when, at the deepest depth, BN's worst seed beats the vanilla "
                  f"net's best seed by more than {_ACC_MARGIN:g} in training accuracy (best learning rate)"),
        ],
        limitations=_limitations,
    )
]
