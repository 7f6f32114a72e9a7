"""One vocabulary: the canonical name of each thing in every command and function, and the old spellings.

The same thing has one name everywhere (docs/cli.md, "Vocabulary"):

========================  ====================  =====================================================
thing                     keyword / flag        values
========================  ====================  =====================================================
nonlinearity φ            ``phi`` / ``--phi``   a registered activation or an expression in x
normalization             ``norm`` / ``--norm`` ``bn``, ``bn_nomean``, ``none``, … (``bnlab.nets``)
weight initialization     ``init`` / ``--init`` ``gaussian``, ``orthogonal``, ``uniform``,
                                                ``asymmetric_uniform``, ``glorot_uniform``, …
========================  ====================  =====================================================

Old spellings are accepted for one release: a function warns with :class:`DeprecationWarning`
(:func:`canonical_value`, :func:`renamed_keywords`), a command prints a one-line note on stderr
(``bnlab.cli._common``).  The tables below are the single source of both.
"""
from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Mapping

__all__ = ["SCALES", "NORM_ALIASES", "INIT_ALIASES", "KEYWORD_ALIASES", "canonical_value", "renamed_keywords",
           "deprecation_text"]

#: Old spellings of normalization values -> the canonical name (``bnlab.nets.NORMALIZATIONS``).
NORM_ALIASES: dict[str, str] = {
    "batch": "bn",  # bnlab.sim before the one vocabulary
    "batch_no_mean": "bn_nomean",  # bnlab.sim
    "bn-nomean": "bn_nomean",  # bnlab rank --norm
}

#: Old spellings of initialization names -> the canonical name.
INIT_ALIASES: dict[str, str] = {
    "asym_uniform": "asymmetric_uniform",  # bnlab.nets before the one vocabulary
}

#: Old keyword (and flag) names -> the canonical one.
KEYWORD_ALIASES: dict[str, str] = {
    "activation": "phi",  # bnlab.rank.run_chain, bnlab rank --activation
    "normalization": "norm",  # bnlab.sim.simulate, bnlab simulate --normalization
}


def deprecation_text(old: str, new: str) -> str:
    """The one sentence every deprecation says (function and command alike)."""
    return f"{old} is deprecated; use {new} (the old spelling is accepted until the next release)"


def _caller_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside bnlab (and outside the
    decorators of torch and the standard library between it and bnlab): the user's line."""
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__)) + os.sep
    skip = (here, os.path.dirname(functools.__file__) + os.sep)
    frame, level = sys._getframe(1), 1
    while frame is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        if not name.startswith(skip) and f"{os.sep}torch{os.sep}" not in name:
            return level
        frame, level = frame.f_back, level + 1
    return level


def canonical_value(name: str, value: Any, aliases: Mapping[str, str]) -> Any:
    """``value`` under its canonical spelling: an old spelling in ``aliases`` is replaced, with a
    :class:`DeprecationWarning` naming the argument ``name``; anything else is returned unchanged
    (the caller's own ``check_choice`` then refuses what is unknown)."""
    if isinstance(value, str) and value in aliases:
        new = aliases[value]
        warnings.warn(deprecation_text(f"{name}={value!r}", f"{name}={new!r}"), DeprecationWarning,
                      stacklevel=_caller_stacklevel())
        return new
    return value


def renamed_keywords(**old_to_new: str) -> Callable:
    """Decorator: accept each old keyword ``old`` as the new ``new`` with a :class:`DeprecationWarning`;
    giving both is a ``TypeError`` (as Python's own duplicate-argument error)."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            for old, new in old_to_new.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(f"{fn.__name__}() got both {new!r} and its deprecated spelling {old!r}")
                    warnings.warn(deprecation_text(f"{fn.__name__}({old}=...)", f"{new}=..."), DeprecationWarning,
                                  stacklevel=_caller_stacklevel())
                    kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return inner

    return wrap


#: bnlab's scales: ``"small"`` (the default: the whole ``bnlab report`` within 10 minutes on 2 CPU cores),
#: ``"medium"`` (the small grids plus the restarts and investigations that do not fit that budget — about
#: an hour on 2 cores; a reproduction that declares no medium grid runs its small one) and ``"paper"``
#: (the papers' own sizes, for GPUs; see docs/paper-scale.md)
SCALES = ("small", "medium", "paper")
