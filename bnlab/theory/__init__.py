"""Mean field theory of batch normalization (Yang et al. 2019, ICLR).

Thin public namespace over one module per method and per piece of the theory.
Names resolve lazily so that importing :mod:`bnlab.theory` is cheap.

Entry point: :func:`analyze` — everything the theory says about (φ, B, ε) as
a typed :class:`TheoryResult`.
"""
from __future__ import annotations

import importlib

# public name -> defining module (relative to bnlab.theory)
_API = {
    # coordinatewise Gaussian kernels V_φ
    "gaussian_kernel": "vphi",
    # the batchnorm transform V_Bφ(Σ) and its methods
    "batchnorm_transform": "batchnorm_map",
    "batchnorm_transform_montecarlo": "batchnorm_map",
    "TRANSFORM_METHODS": "batchnorm_map",
    # Gegenbauer expansion
    "gegenbauer_coefficients": "gegenbauer",
    # BSB1 fixed point
    "BSB1FixedPoint": "fixed_point",
    "bsb1_fixed_point": "fixed_point",
    "iterate_batch_covariance": "fixed_point",
    # forward / backward / cross-batch linearized dynamics
    "ForwardEigenvalues": "forward",
    "forward_eigenvalues": "forward",
    "BackwardEigenvalues": "backward",
    "backward_eigenvalues": "backward",
    "gradient_explosion_rate": "backward",
    "weight_gradient_norms": "backward",
    "CrossBatchResult": "cross_batch",
    "cross_batch_fixed_point": "cross_batch",
    "cross_batch_rate": "cross_batch",
    # epsilon > 0
    "EpsilonResult": "epsilon",
    "epsilon_analysis": "epsilon",
    "EPSILON_METHODS": "epsilon",
    # symmetry breaking
    "fixed_point_kind": "symmetry",
    "alpha_transition": "symmetry",
    "bsb1_stability": "symmetry",
    "BSB1Stability": "symmetry",
    "bsb2_fixed_point": "symmetry",
    "BSB2FixedPoint": "symmetry",
    # infinite-width kernel of a real input batch
    "nngp_kernel": "nngp",
    "NNGP_METHODS": "nngp",
    # everything at once
    "TheoryResult": "analyze",
    "analyze": "analyze",
    "depth_scale": "analyze",
    "max_trainable_depth": "analyze",
    "METHODS": "analyze",
    # batch-size regime checks
    "SmallBatchWarning": "_checks",
    "check_batch_size": "_checks",
}

__all__ = sorted(_API)


def __getattr__(name: str):
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'bnlab.theory' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__():
    return __all__


# The function `analyze` shares its name with the submodule `bnlab.theory.analyze`. Importing a
# submodule binds it as an attribute of the package, which would shadow the lazy lookup above
# (`bnlab.theory.analyze(...)` would then be a module). Binding the function eagerly, after the
# submodule has been loaded once, keeps `bnlab.theory.analyze` the function for good.
from bnlab.theory.analyze import analyze  # noqa: E402
