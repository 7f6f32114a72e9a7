"""Finding experiments: the registered reproductions, plus ones registered in code.

Every module of :mod:`bnlab.reproductions` that exposes
``EXPERIMENTS: list[Experiment]`` is discovered.  A module that fails to import
does not hide the others: its error is kept in :func:`discovery_errors` (and
shown by ``bnlab reproduce --list`` and the report).  Experiments defined
elsewhere are reached either by :func:`register_experiment` or by a
``"package.module:NAME"`` reference, which imports ``package.module`` and
takes ``NAME`` from its ``EXPERIMENTS``.
"""
from __future__ import annotations

import importlib
import pkgutil
import traceback
from typing import Iterable

from bnlab.experiments.spec import Experiment

__all__ = ["list_experiments", "get_experiment", "register_experiment", "unregister_experiment", "discovery_errors"]

_REPRODUCTIONS = "bnlab.reproductions"
_registered: dict[str, Experiment] = {}
_discovered: dict[str, Experiment] | None = None
_errors: dict[str, str] = {}
_origin: dict[int, str] = {}  # id(experiment) -> module it was found in by a "module:NAME" lookup


def _experiments_of(module, where: str) -> list[Experiment]:
    exps = getattr(module, "EXPERIMENTS", None)
    if exps is None:
        return []
    exps = list(exps)
    for e in exps:
        if not isinstance(e, Experiment):
            raise ValueError(f"{where}.EXPERIMENTS holds {e!r}, which is not an Experiment")
    return exps


def _discover() -> dict[str, Experiment]:
    global _discovered
    if _discovered is not None:
        return _discovered
    found: dict[str, Experiment] = {}
    package = importlib.import_module(_REPRODUCTIONS)
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        modname = f"{_REPRODUCTIONS}.{info.name}"
        try:
            module = importlib.import_module(modname)
            for exp in _experiments_of(module, modname):
                if exp.name in found:
                    raise ValueError(f"experiment name {exp.name!r} is declared twice")
                found[exp.name] = exp
        except Exception:  # one broken reproduction must not hide the others
            _errors[modname] = traceback.format_exc()
    _discovered = found
    return found


def refresh() -> None:
    """Forget the discovered modules so the next call imports them again (new files appear)."""
    global _discovered
    _discovered = None
    _errors.clear()


def discovery_errors() -> dict[str, str]:
    """``{module name: traceback}`` for reproduction modules that failed to import."""
    _discover()
    return dict(_errors)


def register_experiment(experiment: Experiment, *, replace: bool = False) -> Experiment:
    """Make ``experiment`` reachable by name (tests and user code); return it.

    Raises ``ValueError`` when the name is taken and ``replace`` is false.
    """
    if not isinstance(experiment, Experiment):
        raise ValueError(f"experiment must be an Experiment, got {type(experiment).__name__}")
    if not replace and (experiment.name in _registered or experiment.name in _discover()):
        raise ValueError(f"an experiment named {experiment.name!r} is already registered")
    _registered[experiment.name] = experiment
    return experiment


def unregister_experiment(name: str) -> None:
    """Remove an experiment added by :func:`register_experiment` (no error if absent)."""
    _registered.pop(name, None)


def list_experiments() -> dict[str, Experiment]:
    """All experiments by name, sorted: the discovered reproductions and the registered ones."""
    merged = {**_discover(), **_registered}
    return dict(sorted(merged.items()))


def get_experiment(name: str | Experiment, module: str | None = None) -> Experiment:
    """The experiment called ``name``.

    Parameters
    ----------
    name:
        A registered name, or ``"package.module:NAME"`` to import
        ``package.module`` and take ``NAME`` from its ``EXPERIMENTS``.  An
        :class:`Experiment` is returned unchanged.
    module:
        A module to import and search when ``name`` is not registered (a
        resume uses the module recorded in the store).

    Raises
    ------
    ValueError
        When no such experiment exists; the message lists the known names.
    """
    if isinstance(name, Experiment):
        return name
    if not isinstance(name, str) or not name:
        raise ValueError(f"experiment name must be a non-empty string, got {name!r}")
    if ":" in name:
        module, name = name.split(":", 1)
    known = list_experiments()
    if name in known and module is None:
        return known[name]
    if module is not None:
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            if name in known:
                return known[name]
            raise ValueError(f"cannot import module {module!r} to find experiment {name!r}: {exc}") from None
        for exp in _experiments_of(mod, module):
            if exp.name == name:
                _origin[id(exp)] = module
                return exp
        if name in known:
            return known[name]
        raise ValueError(f"module {module!r} declares no experiment {name!r} in EXPERIMENTS")
    raise ValueError(
        f"unknown experiment {name!r}; known: {', '.join(known) or '(none)'} "
        f"(or give 'package.module:NAME')"
    )


def experiment_module(experiment: Experiment) -> str | None:
    """The module a resume should import to find ``experiment`` again.

    The module it was loaded from by a ``"module:NAME"`` lookup, else the module defining ``run_cell``.
    """
    return _origin.get(id(experiment)) or getattr(experiment.run_cell, "__module__", None)


def names(experiments: Iterable[Experiment]) -> list[str]:
    return [e.name for e in experiments]
