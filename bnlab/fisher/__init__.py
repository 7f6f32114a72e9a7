"""Fisher information of BatchNorm networks (the Fisher paper: "Mean-field analysis of batch normalization").

* Theory (NumPy/SciPy): :func:`fisher_order_parameters` — the mean-field order parameters, the
  λ̄max lower bound of Claim 3.1 and η* = 2(1+μ)/λ̄max (Eq. 7), for FC and conv architectures
  (:func:`parse_arch`), with and without BN, any φ; ``formula="paper"`` or ``"measured"``.
* Measurement (torch): :func:`curvature_spectrum` — λmax / top-k eigenvalues of the Fisher (Eq. 10),
  GGN, loss Hessian or empirical Fisher of a real ``nn.Module`` on a fixed batch, matrix-free Lanczos,
  BN in train mode (batch statistics) or eval mode (running statistics), never changing the module.

Names resolve lazily so that the theory does not import torch.
"""
from __future__ import annotations

import importlib

_API = {
    "FCLayer": "architecture",
    "ConvLayer": "architecture",
    "Architecture": "architecture",
    "parse_arch": "architecture",
    "FORMULAS": "order_parameters",
    "NORMS": "order_parameters",
    "FisherTheoryResult": "order_parameters",
    "fisher_order_parameters": "order_parameters",
    "eta_star": "order_parameters",
    "build_model": "models",
    "calibrate_batchnorm_": "models",
    "CURVATURES": "spectrum",
    "BN_MODES": "spectrum",
    "SpectrumResult": "spectrum",
    "LOSSES": "spectrum",
    "curvature_spectrum": "spectrum",
    "curvature_operator": "spectrum",
    "CurvatureOverflowError": "spectrum",
    "LanczosNotConvergedError": "spectrum",
}

__all__ = sorted(_API)


def __getattr__(name):
    if name in _API:
        module = importlib.import_module(f".{_API[name]}", __name__)
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return __all__
