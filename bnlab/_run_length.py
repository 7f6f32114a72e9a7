"""The length of the run that a shortened run stands for (a plan's pilot; issue 27 item 3).

A plan times each kind of task on a cut of it — a few steps instead of tens of thousands — and
extrapolates.  Code that picks its route by the length of the run (``train_ensemble``'s
``step_mode="auto"``: compiled or captured for long runs, eager for short ones) must, inside such a
pilot, pick the route of the whole task, or the pilot times a route the run will not take.  The plan
(``bnlab.experiments``) says how long the whole task is with :func:`standing_for`; the trainers
(``bnlab.nets``) ask :func:`whole_run_steps`.  Shared by both parts, like :mod:`bnlab._validation`
(docs/architecture.md): neither imports the other.

The pilot also learns the seconds of the steps themselves from the trainer (:func:`note_steady_steps`,
:func:`steady_steps`).  A plan that only compares the wall times of two cuts reads the seconds per step
off their difference; on a GPU a captured step takes milliseconds while the set-up of each run
(tracing, the graph cache, the capture, the test pass) takes ~10 s and varies by seconds from run to
run, so that difference is noise: a Yang Fig. 3a column on an H100 was planned at 174 ms per step by
it (2026-11-28) where the steps themselves take a few.  The trainer times its steady steps — those
after :data:`STEADY_FROM`, past warm-up, compilation and capture — between two device
synchronizations, and only within :func:`standing_for` (a run outside a pilot adds no synchronization).
"""
from __future__ import annotations

import contextlib
import threading

from bnlab._validation import check_int

__all__ = ["standing_for", "whole_run_steps", "note_route", "COMPILED_ROUTES", "STEADY_FROM", "timing_steps",
           "note_steady_steps", "steady_steps"]

#: routes whose set-up compiles (on the CPU tens of seconds cold, seconds from Inductor's graph cache)
COMPILED_ROUTES = frozenset({"compile", "cuda_graph"})

#: steps a trainer runs before it times its steady steps for a pilot: the captured route's two warm-up
#: steps and its capture (``nets._ensemble_step.StepRunner``); a compiled or eager route's first call
STEADY_FROM = 3

_state = threading.local()


@contextlib.contextmanager
def standing_for(steps: int):
    """Within it (in this thread), a run of any length stands for a run of ``steps`` steps: routes chosen
    by the run's length are chosen for ``steps``.  Yields the set of routes the code within chose
    (:func:`note_route`), for the plan to know whether its pilot compiled.  Nested uses restore the outer
    length on exit, also after an exception."""
    steps = check_int("steps", steps, minimum=1)
    before = getattr(_state, "steps", None), getattr(_state, "routes", None), getattr(_state, "steady", None)
    _state.steps, _state.routes, _state.steady = steps, set(), []
    try:
        yield _state.routes
    finally:
        _state.steps, _state.routes, _state.steady = before


def note_route(route: str) -> None:
    """Record, within :func:`standing_for`, the step route a trainer chose (nothing outside it)."""
    routes = getattr(_state, "routes", None)
    if routes is not None:
        routes.add(route)


def whole_run_steps(steps: int) -> int:
    """The length to choose a route for: the one :func:`standing_for` set, else ``steps`` itself."""
    override = getattr(_state, "steps", None)
    return steps if override is None else override


def timing_steps() -> bool:
    """Whether a pilot listens (within :func:`standing_for`): then a trainer times its steady steps."""
    return getattr(_state, "steady", None) is not None


def note_steady_steps(steps: int, seconds: float) -> None:
    """Record, within :func:`standing_for`, that ``steps`` steady steps took ``seconds`` (device work
    included: timed between two synchronizations).  Nothing outside it."""
    steady = getattr(_state, "steady", None)
    if steady is not None and steps > 0:
        steady.append((int(steps), float(seconds)))


def steady_steps() -> list[tuple[int, float]]:
    """The ``(steps, seconds)`` noted so far within the innermost :func:`standing_for` ([] outside)."""
    return list(getattr(_state, "steady", None) or [])
