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

from typing import Sequence

from bnlab._validation import DEFAULT_MAX_MEMORY_BYTES, check_choice, check_int
from bnlab._vocabulary import NORM_ALIASES, canonical_value

from .architecture import Architecture, ConvLayer, _as_arch

__all__ = ["build_model", "calibrate_batchnorm_"]


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

    Built by :func:`bnlab.nets.feedforward` (the one builder of bnlab's feed-forward networks; its
    convolutions come from the conv-stack builder of :class:`bnlab.nets.FisherCNN`).  ``gamma``,
    ``beta`` (one per hidden layer) and ``sigma_w2``, ``sigma_b2`` (one per layer) are scalars or
    per-layer lists.  Refused before anything is allocated: parameters that need more than
    ``max_memory_bytes`` (default 1 GiB), and scales whose forward pass overflows ``dtype`` however
    the data look — σ_w², σ_b² above √max and |γ|, |β| above max^¼ of the dtype (BN squares the
    pre-activations, which these scale: ``max`` = ``torch.finfo(dtype).max``).
    """
    from bnlab.nets import feedforward

    a = _as_arch(arch)
    norm = check_choice("norm", canonical_value("norm", norm, NORM_ALIASES), ("bn", "none"))
    layers = [("conv", layer.channels, layer.kernel, layer.stride, layer.padding) if isinstance(layer, ConvLayer)
              else ("fc", layer.width) for layer in a.layers]
    return feedforward(a.input_shape, layers, norm=norm, phi=phi, gamma=gamma, beta=beta, sigma_w2=sigma_w2,
                       sigma_b2=sigma_b2, seed=seed, dtype=dtype, max_memory_bytes=max_memory_bytes)


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
