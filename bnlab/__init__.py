"""bnlab: batch normalization theory, simulation and experiments.

Subpackages (one per part of the mission):

* :mod:`bnlab.theory` — mean field theory of batch normalization (Yang et al. 2019)
* :mod:`bnlab.sim` — finite-width random networks, the independent check of every theory
* :mod:`bnlab.data` — datasets from offline sources
* :mod:`bnlab.experiments` — the papers' figures as declared sweeps, the results store, the report
* :mod:`bnlab.optim` — batch normalization preconditioning (Lange et al.)
* (planned) fisher, rank — Fisher information, rank collapse

Subpackages are imported lazily so that ``import bnlab`` stays cheap.
"""
from __future__ import annotations

import importlib

from bnlab.activations import Activation, get_activation, list_activations

__version__ = "0.1.0"
__all__ = ["Activation", "get_activation", "list_activations", "__version__"]

_SUBPACKAGES = {"theory", "sim", "data", "experiments", "activations", "optim"}


def __getattr__(name: str):
    if name in _SUBPACKAGES:
        return importlib.import_module(f"bnlab.{name}")
    raise AttributeError(f"module 'bnlab' has no attribute {name!r}")
