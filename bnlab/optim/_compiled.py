"""The compiled route of BNP's dense layers: ``torch.compile`` of the functional core's dense step.

:func:`bnlab.optim._functional.dense_steps_` — Algorithm 2 steps 1-5 of every dense layer of a
step, as pure tensor functions written back in place — is handed to ``torch.compile`` (inductor).
On a GPU the eager step launches one kernel per operator and per layer (58 launches per training
step of Table 1's network against SGD's 23, measured on an H200; issue #27); compiled, the
elementwise work of all layers (the running averages, σ̃², 1/(q²σ̃²), steps 4-5 and the
write-backs) fuses into a few kernels.  On CPU inductor generates C++ (one fused loop nest for
the whole step), which is how the route is tested here against the eager route.

Compilation happens on the first call (seconds to a minute) and again when the shapes or the
number of layers change (a smaller last batch); if it fails (no Triton, no C++ compiler), a
warning says why and the same functional core runs uncompiled — the same numbers, no speed-up.
"""
from __future__ import annotations

import warnings

import torch

from bnlab.optim import _functional as F

__all__ = ["available", "dense_steps_"]

_STATE: dict[str, object] = {}


def available(device: torch.device) -> bool:
    """Whether ``torch.compile`` can be expected to work for ``device`` (Triton for CUDA)."""
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return False
        return True
    return device.type == "cpu"


def _compiled():
    if "fn" not in _STATE:
        _STATE["fn"] = torch.compile(F.dense_steps_, fullgraph=True)
    return _STATE["fn"]


def dense_steps_(xs, means, variances, gws, gbs, q2s, rho, eps1, eps2, nonfinite_steps=None) -> torch.Tensor:
    """:func:`bnlab.optim._functional.dense_steps_`, compiled (or uncompiled after a failed build)."""
    fn = _STATE.get("failed") or _compiled()
    try:
        return fn(xs, means, variances, gws, gbs, q2s, rho, eps1, eps2, nonfinite_steps)
    except Exception as exc:  # a compiler or backend missing: raised before anything is written
        if fn is F.dense_steps_:
            raise
        warnings.warn(
            f"bnlab: torch.compile of BNP's dense step failed ({type(exc).__name__}: {exc}); using the same "
            "functional core uncompiled",
            RuntimeWarning,
            stacklevel=3,
        )
        _STATE["failed"] = F.dense_steps_
        return F.dense_steps_(xs, means, variances, gws, gbs, q2s, rho, eps1, eps2, nonfinite_steps)
