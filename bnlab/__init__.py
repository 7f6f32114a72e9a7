"""bnlab: batch normalization theory, simulation and experiments.

Subpackages (one per part of the mission):

* :mod:`bnlab.theory` — mean field theory of batch normalization (Yang et al. 2019)
* :mod:`bnlab.sim` — finite-width random networks, the independent check of every theory
* :mod:`bnlab.data` — datasets from offline sources
* :mod:`bnlab.experiments` — the papers' figures as declared sweeps, the results store, the report
* :mod:`bnlab.optim` — batch normalization preconditioning (Lange et al.)
* :mod:`bnlab.fisher`, :mod:`bnlab.rank` — Fisher information, rank collapse
* :func:`bnlab.advise` (:mod:`bnlab.advice`) — the four papers' predictions for your own ``nn.Module``

Subpackages are imported lazily so that ``import bnlab`` stays cheap.
"""
from __future__ import annotations

import importlib

from bnlab.activations import Activation, get_activation, list_activations

__version__ = "0.1.0"
__all__ = ["Activation", "get_activation", "list_activations", "advise", "__version__"]

_SUBPACKAGES = {"theory", "sim", "data", "experiments", "activations", "optim", "advice"}


def __getattr__(name: str):
    if name == "advise":
        # bnlab.advise(model, data, ...) is the function; its subpackage is bnlab.advice (a submodule named
        # ``advise`` would be bound over the function when imported)
        from bnlab.advice import advise

        return advise
    if name in _SUBPACKAGES:
        return importlib.import_module(f"bnlab.{name}")
    raise AttributeError(f"module 'bnlab' has no attribute {name!r}")
