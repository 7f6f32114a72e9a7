"""torch.compile helpers shared by the training loops of bnlab.nets (private)."""
from __future__ import annotations

import types
from typing import Callable

import torch


def fresh_function(fn: Callable) -> Callable:
    """``fn`` with a copy of its code object.

    Dynamo keeps its compiled graphs on the code object, at most ``recompile_limit`` (8) per object,
    after which it silently runs the function uncompiled.  A training loop builds its step from the
    same code for every model (a sweep trains hundreds), so the limit would be passed within a sweep; a
    private code object per training run keeps each run's cache apart (and frees it with the run)."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def compile_failure(exc: BaseException) -> str | None:
    """A one-line description of ``exc`` if it is a compilation failure (Dynamo's or a backend's,
    raised before the compiled code runs), else None."""
    if isinstance(exc, torch._dynamo.exc.TorchDynamoException):
        text = str(exc).strip()
        return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
    return None
