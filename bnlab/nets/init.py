"""Weight initializations by name for the Linear and Conv layers of a module, drawn from a torch.Generator.

``σ_w² = sigma_w2``, ``σ_b² = sigma_b2``, ``d = fan_in`` (in_features, or in_channels/groups × kernel
size for a convolution), ``σ_w = sqrt(σ_w²)``:

``"gaussian"``
    W ~ N(0, σ_w²/d) iid, b ~ N(0, σ_b²) — the mean field convention (Yang et al. 2019 §2 and Eq. 7;
    the Fisher paper §4 uses σ_w² = 2, σ_b² = 0.5).
``"orthogonal"``
    W = σ_w·Q, Q Haar-distributed semi-orthogonal of shape (out, d) (``torch.nn.init.orthogonal_``,
    Saxe et al. 2014): Q Qᵀ = I when out ≤ d, QᵀQ = I otherwise; entries have variance
    σ_w²/max(out, d).  b ~ N(0, σ_b²).
``"glorot_uniform"``
    W ~ U[−a, a], a = σ_w·sqrt(6/(d + fan_out)) (Glorot & Bengio 2010, Eq. 16, with gain σ_w; σ_w² = 1
    is Glorot's; ``torch.nn.init.xavier_uniform_``), b ~ N(0, σ_b²) — Lange et al. use it with zero biases.
``"torch_default"``
    What ``reset_parameters()`` of ``nn.Linear``/``nn.ConvNd`` draws: W ~ U[−1/sqrt(d), 1/sqrt(d)]
    (kaiming_uniform with a = √5) and b ~ U[−1/sqrt(d), 1/sqrt(d)] — but from ``generator`` instead of
    the global generator.  ``sigma_w2``/``sigma_b2`` do not apply and must be left at their defaults.
``"asymmetric_uniform"`` (old spelling ``"asym_uniform"``: a DeprecationWarning, accepted until the next release)
    W ~ U[0, 2σ_w/sqrt(d)] iid, b ~ N(0, σ_b²): with σ_w² = 1 the asymmetric initialization
    U[0, 2/sqrt(d_l)] of Daneshmand et al. 2020, §5 ("Breaking batchnorm"), whose variance 1/(3d)
    equals that of PyTorch's default but whose mean 1/sqrt(d) is not zero.

The same schemes for *ensembles* of random networks (batched weights of shape (networks, d, out)) are
in ``bnlab.sim.init``; the formulas are the same and ``tests/nets/test_init.py`` checks both against
the same moments.  Here each layer is one ``nn.Module`` and PyTorch's own initializers are used with
the ``generator`` argument, so the global random state is never read or advanced.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from bnlab._validation import check_choice, check_real, check_seed
from bnlab._vocabulary import INIT_ALIASES, canonical_value

__all__ = ["INITS", "init_weights_", "initializable_layers"]

#: The initialization schemes :func:`init_weights_` accepts.
INITS = ("gaussian", "orthogonal", "glorot_uniform", "torch_default", "asymmetric_uniform")

_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def initializable_layers(module: nn.Module) -> list[nn.Module]:
    """The ``nn.Linear``/``nn.Conv1d/2d/3d`` submodules of ``module`` (itself included), in ``modules()`` order."""
    return [m for m in module.modules() if isinstance(m, _LAYERS)]


def _generator(generator) -> torch.Generator:
    if generator is None:
        return torch.Generator().manual_seed(0)
    if isinstance(generator, torch.Generator):
        if generator.device.type != "cpu":
            raise ValueError(f"generator={generator!r} is not allowed: expected a CPU torch.Generator")
        return generator
    return torch.Generator().manual_seed(check_seed("generator", generator))


def _draw_weight(scheme: str, shape, dtype, sigma_w: float, g: torch.Generator) -> torch.Tensor:
    w = torch.empty(shape, dtype=dtype)
    fan_in = int(math.prod(shape[1:]))
    if scheme == "gaussian":
        return w.normal_(0.0, sigma_w / math.sqrt(fan_in), generator=g)
    if scheme == "orthogonal":
        return nn.init.orthogonal_(w, gain=sigma_w, generator=g)
    if scheme == "glorot_uniform":
        return nn.init.xavier_uniform_(w, gain=sigma_w, generator=g)
    if scheme == "torch_default":
        return nn.init.kaiming_uniform_(w, a=math.sqrt(5.0), generator=g)
    return w.uniform_(0.0, 2.0 * sigma_w / math.sqrt(fan_in), generator=g)


@torch.no_grad()
def init_weights_(
    module: nn.Module,
    scheme: str,
    *,
    sigma_w2: float = 1.0,
    sigma_b2: float = 0.0,
    generator: torch.Generator | int | None = None,
) -> nn.Module:
    """Initialize every Linear/Conv layer of ``module`` in place by ``scheme`` (one of :data:`INITS`).

    Parameters
    ----------
    module:
        Any ``nn.Module``; its ``nn.Linear`` and ``nn.Conv1d/2d/3d`` submodules (in ``modules()`` order)
        are initialized, weight then bias, layer after layer; normalization layers are left alone.
    scheme:
        See the module docstring.
    sigma_w2, sigma_b2:
        σ_w² > 0 and σ_b² ≥ 0 (σ_b² = 0 sets biases to zero).  Not used by ``"torch_default"``.
    generator:
        A CPU ``torch.Generator`` (advanced by the draws), a seed, or None (seed 0).  Numbers are drawn
        on the CPU in the parameter's dtype and copied to its device, so the result does not depend on
        the device.

    Returns
    -------
    The same ``module``.
    """
    if not isinstance(module, nn.Module):
        raise ValueError(f"module={type(module).__name__} is not allowed: expected a torch.nn.Module")
    scheme = check_choice("scheme", canonical_value("scheme", scheme, INIT_ALIASES), INITS)
    sigma_w2 = check_real("sigma_w2", sigma_w2, minimum=0.0, strict_minimum=True)
    sigma_b2 = check_real("sigma_b2", sigma_b2, minimum=0.0)
    if scheme == "torch_default" and (sigma_w2 != 1.0 or sigma_b2 != 0.0):
        raise ValueError(
            f"sigma_w2={sigma_w2}, sigma_b2={sigma_b2} are not allowed with scheme='torch_default': it has its own "
            "scales (U[-1/sqrt(fan_in), 1/sqrt(fan_in)]); leave them at 1 and 0"
        )
    g = _generator(generator)
    sigma_w, sigma_b = math.sqrt(sigma_w2), math.sqrt(sigma_b2)
    for layer in initializable_layers(module):
        w = layer.weight
        w.copy_(_draw_weight(scheme, tuple(w.shape), w.dtype, sigma_w, g))
        if layer.bias is None:
            continue
        b = torch.empty(layer.bias.shape, dtype=layer.bias.dtype)
        if scheme == "torch_default":
            bound = 1.0 / math.sqrt(int(math.prod(w.shape[1:])))
            b.uniform_(-bound, bound, generator=g)
        elif sigma_b2 > 0:
            b.normal_(0.0, sigma_b, generator=g)
        else:
            b.zero_()
        layer.bias.copy_(b)
    return module
