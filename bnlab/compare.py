"""Simulation beside theory: one function puts a simulated ensemble's quantities next to the mean field predictions.

:func:`compare_with_theory` takes the :class:`bnlab.sim.EnsembleResult` of a
simulation and returns a :class:`SimulationComparison`: for each quantity the
simulated value with its confidence interval, the theory's value, the relative
difference, whether the interval covers the theory, the layers it was measured
on, and — where the theory does not apply or the measurement is delicate — why.

Quantities (Yang et al. 2019):

* ``q_star``, ``c_star``: the BSB1 fixed point Σ* = q*((1 − c*)I + c*11ᵀ) (Thms 3.4,
  3.5), against the BSB1 projection (q, c) of the simulated batch covariance averaged
  over the last 20 % of the layers (``state_layers``);
* ``grad_explosion_rate``: λ_G↓ (Thms 3.9, 3.10), against the fitted per-layer growth of
  E‖∂L/∂h^l‖² (:meth:`bnlab.sim.EnsembleResult.grad_explosion_rate`);
* ``weight_grad_explosion_rate``: the weight gradients grow at the same λ_G↓ (App. L);
* ``cross_batch_rate``: λ_M̃ (Thm 3.11), against the fitted decay of the centered
  cross-batch correlation (:meth:`bnlab.sim.EnsembleResult.cross_batch_rate`).

The predictions come from :func:`bnlab.theory.analyze` for (φ(γ·+β), B, ε, σ_w²) of the
simulation (γ, β the BN affine constants of the simulated network).  This module is the
only place that imports both :mod:`bnlab.sim` and :mod:`bnlab.theory`: the simulator stays
an independent check of the theory.

Where the theory does not apply, the theory value is None and ``notes`` says why:
``norm`` other than ``"bn"`` or a residual network (the theory is Eq. 7 of the
paper); B = 2 (degenerate); a BSB2 regime (symmetry breaking, App. J, K); ε > 0 (only the
fixed point and λ_G↓ are developed); φ that the theory refuses.  A measurement that is
delicate carries a note too: gradient norms of tail index ≤ 2 (BN with ε = 0 at B ≤ 5:
infinite variance, heavy-tail interval), no cross-batch measurement (one batch).

What the interval measures: the Monte Carlo error of the finite ensemble (bootstrap over
networks for the rates, a Student-t interval of the per-network means for q and c), not the
O(1/width) bias of a finite network against the mean field limit; ``ci_covers_theory`` is
False when that bias exceeds the interval (measured biases in docs/sim.md and
:mod:`bnlab.reproductions.yang2019_width`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from bnlab._vocabulary import NORM_ALIASES

__all__ = ["QuantityComparison", "SimulationComparison", "compare_with_theory", "QUANTITIES"]

#: The quantities :func:`compare_with_theory` compares, in the order of its result.
QUANTITIES = ("q_star", "c_star", "grad_explosion_rate", "weight_grad_explosion_rate", "cross_batch_rate")



@dataclass(frozen=True)
class QuantityComparison:
    """One simulated quantity beside its prediction.

    ``simulated`` (None if it could not be measured), ``ci`` its interval (``confidence``
    level; (None, None) without one), ``theory`` (None where the theory does not apply),
    ``rel_diff`` = simulated/theory − 1, ``ci_covers_theory``, ``layers`` the 1-based
    inclusive window it was measured on, ``estimator`` and ``ci_method`` of a fitted rate,
    and ``notes``.
    """

    name: str
    simulated: float | None
    ci: tuple[float | None, float | None]
    theory: float | None
    rel_diff: float | None
    ci_covers_theory: bool | None
    layers: tuple[int, int] | None
    confidence: float | None = None
    estimator: str | None = None
    ci_method: str | None = None
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return dict(
            name=self.name, simulated=self.simulated, ci=list(self.ci), theory=self.theory, rel_diff=self.rel_diff,
            ci_covers_theory=self.ci_covers_theory, layers=None if self.layers is None else list(self.layers),
            confidence=self.confidence, estimator=self.estimator, ci_method=self.ci_method, notes=list(self.notes),
        )


@dataclass(frozen=True)
class SimulationComparison:
    """A simulation's quantities beside the theory (:func:`compare_with_theory`).

    ``quantities`` maps each name of :data:`QUANTITIES` that was asked for to its
    :class:`QuantityComparison`; ``theory_applies`` says whether the mean field theory
    describes the simulated setting at all; ``theory_source`` names the function the
    predictions came from; ``grad_norm_tail_index`` is that of the simulated gradient norms
    (inf: every moment finite); ``per_layer`` holds the ensemble means per layer (and the
    relative distance to the theory's Σ* where it exists); ``notes`` gathers every note.
    """

    config: dict
    theory_applies: bool
    theory_source: str | None
    quantities: dict[str, QuantityComparison]
    grad_norm_tail_index: float
    per_layer: dict[str, list | None] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def __getitem__(self, name: str) -> QuantityComparison:
        return self.quantities[name]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (a non-finite tail index becomes None)."""
        ti = self.grad_norm_tail_index
        return dict(
            config=dict(self.config), theory_applies=self.theory_applies, theory_source=self.theory_source,
            quantities={k: v.to_dict() for k, v in self.quantities.items()},
            grad_norm_tail_index=ti if math.isfinite(ti) else None, per_layer=dict(self.per_layer),
            notes=list(self.notes),
        )


def _rel_diff(sim: float | None, th: float | None) -> float | None:
    if sim is None or th is None or th == 0:
        return None
    return sim / th - 1.0


def _covers(ci, th) -> bool | None:
    lo, hi = ci
    if lo is None or hi is None or th is None:
        return None
    return bool(lo <= th <= hi)


def _theory(result, phi, notes: list[str]) -> tuple[dict[str, float | None], bool]:
    """The predictions of :func:`bnlab.theory.analyze` for the simulated setting, or why there are none."""
    from bnlab.activations import get_activation
    from bnlab.theory import analyze

    cfg = result.config
    none = dict.fromkeys(("q_star", "c_star", "grad_explosion_rate", "cross_batch_rate"))
    norm = cfg.get("norm", cfg.get("normalization"))  # configs recorded before the one vocabulary
    norm = NORM_ALIASES.get(norm, norm)
    if norm != "bn" or cfg.get("residual_scale") is not None:
        notes.append(
            "the mean field theory of Yang et al. 2019 covers norm='bn' without residuals only "
            f"(simulated: norm={norm!r}, residual_scale={cfg.get('residual_scale')!r})"
        )
        return none, False
    if phi is None:
        if not isinstance(cfg["phi"], dict):
            raise ValueError(
                f"phi=None is not allowed for a simulation of the callable phi {cfg['phi']!r}: its config cannot be "
                "turned back into a function; pass the Activation the simulation used as phi="
            )
        cfg_phi = dict(cfg["phi"])
        phi = get_activation(cfg_phi.pop("phi"), **cfg_phi)
    act = get_activation(phi)
    try:
        res = analyze(act, cfg["batch_size"], eps=cfg["eps"], sigma_w2=cfg["sigma_w2"],
                      gamma=cfg.get("bn_gamma", 1.0), beta=cfg.get("bn_beta", 0.0))
    except ValueError as exc:
        notes.append(f"bnlab.theory.analyze: {exc}")
        return none, False
    notes.extend(res.warnings)
    out = {}
    for key in none:
        value = getattr(res, key)
        out[key] = None if value is None or not math.isfinite(value) else float(value)
    return out, True


def _state_window(depth: int, state_layers) -> tuple[int, int]:
    from bnlab._validation import check_int

    if state_layers is None:
        return depth - max(1, depth // 5) + 1, depth  # the last 20 % (past the forward transient)
    if not isinstance(state_layers, (tuple, list)) or len(state_layers) != 2:
        raise ValueError(f"state_layers={state_layers!r} is not allowed: expected (first, last), 1-based inclusive")
    first = check_int("state_layers[0]", state_layers[0], minimum=1, maximum=depth)
    last = check_int("state_layers[1]", state_layers[1], minimum=first, maximum=depth)
    return first, last


def _state(result, name: str, values: np.ndarray, window, theory, confidence: float) -> QuantityComparison:
    """Mean over the window's layers and the networks; Student-t interval of the per-network means
    (the networks are iid, the layers of one network are not)."""
    from scipy import stats

    per_network = values[:, window[0] - 1 : window[1]].mean(axis=1)
    mean = float(per_network.mean())
    n = per_network.size
    if n >= 2:
        half = float(stats.t.ppf(0.5 + confidence / 2, n - 1) * per_network.std(ddof=1) / math.sqrt(n))
        ci = (mean - half, mean + half)
    else:
        ci = (None, None)
    notes = () if n >= 2 else ("one network: no confidence interval",)
    return QuantityComparison(name, mean, ci, theory, _rel_diff(mean, theory), _covers(ci, theory), window,
                              confidence=confidence if n >= 2 else None, notes=notes)


def _rate(name: str, fit_fn, theory) -> QuantityComparison:
    try:
        fit = fit_fn()
    except ValueError as exc:
        return QuantityComparison(name, None, (None, None), theory, None, None, None, notes=(f"{name}: {exc}",))
    ci = (fit.ci_low, fit.ci_high)
    return QuantityComparison(
        name, fit.rate, ci, theory, _rel_diff(fit.rate, theory), _covers(ci, theory),
        (fit.first_layer, fit.last_layer), confidence=fit.confidence, estimator=fit.estimator, ci_method=fit.ci_method,
    )


def _tail_note(result) -> str:
    return (
        f"the gradient norms have tail index {result.grad_norm_tail_index:g} <= 2 across networks (BN with eps = 0 "
        f"at B = {result.config['batch_size']}: a neuron's backward gain ~ 1/chi-square): their variance is infinite "
        "and the ensemble mean converges slowly; the CI of the gradient explosion rate is a heavy-tail bootstrap-t "
        "(grad_explosion_rate_ci_method), whose 95% intervals covered the theory in 88% of ensembles at B = 4, "
        "width 1000 (docs/sim.md)"
    )


def compare_with_theory(
    result,
    *,
    phi=None,
    quantities=QUANTITIES,
    state_layers: tuple[int, int] | None = None,
    rate_options: dict | None = None,
    confidence: float = 0.95,
) -> SimulationComparison:
    """The simulated quantities of ``result`` beside the mean field theory (Yang et al. 2019).

    Parameters
    ----------
    result : bnlab.sim.EnsembleResult
        A simulation (:func:`bnlab.sim.simulate`).
    phi : str, callable or Activation, optional
        The simulated nonlinearity; by default rebuilt from ``result.config`` (required
        only when the simulation used a Python callable, whose config is just its name).
    quantities : sequence of str
        Which of :data:`QUANTITIES` to compare (default: all).
    state_layers : (first, last), optional
        1-based inclusive layers over which q and c are averaged (default: the last 20 %,
        at least one layer).
    rate_options : dict, optional
        Keyword arguments of :meth:`~bnlab.sim.EnsembleResult.grad_explosion_rate` for both
        gradient rates (e.g. ``{"estimator": "log_mean"}`` or ``{"tail_index": None}`` for the
        percentile bootstrap); the layers default to the result's own windows.
    confidence : float
        Level of the q, c intervals, in (0, 1) (the rates' intervals are their fits' own, 0.95
        unless ``rate_options`` says otherwise).

    Returns
    -------
    SimulationComparison

    Raises
    ------
    ValueError
        For an unknown quantity, a bad window or confidence, or a callable φ not passed again.
    """
    from bnlab._validation import check_real
    from bnlab.sim import EnsembleResult

    if not isinstance(result, EnsembleResult):
        raise ValueError(f"result={type(result).__name__} is not allowed: expected a bnlab.sim.EnsembleResult")
    if isinstance(quantities, str):
        quantities = (quantities,)
    unknown = [q for q in quantities if q not in QUANTITIES]
    if unknown or not quantities:
        raise ValueError(f"quantities={list(quantities)!r} is not allowed: expected a non-empty subset of {QUANTITIES}")
    confidence = check_real("confidence", confidence, minimum=0.0, maximum=1.0)
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence={confidence!r} is not allowed: expected 0 < confidence < 1")
    window = _state_window(result.depth, state_layers)
    rate_options = dict(rate_options or {})
    for bad in ("weights", "first_layer", "last_layer"):
        if bad in rate_options:
            raise ValueError(f"rate_options[{bad!r}] is not allowed: the layers are the result's own windows")

    notes: list[str] = []
    theory, applies = _theory(result, phi, notes)
    out: dict[str, QuantityComparison] = {}
    for name in QUANTITIES:
        if name not in quantities:
            continue
        if name in ("q_star", "c_star"):
            out[name] = _state(result, name, result.q if name == "q_star" else result.c, window, theory[name], confidence)
        elif name in ("grad_explosion_rate", "weight_grad_explosion_rate"):
            weights = name.startswith("weight")
            comp = _rate(name, lambda: result.grad_explosion_rate(weights=weights, **rate_options),
                         theory["grad_explosion_rate"])
            if result.grad_norm_tail_index <= 2 and result.grad_norm_sq is not None:
                comp = _with_note(comp, _tail_note(result))
            out[name] = comp
        else:
            if result.cross_batch_corr is None:
                note = "cross_batch_rate: num_batches=1, no cross-batch measurement (simulate with num_batches >= 2)"
                out[name] = QuantityComparison(name, None, (None, None), theory[name], None, None, None, notes=(note,))
            else:
                out[name] = _rate(name, result.cross_batch_rate, theory[name])
    for comp in out.values():
        notes.extend(n for n in comp.notes if n not in notes)
    return SimulationComparison(
        config=dict(result.config), theory_applies=applies, theory_source="bnlab.theory.analyze" if applies else None,
        quantities=out, grad_norm_tail_index=result.grad_norm_tail_index,
        per_layer=_per_layer(result, theory), notes=tuple(notes),
    )


def _with_note(comp: QuantityComparison, note: str) -> QuantityComparison:
    return replace(comp, notes=comp.notes + (note,))


def _per_layer(result, theory) -> dict[str, list | None]:
    """Ensemble means per layer (and ‖Σ^l − Σ*‖/‖Σ*‖ where the theory gives Σ*)."""

    def mean(a):
        return None if a is None else a.mean(0).tolist()

    out = dict(
        grad_norm_sq=mean(result.grad_norm_sq), weight_grad_norm_sq=mean(result.weight_grad_norm_sq),
        cross_batch_corr=mean(result.cross_batch_corr), q=mean(result.q), c=mean(result.c), bsb1_distance=None,
    )
    if theory["q_star"] is not None and theory["c_star"] is not None:
        out["bsb1_distance"] = result.bsb1_distance(theory["q_star"], theory["c_star"]).mean(0).tolist()
    return out
