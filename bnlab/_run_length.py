"""The length of the run that a shortened run stands for (a plan's pilot; issue 27 item 3).

A plan times each kind of task on a cut of it — a few steps instead of tens of thousands — and
extrapolates.  Code that picks its route by the length of the run (``train_ensemble``'s
``step_mode="auto"``: compiled or captured for long runs, eager for short ones) must, inside such a
pilot, pick the route of the whole task, or the pilot times a route the run will not take.  The plan
(``bnlab.experiments``) says how long the whole task is with :func:`standing_for`; the trainers
(``bnlab.nets``) ask :func:`whole_run_steps`.  Shared by both parts, like :mod:`bnlab._validation`
(docs/architecture.md): neither imports the other.
"""
from __future__ import annotations

import contextlib
import threading

from bnlab._validation import check_int

__all__ = ["standing_for", "whole_run_steps", "note_route", "COMPILED_ROUTES"]

#: routes whose set-up compiles (on the CPU tens of seconds cold, seconds from Inductor's graph cache)
COMPILED_ROUTES = frozenset({"compile", "cuda_graph"})

_state = threading.local()


@contextlib.contextmanager
def standing_for(steps: int):
    """Within it (in this thread), a run of any length stands for a run of ``steps`` steps: routes chosen
    by the run's length are chosen for ``steps``.  Yields the set of routes the code within chose
    (:func:`note_route`), for the plan to know whether its pilot compiled.  Nested uses restore the outer
    length on exit, also after an exception."""
    steps = check_int("steps", steps, minimum=1)
    before = getattr(_state, "steps", None), getattr(_state, "routes", None)
    _state.steps, _state.routes = steps, set()
    try:
        yield _state.routes
    finally:
        _state.steps, _state.routes = before


def note_route(route: str) -> None:
    """Record, within :func:`standing_for`, the step route a trainer chose (nothing outside it)."""
    routes = getattr(_state, "routes", None)
    if routes is not None:
        routes.add(route)


def whole_run_steps(steps: int) -> int:
    """The length to choose a route for: the one :func:`standing_for` set, else ``steps`` itself."""
    override = getattr(_state, "steps", None)
    return steps if override is None else override
