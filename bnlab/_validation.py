"""Argument checks shared by every part of bnlab, and the one way every part writes an output file.

Bad input is rejected at the public boundary with a ``ValueError`` that names
the argument, the value received and what is allowed (never a NaN, a silent
clamp or a traceback from deep inside).

Seeds are integers in [0, 2**63 − 1] (:func:`check_seed`; torch and NumPy take them, and a seed
plus a small offset per network still fits torch's 64-bit generator).  Sizes are checked against a
memory bound before anything is allocated (:func:`check_memory`; the default
:data:`DEFAULT_MAX_MEMORY_BYTES` = 1 GiB, the ``--max-memory-gb`` of the commands).  Output files are
written to a temporary file in their folder and renamed over their path
(:func:`atomic_output_path`), so a symbolic link planted at the path is replaced, never followed.
Every path bnlab is given to read or write is checked once, by :func:`check_path`.
"""
from __future__ import annotations

import contextlib
import math
import numbers
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

__all__ = [
    "check_int",
    "check_real",
    "check_choice",
    "check_psd_matrix",
    "check_finite_array",
    "check_device",
    "check_writable_ancestor",
    "check_path",
    "per_layer",
    "MAX_PATH_BYTES",
    "check_seed",
    "check_memory",
    "check_max_memory_gb",
    "atomic_output_path",
    "DEFAULT_MAX_MEMORY_BYTES",
    "MAX_SEED",
]

#: The largest seed accepted anywhere (torch's generators take 64 bits; this leaves room for offsets).
MAX_SEED = 2**63 - 1
#: The working-memory bound of every size check unless the caller gives another (``--max-memory-gb 1``).
DEFAULT_MAX_MEMORY_BYTES = 1 << 30
#: The largest ``--max-memory-gb`` accepted (1 PiB): beyond it the bound is no bound.
MAX_MEMORY_GB = 2.0**20


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

    CUDA requested on a machine without it, and a CUDA index beyond the devices present
    (``cuda:99``), are rejected here rather than failing deep inside torch at the first ``.to()``.
    """
    import torch  # lazily: the NumPy parts of bnlab must not pay torch's import

    allowed = "expected 'cpu', 'cuda' or 'cuda:<index>'"
    if isinstance(value, torch.device):
        dev = value
    elif isinstance(value, str) and value.strip():
        try:
            dev = torch.device(value.strip())
        except (RuntimeError, TypeError, ValueError):
            raise ValueError(f"{name}={value!r} is not allowed: {allowed}") from None
    else:
        raise ValueError(f"{name}={value!r} is not allowed: {allowed}")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}={value!r} is not allowed: {allowed}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"{name}={value!r} is not allowed: CUDA is not available on this machine; use {name}='cpu'"
            )
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ValueError(
                f"{name}={value!r} is not allowed: this machine has {count} CUDA device(s), "
                f"cuda:0 to cuda:{count - 1}"
            )
    return dev


def per_layer(name: str, value: Any, n: int) -> list:
    """``value`` broadcast to ``n`` entries when a scalar, or as a list when a list/tuple of exactly ``n``
    (one per layer); another length is a ``ValueError`` naming ``name``.  The entries are not checked."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries: expected {n} (one per layer) or a scalar")
        return list(value)
    return [value] * n


def check_seed(name: str, value: Any) -> int:
    """Return ``value`` as an int seed in [0, :data:`MAX_SEED`], or raise ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, np.integer)):
        raise ValueError(f"{name}={value!r} is not allowed: expected an integer seed in [0, 2**63 - 1]")
    value = int(value)
    if not 0 <= value <= MAX_SEED:
        raise ValueError(f"{name}={value} is not allowed: expected an integer seed in [0, 2**63 - 1]")
    return value


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.3g} GiB"


def check_memory(what: str, needed_bytes: float, max_memory_bytes: Any, *, hint: str = "") -> int:
    """Refuse, before allocating, work that needs more than ``max_memory_bytes``; return the bound.

    ``what`` says which sizes need the memory (it names the arguments to reduce); the message names
    ``max_memory_bytes`` and the ``--max-memory-gb`` option that sets it.
    """
    bound = check_int("max_memory_bytes", max_memory_bytes, minimum=1)
    if not needed_bytes <= bound:  # also refuses a NaN or infinite estimate
        raise ValueError(
            f"{what} needs about {_gib(needed_bytes)} of memory, more than max_memory_bytes={bound} "
            f"({_gib(bound)}; --max-memory-gb on the command line){'; ' + hint if hint else ''}"
        )
    return bound


def check_max_memory_gb(name: str, value: Any) -> int:
    """``--max-memory-gb`` (a positive number of GiB, at most 2**20) as a byte count, or ``ValueError``."""
    gb = check_real(name, value, minimum=0.0, strict_minimum=True, maximum=MAX_MEMORY_GB)
    return max(1, int(gb * 2**30))


def _umask() -> int:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


@contextlib.contextmanager
def atomic_output_path(path: Any, *, name: str = "output") -> Iterator[Path]:
    """A temporary path beside ``path`` to write to; on success it is renamed over ``path``.

    The temporary file is created with ``O_EXCL`` (``tempfile.mkstemp``) in the destination folder
    and ``os.replace``-d onto ``path``: a symbolic link planted at ``path`` is replaced by the new
    file, never followed, and a reader never sees a half-written file.  On an error the temporary
    file is removed and ``path`` is left as it was.  The file gets the usual mode (0666 & ~umask).
    A directory at ``path`` is a ``ValueError`` naming ``name``.
    """
    import os
    import tempfile

    target = Path(path)
    if target.is_dir() and not target.is_symlink():
        raise ValueError(f"{name}={str(target)!r} is not allowed: it is a directory")
    folder = target.parent
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{target.name[:200]}.", suffix=".tmp" + target.suffix)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        os.close(fd)
        yield Path(tmp)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def check_writable_ancestor(name: str, text: str, start: Any) -> None:
    """``ValueError`` naming ``name`` (given as ``text``) unless the nearest existing folder at or above
    ``start`` is a directory this process may write to — so what is to be created under it can be.
    A symbolic link to nothing on the way up is refused too (creating the folders below it would fail
    or land where it points).

    Permission bits do not tell for root, whom ``os.access`` lets write to /sys and /proc and to read-only
    mounts that refuse every new file: where they allow it, an empty folder is created there and removed at
    once, so an output that cannot be written is refused before the work that produces it (minutes), not
    after."""
    import os
    import tempfile
    from pathlib import Path

    parent = Path(os.path.abspath(start))
    while not parent.exists() and parent != parent.parent:
        if parent.is_symlink():
            raise ValueError(f"{name}={text!r} is not allowed: {str(parent)!r} is a symbolic link to "
                             f"{os.readlink(parent)!r}, which does not exist")
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{name}={text!r} is not allowed: {str(parent)!r} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{name}={text!r} is not allowed: the folder {str(parent)!r} is not writable")
    try:
        os.rmdir(tempfile.mkdtemp(dir=parent, prefix=".bnlab-write-probe."))
    except OSError as exc:
        raise ValueError(f"{name}={text!r} is not allowed: the folder {str(parent)!r} is not writable "
                         f"({exc.strerror or type(exc).__name__})") from None


#: Longest path accepted (Linux PATH_MAX is 4096 bytes including the terminating NUL); 255 per part.
MAX_PATH_BYTES = 4000

_PATH_KINDS = ("file", "directory")


def check_path(name: str, value: Any, *, kind: str = "file", readonly: bool = False, replaced: bool = False,
               expected: str | None = None) -> Path:
    """``value`` as a ``Path`` bnlab may read (``readonly``) or write, or ``ValueError`` naming ``name``.

    The one path validator of bnlab (results stores, exports, output folders).  Refused:

    * anything but a ``str``, ``bytes`` or path-like object (``os.PathLike``);
    * an empty or blank path, white space at either end, a NUL character, ``"."``/``".."`` for a
      file, more than :data:`MAX_PATH_BYTES` bytes or 255 in one part — ``expected`` (default "a file
      path" / "a directory path") says what was wanted;
    * an existing path of the other ``kind`` (``"file"``: a directory, device, pipe or socket;
      ``"directory"``: anything but a directory), or one ``os.stat`` cannot read;
    * a symbolic link to nothing, unless ``replaced`` (the file is written by
      :func:`atomic_output_path`, which renames over the link instead of following it);
    * with ``readonly``: a path that does not exist or cannot be read; otherwise an existing file this
      process may not read and write (unless ``replaced``: the rename needs only the folder) and a nearest
      existing folder that is not a writable directory (:func:`check_writable_ancestor`).
    """
    import os
    import stat

    kind = check_choice("kind", kind, _PATH_KINDS)
    wanted = expected or ("a file path" if kind == "file" else "a directory path (an empty path is not the current folder)")
    if value is not None and not isinstance(value, (str, bytes, os.PathLike)):
        # str() would make a path of anything (123 -> "123", b"x" -> "b'x'")
        raise ValueError(f"{name}={value!r} is not allowed: expected {wanted} (a str or a path-like object), "
                         f"got {type(value).__name__}")
    text = "" if value is None else os.fsdecode(os.fspath(value))
    if not text.strip() or (kind == "file" and text in (".", "..")):
        raise ValueError(f"{name}={text!r} is not allowed: expected {wanted}")
    if text.strip() != text:
        raise ValueError(f"{name}={text!r} is not allowed: it begins or ends with white space; expected {wanted}")
    if "\x00" in text:
        raise ValueError(f"{name}={text!r} is not allowed: the path contains a NUL character")
    path = Path(text)
    if len(os.fsencode(text)) > MAX_PATH_BYTES or any(len(os.fsencode(p)) > 255 for p in path.parts):
        raise ValueError(f"{name} is not allowed: the path is {len(text)} characters long (at most "
                         f"{MAX_PATH_BYTES}, 255 per part)")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise ValueError(f"{name}={text!r} is not allowed: {exc.strerror}") from None
    if st is None:
        if os.path.islink(path) and not replaced:
            raise ValueError(f"{name}={text!r} is not allowed: it is a symbolic link to {os.readlink(path)!r}, which "
                             "does not exist; bnlab does not create anything through a link (remove the link or give "
                             "the real path)")
        if readonly:
            raise ValueError(f"{name}={text!r} is not allowed: it does not exist")
    elif kind == "directory" and not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{name}={text!r} is not allowed: it exists and is not a directory")
    elif kind == "file" and stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{name}={text!r} is not allowed: it is a directory; expected {wanted}")
    elif kind == "file" and not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{name}={text!r} is not allowed: it is not a regular file (a device, pipe or socket)")
    elif not os.access(path, os.R_OK if readonly else 0 if replaced else os.R_OK | os.W_OK):
        raise ValueError(f"{name}={text!r} is not allowed: permission denied")
    if not readonly:
        check_writable_ancestor(name, text, path if kind == "directory" else Path(os.path.abspath(path)).parent)
    return path
