"""Yang et al. 2019, Fig. 5a–d: three ways to counteract BN's gradient explosion.

Test accuracy on MNIST over depth × a hyperparameter that makes the network
more linear, with the mean field maximum trainable depth 16ξ,
ξ = 1/log λ_G↓ (from :func:`bnlab.theory.analyze`), as a white dashed line:

* ``yang2019-fig5a``: tanh, pre-activation scale γ ∈ (0, 2] (γ → 0 is linear);
* ``yang2019-fig5b``: ReLU, pre-activation shift β ∈ [0, 2] (β → ∞ is linear);
* ``yang2019-fig5c``: tanh, BN's ε (a transition near ε ~ 1);
* ``yang2019-fig5d``: ReLU with β = 2, BN's ε.

The paper does not state the batch size of Fig. 5; B = 32 is used here (the
16ξ line is computed at the same B).  γ = 0 is excluded (tanh(0·x) is
constant).  Deviations at ``small`` scale are those of the small-scale Fig. 3
(width 128, 10 000 training images, fixed 150 SGD steps, η = 3e-3·B — but
1e-3·B for the ReLU panels b, d, see ``_SMALL_LR_PER_B``; see
:mod:`bnlab.reproductions.trainability`) plus a 4-point
hyperparameter grid and depths {5, 10, 20, 40, 60}.

ε sweeps stop at ε = 10 (paper scale) / 1 (small): with σ_w² = 1 the
batch-centred pre-activation variance obeys roughly v ↦ σ_w²·v/(v + ε) in the
near-linear regime, so for ε > σ_w² the signal (and the gradient) vanishes
geometrically — measured at small scale: ReLU β = 2, ε = 10 stays at chance
even at depth 5 — while the theory's λ_G↓ drops below 1 (e.g. 0.33 at ε = 3),
where 16ξ = 16/log λ_G↓ is no longer a trainable-depth limit (shown as ∞).
"""
from __future__ import annotations

import functools
from typing import Any

import numpy as np

from bnlab.reproductions.trainability import (
    compare_depths,
    heatmap,
    run_trainability_cell,
    theory_max_depth,
)
from bnlab.experiments.spec import Experiment

__all__ = ["EXPERIMENTS"]

_B = 32

# η/B at small scale.  ReLU with β > 0 (panels b, d) is nearly linear and its deep nets'
# training loss blows up within 150 steps at 3e-3·B (measured, β = 2, ε = 1e-3, depth 40:
# accuracy 0.09–0.12 and final loss 72–221 at 1e-2·B and 3e-2·B, 0.22 after 400 steps at
# 3e-3·B, but 0.73 at 1e-3·B); tanh trains well at 3e-3·B (same as the small Fig. 3).
_SMALL_LR_PER_B = {"a": 3e-3, "b": 1e-3, "c": 3e-3, "d": 1e-3}

# letter -> (phi, swept key, fixed settings, small grid, paper grid, axis label, log axis)
_PANELS: dict[str, dict[str, Any]] = {
    "a": dict(phi="tanh", key="gamma", fixed=dict(beta=0.0, eps=1e-3),
              small=[0.25, 0.5, 1.0, 2.0], paper=[round(0.1 * k, 1) for k in range(1, 21)],
              xlabel="γ (tanh(γ·h̃))", xlog=False, title="tanh: pre-activation scale γ"),
    "b": dict(phi="relu", key="beta", fixed=dict(gamma=1.0, eps=1e-3),
              small=[0.0, 0.5, 1.0, 2.0], paper=[round(0.2 * k, 1) for k in range(0, 11)],
              xlabel="β (relu(h̃ + β))", xlog=False, title="ReLU: pre-activation shift β"),
    "c": dict(phi="tanh", key="eps", fixed=dict(gamma=1.0, beta=0.0),
              small=[1e-3, 1e-2, 1e-1, 1.0], paper=[float(f"{v:.3g}") for v in np.logspace(-3, 1, 13)],
              xlabel="ε", xlog=True, title="tanh: BN ε"),
    "d": dict(phi="relu", key="eps", fixed=dict(gamma=1.0, beta=2.0),
              small=[1e-3, 1e-2, 1e-1, 1.0], paper=[float(f"{v:.3g}") for v in np.logspace(-3, 1, 13)],
              xlabel="ε", xlog=True, title="ReLU (β = 2): BN ε"),
}


def _settings(letter: str, x: float) -> dict:
    p = _PANELS[letter]
    s = dict(gamma=1.0, beta=0.0, eps=0.0)
    s.update(p["fixed"])
    s[p["key"]] = float(x)
    if p["key"] != "eps":
        # ε = 1e-3 ≪ the pre-activation variance: the ε = 0 theory applies (as for Fig. 3)
        s["eps"] = 0.0
    return s


def _theory_at(letter: str, x: float) -> float | None:
    if _PANELS[letter]["key"] == "gamma" and x <= 0:
        return None
    s = _settings(letter, x)
    return theory_max_depth(_PANELS[letter]["phi"], _B, s["eps"], s["gamma"], s["beta"])


def _theory_curve(letter: str, xs) -> np.ndarray:
    out = []
    for x in np.atleast_1d(xs):
        t = _theory_at(letter, float(x))
        out.append(np.nan if t is None else t)
    return np.array(out)


def _grid(scale: str, *, letter: str) -> list[dict]:
    from bnlab._validation import check_choice
    from bnlab.experiments.spec import SCALES

    check_choice("scale", scale, SCALES)
    p = _PANELS[letter]
    small = scale == "small"
    depths = [5, 10, 20, 40, 60] if small else [2, 5, 10, 15, 20, 30, 40, 50, 60, 80, 100, 150, 200]
    cells = []
    for x in p["small"] if small else p["paper"]:
        for d in depths:
            c = dict(dataset="mnist", phi=p["phi"], gamma=1.0, beta=0.0, eps=1e-3)
            c.update(p["fixed"])
            c[p["key"]] = float(x)
            c.update(depth=d, width=128 if small else 384, bn_batch=_B, batch_size=_B, optimizer="sgd",
                     lr=(_SMALL_LR_PER_B[letter] if small else 1e-5) * _B, n_train=10_000 if small else 60_000,
                     n_test=2_000 if small else 10_000, seed=0)
            if small:
                c["steps"] = 150
            else:
                c["epochs"] = 10
            cells.append(c)
    return cells


def _make(letter: str) -> Experiment:
    p = _PANELS[letter]
    name = f"yang2019-fig5{letter}"
    return Experiment(
        name=name,
        paper="Yang et al. 2019 (ICLR), A Mean Field Theory of Batch Normalization",
        figure=f"Fig. 5{letter}",
        title=p["title"],
        claim=(
            "Making the network more linear at initialization reduces the gradient explosion rate λ_G↓, "
            "so the maximum trainable depth, predicted as 16ξ with ξ = 1/log λ_G↓, grows: "
            + {"a": "for tanh as γ → 0.", "b": "for ReLU as β grows.",
               "c": "for tanh as ε grows, with a transition near ε ~ 1 beyond which very deep nets train.",
               "d": "for ReLU with β = 2 as ε grows, with a transition near ε ~ 1."}[letter]
        ),
        grid=functools.partial(_grid, letter=letter),
        run_cell=run_trainability_cell,
        plot=functools.partial(
            heatmap, name=name, xkey=p["key"], xlabel=p["xlabel"], xlog=p["xlog"],
            title=f"Yang et al. 2019 Fig. 5{letter}: {p['title']} (B = {_B})",
            theory_curve=functools.partial(_theory_curve, letter),
        ),
        compare=functools.partial(
            compare_depths, xkey=p["key"], xname={"gamma": "γ", "beta": "β", "eps": "ε"}[p["key"]],
            theory_at=functools.partial(_theory_at, letter),
        ),
        uses_gpu=True,
    )


EXPERIMENTS = [_make(letter) for letter in "abcd"]
