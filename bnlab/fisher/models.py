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

from bnlab._validation import DEFAULT_MAX_MEMORY_BYTES, check_choice, check_int, check_memory, check_real, check_seed
from bnlab._vocabulary import NORM_ALIASES, canonical_value
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
    max_memory_bytes: int = DEFAULT_MAX_MEMORY_BYTES,
):
    """An ``nn.Sequential`` drawn from the Fisher paper's ensemble for ``arch`` (see module docstring).

    Refused before anything is allocated: parameters that need more than ``max_memory_bytes``
    (default 1 GiB), and scales whose forward pass overflows ``dtype`` however the data look —
    σ_w², σ_b² above √max and |γ|, |β| above max^¼ of the dtype (BN squares the pre-activations,
    which these scale: ``max`` = ``torch.finfo(dtype).max``).
    """
    import torch

    a = _as_arch(arch)
    norm = check_choice("norm", canonical_value("norm", norm, NORM_ALIASES), ("bn", "none"))
    seed = check_seed("seed", seed)
    L = a.depth
    if dtype is None:
        dtype = torch.get_default_dtype()
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype!r} is not allowed: expected a floating torch.dtype such as torch.float64")
    big = float(torch.finfo(dtype).max)
    sw2 = [check_real("sigma_w2", v, minimum=0.0, strict_minimum=True) for v in _as_sequence("sigma_w2", sigma_w2, L)]
    sb2 = [check_real("sigma_b2", v, minimum=0.0) for v in _as_sequence("sigma_b2", sigma_b2, L)]
    gam = [check_real("gamma", v) for v in _as_sequence("gamma", gamma, max(L - 1, 0))]
    bet = [check_real("beta", v) for v in _as_sequence("beta", beta, max(L - 1, 0))]
    for name, values, bound in (("sigma_w2", sw2, big**0.5), ("sigma_b2", sb2, big**0.5),
                                ("gamma", gam, big**0.25), ("beta", bet, big**0.25)):
        for v in values:
            if abs(v) > bound:
                raise ValueError(
                    f"{name}={v!r} is not allowed in {str(dtype).replace('torch.', '')}: at most {bound:.3g} in "
                    "magnitude (BN squares the pre-activations this scales, which would overflow)"
                )
    geos = a.geometry()
    itemsize = torch.empty((), dtype=dtype).element_size()
    n_params = sum(
        (g["fan_in"] + 1) * (layer.channels if isinstance(layer, ConvLayer) else layer.width) + 2 * g["channels"]
        for layer, g in zip(a.layers, geos)
    )
    check_memory(f"arch={a.to_spec()!r} ({n_params:.3g} parameters)", n_params * itemsize, max_memory_bytes,
                 hint="use narrower layers or raise the bound")
    gen = torch.Generator().manual_seed(seed)
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

    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model={type(model).__name__} is not allowed: expected a torch.nn.Module")
    batch_size = check_int("batch_size", batch_size, minimum=1)
    if not isinstance(inputs, torch.Tensor) or inputs.ndim < 1 or inputs.shape[0] < 1:
        raise ValueError("inputs is not allowed: expected a tensor with a leading batch dimension >= 1")
    if inputs.is_floating_point() and not bool(torch.isfinite(inputs).all()):
        raise ValueError("inputs is not allowed: it contains NaN or infinite entries")
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
    for name, m in model.named_modules():
        if m in bns and m.running_var is not None and not bool(torch.isfinite(m.running_var).all()):
            # eval mode would divide by an infinite variance: every output of this layer 0, silently
            raise ValueError(
                f"the running variance of BatchNorm layer {name!r} overflows {m.running_var.dtype} on these "
                "inputs (the pre-activations are too large: reduce sigma_w2 or gamma, or use float64)"
            )
    return model
