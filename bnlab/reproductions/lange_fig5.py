"""Lange et al. (BNP), Fig. 5: the 5-layer CNN at mini-batch sizes 128 and 2.

The network: :class:`bnlab.nets.BNPCNN` (3×3 convolutions of 32-64-32 filters, two dense layers,
normalization after every convolution and the hidden dense layer, Glorot-uniform weights), SGD with
the paper's tuned learning rates (Table 3: 0.1 for every method at 128; vanilla and BN 1e-3, BNP
and Batch Renorm 1e-2 at 2; the paper's vanilla at 128 used Adam, here SGD).  Methods: vanilla,
BN, Batch Renorm (at 2) and BNP (the vanilla CNN + ``bnlab.optim.BNPreconditioner``, Algorithm 3
with per-channel statistics).  "BN with 4 things" is not reproduced.  The paper uses CIFAR-10,
which is not available offline here; the cells use MNIST (stated in the report).

Scales.  ``small``: 4 000 / 1 000 training images at batch 128 / 2 (seeded draws) for 3 / 2 epochs
(93 / 1 000 steps), 2 000 test images, one seed (cut to fit ``bnlab report``'s 10-minute budget on
2 CPU cores).  At 93 steps BNP is still catching up with BN at mini-batch 128 (it starts slower, as
in the paper), so "BNP comparable to BN at 128" is judged only at ``paper`` scale; ``small`` judges
BN above vanilla at 128 and the mini-batch-2 ordering (see the experiment's ``limitations``).  ``paper``: the full data set, 20 epochs at 128
and 5 at 2, five seeds; on a GPU the five seeds of vanilla and BN at one batch size train as one
batched ensemble, one epoch per chunk with a fresh data order per chunk (:mod:`bnlab.reproductions.chunked`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from bnlab.experiments.spec import Check, Comparison, Experiment, Record, Setting
from bnlab.reproductions.lange_common import LABEL as _LABEL
from bnlab.reproductions.lange_common import final_accuracies as _finals
from bnlab.reproductions.lange_common import mean as _mean
from bnlab.reproductions.lange_common import (LangeCell, cell_cost, chunked_group, extra_seed_cells,
                                              paired_difference, plot_training_curves, run_chunked_cells, seeds_text,
                                              shorten_cells, train_cell, training_grid)

__all__ = ["EXPERIMENTS", "run_cell", "run_group", "cost"]

_PAPER = "Lange, Helfrich & Ye, Batch Normalization Preconditioning for Neural Network Training (JMLR)"
_METHODS = {128: ("none", "bn", "bnp"), 2: ("none", "bn", "brn", "bnp")}
_SCALES = {
    "small": dict(train_size={128: 4000, 2: 1000}, test_size=2000, epochs={128: 3, 2: 2}, seeds=(0,)),
    "paper": dict(train_size={128: None, 2: None}, test_size=None, epochs={128: 20, 2: 5}, seeds=(0, 1, 2, 3, 4)),
}


#: methods whose paper-scale cells train one epoch per chunk, the seeds of one (batch size, method) as one
#: batched ensemble; BNP (an optimizer hook) and Batch Renorm (a host-side step counter) cannot run under
#: vmap and train one network per cell
_CHUNKED = ("none", "bn")


#: small scale: restarts of the batch-2 cells whose comparison needs an interval over seeds
_SMALL_EXTRA = dict(pairs={(2, "bn"), (2, "brn"), (2, "bnp")}, seeds=(1, 2))


def _grid(scale: str) -> list[dict]:
    cells = training_grid(_SCALES, _METHODS, scale, chunked=_CHUNKED)
    if scale == "small":
        cells += extra_seed_cells(cells, _SMALL_EXTRA["pairs"], _SMALL_EXTRA["seeds"])
    return cells


def _seeds_text(scale: str) -> str:
    """Seeds per batch size, read off the grid."""
    cells = _grid(scale)
    per = {b: len({c["seed"] for c in cells if c["batch_size"] == b}) for b in (128, 2)}
    if len(set(per.values())) == 1:
        return str(per[128])
    return ", ".join(f"{n} at {b}" for b, n in per.items()) + " (BNP, BN, Batch Renorm at 2)"


def run_group(cells: list[LangeCell | dict]) -> list[dict]:
    """The chunked cells of one (batch size, method) — its seeds — trained together
    (:func:`bnlab.reproductions.lange_common.run_chunked_cells`)."""
    return run_chunked_cells("cnn", cells)


def cost(cells: list[dict]):
    """What a task costs, for a plan (:func:`bnlab.reproductions.lange_common.cell_cost`)."""
    return cell_cost("cnn", cells)


def _settings() -> list[Setting]:
    # read off _SCALES, so the report's table cannot drift from the grid
    s, p = _SCALES["small"], _SCALES["paper"]

    def per_batch(d, fmt=str):
        return ", ".join(f"{fmt(d[b])} at {b}" for b in (128, 2))

    return [
        Setting("data set", "CIFAR-10", "MNIST", "MNIST", "CIFAR-10 is not available offline"),
        Setting("training images", "50 000 (CIFAR-10)", per_batch(s["train_size"]),
                per_batch(p["train_size"], lambda v: "all" if v is None else str(v))),
        Setting("epochs", "not stated in the text", per_batch(s["epochs"]), per_batch(p["epochs"]),
                "small: cut to fit bnlab report's 10 minutes on 2 CPU cores"),
        Setting("seeds", "5 tests", _seeds_text("small"), _seeds_text("paper"),
                "small: restarts only where a comparison needs an interval"),
        Setting("data order", "not stated", "reshuffled every epoch", "reshuffled every epoch (vanilla and BN: "
                "a fresh permutation per one-epoch chunk)", "paper: the seeds of vanilla and BN train as one ensemble"),
    ]


def run_cell(params: LangeCell | dict) -> dict:
    """Train one (batch size, method, seed) of the 5-layer CNN (``params``: a
    :class:`~bnlab.reproductions.lange_common.LangeCell`, what the engine hands over, or its dict)."""
    return train_cell("cnn", params)


def _plot(records: Sequence[Record], outdir: Path) -> list[Path]:
    return plot_training_curves(records, outdir, methods=_METHODS, panel_title="5-layer CNN, MNIST, mini-batch {b}",
                                suptitle="Lange et al. Fig. 5 (5-layer CNN: BNP vs vanilla, BN, Batch Renorm)",
                                stem="lange_fig5")


# BNP at mini-batch 128 starts slower than BN and catches up late: measured (MNIST, 8 000 images,
# seed 0) 0.80 vs 0.97 after 124 steps, 0.95 vs 0.98 after 310, 0.96 vs 0.97 after 372.  The
# "comparable" row is judged only when the BNP cell ran at least this many steps.
_MIN_STEPS_128 = 1000


def _judges_bnp_at_128(records: Sequence[Record]) -> bool:
    steps = [r.metrics.get("steps") for r in records
             if r.params["batch_size"] == 128 and r.params["norm"] == "bnp" and r.metrics.get("trainable")]
    return bool(steps) and min(s or 0 for s in steps) >= _MIN_STEPS_128


def _bnp_steps_128(records: Sequence[Record]) -> int:
    return min((r.metrics.get("steps") or 0 for r in records
                if r.params["batch_size"] == 128 and r.params["norm"] == "bnp" and r.metrics.get("trainable")), default=0)


def _learning_rates(records: Sequence[Record], batch: int) -> dict[str, float]:
    """The learning rate each method trained with at ``batch`` (Table 3's, recorded by the cells)."""
    out = {}
    for r in records:
        if r.params["batch_size"] == batch and r.metrics.get("learning_rate") is not None:
            out.setdefault(r.params["norm"], r.metrics["learning_rate"])
    return {k: out[k] for k in ("bnp", "bn", "brn", "none") if k in out}


def _limitations(records: Sequence[Record]) -> str:
    """What the small scale changes, read off the records: steps, seeds and the learning rates at batch 2."""
    steps = {b: min((r.metrics.get("steps") or 0 for r in records if r.params["batch_size"] == b
                     and r.metrics.get("trainable")), default=0) for b in (128, 2)}
    seeds = {b: len({r.params["seed"] for r in records if r.params["batch_size"] == b}) for b in (128, 2)}
    lrs = _learning_rates(records, 2)
    text = (f"MNIST instead of CIFAR-10; {steps[128]} steps at mini-batch 128 and {steps[2]} at mini-batch 2; seeds: "
            f"{seeds[128]} at 128, {seeds[2]} at 2 (BNP, BN, Batch Renorm; the paper: 5 runs).  At {steps[128]} steps "
            f"BNP is still catching up with BN at mini-batch 128 — it starts slower, as in the paper (measured on "
            f"8 000 images, commit a728cb6: 0.80 vs 0.97 after 124 steps, 0.96 vs 0.97 after 372) — so "
            f"'BNP comparable to BN at 128' is judged only with ≥ {_MIN_STEPS_128} steps (paper scale).")
    if lrs and "bnp" in lrs and "bn" in lrs and lrs["bn"] != lrs["bnp"]:
        text += (f"  At mini-batch 2 each method trains at its Table 3 rate: BN at {lrs['bn']:g}, "
                 f"{lrs['bnp'] / lrs['bn']:g}× smaller than BNP's {lrs['bnp']:g}"
                 + (f" (Batch Renorm {lrs['brn']:g})" if "brn" in lrs else "")
                 + " — part of BNP's lead there is that rate, which the paper found best for each method.")
    return text


def _compare(records: Sequence[Record]) -> list[Comparison]:
    finals = _finals(records)
    rows = []

    def acc(b, n):
        return _mean(finals[(b, n)]) if (b, n) in finals else None

    if acc(128, "bnp") is not None and acc(128, "bn") is not None:
        a_bnp, a_bn, a_van = acc(128, "bnp"), acc(128, "bn"), acc(128, "none")
        full = _judges_bnp_at_128(records)
        rows.append(Comparison(
            quantity="mini-batch 128: final test accuracy",
            paper="BN and BNP comparable, both above vanilla (Fig. 5 left; CIFAR-10)",
            bnlab=f"BNP {a_bnp:.4f}, BN {a_bn:.4f}" + (f", vanilla {a_van:.4f}" if a_van is not None else "")
            + " (MNIST)" + ("" if full else f"; not judged below {_MIN_STEPS_128} steps (BNP still catching up)"),
            agrees=(abs(a_bnp - a_bn) <= 0.02 and (a_van is None or a_bnp >= a_van - 0.005)) if full else None,
            reason="" if full else (f"BNP ran {_bnp_steps_128(records)} steps at mini-batch 128 (fewer than "
                                    f"{_MIN_STEPS_128}): it starts slower than BN, as in the paper, and has not caught "
                                    "up yet — judged at paper scale"),
        ))
    if acc(128, "bn") is not None and acc(128, "none") is not None:
        a_bn, a_van = acc(128, "bn"), acc(128, "none")
        rows.append(Comparison(
            quantity="mini-batch 128: BN above vanilla",
            paper="BN above vanilla (Fig. 5 left; CIFAR-10)",
            bnlab=f"BN {a_bn:.4f}, vanilla {a_van:.4f} (MNIST)",
            agrees=a_bn > a_van,
        ))
    lrs = _learning_rates(records, 2)
    for other in ("bn", "brn"):
        d = paired_difference(records, 2, "bnp", other)
        if d is None:
            continue
        m, lo, hi, n = d
        means = ", ".join(f"{_LABEL[k]} {acc(2, k):.4f}" for k in ("bnp", "bn", "brn", "none") if acc(2, k) is not None)
        rate = "" if not lrs else "; learning rates " + ", ".join(f"{_LABEL[k]} {v:g}" for k, v in lrs.items())
        rows.append(Comparison(
            quantity=f"mini-batch 2: BNP − {_LABEL[other]}, final test accuracy over seeds",
            paper=f"BNP significantly outperforms {_LABEL[other]} at mini-batch 2; BN is the worst (Fig. 5 right; "
                  "CIFAR-10)",
            bnlab=f"{m:+.4f} [{lo:+.4f}, {hi:+.4f}] ({seeds_text(n)}; means: {means}{rate}; MNIST)",
            agrees=None if n < 2 else bool(lo > 0),
            reason="" if n >= 2 else "one seed: an interval needs at least two"))
    return rows


EXPERIMENTS = [
    Experiment(
        name="lange-fig5",
        paper=_PAPER,
        figure="Fig. 5 (5-layer CNN)",
        title="BNP vs vanilla, BN and Batch Renorm on the 5-layer CNN at mini-batch 128 and 2",
        claim="On the 5-layer CNN BNP is comparable to BN at mini-batch 128 and significantly better than BN "
        "and Batch Renorm at mini-batch 2 (§5, Fig. 5).  Run on MNIST (CIFAR-10 is not available offline).",
        grid=_grid,
        run_cell=run_cell,
        cell=LangeCell,
        plot=_plot,
        compare=_compare,
        uses_gpu=True,
        group=chunked_group,
        run_group=run_group,
        cost=cost,
        shorten=shorten_cells,
        settings=_settings(),
        checks=[
            Check("mini-batch 128: final test accuracy", "'comparable': |BNP − BN| ≤ 0.02 and BNP ≥ vanilla − 0.005 "
                  f"(means over seeds); judged only when BNP ran ≥ {_MIN_STEPS_128} steps"),
            Check("mini-batch 128: BN above vanilla", "agrees when BN's mean final test accuracy exceeds vanilla's"),
            Check("mini-batch 2: BNP − BN", "'significantly outperforms': the 95 % t-interval over seeds of BNP − BN "
                  "(paired by seed) lies above 0; not judged with one seed"),
            Check("mini-batch 2: BNP − Batch Renorm", "the same for BNP − Batch Renorm"),
        ],
        limitations=_limitations,
    )
]
