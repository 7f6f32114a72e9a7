"""``advise-validation``: does ``bnlab.advise`` predict what training then shows?

Each row is a network with a known outcome.  :func:`bnlab.advise` is run on it first (on a batch of the data it
will train on, nothing else), its verdict is recorded as the *prediction*; then the network is trained and
the outcome recorded as the *observation*.  Four cells, two networks each:

* **depth** (Yang et al. 2019, §4): BN-MLPs (ReLU, width 128, ε = 1e-3, B = 8) of depth 6 and 40 against
  16ξ = 27.7 — predicted by the gradient part (``trainable``); observed as test accuracy after SGD at
  η = 1e-3·B (``yang2019-fig3a``'s small-scale rate; the two trained together by
  :func:`bnlab.nets.train_ensemble`);
* **rank** (Daneshmand et al. 2020, Fig. 1): ReLU MLPs of depth 16 and width 128 with PyTorch's default
  initialization, without and with BN — predicted by the rank part (``collapsed``); observed as training
  accuracy after SGD (lr 0.1, batch 128, as ``daneshmand2020-fig1``);
* **learning rate** (the Fisher paper, Eq. 7): a BN-MLP (784-128×4-10, ½‖f − y‖², momentum 0.9, B = 64)
  trained at 0.7 η* and 2 η* of the learning-rate part's limit — predicted stable below the limit and
  exploding above it; observed as divergence (a non-finite loss or one above 1e4) or not;
* **batch 1** (Lange et al.): a BN-MLP (784-64×3-10) at B = 1 — predicted by the batch-size part: BN cannot
  train, BNP can once the BN layers are gone; observed by training the BN network at batch 1 (BatchNorm1d
  raises) and BNP on the copy without BN (lr 0.1, the paper's Table 2).

The number of steps of each cell, per scale, is in ``_SCALES`` (and the report's Setting rows); ``small`` is
sized for ``bnlab report``'s budget.

"Trains" means an accuracy of at least 0.5 on 10-class MNIST (chance 0.1) — for the learning-rate rows, no
divergence and a final training loss below half the initial one.  A row agrees when prediction and observation
say the same.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Sequence

from bnlab.experiments.cells import Cell, cell_param
from bnlab.experiments.spec import Check, Comparison, Experiment, Record, Setting

__all__ = ["EXPERIMENTS", "ValidationCell", "run_cell", "CASES", "CELLS"]

_PAPER = "bnlab.advise (the four papers' predictions for a user's network)"
#: row -> (paper, what the advice predicts)
CASES = {
    "depth-below": ("Yang et al. 2019 §4", "a BN-MLP shallower than 16ξ trains"),
    "depth-above": ("Yang et al. 2019 §4", "a BN-MLP deeper than 16ξ fails"),
    "rank-vanilla": ("Daneshmand et al. 2020", "a deep vanilla ReLU MLP collapses and does not train"),
    "rank-bn": ("Daneshmand et al. 2020", "the same MLP with BN keeps its rank and trains"),
    "lr-below": ("the Fisher paper", "trained at 0.7 η*: stable"),
    "lr-above": ("the Fisher paper", "trained at 2 η*: explodes"),
    "batch1-bn": ("Lange et al.", "BN at batch 1 cannot train"),
    "batch1-bnp": ("Lange et al.", "BNP at batch 1 (BN layers removed) trains"),
}
#: cell -> its two rows
CELLS = {"depth": ("depth-below", "depth-above"), "rank": ("rank-vanilla", "rank-bn"),
         "learning-rate": ("lr-below", "lr-above"), "batch-1": ("batch1-bn", "batch1-bnp")}
_ACCURACY = 0.5
_STEP_ROWS = {"depth_steps": "depth rows", "rank_steps": "rank rows", "lr_steps": "learning-rate rows",
              "b1_steps": "batch-1 BNP row"}
_SCALES = {
    "small": dict(seeds=[0], n_train=10_000, n_test=2_000, depths=[6, 40], depth_steps=200, rank_steps=100,
                  lr_steps=200, b1_steps=1000),
    "paper": dict(seeds=[0, 1, 2], n_train=60_000, n_test=10_000, depths=[6, 64], depth_steps=6000,
                  rank_steps=3000, lr_steps=2000, b1_steps=15000),
}


def _grid(scale: str) -> list[dict]:
    from bnlab._validation import check_choice

    s = _SCALES[check_choice("scale", scale, tuple(_SCALES))]
    return [dict(cell=c, seed=seed, **{k: v for k, v in s.items() if k != "seeds"}) for seed in s["seeds"]
            for c in CELLS]


def _mnist(n_train, n_test, seed):
    from bnlab.data import load_dataset, standardize

    train, test = standardize(load_dataset("mnist", "train").subset(n_train, seed=seed),
                              load_dataset("mnist", "test").subset(n_test, seed=seed))
    return (train.x.reshape(n_train, -1), train.y), (test.x.reshape(n_test, -1), test.y)


def _accuracy(model, data) -> float:
    import torch

    model.eval()
    with torch.no_grad():
        out = model(data[0])
    model.train()
    if not bool(torch.isfinite(out).all()):
        return 0.1
    return float((out.argmax(1) == data[1]).float().mean())


def _row(case: str, predicted: bool, prediction: str, observed: bool, observation: str, **extra) -> dict:
    return dict(case=case, predicted_trains=bool(predicted), prediction=prediction, observed_trains=bool(observed),
                observation=observation, agrees=bool(predicted) == bool(observed), **extra)


@dataclass(frozen=True, kw_only=True)
class ValidationCell(Cell):
    """The parameters of an advise-validation cell: which pair of networks (``cell``, a key of :data:`CELLS`),
    the MNIST subsets and seed, and the training length of each kind of cell."""

    cell: Literal["depth", "rank", "learning-rate", "batch-1"]  # the keys of CELLS
    seed: int = cell_param(minimum=0)
    n_train: int = cell_param(minimum=1)
    n_test: int = cell_param(minimum=1)
    depths: tuple[int, ...] = cell_param(minimum=1)
    depth_steps: int = cell_param(minimum=1)
    rank_steps: int = cell_param(minimum=1)
    lr_steps: int = cell_param(minimum=1)
    b1_steps: int = cell_param(minimum=1)


def _depth(cell: ValidationCell, tr, te, gen):
    import torch

    from bnlab.advice import advise
    from bnlab.nets import BNMLP, train_ensemble

    b, seed = 8, cell.seed
    models = [BNMLP(784, 10, depth=d, width=128, eps=1e-3, seed=seed) for d in cell.depths]
    idx = torch.randperm(tr[0].shape[0], generator=gen)[:b]
    advice = [advise(m, (tr[0][idx], tr[1][idx]), lr=1e-3 * b, skip=("learning_rate", "rank", "batch_size"),
                     seed=seed).gradients for m in models]
    results = train_ensemble(models, tr, lr=1e-3 * b, batch_size=b, steps=cell.depth_steps, test_data=te,
                             seeds=seed)
    rows = []
    for case, d, g, res in zip(CELLS["depth"], cell.depths, advice, results):
        acc = 0.1 if res.diverged else float(res.test_accuracy)
        rows.append(_row(case, g.trainable, g.verdict, acc >= _ACCURACY,
                         f"depth {d}: test accuracy {acc:.3f} after {cell.depth_steps} SGD steps", depth=d,
                         max_depth=g.max_depth_theory if g.theory_basis == "theorem" else g.max_depth_measured,
                         measured_rate=g.rate, theory_rate=g.theory_rate, accuracy=acc, history=res.history[::10]))
    return rows


def _rank(cell: ValidationCell, tr, te, gen):
    import functools

    import torch

    from bnlab.advice import advise
    from bnlab.nets import MLP, train

    b, seed = 128, cell.seed
    rows = []
    for case, norm in zip(CELLS["rank"], ("none", "bn")):
        model = MLP(784, [128] * 16, 10, norm=norm, init="torch_default", seed=seed)
        idx = torch.randperm(tr[0].shape[0], generator=gen)[:b]
        r = advise(model, (tr[0][idx], tr[1][idx]), skip=("gradients", "learning_rate", "batch_size"), seed=seed).rank
        res = train(model, tr, optimizer=functools.partial(torch.optim.SGD, lr=0.1), batch_size=b,
                    steps=cell.rank_steps, seed=seed, diverge_above=1e6)
        acc = 0.1 if res.diverged else _accuracy(model, (tr[0][:5000], tr[1][:5000]))
        rows.append(_row(case, not r.collapsed, r.verdict, acc >= _ACCURACY,
                         f"{'BN' if norm == 'bn' else 'vanilla'}: training accuracy {acc:.3f} after "
                         f"{cell.rank_steps} SGD steps", r_last=r.r_bound[-1], soft_rank_last=r.soft_rank[-1],
                         accuracy=acc, history=res.history[::5]))
    return rows


def _learning_rate(cell: ValidationCell, tr, te, gen):
    import functools

    import torch

    from bnlab.advice import advise
    from bnlab.nets import MLP, half_squared_error, train

    b, seed = 64, cell.seed
    idx = torch.randperm(tr[0].shape[0], generator=gen)[:b]
    measured = advise(MLP(784, [128] * 4, 10, norm="bn", seed=seed), (tr[0][idx], tr[1][idx]), loss="mse",
                      momentum=0.9, skip=("gradients", "rank", "batch_size"), seed=seed).learning_rate
    rows = []
    for case, factor in zip(CELLS["learning-rate"], (0.7, 2.0)):
        at = measured.at(factor * measured.limit)
        model = MLP(784, [128] * 4, 10, norm="bn", seed=seed)
        res = train(model, tr, optimizer=functools.partial(torch.optim.SGD, lr=at.lr, momentum=0.9), batch_size=b,
                    steps=cell.lr_steps, seed=seed, loss_fn=half_squared_error, diverge_above=1e4)
        first = res.history[0] if res.history else math.nan
        ok = (not res.diverged) and res.final_train_loss < 0.5 * first
        seen = (f"diverged at step {res.diverged_at_step}" if res.diverged else
                f"final loss {res.final_train_loss:.3g} (initial {first:.3g})")
        rows.append(_row(case, at.ratio <= 1.0, at.verdict, ok, f"lr {at.lr:.3g}: {seen}", eta_star=measured.limit,
                         eta_star_whole=measured.eta_star, lr=at.lr,
                         bound_train=(measured.bound or {}).get("train", {}).get("eta_star"),
                         history=res.history[::5]))
    return rows


def _batch_one(cell: ValidationCell, tr, te, gen):
    import functools

    import torch

    from bnlab.advice import advise
    from bnlab.advice.batch import without_batch_norm
    from bnlab.nets import MLP, train
    from bnlab.optim import BNPreconditioner

    seed = cell.seed
    model = MLP(784, [64] * 3, 10, norm="bn", seed=seed)
    bs = advise(model, (tr[0][:1], tr[1][:1]), skip=("gradients", "learning_rate", "rank"), measure_bnp=True,
                seed=seed).batch_size
    try:
        train(model, tr, optimizer=functools.partial(torch.optim.SGD, lr=0.01), batch_size=1, steps=10, seed=seed)
        acc = _accuracy(model, te)
        seen, ok = f"BN at batch 1 trained: test accuracy {acc:.3f}", acc >= _ACCURACY
    except (ValueError, RuntimeError) as exc:
        seen, ok = f"BN at batch 1: training raised: {str(exc).splitlines()[0][:100]}", False
    rows = [_row("batch1-bn", not bs.bn_layers_must_go, bs.verdict, ok, seen)]
    plain, _ = without_batch_norm(model)
    pre = BNPreconditioner(plain)
    res = train(plain, tr, optimizer=functools.partial(torch.optim.SGD, lr=0.1), batch_size=1,
                steps=cell.b1_steps, seed=seed, hooks=[lambda m: pre.step()], test_data=te)
    acc = 0.1 if res.diverged else float(res.test_accuracy)
    rows.append(_row("batch1-bnp", bs.bnp_supported > 0, bs.verdict, acc >= _ACCURACY,
                     f"BNP without BN at batch 1: test accuracy {acc:.3f} after {cell.b1_steps} steps",
                     overhead=bs.bnp_overhead, accuracy=acc, history=res.history[::30]))
    return rows


def run_cell(params: ValidationCell | dict) -> dict:
    """Advise, then train, for the two networks of one cell: ``{"rows": [prediction, observation, agrees, …]}``
    (``params``: a :class:`ValidationCell`, what the engine hands over, or its dict)."""
    import torch

    from bnlab.data import DatasetNotFoundError

    cell = ValidationCell.parse(params)
    try:
        tr, te = _mnist(cell.n_train, cell.n_test, cell.seed)
    except (DatasetNotFoundError, OSError) as exc:
        return {"skipped": True, "skip_reason": f"MNIST not available: {exc}"}
    gen = torch.Generator().manual_seed(cell.seed)
    run = {"depth": _depth, "rank": _rank, "learning-rate": _learning_rate, "batch-1": _batch_one}[cell.cell]
    return {"rows": run(cell, tr, te, gen)}


def _rows(records: Sequence[Record]) -> list[tuple[int, dict]]:
    order = list(CASES)
    out = [(r.params["seed"], row) for r in records if not r.metrics.get("skipped") for row in r.metrics["rows"]]
    return sorted(out, key=lambda t: (order.index(t[1]["case"]), t[0]))


def _plot(records: Sequence[Record], outdir: Path) -> list[Path]:
    from bnlab.reproductions.plotting import pyplot, save_figure

    plt = pyplot()
    rows = _rows(records)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [1.1, 1]})
    for y, (seed, m) in enumerate(rows):
        ax.plot([0], [y], "o", ms=11, color="C2" if m["predicted_trains"] else "C3")
        ax.plot([1], [y], "s", ms=11, color="C2" if m["observed_trains"] else "C3")
        ax.text(1.25, y, "agrees" if m["agrees"] else "DISAGREES", va="center", color="k" if m["agrees"] else "C3",
                fontsize=8)
    ax.set_yticks(list(range(len(rows))), [f"{m['case']} (seed {seed})" for seed, m in rows], fontsize=8)
    ax.set_xticks([0, 1], ["predicted\n(advise)", "observed\n(training)"])
    ax.set_xlim(-0.5, 2.2)
    ax.invert_yaxis()
    ax.set_title("green: trains, red: fails", fontsize=9)
    cap = 100.0
    for seed, m in rows:
        h = m.get("history")
        if h:
            # an exploding loss is drawn at the cap (the divergence itself is in the row's observation)
            vals = [min(v, cap) if v == v else cap for v in h]
            frac = [i / max(len(vals) - 1, 1) for i in range(len(vals))]
            bx.semilogy(frac, vals, label=m["case"])
    bx.set(xlabel="fraction of the training run", ylabel=f"training loss (clipped at {cap:g})", title="training curves")
    bx.legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, outdir, "advise_validation")


def _compare(records: Sequence[Record]) -> list[Comparison]:
    out = []
    for seed, m in _rows(records):
        paper, what = CASES[m["case"]]
        out.append(Comparison(
            quantity=f"{m['case']} (seed {seed}): {what} [{paper}]",
            paper=f"advise predicts {'trains' if m['predicted_trains'] else 'fails'} — {m['prediction']}",
            bnlab=f"observed {'trains' if m['observed_trains'] else 'fails'}: {m['observation']}",
            agrees=bool(m["agrees"])))
    return out


def _settings() -> list[Setting]:
    s, p = _SCALES["small"], _SCALES["paper"]
    return [
        Setting("data", "—", f"MNIST, {s['n_train']} training / {s['n_test']} test images",
                f"MNIST, {p['n_train']} / {p['n_test']}"),
        Setting("depth rows", "Yang et al. Fig. 3a: width 384, 10 epochs, η = 1e-5·B",
                f"BN-MLP width 128, depths {' and '.join(map(str, s['depths']))}, B = 8, {s['depth_steps']} SGD steps "
                "at 1e-3·B", f"depths {' and '.join(map(str, p['depths']))}, {p['depth_steps']} steps",
                "the small scale of yang2019-fig3a, whose boundary at B = 8 lies between depths 16 and 24"),
        Setting("rank rows", "Daneshmand et al. Fig. 1: width 128, ReLU, PyTorch's initialization, 75 epochs",
                f"depth 16, {s['rank_steps']} SGD steps, lr 0.1, batch 128", f"{p['rank_steps']} steps",
                "daneshmand2020-fig1's small scale shows vanilla nets at chance from depth 8 on"),
        Setting("learning-rate rows", "Fisher paper Fig. 2: phase diagrams over (η, γ)",
                f"BN-MLP 784-128×4-10, ½‖f − y‖², μ = 0.9, B = 64, {s['lr_steps']} steps at 0.7 and 2 η*",
                f"{p['lr_steps']} steps"),
        Setting("batch-1 rows", "Lange et al. Fig. 4: FC net at batch 1, BNP lr 0.1 (Table 2)",
                f"MLP 784-64×3-10, {s['b1_steps']} steps of batch 1, BNP lr 0.1", f"{p['b1_steps']} steps"),
        Setting("restarts", "—", str(len(s["seeds"])), str(len(p["seeds"]))),
    ]


EXPERIMENTS = [
    Experiment(
        name="advise-validation",
        paper=_PAPER,
        figure="advise: predicted vs observed",
        title="bnlab.advise's verdicts on networks with known outcomes, against training them",
        claim="The advice's verdicts — trainable depth (16ξ), the learning-rate limit (η*), rank collapse, and BN vs "
        "BNP at batch 1 — predict whether each network trains: BN-MLPs below and above 16ξ, deep ReLU MLPs "
        "without and with BN, a BN-MLP at 0.7 and 2 η*, and a BN-MLP at batch 1 with BN and with BNP.",
        grid=_grid,
        run_cell=run_cell,
        cell=ValidationCell,
        plot=_plot,
        compare=_compare,
        uses_gpu=False,
        settings=_settings(),
        checks=[Check(c, f"agrees when the advice's verdict ({CASES[c][1]}) matches the training outcome: trains = "
                         "accuracy ≥ 0.5 (chance 0.1), or for the learning-rate rows no divergence and a final loss "
                         "below half the initial one") for c in CASES],
        limitations="One seed and one network per row at small scale: the rows show that the verdicts are right on "
        "clear cases (depths 6 and 40 around 16ξ = 27.7; 0.7 and 2 η*), not how sharp the boundaries are — at 1.4 η* "
        "the same BN-MLP degraded (final loss 4× that at 0.7 η*) without exploding in 200 steps. The learning-rate "
        "rows use the squared loss, where explosion is the failure; with cross-entropy the loss stalls near chance "
        "instead (docs/advise.md). Small scale trains briefly (" + ", ".join(
            f"{_STEP_ROWS[k]}: {v} steps" for k, v in _SCALES["small"].items() if k in _STEP_ROWS)
        + "): 'trains' there means clearly above chance after a short run, not a finished training.",
    )
]
