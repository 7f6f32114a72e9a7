"""The Fisher paper's random networks as ``torch.nn`` modules, built from an architecture spec.

``build_model`` realizes the ensemble of the theory (Fisher paper Eqs. 11–16, 26–28): every layer
is ``Linear``/``Conv2d`` with W ~ N(0, σ_w²/fan_in) and b ~ N(0, σ_b²); every layer but the last is
followed by ``BatchNorm1d``/``BatchNorm2d`` (weight γ, bias β, when ``norm="bn"``) and φ. Conv
outputs are flattened before the first FC layer.

``calibrate_batchnorm_`` sets the running statistics of every BN layer to the statistics of the
given data (one pass, cumulative average), so that eval mode uses the population statistics of
the theory's model.
"""
from __future__ import annotations

import math
from typing import Sequence

from bnlab._validation import check_choice, check_int, check_real
from bnlab.activations import get_activation

from .architecture import Architecture, ConvLayer, _as_arch, _as_sequence

__all__ = ["build_model", "calibrate_batchnorm_"]


def _phi_module(phi):
    import torch

    act = get_activation(phi)

    class _Phi(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.spec = act.spec

        def forward(self, x):
            return act.torch(x)

        def extra_repr(self):
            return self.spec

    return _Phi()


def build_model(
    arch: "str | Architecture",
    *,
    norm: str = "bn",
    phi="relu",
    gamma: "float | Sequence[float]" = 1.0,
    beta: "float | Sequence[float]" = 0.0,
    sigma_w2: "float | Sequence[float]" = 2.0,
    sigma_b2: "float | Sequence[float]" = 0.5,
    seed: int = 0,
    dtype=None,
):
    """An ``nn.Sequential`` drawn from the Fisher paper's ensemble for ``arch`` (see module docstring)."""
    import torch

    a = _as_arch(arch)
    norm = check_choice("norm", norm, ("bn", "none"))
    seed = check_int("seed", seed, minimum=0)
    L = a.depth
    sw2 = [check_real("sigma_w2", v, minimum=0.0, strict_minimum=True) for v in _as_sequence("sigma_w2", sigma_w2, L)]
    sb2 = [check_real("sigma_b2", v, minimum=0.0) for v in _as_sequence("sigma_b2", sigma_b2, L)]
    gam = [check_real("gamma", v) for v in _as_sequence("gamma", gamma, max(L - 1, 0))]
    bet = [check_real("beta", v) for v in _as_sequence("beta", beta, max(L - 1, 0))]
    dtype = dtype or torch.get_default_dtype()
    gen = torch.Generator().manual_seed(seed)
    geos = a.geometry()
    mods: list = []
    flattened = len(a.input_shape) == 1
    for l, (layer, geo) in enumerate(zip(a.layers, geos)):
        if isinstance(layer, ConvLayer):
            lin = torch.nn.Conv2d(geo["in_channels"], layer.channels, layer.kernel, layer.stride, layer.padding)
        else:
            if not flattened:
                mods.append(torch.nn.Flatten())
                flattened = True
            lin = torch.nn.Linear(geo["in_units"], layer.width)
        lin = lin.to(dtype)
        with torch.no_grad():
            scale = math.sqrt(sw2[l] / geo["fan_in"])
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen, dtype=dtype) * scale)
            lin.bias.copy_(torch.randn(lin.bias.shape, generator=gen, dtype=dtype) * math.sqrt(sb2[l]))
        mods.append(lin)
        if l == L - 1:
            break
        if norm == "bn":
            bn_cls = torch.nn.BatchNorm2d if isinstance(layer, ConvLayer) else torch.nn.BatchNorm1d
            bn = bn_cls(layer.channels if isinstance(layer, ConvLayer) else layer.width).to(dtype)
            with torch.no_grad():
                bn.weight.fill_(gam[l])
                bn.bias.fill_(bet[l])
            mods.append(bn)
        mods.append(_phi_module(phi))
    return torch.nn.Sequential(*mods)


def calibrate_batchnorm_(model, inputs, *, batch_size: int = 1024):
    """Set every BN layer's running statistics to those of ``inputs`` (cumulative average; in place).

    The module's train/eval flags are restored; parameters are not touched. PyTorch stores the
    unbiased variance (factor n/(n − 1) over the biased batch variance used in train mode), an
    O(1/n) difference between eval and train mode on the same batch.
    """
    import torch

    bns = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if not bns:
        return model
    flags = {m: m.training for m in model.modules()}
    saved = [(m.momentum,) for m in bns]
    for m in bns:
        m.reset_running_stats()
        m.momentum = None  # cumulative moving average = exact mean over the passes
    model.train()
    with torch.no_grad():
        for start in range(0, inputs.shape[0], batch_size):
            model(inputs[start : start + batch_size])
    for m, (mom,) in zip(bns, saved):
        m.momentum = mom
    for m, t in flags.items():
        m.train(t)
    return model
