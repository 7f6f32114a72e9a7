"""Argument checks shared by every part of bnlab.

Bad input is rejected at the public boundary with a ``ValueError`` that names
the argument, the value received and what is allowed (never a NaN, a silent
clamp or a traceback from deep inside).
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Iterable

import numpy as np

__all__ = [
    "check_int",
    "check_real",
    "check_choice",
    "check_psd_matrix",
    "check_finite_array",
    "check_device",
    "check_writable_ancestor",
]


def check_int(name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """Return ``value`` as an int, or raise ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, np.integer)):
        if isinstance(value, (float, np.floating)) and float(value).is_integer():
            value = int(value)
        else:
            raise ValueError(f"{name}={value!r} is not allowed: expected an integer")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}={value} is not allowed: expected an integer >= {minimum}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name}={value} is not allowed: expected an integer <= {maximum}")
    return value


def check_real(
    name: str,
    value: Any,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    strict_minimum: bool = False,
) -> float:
    """Return ``value`` as a finite float, or raise ``ValueError`` naming ``name``.

    ``strict_minimum`` makes the lower bound exclusive (value > minimum).
    """
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, np.floating, np.integer)):
        raise ValueError(f"{name}={value!r} is not allowed: expected a real number")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name}={value!r} is not allowed: expected a finite real number")
    if minimum is not None:
        if strict_minimum and value <= minimum:
            raise ValueError(f"{name}={value!r} is not allowed: expected a number > {minimum}")
        if not strict_minimum and value < minimum:
            raise ValueError(f"{name}={value!r} is not allowed: expected a number >= {minimum}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name}={value!r} is not allowed: expected a number <= {maximum}")
    return value


def check_choice(name: str, value: Any, choices: Iterable[str]) -> str:
    """Return ``value`` if it is one of ``choices``, else raise ``ValueError``."""
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not allowed: expected one of {', '.join(map(repr, choices))}")
    return value


def check_finite_array(name: str, value: Any, *, ndim: int | None = None) -> np.ndarray:
    """Return ``value`` as a float64 array with no NaN/inf, or raise ``ValueError``."""
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} is not allowed: cannot convert to a float64 array ({exc})") from None
    if ndim is not None and arr.ndim != ndim:
        raise ValueError(f"{name} is not allowed: expected a {ndim}-d array, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} is not allowed: it contains NaN or infinite entries")
    return arr


def check_psd_matrix(name: str, value: Any, *, rtol: float = 1e-10, min_size: int = 1) -> np.ndarray:
    """Return ``value`` as a symmetric positive semi-definite float64 matrix.

    Symmetry is required to relative tolerance ``rtol`` (the result is
    symmetrized); PSD means the smallest eigenvalue is >= -rtol·‖Σ‖₂.
    """
    arr = check_finite_array(name, value, ndim=2)
    if arr.shape[0] != arr.shape[1]:
        raise ValueError(f"{name} is not allowed: expected a square matrix, got shape {arr.shape}")
    if arr.shape[0] < min_size:
        raise ValueError(f"{name} is not allowed: expected at least {min_size}x{min_size}, got shape {arr.shape}")
    scale = max(float(np.max(np.abs(arr))), np.finfo(np.float64).tiny)
    if np.max(np.abs(arr - arr.T)) > rtol * scale:
        raise ValueError(f"{name} is not allowed: the matrix is not symmetric")
    arr = 0.5 * (arr + arr.T)
    lam_min = float(np.linalg.eigvalsh(arr)[0])
    if lam_min < -rtol * scale * arr.shape[0]:
        raise ValueError(
            f"{name} is not allowed: the matrix is not positive semi-definite (smallest eigenvalue {lam_min:.3g})"
        )
    return arr


def check_device(name: str, value: Any):
    """Return ``value`` as a ``torch.device`` ('cpu' or 'cuda[:i]'), or raise ``ValueError`` naming ``name``.

    CUDA requested on a machine without it is rejected here rather than failing deep inside torch.
    """
    import torch  # lazily: the NumPy parts of bnlab must not pay torch's import

    try:
        dev = torch.device(value)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{name}={value!r} is not allowed: {exc}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{name}={value!r} is not allowed: CUDA is not available on this machine; use {name}='cpu'")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}={value!r} is not allowed: expected 'cpu' or 'cuda'")
    return dev


def check_writable_ancestor(name: str, text: str, start: Any) -> None:
    """``ValueError`` naming ``name`` (given as ``text``) unless the nearest existing folder at or above
    ``start`` is a directory this process may write to — so what is to be created under it can be."""
    import os
    from pathlib import Path

    parent = Path(os.path.abspath(start))
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{name}={text!r} is not allowed: {str(parent)!r} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{name}={text!r} is not allowed: the folder {str(parent)!r} is not writable")
