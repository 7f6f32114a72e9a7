"""The theory engine's predictions for a simulated configuration (imported lazily, optional pieces).

``bnlab.theory.analyze`` is used when present; otherwise the individual public
functions that exist are used (``gradient_explosion_rate``,
``bsb1_fixed_point``, ``cross_batch_rate``).  A missing piece is reported as
``None`` with the reason in ``notes`` rather than failing the simulation.
"""
from __future__ import annotations

from typing import Any


def theory_predictions(phi, batch_size: int, *, eps: float = 0.0, sigma_w2: float = 1.0) -> dict[str, Any]:
    """{"q_star", "c_star", "grad_explosion_rate", "cross_batch_rate", "source", "notes"} from bnlab.theory."""
    out: dict[str, Any] = dict(q_star=None, c_star=None, grad_explosion_rate=None, cross_batch_rate=None, notes=[])
    import bnlab.theory as theory

    try:
        res = theory.analyze(phi, batch_size, eps=eps, sigma_w2=sigma_w2)
    except (ImportError, AttributeError) as exc:
        out["notes"].append(f"bnlab.theory.analyze unavailable ({exc.__class__.__name__}: {exc})")
    except ValueError as exc:
        out["notes"].append(f"bnlab.theory.analyze: {exc}")
    else:
        for key in ("q_star", "c_star", "grad_explosion_rate"):
            out[key] = _float(getattr(res, key, None))
        out["cross_batch_rate"] = _float(getattr(res, "cross_batch_rate", None))
        out["source"] = "bnlab.theory.analyze"
        return out
    out["source"] = "bnlab.theory (individual functions)"
    calls = {
        "grad_explosion_rate": lambda: theory.gradient_explosion_rate(phi, batch_size, eps=eps, sigma_w2=sigma_w2),
        "bsb1": lambda: theory.bsb1_fixed_point(phi, batch_size),
        "cross_batch_rate": lambda: theory.cross_batch_rate(phi, batch_size),
    }
    for key, call in calls.items():
        if key != "grad_explosion_rate" and eps > 0:
            out["notes"].append(f"{key}: the eps=0 theory is not used for eps={eps}")
            continue
        try:
            val = call()
        except (ImportError, AttributeError) as exc:
            out["notes"].append(f"{key} unavailable ({exc.__class__.__name__}: {exc})")
            continue
        except (ValueError, TypeError) as exc:
            out["notes"].append(f"{key}: {exc}")
            continue
        if key == "bsb1":
            out["q_star"] = _float(getattr(val, "q_star", None))
            out["c_star"] = _float(getattr(val, "c_star", None))
        elif key == "cross_batch_rate" and not isinstance(val, (int, float)):
            out[key] = _float(getattr(val, "rate", getattr(val, "cross_batch_rate", None)))
        else:
            out[key] = _float(val)
    return out


def _float(v):
    try:
        return None if v is None else float(v)
    except (TypeError, ValueError):
        return None
