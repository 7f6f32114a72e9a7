"""The theory engine's predictions for a simulated configuration (the simulation's twin)."""
from __future__ import annotations

import math
from typing import Any


def theory_predictions(phi, batch_size: int, *, eps: float = 0.0, sigma_w2: float = 1.0) -> dict[str, Any]:
    """Predictions of :func:`bnlab.theory.analyze` for (φ, B, ε, σ_w²) as plain floats.

    Returns ``{"q_star", "c_star", "grad_explosion_rate", "cross_batch_rate", "source", "notes"}``.
    Where the theory does not apply (B = 2, a BSB2 regime, …) the values are ``None`` and
    ``notes`` says why, so that a simulation is still reported beside what the theory can say.
    """
    from bnlab.theory import analyze

    out: dict[str, Any] = dict(q_star=None, c_star=None, grad_explosion_rate=None, cross_batch_rate=None,
                               source="bnlab.theory.analyze", notes=[])
    try:
        res = analyze(phi, batch_size, eps=eps, sigma_w2=sigma_w2)
    except ValueError as exc:
        out["notes"].append(f"bnlab.theory.analyze: {exc}")
        return out
    for key in ("q_star", "c_star", "grad_explosion_rate", "cross_batch_rate"):
        value = getattr(res, key)
        out[key] = None if value is None or not math.isfinite(value) else float(value)
    out["notes"].extend(res.warnings)
    return out
