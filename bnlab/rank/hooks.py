"""Per-layer representations and rank measures of any ``nn.Module``, through forward hooks.

:func:`record_representations` is a context manager that registers forward hooks on named
submodules (names as in ``model.named_modules()``) and removes every one of them on exit,
also when the forward pass raises.  :func:`layer_rank_measures` runs one forward pass on a
batch and returns the rank measures (:func:`bnlab.rank.rank_measures`) of each named layer's
representation.

A layer's output of shape (N, ...) becomes the representation H = output.reshape(N, −1)ᵀ
(features × samples, the paper's d × N convention; a conv layer's channels × positions are
flattened per sample).  With ``capture="input"`` the hooked module's input is recorded
instead — e.g. the input of the classifier, the paper's last hidden representation H_L.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
from torch import nn

from bnlab._validation import check_choice, check_real
from bnlab.rank.measures import RankMeasures, rank_measures

__all__ = [
    "record_representations",
    "layer_rank_measures",
    "last_linear_name",
    "representation_matrix",
    "rescale_to_unit_trace",
]


def representation_matrix(output: torch.Tensor) -> torch.Tensor:
    """A layer output (N, ...) as the representation H (d × N), d = the per-sample size."""
    if not isinstance(output, torch.Tensor):
        raise ValueError(f"the hooked layer returned {type(output).__name__}, expected a tensor")
    if output.ndim < 1:
        raise ValueError("the hooked layer returned a scalar, expected a batch (N, ...)")
    return output.reshape(output.shape[0], -1).transpose(0, 1)


def rescale_to_unit_trace(h: torch.Tensor) -> torch.Tensor:
    """H scaled by one scalar so that tr M(H) = d (M = H Hᵀ/N): the scale BN gives (App. A, p.1).

    Only the soft rank depends on the scale; Lemma 1's bound rank_τ ≥ (1 − τ)² r holds at it.
    H = 0 is returned unchanged.
    """
    d, n = h.shape[-2], h.shape[-1]
    # divided by max|H| first: ‖1e200·H‖_F² overflows float64 and the result was all zeros
    peak = h.abs().amax(dim=(-2, -1), keepdim=True)
    u = h / torch.where(peak > 0, peak, torch.ones_like(peak))
    fro2 = u.pow(2).sum(dim=(-2, -1), keepdim=True)
    return u * torch.where(fro2 > 0, torch.rsqrt(torch.where(fro2 > 0, fro2, torch.ones_like(fro2)) / (d * n)),
                           peak)


def _resolve_names(model: nn.Module, names: Sequence[str] | str) -> dict[str, nn.Module]:
    if isinstance(names, str):
        names = [names]
    modules = dict(model.named_modules())
    out = {}
    for name in names:
        if name not in modules:
            available = [k for k in modules if k]
            shown = ", ".join(map(repr, available[:20])) + (" ..." if len(available) > 20 else "")
            raise ValueError(f"layer {name!r} is not allowed: the model has no submodule of that name; "
                             f"named submodules: {shown or '(none)'}")
        out[name] = modules[name]
    if not out:
        raise ValueError("names is not allowed: expected at least one layer name")
    return out


def last_linear_name(model: nn.Module) -> str:
    """Name of the last ``nn.Linear`` registered in ``model`` (its classifier, for an MLP)."""
    last = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            last = name
    if last is None:
        raise ValueError("model is not allowed: it has no nn.Linear layer; name the layer explicitly")
    return last


@contextlib.contextmanager
def record_representations(
    model: nn.Module, names: Sequence[str] | str, *, capture: str = "output", detach: bool = True
) -> Iterator[dict[str, torch.Tensor]]:
    """Record named layers' representations (d × N) during the forward passes inside the block.

    Yields a dict filled by the hooks: name → H (the last call's, if a module runs twice).
    ``detach=False`` keeps the autograd graph (the pre-training differentiates r(H) through it).
    Every hook is removed on exit, even on error.  Unknown names raise ``ValueError`` before
    any hook is registered.
    """
    capture = check_choice("capture", capture, ("output", "input"))
    targets = _resolve_names(model, names)
    store: dict[str, torch.Tensor] = {}
    handles = []

    def make_hook(name):
        if capture == "output":
            def hook(_module, _inputs, output):
                h = representation_matrix(output)
                store[name] = h.detach() if detach else h
        else:
            def hook(_module, inputs):
                if not inputs:
                    raise ValueError(f"layer {name!r} was called without a positional input")
                h = representation_matrix(inputs[0])
                store[name] = h.detach() if detach else h
        return hook

    try:
        for name, mod in targets.items():
            if capture == "output":
                handles.append(mod.register_forward_hook(make_hook(name)))
            else:
                handles.append(mod.register_forward_pre_hook(make_hook(name)))
        yield store
    finally:
        for hd in handles:
            hd.remove()


def layer_rank_measures(
    model: nn.Module,
    x: torch.Tensor,
    names: Sequence[str] | str | None = None,
    *,
    tau: float = 0.5,
    capture: str = "output",
    rescale: bool = True,
) -> dict[str, RankMeasures]:
    """Rank measures of each named layer's representation on the batch ``x`` (one forward pass).

    ``names=None`` measures every ``nn.Linear`` and conv layer.  The model's mode is left as it
    is (BN in train mode normalizes with the batch's statistics, as at the paper's
    initialization).  ``rescale=True`` reads the soft rank at tr M = d
    (:func:`rescale_to_unit_trace`); the other measures are scale-invariant.
    """
    tau = check_real("tau", tau, minimum=0.0, strict_minimum=True)
    if not isinstance(model, nn.Module):
        raise ValueError(f"model is not allowed: expected an nn.Module, got {type(model).__name__}")
    if not isinstance(x, torch.Tensor) or x.ndim < 1 or x.shape[0] < 1:
        raise ValueError("x is not allowed: expected a tensor with a leading batch dimension >= 1")
    if x.is_floating_point() and not bool(torch.isfinite(x).all()):
        raise ValueError("x is not allowed: it contains NaN or infinite entries")
    if names is None:
        names = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d))]
        if not names:
            raise ValueError("names is not allowed: None, and the model has no Linear/Conv layer to default to")
    with torch.no_grad(), record_representations(model, names, capture=capture) as store:
        model(x)
    missing = [n for n in ([names] if isinstance(names, str) else names) if n not in store]
    if missing:
        raise ValueError(f"layer(s) {missing} did not run in the forward pass")
    out = {}
    for name, h in store.items():
        h = h.to(torch.float64) if h.dtype not in (torch.float32, torch.float64) else h
        out[name] = rank_measures(rescale_to_unit_trace(h) if rescale else h, tau=tau)
    return out
