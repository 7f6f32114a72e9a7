"""Argument checks of :class:`bnlab.optim.BNPreconditioner`: its ``skip`` entries, the layers it
registers, the inputs its hooks see, and the state dicts it loads (issue #26: a ``ValueError``
naming the argument, the value and what is allowed, before anything changes)."""
from __future__ import annotations

import fnmatch
from typing import TYPE_CHECKING, Any, Mapping

import torch
from torch import nn

from bnlab.optim._layers import _layer_label

if TYPE_CHECKING:  # _bnp_layers imports this module
    from bnlab.optim._bnp_layers import BNPLayer

__all__ = ["bad_input", "check_layer", "entry_mapping", "skip_entries", "state_tensor"]




def skip_entries(skip, model: nn.Module) -> tuple[list[str], list[type]]:
    if isinstance(skip, (str, type)):
        skip = (skip,)
    try:
        skip = tuple(skip)
    except TypeError:
        raise ValueError(f"skip={skip!r} is not allowed: expected module names (str) or nn.Module types") from None
    names, types = [], []
    for item in skip:
        if isinstance(item, str):
            names.append(item)
        elif isinstance(item, type) and issubclass(item, nn.Module):
            types.append(item)
        else:
            raise ValueError(f"skip entry {item!r} is not allowed: expected a module name (str) or an nn.Module type")
    all_names = [n for n, _ in model.named_modules()]
    for pattern in names:
        if not any(n == pattern or fnmatch.fnmatchcase(n, pattern) for n in all_names):
            raise ValueError(
                f"skip entry {pattern!r} matches no module of the model (module names: "
                f"{', '.join(repr(n) for n in all_names[1:21])}{' …' if len(all_names) > 21 else ''})"
            )
    return names, types


def check_layer(module: nn.Module, name: str) -> None:
    weight = getattr(module, "weight", None)
    kind = type(module).__name__
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"BNP cannot precondition layer {_layer_label(name)} ({kind}): it has no weight tensor; "
                         f"skip it with skip=[{name!r}]")
    if isinstance(weight, nn.parameter.UninitializedParameter):
        raise ValueError(f"BNP cannot precondition layer {_layer_label(name)} ({kind}) yet: it is a lazy module whose "
                         "weight is not initialized; run one forward pass before creating the preconditioner")
    if not isinstance(weight, nn.Parameter):
        # weight_norm, spectral_norm, nn.utils.parametrize: the weight is computed from other parameters in every
        # forward, so it has no .grad for BNP to rewrite (the layer was listed, and step() changed nothing)
        raise ValueError(f"BNP cannot precondition layer {_layer_label(name)} ({kind}): its weight is computed "
                         "(weight_norm, spectral_norm or another parametrization), not a parameter whose gradient BNP "
                         f"could precondition; skip it with skip=[{name!r}]")
    if not weight.is_floating_point():
        raise ValueError(f"BNP cannot precondition layer {_layer_label(name)} ({kind}) of dtype {weight.dtype}: "
                         f"expected a real floating dtype; skip it with skip=[{name!r}]")
    if weight.is_meta:
        raise ValueError(f"BNP cannot precondition layer {_layer_label(name)} ({kind}): its weight is on the meta "
                         "device (no data); move the model to a real device first")


def bad_input(layer: BNPLayer, x: torch.Tensor) -> None:
    kind = type(layer.module).__name__
    if not x.is_floating_point():
        raise ValueError(f"BNP layer {_layer_label(layer.name)} ({kind}) got an input of dtype {x.dtype}: expected a "
                         "real floating dtype")
    raise ValueError(f"BNP layer {_layer_label(layer.name)} ({kind}) got an input of shape {tuple(x.shape)}: an "
                     "empty mini-batch has no statistics; leave empty batches out of training")


def entry_mapping(value: Any, where: str, keys: tuple[str, ...]) -> Mapping:
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}={type(value).__name__} is not allowed: expected a mapping with keys "
                         f"{', '.join(map(repr, keys))}")
    missing = [k for k in keys if k not in value]
    if missing:
        raise ValueError(f"{where} is not allowed: missing key(s) {', '.join(map(repr, missing))}")
    return value


def state_tensor(value: Any, where: str, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{where} is a {type(value).__name__}: expected a torch.Tensor")
    if value.is_meta or value.layout != torch.strided:
        raise ValueError(f"{where} is a {'meta' if value.is_meta else str(value.layout)} tensor: expected a dense "
                         "tensor with data")
    if value.is_complex() or value.dtype == torch.bool:
        raise ValueError(f"{where} has dtype {value.dtype}: expected a real dtype")
    if tuple(value.shape) != (cols,):
        # (the layer's name first: the message existing callers match)
        raise ValueError(f"{where.rsplit(' ', 1)[0]} has statistics of shape {tuple(value.shape)}, expected ({cols},)")
    out = value.detach().to(device=device, dtype=dtype).clone()
    if not bool(torch.isfinite(out).all()):
        raise ValueError(f"{where} is not allowed: it has NaN or infinite entries (in {dtype})")
    return out
