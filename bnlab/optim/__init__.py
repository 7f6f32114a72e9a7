"""Batch normalization preconditioning (Lange, Helfrich & Ye): BNP as a PyTorch gradient preconditioner.

* :class:`BNPreconditioner` — forward hooks on Linear / Conv1d / Conv2d layers record their input
  statistics; ``step()`` rewrites the layers' ``.grad`` (Eq. 15, Algorithms 2-3) so any
  ``torch.optim`` optimizer then takes a BNP step.
* :func:`bnp_precondition_`, :func:`regularized_variance` — the functional core.
* :func:`register_layer_handler`, :class:`LayerHandler` — the registry of supported layer types.
* :func:`layer_hessian_conditioning`, :class:`ConditioningLogger` — Theorem 4 measured: the condition
  number of one neuron's Hessian block with and without preconditioning, and κ(D).
"""
from __future__ import annotations

from bnlab.optim._layers import CONV_STATISTICS, LayerHandler
from bnlab.optim.bnp import (
    BNPreconditioner,
    bnp_precondition_,
    layer_handlers,
    register_layer_handler,
    regularized_variance,
)
from bnlab.optim.conditioning import (
    ConditioningLogger,
    HessianConditioning,
    condition_number,
    layer_hessian_conditioning,
    neuron_hessian,
)

__all__ = [
    "BNPreconditioner",
    "bnp_precondition_",
    "regularized_variance",
    "register_layer_handler",
    "layer_handlers",
    "LayerHandler",
    "CONV_STATISTICS",
    "layer_hessian_conditioning",
    "neuron_hessian",
    "condition_number",
    "HessianConditioning",
    "ConditioningLogger",
]
