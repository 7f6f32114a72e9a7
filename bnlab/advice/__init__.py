"""``bnlab.advise``: the user's own ``nn.Module`` in, the four papers' predictions out.

:func:`advise` measures a network at initialization on one batch and returns an :class:`Advice`: its
structure and which of the papers' assumptions hold, gradient explosion and the trainable depth (Yang et
al. 2019), the largest stable learning rate (the Fisher paper), rank collapse (Daneshmand et al. 2020) and
the batch size with BNP as the alternative (Lange et al.).  It calls theory, fisher, rank, optim and sim
and owns no numerics of its own.  ``bnlab advise`` is the command line; see ``docs/advise.md``.

This subpackage is ``bnlab.advice`` (the function ``bnlab.advise`` would otherwise be shadowed by a
submodule of the same name).
"""
from __future__ import annotations

from bnlab.advice.core import DEFAULT_MAX_MEMORY_GB, PARTS, SKIPPABLE, Advice, advise

__all__ = ["advise", "Advice", "PARTS", "SKIPPABLE", "DEFAULT_MAX_MEMORY_GB", "load_model", "NAMED_MODELS",
           "batch_for", "parse_shape", "GradientAdvice", "LearningRateAdvice", "RankAdvice", "BatchSizeAdvice", "Structure", "Layer",
           "Assumption", "Knob"]

_LAZY = {"load_model": "bnlab.advice.models", "NAMED_MODELS": "bnlab.advice.models", "batch_for": "bnlab.advice.models",
         "parse_shape": "bnlab.advice.models",
         "GradientAdvice": "bnlab.advice.gradients", "Knob": "bnlab.advice.gradients",
         "LearningRateAdvice": "bnlab.advice.learning_rate", "RankAdvice": "bnlab.advice.collapse",
         "BatchSizeAdvice": "bnlab.advice.batch", "Structure": "bnlab.advice.structure",
         "Layer": "bnlab.advice.structure", "Assumption": "bnlab.advice.structure"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'bnlab.advice' has no attribute {name!r}")
