"""Finite-width random networks in torch: the simulated twin of every mean field prediction.

Ensembles of random networks are computed together (batched over networks, on
CPU or CUDA, float32 or float64) and measured layer by layer: the batch
covariance Σ^l and its distance to the BSB1 fixed point, the gradient norms
‖∂L/∂h^l‖² and ‖∂L/∂W^l‖² through the batch statistics, the cross-batch
correlation, and per-layer rates with bootstrap confidence intervals.

Entry point: :func:`simulate` → :class:`EnsembleResult`.  See ``docs/sim.md``.

``bnlab.sim`` does not import :mod:`bnlab.theory`: it is the theory's independent check.
:func:`bnlab.compare.compare_with_theory` puts an ensemble beside the predictions.

Trainable networks and the training loop live in :mod:`bnlab.nets` (``docs/nets.md``).
"""
from __future__ import annotations

from bnlab.sim.fit import RateFit, fit_geometric_rate
from bnlab.sim.init import INITS, init_weights
from bnlab.sim.measure import (
    batch_covariance,
    bsb1_distance,
    bsb1_projection,
    cross_batch_correlation,
    weight_gradient_norm_sq,
)
from bnlab.sim.networks import NORMALIZATIONS, EnsembleResult, resolve_device, resolve_dtype, simulate

__all__ = [
    "simulate",
    "EnsembleResult",
    "NORMALIZATIONS",
    "INITS",
    "init_weights",
    "RateFit",
    "fit_geometric_rate",
    "batch_covariance",
    "bsb1_projection",
    "bsb1_distance",
    "cross_batch_correlation",
    "weight_gradient_norm_sq",
    "resolve_device",
    "resolve_dtype",
]
