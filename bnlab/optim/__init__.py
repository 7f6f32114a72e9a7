"""Batch normalization preconditioning (Lange, Helfrich & Ye): BNP as a PyTorch gradient preconditioner.

* :class:`BNPreconditioner` — forward hooks on Linear / Conv1d / Conv2d layers record their input
  statistics; ``step()`` rewrites the layers' ``.grad`` (Eq. 15, Algorithms 2-3) so any
  ``torch.optim`` optimizer then takes a BNP step.
* :func:`bnp_precondition_`, :func:`regularized_variance` — the functional core.
* :func:`register_layer_handler`, :class:`LayerHandler` — the registry of supported layer types.
* :func:`layer_hessian_conditioning`, :class:`ConditioningLogger` — Theorem 4 measured: the condition
  number of one neuron's Hessian block with and without preconditioning, and κ(D).
* :func:`train_network` — Lange et al.'s FC network / 5-layer CNN trained with BNP or a
  normalization layer (needs :mod:`bnlab.nets`; imported lazily).
* :func:`train_resnet`, :func:`resnet_learning_rate` — the ResNets of Lange et al. Figs. 6-7 (BN, GN,
  BNP, BNP+GN) with momentum SGD, weight decay, warm-up and step decay (imported lazily).
"""
from __future__ import annotations

from bnlab.optim._layers import CONV_STATISTICS, LayerHandler
from bnlab.optim.bnp import (
    GRADIENT_MODES,
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

_LAZY = {"train_network": "bnlab.optim.training", "default_learning_rate": "bnlab.optim.training",
         "build_network": "bnlab.optim.training",
         "NetworkTrainingResult": "bnlab.optim.training", "TRAIN_NORMS": "bnlab.optim.training",
         "TRAIN_MODELS": "bnlab.optim.training", "train_resnet": "bnlab.optim.resnets",
         "resnet_learning_rate": "bnlab.optim.resnets", "RESNET_METHODS": "bnlab.optim.resnets"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'bnlab.optim' has no attribute {name!r}")


__all__ = [
    "BNPreconditioner",
    "bnp_precondition_",
    "regularized_variance",
    "register_layer_handler",
    "layer_handlers",
    "LayerHandler",
    "CONV_STATISTICS",
    "GRADIENT_MODES",
    "layer_hessian_conditioning",
    "neuron_hessian",
    "condition_number",
    "HessianConditioning",
    "ConditioningLogger",
    "train_network",
    "build_network",
    "default_learning_rate",
    "NetworkTrainingResult",
    "TRAIN_NORMS",
    "TRAIN_MODELS",
    "train_resnet",
    "resnet_learning_rate",
    "RESNET_METHODS",
]
